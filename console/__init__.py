"""The operator side of MARLaaS: CLI, client SDK, job files, status, report, embedded stack."""

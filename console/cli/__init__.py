"""The `marlaas` command line: `main` (the app and its small commands) and a module per
group of commands (`jobs`, `envs`, `sample`, `track`, `access`, `tenants`), `support` for
what they share."""

"""Shared pieces of every MARLaaS process: messages, bus, registry, config, models, local stack."""

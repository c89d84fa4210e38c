"""Built-in environments; each registers by name in `env_svc.protocol.BUILTIN_ENVIRONMENTS`."""

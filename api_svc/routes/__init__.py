"""The tenant API's endpoints, a module per resource (`api_svc.server` mounts them)."""

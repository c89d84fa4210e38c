"""What a running service process needs: settings (`config`), the service runner and its
consumer loops (`service`), health and metrics endpoints (`health`, `metrics`), logs,
retry with backoff (`backoff`), the CPU cores and hardware it runs on (`cores`,
`hardware`), fault injection for the chaos tests (`faults`) and loading a named object
(`imports`).
"""

"""What a running service process needs: settings (`config`), the service runner and its
consumer loops (`service`), what each service's `python -m` does around it (`entrypoint`),
health and metrics endpoints (`health`, `metrics`), logs, retry with backoff (`backoff`),
the CPU cores and hardware it runs on (`cores`, `hardware`), fault injection for the chaos
tests (`faults`) and loading a named object (`imports`).
"""

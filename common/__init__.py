"""What the three services share (docs/architecture.md, "Code layout").

Messages, the Kafka bus, the Redis store, config, the service runner, logs, metrics, health,
the artifact format and the model resolver: only modules at least one service imports.
Nothing here imports `console` or a service.
"""

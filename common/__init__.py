"""What the three services share (docs/architecture.md, "Code layout"), in six rooms:
`wire` (messages, their encoding, the job spec and its states), `bus` (Kafka), `state`
(Redis, by concern), `runtime` (settings, the service runner, logs, metrics, health),
`security` (grants, secrets, signatures) and `files` (artifacts, the base model). Only
modules at least one service imports; nothing here imports `console` or a service.
"""

"""Kafka as the services use it: the producer and consumer loops with their delivery rules
(`kafka`, the import point, over `clients`, `producer`, `delivery`, `consumer`, `records`,
`commits` and `telemetry`), what a handler sees of the producer (`sender`), handlers chosen by
message type (`dispatch`), the commit positions held until work is done (`offsets`), and the
records every replica must read (`broadcast`).
"""

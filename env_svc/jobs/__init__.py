"""The parts of env_svc that handle a job, each testable alone; `env_svc.service.EnvService`
wires them to the bus.

`environments` (each job's environment, built once), `admission` (a job spec bound to its
owner, checked against its tenant's limits, proven, registered or rejected), `issuing` (groups
of prompts within the staleness bound, and claims sent again), `scoring` (a rollout's result
into its episode's next turn or its trajectory), `evaluations` (held-out sets: issued,
tallied, swept), `commands` (pause, resume, cancel), `retirement` (an ended job's state
expired), `sweep` (the periodic pass over every active job), `reasons` (an error in words).
"""

from common.wire.lifecycle import ServiceName

SERVICE: ServiceName = "env_svc"
"""The sender env_svc's parts sign their job events with."""

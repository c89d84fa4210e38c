"""Fault injection for the chaos tests: named points where a process may die on purpose.

`MARLAAS_FAULT=<point>:<probability>[,<point>:<probability>...]` makes the process that
reaches `<point>` exit at once with code 137 (what a `kill -9` leaves), with that probability,
so crash recovery is tested at exactly the moments it is hardest: between two effects that
must both happen. Unset (production), `fault_point` is a dictionary lookup and nothing else.
`*` as the point name matches every point.
"""

from __future__ import annotations

import logging
import os
import random
from typing import Literal, get_args

log = logging.getLogger(__name__)

ENV_VAR = "MARLAAS_FAULT"

FaultPoint = Literal[
    "env.after_claim",  # a group index claimed, none of its requests sent
    "env.mid_group",  # some of a group's first requests sent, not all
    "env.after_send",  # an episode's next message sent, its result not yet marked seen
    "rollout.after_send",  # a result sent, its prompt's offset not yet released
    "trainer.after_checkpoint",  # the checkpoint directory written, `latest` not moved
    "trainer.after_latest",  # `latest` moved, the pointer not (nor the groups marked)
    "trainer.after_pointer",  # pointer moved and groups marked (one script), no AdapterUpdate
    "trainer.before_update",  # about to announce the version
    "trainer.after_update",  # the version announced (AdapterUpdate), its step event not sent
]
FAULT_POINTS: tuple[FaultPoint, ...] = get_args(FaultPoint)


def parse(spec: str) -> dict[str, float]:
    """ "env.mid_group:0.1,trainer.after_latest:1" -> {point: probability}; raises
    ValueError naming the bad part (an unknown point, a probability outside [0, 1])."""
    found: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        point, _, probability = part.rpartition(":")
        if point != "*" and point not in FAULT_POINTS:
            raise ValueError(f"{ENV_VAR}: unknown fault point {point!r}; known: {FAULT_POINTS}")
        try:
            value = float(probability)
        except ValueError:
            raise ValueError(f"{ENV_VAR}: {part!r} is not <point>:<probability>") from None
        if not 0 <= value <= 1:
            raise ValueError(f"{ENV_VAR}: probability {value} of {point!r} is not in [0, 1]")
        found[point] = value
    return found


_configured = parse(os.environ.get(ENV_VAR, ""))


def configure(spec: str) -> None:
    """Replace the configured faults (tests; processes read `MARLAAS_FAULT` at import)."""
    global _configured
    _configured = parse(spec)


def fault_point(point: FaultPoint) -> None:
    """Exit the process here, as a kill -9 would, when `MARLAAS_FAULT` asks for it."""
    if not _configured:
        return
    probability = _configured.get(point, _configured.get("*", 0.0))
    if probability and random.random() < probability:
        log.critical("fault injected at %s: exiting with 137", point)
        logging.shutdown()
        os._exit(137)

"""`marlaas up --replicas`: which service processes the embedded stack starts."""

from __future__ import annotations

import pytest

from common.wire.lifecycle import SERVICES
from console.stack.services import replicated


def test_replicas_repeat_each_named_service_and_keep_the_others_single() -> None:
    assert replicated(SERVICES, {}) == SERVICES
    services = replicated(SERVICES, {"env": 2, "trainer_svc": 3})
    assert services.count("env_svc") == 2 and services.count("trainer_svc") == 3
    assert services.count("rollout_svc") == 1


@pytest.mark.parametrize(
    ("replicas", "message"),
    [
        ({"gpu": 2}, "'gpu' is not a service (env, rollout, trainer)"),
        ({"rollout": 0}, "rollout=0; at least 1 replica"),
    ],
)
def test_bad_replica_counts_are_refused_by_name(replicas: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        replicated(SERVICES, replicas)

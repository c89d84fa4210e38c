"""`remote_verifier`: arithmetic whose answers a remote service checks, slowly.

A third-party environment as users write them: the reward is a plain (synchronous) function
that blocks while a verifier elsewhere answers. Here the verifier is a stand-in that takes
`verify_wait_s` (a `time.sleep`) and then judges as `arithmetic` does, so learning is the
same and only the waiting differs. Register it with env_svc, this folder on its Python path:

    MARLAAS_ENVIRONMENTS=remote_verifier=remote_verifier:RemoteVerifierEnv

bench/slow_verifier.py runs jobs on it to measure what a slow reward costs a replica.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Annotated

from msgspec import Meta

from env_svc.envs.arithmetic import ArithmeticEnv, ArithmeticParams, ArithmeticTask, correct
from env_svc.protocol import ChatMessage, Reward


class RemoteVerifierParams(ArithmeticParams, frozen=True):
    verify_wait_s: Annotated[float, Meta(ge=0, le=30)] = 1.0
    """How long the stand-in verifier takes to answer each episode."""


class RemoteVerifierEnv(ArithmeticEnv):
    name = "remote_verifier"
    params_type = RemoteVerifierParams
    params: RemoteVerifierParams

    def make_rewards(self) -> list[Reward[ArithmeticTask]]:
        return [
            Reward("correct", self.verified, 1.0),
            *(r for r in super().make_rewards() if r.name != "correct"),
        ]

    def verified(self, task: ArithmeticTask, completion: Sequence[ChatMessage]) -> float:
        time.sleep(self.params.verify_wait_s)  # the round trip to the verifier
        return correct(task, completion)

"""A job's learning-rate schedule: the share of `rl.learning_rate` each optimizer step takes.

This module owns `RLSettings.lr_schedule` and `RLSettings.warmup_steps`. A job's step s
(1-based: the adapter version it makes, so a restarted trainer resumes the schedule where the
published version left it) of its `max_steps` N, with W warm-up steps:

  s <= W:  s / W                                  linear warm-up, the peak at step W
  s > W:   k = s - W of the n = N - W steps left, p = (k - 1) / n in [0, 1)
           constant  1
           linear    1 - p                        (n - k + 1) / n: 1 at the first, 1/n at the last
           cosine    (1 + cos(pi * p)) / 2

The decay ends one step past the last (as TRL's and transformers' schedulers do), so every step
trains. A step past N (none is taken; a defensive bound) takes the last step's share.
"""

from __future__ import annotations

import math

from common.wire.messages import RLSettings


def lr_factor(rl: RLSettings, step: int) -> float:
    """The share of `rl.learning_rate` that the job's optimizer step `step` (>= 1) takes."""
    if step < 1:
        raise ValueError(f"optimizer steps count from 1, got {step}")
    step = min(step, rl.max_steps)
    warmup = rl.warmup_steps
    if step <= warmup:
        return step / warmup
    left = rl.max_steps - warmup
    progress = (step - warmup - 1) / left
    if rl.lr_schedule == "linear":
        return 1.0 - progress
    if rl.lr_schedule == "cosine":
        return (1.0 + math.cos(math.pi * progress)) / 2.0
    return 1.0


def learning_rate(rl: RLSettings, step: int) -> float:
    """The learning rate of the job's optimizer step `step` (>= 1)."""
    return rl.learning_rate * lr_factor(rl, step)

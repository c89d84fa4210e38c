"""Each job's adapter slot (its LoRA parameters and AdamW optimizer) and the optimizer step
that ends a training step: each job clips and steps alone."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.wire.messages import LoraSettings, RLSettings
from trainer_svc.schedule import learning_rate
from trainer_svc.tally import Tally

if TYPE_CHECKING:
    import torch

MAX_GRAD_NORM = 1.0


@dataclass
class AdapterSlot:
    """A job's adapter on the shared model and the optimizer that holds exactly its
    parameters."""

    adapter_name: str
    lora: LoraSettings
    rl: RLSettings
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]


class NonFiniteGradientError(ArithmeticError):
    """A job's gradient is NaN or infinite (its adapter diverged, or a reward was not
    finite): no optimizer stepped, so no non-finite weight is ever saved or published."""

    def __init__(self, job_ids: Sequence[str]) -> None:
        super().__init__(
            f"non-finite gradient in job(s) {', '.join(job_ids)}: the step was not taken"
        )
        self.job_ids = list(job_ids)


def step_each(
    jobs: Mapping[str, AdapterSlot],
    tallies: Mapping[str, Tally],
    versions: Mapping[str, int] | None,
    skip_zero_advantages: bool,
) -> dict[str, dict[str, float]]:
    """Each job clips its own gradient and steps its own optimizer, unless none of its rows
    carried an advantage: then the step has no signal, and its optimizer does not step.
    The step that makes version v + 1 from `versions`' v takes that step's learning rate
    of the job's schedule (`trainer_svc.schedule`); a job not in `versions` keeps the
    rate it has (`rl.learning_rate` unless a versioned step set another).

    AdamW would otherwise still move the adapter on its momentum (and count the step in
    its bias correction): a job whose groups are all solved, several steps running, was
    carried past its solution that way (rewards of 1.0 fell to 0.1 in one step
    after two or three such steps; bench/results/learning-*.json). Computing the rows or
    skipping them gives the same update either way."""
    import torch

    norms: dict[str, float] = {}
    for job_id, job in jobs.items():
        # A param no micro-batch reached (all masked) has grad None; clip and step skip it.
        # A skipped row would have reached it with a zero gradient, which still moves
        # Adam's state: give it that zero.
        if tallies[job_id].zero_rows and skip_zero_advantages:
            for param in job.params:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
        norms[job_id] = float(torch.nn.utils.clip_grad_norm_(job.params, MAX_GRAD_NORM))
    if diverged := sorted(job_id for job_id, norm in norms.items() if not math.isfinite(norm)):
        # No optimizer has stepped: the weights stay finite, and the caller can train the
        # other jobs again without this one (trainer_svc/step.py, `Stepper._untrainable`).
        for job in jobs.values():
            job.optimizer.zero_grad(set_to_none=True)
        raise NonFiniteGradientError(diverged)
    results: dict[str, dict[str, float]] = {}
    for job_id, job in jobs.items():
        if versions is not None and job_id in versions:
            for group in job.optimizer.param_groups:
                group["lr"] = learning_rate(job.rl, versions[job_id] + 1)
        if tallies[job_id].has_signal:
            job.optimizer.step()
        job.optimizer.zero_grad(set_to_none=True)
        results[job_id] = {
            **tallies[job_id].metrics(),
            "grad_norm": norms[job_id],
            "learning_rate": job.optimizer.param_groups[0]["lr"],
        }
    return results

"""A training step's rows (a trajectory, its job and advantage) and each job's tally of them:
its loss tokens and the sums its step metrics are means of."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from common.wire.messages import Trajectory

TOKEN_MEAN_METRICS = (
    "loss",
    "clip_fraction",
    "is_capped_fraction",
    "mean_ratio",
    "mean_is_weight",
    "approx_kl",
)
"""policy_loss metrics that are means over masked tokens: combined across micro-batches
weighted by each micro-batch's token count. All but the loss compare the trained policy
with the sampler, so they exist only for rows that were put through the model."""


def sampled_only_with(trajectory: Trajectory, version: int) -> bool:
    """Whether every turn of the trajectory was sampled with adapter `version`."""
    return bool(trajectory.adapter_versions) and all(
        v == version for v in trajectory.adapter_versions
    )


@dataclass
class Row:
    """One trajectory of a step, with its job and advantage."""

    job_id: str
    trajectory: Trajectory
    advantage: float
    fresh: bool = False
    """Sampled (every turn) with the adapter version the trainer holds now."""

    @property
    def tokens(self) -> int:
        # Position 0 predicts nothing (token_logprobs gives it 0): never in the loss.
        return sum(self.trajectory.loss_mask[1:])


@dataclass
class Tally:
    """One job's step: its loss tokens (all rows, the computed ones) and metric sums."""

    tokens: int = 0
    """The loss's denominator: every row's, the skipped ones' too."""
    computed_tokens: int = 0
    rows: int = 0
    zero_rows: int = 0
    surprise: float = 0.0
    """Sum of -log mu over every row's sampled tokens (the sampler's entropy estimate)."""
    fresh_tokens: int = 0
    fresh_kl_sum: float = 0.0
    """Sum of k3 over the computed fresh rows' tokens (`fresh_kl`)."""
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TOKEN_MEAN_METRICS, 0.0))

    @property
    def has_signal(self) -> bool:
        """Some row carries an advantage (a step without one leaves the adapter alone)."""
        return self.zero_rows < self.rows

    def add_row(self, row: Row) -> None:
        self.tokens += row.tokens
        self.rows += 1
        self.zero_rows += row.advantage == 0.0
        trajectory = row.trajectory
        self.surprise -= sum(
            logprob
            for logprob, masked in zip(
                trajectory.behaviour_logprobs[1:], trajectory.loss_mask[1:], strict=True
            )
            if masked
        )

    def add_computed(self, row: Row) -> None:
        self.computed_tokens += row.tokens

    def add_fresh(self, kl_sum: float, tokens: int) -> None:
        self.fresh_kl_sum += kl_sum
        self.fresh_tokens += tokens

    def add(self, metrics: Mapping[str, float]) -> None:
        """A pass's metrics for this job: the loss is a mean over all the job's tokens
        (skipped rows add 0), the other metrics over the computed ones."""
        for key in TOKEN_MEAN_METRICS:
            of = self.tokens if key == "loss" else self.computed_tokens
            self.sums[key] += metrics[key] * metrics["tokens"] / max(of, 1)

    def metrics(self) -> dict[str, float]:
        """The step's metrics: the loss; the entropy over every row (it is the sampler's, and
        the rows carry it); the rest only where some row was computed (a step whose rows all
        had zero advantage compared no policy with the sampler: no KL of 0 to mislead)."""
        computed = {k: v for k, v in self.sums.items() if k == "loss" or self.computed_tokens}
        if self.fresh_tokens:
            computed["fresh_kl"] = self.fresh_kl_sum / self.fresh_tokens
        return {
            **computed,
            "entropy": self.surprise / max(self.tokens, 1),
            "tokens": float(self.tokens),
            "zero_advantage_share": self.zero_rows / max(self.rows, 1),
        }


def step_rows(
    batches: Mapping[str, tuple[Sequence[Trajectory], Sequence[float]]],
    versions: Mapping[str, int] | None,
) -> list[Row]:
    """A step's rows, job by job; a row is fresh when it was sampled (every turn) with the
    version its job holds (`versions`)."""
    rows: list[Row] = []
    for job_id, (trajectories, advantages) in batches.items():
        if not trajectories or len(trajectories) != len(advantages):
            raise ValueError(f"job {job_id!r}: need one advantage per trajectory and at least one")
        held = None if versions is None else versions.get(job_id)
        rows += [
            Row(job_id, t, a, fresh=held is not None and sampled_only_with(t, held))
            for t, a in zip(trajectories, advantages, strict=True)
        ]
    return rows

"""One base model, many jobs: a PEFT LoRA adapter and an AdamW optimizer per job.

The base model is loaded once (float32, CPU) and shared: every job's adapter is a named
adapter of one `PeftModel`, and a step activates that job's adapter only. Each optimizer holds
exactly its job's adapter parameters, so one job's step can neither read another job's
gradients nor move its weights (tests/unit/test_policy.py checks both).

Dropout stays off (the model is always in eval mode): the loss already has a sampling-noise
floor, and a deterministic forward pass is what makes a resumed job continue bit-identically.

torch, transformers and peft are imported inside the functions: services import this module
at start-up, before they decide to load a model.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.files.artifacts import ADAPTER_CONFIG, ADAPTER_WEIGHTS, atomic_dir
from common.runtime.hardware import ComputeDtype
from common.wire.messages import LoraSettings, RLSettings, Trajectory
from trainer_svc.grpo import k3_kl, masked_token_logprobs, policy_loss, token_logprobs
from trainer_svc.packing import (
    SUB_BATCH_OVERHEAD,
    Pack,
    PackRow,
    length_batches,
    plan_packs,
)
from trainer_svc.schedule import learning_rate

if TYPE_CHECKING:
    import torch
    from peft import PeftModel


OPTIMIZER_STATE = "optimizer.pt"
TRAINER_STATE = "trainer_state.json"
_CHECKPOINT_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, OPTIMIZER_STATE, TRAINER_STATE)
MAX_GRAD_NORM = 1.0

# policy_loss metrics that are means over masked tokens: combined across micro-batches
# weighted by each micro-batch's token count. All but the loss compare the trained policy
# with the sampler, so they exist only for rows that were put through the model.
_TOKEN_MEAN_METRICS = (
    "loss",
    "clip_fraction",
    "is_capped_fraction",
    "mean_ratio",
    "mean_is_weight",
    "approx_kl",
)


@dataclass
class _Job:
    adapter_name: str
    lora: LoraSettings
    rl: RLSettings
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]


@dataclass
class _Row:
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
class _Tally:
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
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_TOKEN_MEAN_METRICS, 0.0))

    @property
    def has_signal(self) -> bool:
        """Some row carries an advantage (a step without one leaves the adapter alone)."""
        return self.zero_rows < self.rows

    def add_row(self, row: _Row) -> None:
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

    def add_computed(self, row: _Row) -> None:
        self.computed_tokens += row.tokens

    def add_fresh(self, kl_sum: float, tokens: int) -> None:
        self.fresh_kl_sum += kl_sum
        self.fresh_tokens += tokens

    def add(self, metrics: Mapping[str, float]) -> None:
        """A pass's metrics for this job: the loss is a mean over all the job's tokens
        (skipped rows add 0), the other metrics over the computed ones."""
        for key in _TOKEN_MEAN_METRICS:
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


class NonFiniteGradientError(ArithmeticError):
    """A job's gradient is NaN or infinite (its adapter diverged, or a reward was not
    finite): no optimizer stepped, so no non-finite weight is ever saved or published."""

    def __init__(self, job_ids: Sequence[str]) -> None:
        super().__init__(
            f"non-finite gradient in job(s) {', '.join(job_ids)}: the step was not taken"
        )
        self.job_ids = list(job_ids)


def _sampled_only_with(trajectory: Trajectory, version: int) -> bool:
    return bool(trajectory.adapter_versions) and all(
        v == version for v in trajectory.adapter_versions
    )


def _adapter_name(job_id: str) -> str:
    # Job ids are free text, but peft adapter names become module keys (no '.') and appear
    # inside parameter names; peft even warns when a name is a substring of "lora_". A hash
    # is always a safe, distinct name.
    return "job_" + hashlib.sha256(job_id.encode()).hexdigest()[:16]


class MultiAdapterPolicy:
    """A shared float32 base model with one trainable LoRA adapter per job."""

    def __init__(
        self,
        base_model_dir: Path,
        *,
        micro_batch_tokens: int = 2048,
        torch_threads: int = 0,
        compute_dtype: ComputeDtype = "float32",
        device: str = "cpu",
        share_prefixes: bool = True,
        skip_zero_advantages: bool = True,
        adjust_threads: Callable[[], int] | None = None,
        sub_batch_overhead: int = SUB_BATCH_OVERHEAD,
    ) -> None:
        """`micro_batch_tokens`: padded tokens (sequences x longest length) per forward pass;
        bounds activation memory, not the batch. `torch_threads`: 0 leaves torch's default.
        `compute_dtype` "bfloat16" runs a training step's forward and backward under autocast
        (common/runtime/hardware.py says where that pays); weights, LoRA masters, optimizer state
        and the loss stay float32. `device`: "cpu", "cuda", "cuda:N" or "auto" (CUDA when
        present). `share_prefixes`: run each group's common prompt once, not once per
        sample (trainer_svc/packing.py). `skip_zero_advantages`: leave rows whose advantage
        is 0 out of the passes (their loss and gradient are 0; see `train_steps`).
        `adjust_threads`: called before each decoder layer's forward and backward, returns
        the threads what follows runs on (trainer_svc/compute.py lends idle cores this way).
        `sub_batch_overhead`: what one more batch of a pack's suffixes costs, in positions
        (`length_batches`; 0 splits wherever lengths differ)."""
        import torch
        from transformers import AutoModelForCausalLM

        if torch_threads > 0:
            torch.set_num_threads(torch_threads)
        self.base_model_dir = Path(base_model_dir)
        self.micro_batch_tokens = micro_batch_tokens
        self.compute_dtype = compute_dtype
        self.share_prefixes = share_prefixes
        self.skip_zero_advantages = skip_zero_advantages
        self.adjust_threads = adjust_threads
        self.sub_batch_overhead = sub_batch_overhead
        self._threads = torch.get_num_threads()
        """Threads since `_threads_since` (the last call of `adjust_threads`)."""
        self._threads_since = 0.0
        self._thread_s = 0.0
        """Threads x seconds since the step began."""
        self.device = resolve_device(device)
        self._base = AutoModelForCausalLM.from_pretrained(
            self.base_model_dir, dtype=torch.float32, device_map=self.device
        ).eval()
        for param in self._base.parameters():
            param.requires_grad_(False)
        if adjust_threads is not None:
            for layer in self._base.get_decoder().layers:
                layer.register_forward_pre_hook(self._before_layer)
                layer.register_forward_hook(self._after_layer)
        # Created with the first job: a PeftModel cannot exist without an adapter config.
        self._peft: PeftModel | None = None
        self._jobs: dict[str, _Job] = {}

    @property
    def jobs(self) -> list[str]:
        return list(self._jobs)

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding: a token id at or past it cannot be trained on."""
        return int(self._base.get_input_embeddings().weight.shape[0])

    def add_job(self, job_id: str, lora: LoraSettings, rl: RLSettings, seed: int = 0) -> None:
        """Attach a fresh adapter (identity: LoRA B starts at zero) and its optimizer."""
        import torch
        from peft import LoraConfig, get_peft_model

        if job_id in self._jobs:
            raise ValueError(f"job {job_id!r} already has an adapter")
        name = _adapter_name(job_id)
        config = LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            bias="none",  # vLLM's LoRA loader rejects adapter biases and DoRA
            use_dora=False,
            base_model_name_or_path=str(self.base_model_dir),
        )
        # The seed fixes LoRA A's random init; forking keeps the caller's RNG stream intact.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if self._peft is None:
                self._peft = get_peft_model(self._base, config, adapter_name=name)
            else:
                self._peft.add_adapter(name, config)
        self._peft.eval()
        params = [p for n, p in self._peft.named_parameters() if f".{name}." in n]
        # No weight decay: with zero advantages the update must be exactly zero.
        optimizer = torch.optim.AdamW(params, lr=rl.learning_rate, weight_decay=0.0)
        self._jobs[job_id] = _Job(name, lora, rl, optimizer, params)

    def remove_job(self, job_id: str) -> None:
        job = self._job(job_id)
        assert self._peft is not None
        self._peft.delete_adapter(job.adapter_name)
        del self._jobs[job_id]

    def train_step(
        self, job_id: str, trajectories: Sequence[Trajectory], advantages: Sequence[float]
    ) -> dict[str, float]:
        """One optimizer step of one job: `train_steps` with that job alone."""
        return self.train_steps({job_id: (trajectories, advantages)})[job_id]

    def train_steps(
        self,
        batches: Mapping[str, tuple[Sequence[Trajectory], Sequence[float]]],
        versions: Mapping[str, int] | None = None,
    ) -> dict[str, dict[str, float]]:
        """One optimizer step per job, all the jobs' trajectories in shared forward/backward
        passes (each row routed through its own job's adapter).

        Each job's loss is the token mean over its own batch and reaches only its own
        adapter; every job then clips and steps alone, so its update equals the one it would
        get trained by itself (up to float rounding; tests/unit/test_policy.py). Micro-batches
        accumulate gradients: policy_loss returns a mean over one job's rows in one
        micro-batch, re-weighted by (those tokens / the job's batch tokens). Each job's
        `step_s` is its share of the shared time, by trained tokens.

        A row whose advantage is 0 (every row of a group whose rewards are all equal) adds
        exactly 0 to the loss and to every gradient (the objective has no other term), so it
        is not put through the model: the update is the same, the job's token count (the
        loss's denominator) still includes its tokens, and the ratio/clip/IS/KL metrics are
        means over the rows that were computed (absent when none was); the entropy is over
        every row. `zero_advantage_share` says how many rows were left out.

        `versions`: the adapter version each job holds now. The step makes version + 1, its
        place in the job's learning-rate schedule (`trainer_svc.schedule`; a job left out
        keeps its optimizer's rate). The computed rows sampled (every turn) with exactly that
        version give `fresh_kl`, the KL between the sampler's and the trainer's logprobs of
        the same weights: float rounding only (~1e-3 with bf16 on one side), unless the
        sampler did not run the weights it named.
        """
        started = time.monotonic()
        jobs = {job_id: self._job(job_id) for job_id in batches}
        rows: list[_Row] = []
        for job_id, (trajectories, advantages) in batches.items():
            if not trajectories or len(trajectories) != len(advantages):
                raise ValueError(
                    f"job {job_id!r}: need one advantage per trajectory and at least one"
                )
            held = None if versions is None else versions.get(job_id)
            rows += [
                _Row(job_id, t, a, fresh=held is not None and _sampled_only_with(t, held))
                for t, a in zip(trajectories, advantages, strict=True)
            ]
        tallies = {job_id: _Tally() for job_id in jobs}
        for row in rows:
            tallies[row.job_id].add_row(row)
        computed = [r for r in rows if r.advantage != 0.0 or not self.skip_zero_advantages]
        for row in computed:
            tallies[row.job_id].add_computed(row)
        self._train_only(jobs.values())
        pack_rows = [
            PackRow(
                (r.job_id, r.trajectory.group_id), r.trajectory.token_ids, r.trajectory.loss_mask
            )
            for r in computed
        ]
        packs = plan_packs(pack_rows, self.micro_batch_tokens, share_prefixes=self.share_prefixes)
        lengths = [len(row.token_ids) for row in pack_rows]
        overhead = self.sub_batch_overhead
        positions = sum(pack.positions(lengths, overhead) for pack in packs)
        padding = sum(pack.padding(lengths, overhead) for pack in packs)
        self._thread_s, self._threads_since = 0.0, started
        for pack in packs:  # each decoder layer asks for its threads (`_before_layer`)
            self._pass(pack, computed, jobs, tallies)
        results = self._step_each(jobs, tallies, versions)
        self._adjust_threads()  # closes the step's last span of threads
        elapsed = time.monotonic() - started
        all_tokens = sum(tally.tokens for tally in tallies.values())
        for job_id, metrics in results.items():
            share = tallies[job_id].tokens / all_tokens if all_tokens else 1 / len(jobs)
            metrics["step_s"] = elapsed * share
            metrics["jobs_in_step"] = float(len(jobs))
            metrics["positions"] = float(positions)
            metrics["padding_share"] = padding / positions if positions else 0.0
            if self.adjust_threads is not None and elapsed > 0:
                metrics["threads"] = self._thread_s / elapsed
        return results

    def _adjust_threads(self) -> None:
        """Let `adjust_threads` set the threads of what runs next; count the time at the last."""
        if self.adjust_threads is None:
            return
        now = time.monotonic()
        self._thread_s += (now - self._threads_since) * self._threads
        self._threads_since = now
        self._threads = self.adjust_threads()

    def _before_layer(self, module: torch.nn.Module, args: Any) -> None:
        self._adjust_threads()

    def _after_layer(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """The layer's backward begins when its output's gradient is in: adjust there too."""
        import torch

        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(self._before_layer_backward)

    def _before_layer_backward(self, grad: torch.Tensor) -> None:
        self._adjust_threads()

    def _pass(
        self, pack: Pack, computed: list[_Row], jobs: Mapping[str, _Job], tallies: dict[str, _Tally]
    ) -> None:
        """One forward/backward pass over a pack (its indices are into `computed`): each
        job's loss, weighted by its share of the job's tokens, into one backward."""
        import torch

        rows = [computed[i] for i in pack.rows]
        owners = [row.job_id for row in rows]
        # In a pack everything is in suffix coordinates: position 0 is `prefix_len`.
        token_ids_BT, attention_BT, mask_BT, behaviour_BT = (
            tensor.to(self.device)
            for tensor in _pad([row.trajectory for row in rows], start=pack.prefix_len)
        )
        prefix = None
        if pack.prefix_len:
            leaders = [computed[i] for i in pack.prefix_rows]
            prefix = SharedPrefix(
                token_ids_GP=torch.tensor(
                    [row.trajectory.token_ids[: pack.prefix_len] for row in leaders],
                    device=self.device,
                ),
                adapter_names_G=[jobs[row.job_id].adapter_name for row in leaders],
                group_of_row_B=torch.tensor(pack.prefix_of_row, device=self.device),
            )
        logprobs_BT = self._loss_logprobs(
            token_ids_BT, attention_BT, mask_BT, [jobs[o].adapter_name for o in owners], prefix
        )
        advantages_B = torch.tensor(
            [row.advantage for row in rows], dtype=torch.float32, device=self.device
        )
        fresh_rows_B = torch.tensor([row.fresh for row in rows], device=self.device)
        objective: torch.Tensor | None = None
        for job_id in dict.fromkeys(owners):
            rl = jobs[job_id].rl
            own_B = torch.tensor([owner == job_id for owner in owners], device=self.device)
            loss, metrics = policy_loss(
                logprobs_BT[own_B],
                behaviour_BT[own_B],
                advantages_B[own_B],
                mask_BT[own_B],
                clip_low=rl.clip_low,
                clip_high=rl.clip_high,
                is_cap=rl.is_cap,
            )
            tally = tallies[job_id]
            fresh_B = own_B & fresh_rows_B
            if bool(fresh_B.any()):
                fresh_mask_BT = mask_BT[fresh_B]
                with torch.no_grad():
                    k3_BT = k3_kl(logprobs_BT[fresh_B], behaviour_BT[fresh_B], fresh_mask_BT)
                tally.add_fresh(float(k3_BT.sum()), int(fresh_mask_BT.sum()))
            if metrics["tokens"] > 0:
                weighted = loss * (metrics["tokens"] / max(tally.tokens, 1))
                objective = weighted if objective is None else objective + weighted
            tally.add(metrics)
        if objective is not None:
            objective.backward()

    def _step_each(
        self,
        jobs: Mapping[str, _Job],
        tallies: Mapping[str, _Tally],
        versions: Mapping[str, int] | None,
    ) -> dict[str, dict[str, float]]:
        """Each job clips its own gradient and steps its own optimizer, unless none of its rows
        carried an advantage: then the step has no signal, and its optimizer does not step.
        The step that makes version v + 1 from `versions`' v takes that step's learning rate
        of the job's schedule (`trainer_svc.schedule`); a job not in `versions` keeps the
        rate it has (`rl.learning_rate` unless a versioned step set another).

        AdamW would otherwise still move the adapter on its momentum (and count the step in
        its bias correction): a job whose groups are all solved, several steps running, was
        carried past its solution that way (issue 26: rewards of 1.0 fell to 0.1 in one step
        after two or three such steps; bench/results/learning-*.json). Computing the rows or
        skipping them gives the same update either way."""
        import torch

        norms: dict[str, float] = {}
        for job_id, job in jobs.items():
            # A param no micro-batch reached (all masked) has grad None; clip and step skip it.
            # A skipped row would have reached it with a zero gradient, which still moves
            # Adam's state: give it that zero.
            if tallies[job_id].zero_rows and self.skip_zero_advantages:
                for param in job.params:
                    if param.grad is None:
                        param.grad = torch.zeros_like(param)
            norms[job_id] = float(torch.nn.utils.clip_grad_norm_(job.params, MAX_GRAD_NORM))
        if diverged := sorted(job_id for job_id, norm in norms.items() if not math.isfinite(norm)):
            # No optimizer has stepped: the weights stay finite, and the caller can train the
            # other jobs again without this one (trainer_svc/service.py, `_untrainable`).
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

    def logprobs(self, job_id: str | None, token_ids: Sequence[int]) -> list[float]:
        """Logprob of each token given the ones before (position 0 gets 0); None = base model."""
        import torch

        token_ids_BT = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        with torch.no_grad():
            if job_id is None:
                if self._peft is None:
                    logits_BTV = self._base(input_ids=token_ids_BT, use_cache=False).logits
                else:
                    with self._peft.disable_adapter():
                        logits_BTV = self._peft(input_ids=token_ids_BT, use_cache=False).logits
            else:
                self._activate(job_id)
                logits_BTV = self._peft_model()(input_ids=token_ids_BT, use_cache=False).logits
        return token_logprobs(logits_BTV, token_ids_BT)[0].tolist()

    def adapter_state(self, job_id: str) -> dict[str, torch.Tensor]:
        """The job's adapter weights under peft's saved names (no adapter name in the keys)."""
        from peft import get_peft_model_state_dict

        job = self._job(job_id)
        state = get_peft_model_state_dict(self._peft_model(), adapter_name=job.adapter_name)
        return {key: tensor.detach().cpu().clone().contiguous() for key, tensor in state.items()}

    def save_adapter(self, job_id: str, out_dir: Path) -> Path:
        """Write a standard PEFT adapter directory (config + safetensors) atomically.

        Written by hand rather than with `save_pretrained`, which puts any adapter not named
        "default" into a subdirectory named after it.
        """
        out_dir = Path(out_dir)
        with atomic_dir(out_dir) as staging:
            self._write_adapter(job_id, staging)
        return out_dir

    def save_checkpoint(
        self,
        job_id: str,
        out_dir: Path,
        *,
        step: int,
        version: int,
        extra_files: Mapping[str, str] | None = None,
    ) -> Path:
        """Adapter (loadable on its own) + optimizer state + step/version, atomically.

        `extra_files` (file name -> text) are written into the same directory before it is
        renamed into place, so they appear together with the rest or not at all.
        """
        import torch

        job = self._job(job_id)
        out_dir = Path(out_dir)
        extra = dict(extra_files or {})
        for name in extra:
            if name in _CHECKPOINT_FILES or Path(name).name != name or name[:1] in ("", "."):
                raise ValueError(f"extra checkpoint file {name!r}: need a new plain file name")
        with atomic_dir(out_dir) as staging:
            self._write_adapter(job_id, staging)
            torch.save(job.optimizer.state_dict(), staging / OPTIMIZER_STATE)
            state = {"job_id": job_id, "step": step, "version": version}
            (staging / TRAINER_STATE).write_text(json.dumps(state, indent=2))
            for name, text in extra.items():
                (staging / name).write_text(text)
        return out_dir

    def load_checkpoint(self, job_id: str, ckpt_dir: Path) -> tuple[int, int]:
        """Restore a checkpoint into a job already added with `add_job`; returns (step, version)."""
        import torch
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        job = self._job(job_id)
        ckpt_dir = Path(ckpt_dir)
        saved_config = json.loads((ckpt_dir / ADAPTER_CONFIG).read_text())
        expected = (job.lora.rank, job.lora.alpha, sorted(job.lora.target_modules))
        found = (
            saved_config["r"],
            saved_config["lora_alpha"],
            sorted(saved_config["target_modules"]),
        )
        if found != expected:
            raise ValueError(f"checkpoint has LoRA (r, alpha, targets) {found}, job {expected}")
        weights = load_file(ckpt_dir / ADAPTER_WEIGHTS)
        if set(weights) != set(self.adapter_state(job_id)):
            raise ValueError(f"checkpoint {ckpt_dir} does not hold this job's adapter tensors")
        # load_state_dict copies in place, so the optimizer still holds the same Parameters.
        result = set_peft_model_state_dict(
            self._peft_model(), weights, adapter_name=job.adapter_name
        )
        # torch's load_state_dict result (missing_keys, unexpected_keys); peft's stubs lose it.
        unexpected: list[str] = result.unexpected_keys  # type: ignore[attr-defined]
        if unexpected:
            raise ValueError(f"unexpected adapter tensors: {unexpected[:5]}")
        job.optimizer.load_state_dict(
            torch.load(ckpt_dir / OPTIMIZER_STATE, weights_only=True, map_location=self.device)
        )
        state = json.loads((ckpt_dir / TRAINER_STATE).read_text())
        return int(state["step"]), int(state["version"])

    # --- internals ----------------------------------------------------------------------

    def _job(self, job_id: str) -> _Job:
        try:
            return self._jobs[job_id]
        except KeyError:
            raise KeyError(f"no adapter for job {job_id!r}") from None

    def _peft_model(self) -> PeftModel:
        assert self._peft is not None, "no job added yet"
        return self._peft

    def _train_only(self, jobs: Iterable[_Job]) -> None:
        """Make exactly these jobs' adapters trainable, with no gradients left over."""
        model = self._peft_model()
        jobs = list(jobs)
        model.set_adapter(jobs[0].adapter_name)  # freezes every other adapter
        for job in jobs:
            job.optimizer.zero_grad(set_to_none=True)
            for param in job.params:
                param.requires_grad_(True)

    def _activate(self, job_id: str) -> _Job:
        job = self._job(job_id)
        model = self._peft_model()
        # set_adapter also marks only this adapter trainable, so other jobs' weights get no
        # gradient (they are not in the forward pass either); the base stays frozen.
        model.set_adapter(job.adapter_name)
        return job

    def _write_adapter(self, job_id: str, out_dir: Path) -> None:
        from safetensors.torch import save_file

        job = self._job(job_id)
        config: dict[str, Any] = self._peft_model().peft_config[job.adapter_name].to_dict()
        config["base_model_name_or_path"] = str(self.base_model_dir)
        # vLLM's loader wants a list (peft holds a set); sorted keeps the file reproducible.
        config["target_modules"] = sorted(config["target_modules"])
        (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
        save_file(self.adapter_state(job_id), out_dir / ADAPTER_WEIGHTS, metadata={"format": "pt"})

    def _loss_logprobs(
        self,
        token_ids_BT: torch.Tensor,
        attention_BT: torch.Tensor,
        mask_BT: torch.Tensor,
        adapter_names_B: Sequence[str],
        prefix: SharedPrefix | None = None,
    ) -> torch.Tensor:
        """Trainer logprobs at the loss positions (0 elsewhere), with the gradient; row b
        goes through adapter `adapter_names_B[b]`. With `prefix`, the rows continue the
        prefix rows' tokens (computed once per group, trainer_svc/packing.py): the tensors
        hold only what follows them. The rows run in batches of similar length
        (`length_batches`), each padded only to its own longest."""
        import torch
        from transformers import DynamicCache

        # The causal LM with the LoRA layers injected (typed loosely in peft's stubs).
        model: Any = self._peft_model().get_base_model()
        decoder = model.get_decoder()
        lengths_B = attention_BT.sum(dim=1).tolist()
        with torch.autocast(
            self.device.type,
            dtype=getattr(torch, self.compute_dtype),
            enabled=self.compute_dtype != "float32",
        ):
            prefix_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
            if prefix is not None:
                with self._routing(prefix.adapter_names_G):
                    past = decoder(input_ids=prefix.token_ids_GP, use_cache=True).past_key_values
                prefix_kv = [(layer.keys, layer.values) for layer in past.layers]
            logprobs_B: list[torch.Tensor] = [mask_BT.new_zeros(0)] * len(lengths_B)
            for batch in length_batches(lengths_B, self.sub_batch_overhead):
                rows_b = torch.tensor(batch, device=self.device)
                length = max(lengths_B[b] for b in batch)
                attention_bT = attention_BT[rows_b, :length]
                cache = None
                if prefix is not None:
                    # Each row attends to its group's keys and values; the gradient of every
                    # row's loss flows back through these copies into the one prefix pass.
                    groups_b = prefix.group_of_row_B[rows_b]
                    cache = DynamicCache(
                        ddp_cache_data=[
                            (keys.index_select(0, groups_b), values.index_select(0, groups_b))
                            for keys, values in prefix_kv
                        ]
                    )
                    attention_bT = torch.cat(
                        [
                            attention_bT.new_ones((len(batch), prefix.token_ids_GP.shape[1])),
                            attention_bT,
                        ],
                        dim=1,
                    )
                with self._routing([adapter_names_B[b] for b in batch]):
                    hidden_bTH = decoder(
                        input_ids=token_ids_BT[rows_b, :length],
                        attention_mask=attention_bT,
                        past_key_values=cache,
                        use_cache=cache is not None,
                    ).last_hidden_state
                logprobs_bT = masked_token_logprobs(
                    hidden_bTH,
                    model.get_output_embeddings(),
                    token_ids_BT[rows_b, :length],
                    mask_BT[rows_b, :length],
                )
                padding = token_ids_BT.shape[1] - length
                for row, logprobs_T in zip(batch, logprobs_bT, strict=True):
                    logprobs_B[row] = torch.nn.functional.pad(logprobs_T, (0, padding))
            return torch.stack(logprobs_B)

    def _routing(self, adapter_names_B: Sequence[str]) -> contextlib.AbstractContextManager[Any]:
        """Route row b of the next forward pass through adapter `adapter_names_B[b]`."""
        peft = self._peft_model()
        if set(adapter_names_B) == {peft.active_adapter}:
            return contextlib.nullcontext()
        # peft's mixed-adapter batch: each LoRA layer adds each row's own adapter. The hooks
        # are what PeftModel.forward installs for `adapter_names`; we call the decoder
        # directly (logits only at the loss positions), so install them here. (set_adapter
        # instead would freeze the other jobs of this step.)
        hooks: Any = peft._enable_peft_forward_hooks
        return hooks(adapter_names=list(adapter_names_B))  # type: ignore[no-any-return]


def resolve_device(device: str) -> torch.device:
    """ "auto" is CUDA when torch sees a GPU, else the CPU; anything else as torch names it."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"trainer device {device!r}: torch sees no CUDA device")
    return resolved


@dataclass
class SharedPrefix:
    """Prefixes a pack computes once per group (trainer_svc/packing.py)."""

    token_ids_GP: torch.Tensor
    adapter_names_G: list[str]
    group_of_row_B: torch.Tensor
    """Each row's index into the prefixes."""


def _pad(
    batch: Sequence[Trajectory], start: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad to the longest sequence from position `start` on; padding is out of the
    attention and the loss."""
    import torch

    length = max(len(t.token_ids) for t in batch) - start
    token_ids_BT = torch.zeros((len(batch), length), dtype=torch.long)
    attention_BT = torch.zeros((len(batch), length), dtype=torch.long)
    mask_BT = torch.zeros((len(batch), length), dtype=torch.float32)
    behaviour_BT = torch.zeros((len(batch), length), dtype=torch.float32)
    for row, trajectory in enumerate(batch):
        n = len(trajectory.token_ids)
        if len(trajectory.loss_mask) != n or len(trajectory.behaviour_logprobs) != n:
            raise ValueError(f"episode {trajectory.episode_id}: misaligned mask or logprobs")
        token_ids_BT[row, : n - start] = torch.tensor(trajectory.token_ids[start:])
        attention_BT[row, : n - start] = 1
        mask_BT[row, : n - start] = torch.tensor(trajectory.loss_mask[start:], dtype=torch.float32)
        behaviour_BT[row, : n - start] = torch.tensor(trajectory.behaviour_logprobs[start:])
    # No logprob at position 0, nor at a suffix's first position (its logits are the
    # prefix's, and packing never cuts before a loss position).
    mask_BT[:, 0] = 0.0
    return token_ids_BT, attention_BT, mask_BT, behaviour_BT

"""One base model, many jobs: a PEFT LoRA adapter and an AdamW optimizer per job.

The base model is loaded once (float32, CPU) and shared: every job's adapter is a named
adapter of one `PeftModel`, and a step activates that job's adapter only. Each optimizer holds
exactly its job's adapter parameters, so one job's step can neither read another job's
gradients nor move its weights (tests/unit/test_policy.py checks both).

Dropout stays off (the model is always in eval mode): the loss already has a sampling-noise
floor, and a deterministic forward pass is what makes a resumed job continue bit-identically.

The parts: `optimizers` (each job's adapter slot and optimizer step), `tally` (a step's rows
and metric sums), `forward` (the loss's forward pass), `layer_threads` (threads per decoder
layer), `adapter_files` (adapters and checkpoints on disk); this module wires them.

torch, transformers and peft are imported inside the functions: services import this module
at start-up, before they decide to load a model.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from common.files.artifacts import atomic_dir
from common.runtime.hardware import ComputeDtype
from common.wire.messages import LoraSettings, RLSettings, Trajectory
from trainer_svc import adapter_files
from trainer_svc.forward import LossForward, LossLogits, SharedPrefix, pad
from trainer_svc.grpo import k3_kl, policy_loss, token_logprobs
from trainer_svc.layer_threads import LayerThreads
from trainer_svc.optimizers import AdapterSlot, step_each
from trainer_svc.packing import SUB_BATCH_OVERHEAD, Pack, PackRow, plan_packs
from trainer_svc.tally import Row, Tally, step_rows

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import PreTrainedModel


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
        loss_logits: LossLogits = "loss_positions",
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
        (`length_batches`; 0 splits wherever lengths differ). `loss_logits`: where the
        forward pass computes logits (`trainer_svc.forward.LossLogits`; "all_positions" is
        the plain causal-LM path, for comparison, and takes no shared prefixes)."""
        import torch
        from transformers import AutoModelForCausalLM

        if torch_threads > 0:
            torch.set_num_threads(torch_threads)
        self.base_model_dir = Path(base_model_dir)
        self.micro_batch_tokens = micro_batch_tokens
        self.compute_dtype = compute_dtype
        self.share_prefixes = share_prefixes
        self.skip_zero_advantages = skip_zero_advantages
        self.sub_batch_overhead = sub_batch_overhead
        if loss_logits == "all_positions" and share_prefixes:
            raise ValueError("loss_logits='all_positions' needs share_prefixes=False")
        self.device = resolve_device(device)
        self._base = AutoModelForCausalLM.from_pretrained(
            self.base_model_dir, dtype=torch.float32, device_map=self.device
        ).eval()
        for param in self._base.parameters():
            param.requires_grad_(False)
        self.layer_threads: LayerThreads | None = None
        if adjust_threads is not None:
            self.layer_threads = LayerThreads(adjust_threads, torch.get_num_threads())
            self.layer_threads.hook(self._base.get_decoder().layers)
        # Created with the first job: a PeftModel cannot exist without an adapter config.
        self._peft: PeftModel | None = None
        self._jobs: dict[str, AdapterSlot] = {}
        self.loss_forward = LossForward(
            self._peft_model, self.device, compute_dtype, sub_batch_overhead, loss_logits
        )

    @property
    def jobs(self) -> list[str]:
        return list(self._jobs)

    @property
    def base_model(self) -> PreTrainedModel:
        """The shared base causal LM (frozen; the adapters are injected into it)."""
        model: PreTrainedModel = self._base
        return model

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
        self._jobs[job_id] = AdapterSlot(name, lora, rl, optimizer, params)

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
        rows = step_rows(batches, versions)
        tallies = {job_id: Tally() for job_id in jobs}
        for row in rows:
            tallies[row.job_id].add_row(row)
        computed = [r for r in rows if r.advantage != 0.0 or not self.skip_zero_advantages]
        for row in computed:
            tallies[row.job_id].add_computed(row)
        self._train_only(jobs.values())
        packs, positions, padding = self._plan(computed)
        if self.layer_threads is not None:
            self.layer_threads.begin(started)
        for pack in packs:  # each decoder layer asks for its threads (`LayerThreads`)
            self._pass(pack, computed, jobs, tallies)
        results = step_each(jobs, tallies, versions, self.skip_zero_advantages)
        if self.layer_threads is not None:
            self.layer_threads.step()  # closes the step's last span of threads
        elapsed = time.monotonic() - started
        all_tokens = sum(tally.tokens for tally in tallies.values())
        for job_id, metrics in results.items():
            share = tallies[job_id].tokens / all_tokens if all_tokens else 1 / len(jobs)
            metrics["step_s"] = elapsed * share
            metrics["jobs_in_step"] = float(len(jobs))
            metrics["positions"] = float(positions)
            metrics["padding_share"] = padding / positions if positions else 0.0
            if self.layer_threads is not None and elapsed > 0:
                metrics["threads"] = self.layer_threads.thread_s / elapsed
        return results

    def _plan(self, computed: Sequence[Row]) -> tuple[list[Pack], int, int]:
        """The computed rows' packs (trainer_svc/packing.py), with the positions they run
        and how many of those are padding."""
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
        return packs, positions, padding

    def _pass(
        self,
        pack: Pack,
        computed: list[Row],
        jobs: Mapping[str, AdapterSlot],
        tallies: dict[str, Tally],
    ) -> None:
        """One forward/backward pass over a pack (its indices are into `computed`): each
        job's loss, weighted by its share of the job's tokens, into one backward."""
        import torch

        rows = [computed[i] for i in pack.rows]
        owners = [row.job_id for row in rows]
        # In a pack everything is in suffix coordinates: position 0 is `prefix_len`.
        token_ids_BT, attention_BT, mask_BT, behaviour_BT = (
            tensor.to(self.device)
            for tensor in pad([row.trajectory for row in rows], start=pack.prefix_len)
        )
        prefix = _shared_prefix(pack, computed, jobs, self.device) if pack.prefix_len else None
        logprobs_BT = self.loss_forward.loss_logprobs(
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
        """Write a standard PEFT adapter directory (config + safetensors) atomically."""
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
        job = self._job(job_id)
        out_dir = Path(out_dir)
        extra = adapter_files.checked_extra_files(extra_files)
        with atomic_dir(out_dir) as staging:
            self._write_adapter(job_id, staging)
            adapter_files.write_trainer_state(staging, job.optimizer, job_id, step, version, extra)
        return out_dir

    def load_checkpoint(self, job_id: str, ckpt_dir: Path) -> tuple[int, int]:
        """Restore a checkpoint into a job already added with `add_job`; returns (step, version)."""
        from peft import set_peft_model_state_dict

        job = self._job(job_id)
        ckpt_dir = Path(ckpt_dir)
        weights = adapter_files.load_adapter_weights(
            ckpt_dir, job.lora, set(self.adapter_state(job_id))
        )
        # load_state_dict copies in place, so the optimizer still holds the same Parameters.
        result = set_peft_model_state_dict(
            self._peft_model(), weights, adapter_name=job.adapter_name
        )
        # torch's load_state_dict result (missing_keys, unexpected_keys); peft's stubs lose it.
        unexpected: list[str] = result.unexpected_keys  # type: ignore[attr-defined]
        if unexpected:
            raise ValueError(f"unexpected adapter tensors: {unexpected[:5]}")
        return adapter_files.load_trainer_state(ckpt_dir, job.optimizer, self.device)

    # --- internals ----------------------------------------------------------------------

    def _job(self, job_id: str) -> AdapterSlot:
        try:
            return self._jobs[job_id]
        except KeyError:
            raise KeyError(f"no adapter for job {job_id!r}") from None

    def _peft_model(self) -> PeftModel:
        assert self._peft is not None, "no job added yet"
        return self._peft

    def _train_only(self, jobs: Iterable[AdapterSlot]) -> None:
        """Make exactly these jobs' adapters trainable, with no gradients left over."""
        model = self._peft_model()
        jobs = list(jobs)
        model.set_adapter(jobs[0].adapter_name)  # freezes every other adapter
        for job in jobs:
            job.optimizer.zero_grad(set_to_none=True)
            for param in job.params:
                param.requires_grad_(True)

    def _activate(self, job_id: str) -> AdapterSlot:
        job = self._job(job_id)
        model = self._peft_model()
        # set_adapter also marks only this adapter trainable, so other jobs' weights get no
        # gradient (they are not in the forward pass either); the base stays frozen.
        model.set_adapter(job.adapter_name)
        return job

    def _write_adapter(self, job_id: str, out_dir: Path) -> None:
        job = self._job(job_id)
        adapter_files.write_adapter(
            self._peft_model(),
            job.adapter_name,
            self.base_model_dir,
            self.adapter_state(job_id),
            out_dir,
        )


def _shared_prefix(
    pack: Pack, computed: list[Row], jobs: Mapping[str, AdapterSlot], device: torch.device
) -> SharedPrefix:
    """The pack's prefixes, one per group: its leading rows' first `prefix_len` tokens."""
    import torch

    leaders = [computed[i] for i in pack.prefix_rows]
    return SharedPrefix(
        token_ids_GP=torch.tensor(
            [row.trajectory.token_ids[: pack.prefix_len] for row in leaders], device=device
        ),
        adapter_names_G=[jobs[row.job_id].adapter_name for row in leaders],
        group_of_row_B=torch.tensor(pack.prefix_of_row, device=device),
    )


def resolve_device(device: str) -> torch.device:
    """ "auto" is CUDA when torch sees a GPU, else the CPU; anything else as torch names it."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"trainer device {device!r}: torch sees no CUDA device")
    return resolved

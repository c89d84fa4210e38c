"""How a rollout engine is built: its settings, and vLLM's engine arguments made from them.

How vLLM runs here, its CPU quirks and our work-arounds: docs/architecture.md, "vLLM on CPU".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from common.runtime.hardware import ComputeDtype
from rollout_svc.loras import VLLM_LORA_RANKS

if TYPE_CHECKING:
    from vllm import AsyncEngineArgs

_GIB = 1 << 30
CPU_KV_CACHE_GIB = 1.0
"""KV cache of a CPU engine when none is set: vLLM's CPU backend cannot size it itself."""
CPU_BLOCK_SIZE = 32
"""KV cache block of a CPU engine, in tokens (vLLM's CPU default: 128; its attention takes
multiples of 32). A group's G samples share one prompt, but the prefix cache only shares
whole blocks: with 128, each sample recomputed up to 127 tokens of the prompt's tail. For
16 samples of a 371-token prompt (SmolLM2, float32, AVX2 class): 1.97 s with 32 against
5.53 s with 128, and 0.95 s for one; decoding as fast with either (77 vs 76 tok/s at 16
sequences, 104 vs 106 at 64). bench/kv_blocks.py, results/kv-blocks-20261205-cpu2-avx2.json."""


@dataclass(frozen=True)
class EngineSettings:
    """One rollout engine's configuration; nothing starts until the engine's `start()`."""

    model: str | Path
    """The base model's directory (or hub name)."""
    enable_lora: bool = True
    """False serves the base model only (every request must be version 0)."""
    max_loras: int = 4
    """Distinct adapters in one batch step."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded (least recently used ones are evicted and reloaded from their path
    on next use); None: `max_loras`."""
    max_lora_rank: int = 16
    """The largest adapter rank served: one of `VLLM_LORA_RANKS`."""
    lora_target_modules: Sequence[str] | None = None
    """The modules (PEFT names) that get LoRA slots; None lets vLLM give every supported
    linear layer one, which costs compute on layers no adapter targets."""
    max_model_len: int = 1024
    """Context plus completion, in tokens."""
    max_num_seqs: int | None = None
    """Sequences in one batch step; None: vLLM's default."""
    kv_cache_gib: float | None = None
    """KV cache size; None: `CPU_KV_CACHE_GIB` on a CPU, and on a GPU what
    `gpu_memory_utilization` leaves."""
    gpu_memory_utilization: float = 0.85
    """Share of the GPU's memory vLLM may take."""
    dtype: str = "auto"
    """`auto` (bf16 where the hardware runs it natively, else float32 on a CPU and float16 on
    a GPU, common/runtime/hardware.py) or a dtype."""
    enforce_eager: bool | None = None
    """None: eager on a CPU, CUDA graphs on a GPU."""
    logprobs_mode: str = "raw_logprobs"
    """`raw_logprobs` returns the model's log-softmax before temperature/top-p, the quantity
    the trainer recomputes; `processed_logprobs` the distribution actually sampled from."""
    seed: int = 0
    """vLLM's engine seed (a seeded job's turns carry their own, `sampling.turn_seed`)."""

    def __post_init__(self) -> None:
        if self.max_lora_rank not in VLLM_LORA_RANKS:
            raise ValueError(
                f"max_lora_rank must be one of {VLLM_LORA_RANKS}, not {self.max_lora_rank}"
            )


def engine_args(
    settings: EngineSettings, *, dtype: ComputeDtype, on_cpu: bool, extra_lora_slots: int
) -> AsyncEngineArgs:
    """vLLM's arguments for `settings` on this machine: `dtype` as resolved for its hardware,
    `extra_lora_slots` for the null adapter (rollout_svc/loras.py) where one is pinned."""
    from vllm import AsyncEngineArgs

    kv_cache_gib = settings.kv_cache_gib or (CPU_KV_CACHE_GIB if on_cpu else None)
    max_cpu_loras = settings.max_cpu_loras
    return AsyncEngineArgs(
        model=str(settings.model),
        dtype=dtype,
        enforce_eager=on_cpu if settings.enforce_eager is None else settings.enforce_eager,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        enable_lora=settings.enable_lora,
        max_loras=settings.max_loras + extra_lora_slots,
        max_cpu_loras=None if max_cpu_loras is None else max_cpu_loras + extra_lora_slots,
        max_lora_rank=settings.max_lora_rank,  # type: ignore[arg-type]
        lora_target_modules=(
            None if settings.lora_target_modules is None else list(settings.lora_target_modules)
        ),
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        kv_cache_memory_bytes=None if kv_cache_gib is None else int(kv_cache_gib * _GIB),
        block_size=CPU_BLOCK_SIZE if on_cpu else None,
        logprobs_mode=settings.logprobs_mode,  # type: ignore[arg-type]
        seed=settings.seed,
        # Per-request stats carry the engine's queued/scheduled timestamps (queue_s).
        disable_log_stats=False,
    )

"""Trainer throughput beside the CPU's own matmul peak, measured side by side in one run.

    python bench/trainer.py [--model smollm2-135m-instruct] [--jobs 8] [--repeats 3]

For each trainer variant — the code before issue 10's first changes (float32, logits at every
position), logits at the loss positions only, and that with each group's shared prompt
computed once (trainer_svc/packing.py), in float32 and (where the CPU runs bf16 natively, or
named with `--variants`) under bf16 autocast — it times one job's `train_step` on a
demo-sized batch (16 trajectories of a 45-token prompt + 16 sampled tokens, the arithmetic demo
job's shape), 8 jobs' steps one after another, and the same 8 jobs in one batched step
(`train_steps`: shared passes, per-job loss and optimizer). Beside them, in the same run:
the best square-matmul rate in float32 and bfloat16 on the same threads. Writes
`bench/results/trainer-<date>-<machine>.json`; every figure that matters is a ratio of two of
its numbers.

Model FLOPs of a LoRA step (frozen base): forward 2·N·T, backward through the activations
2·N·T (no weight gradients for frozen weights), so 4·N·T for the decoder's N weights over all
T positions, plus 4·V·H for each position that goes through the vocabulary projection. LoRA's
own FLOPs (rank 8) are under 3% and left out: the share of peak is a slight underestimate.
With the shared prompt (bf16_shared_prompt) T counts the positions actually computed: each
group's prompt once, then every sample's own tokens; trained tokens/s is the figure to
compare across variants.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from machine import machine_fields, result_path, trainer_dtype  # bench/machine.py

from common.files.models import model_source, resolve_base_model
from common.wire.messages import LoraSettings, RLSettings, Trajectory
from trainer_svc.policy import MultiAdapterPolicy, resolve_device

PROMPT_TOKENS, SAMPLED_TOKENS, TRAJECTORIES, GROUP_SIZE = 45, 16, 16, 8
VARIANTS = (
    "fp32_full_logits",
    "fp32_loss_logits",
    "fp32_shared_prompt",
    "bf16_loss_logits",
    "bf16_shared_prompt",
)
"""The bf16 ones run by default only where the trainer's `auto` precision is bf16: on a CPU
without native bf16 they are ~40x slower (bench/precision.py) and say nothing new."""
LORA = LoraSettings(rank=8, alpha=16)
RL = RLSettings(learning_rate=1e-4)


def matmul_peak_flops(
    dtype: torch.dtype, device: torch.device, n: int = 2048, repeats: int = 5
) -> float:
    """Best FLOP/s of an n x n x n matmul in `dtype` over `repeats` timed runs."""
    if device.type == "cuda":
        n = 8192  # a GPU needs a bigger problem to reach its peak
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)  # warm-up: kernel selection, page faults
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return 2 * n**3 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batch(vocab: int, seed: int) -> list[Trajectory]:
    """Groups of GROUP_SIZE samples; a group's samples share their prompt, as in a real step."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for index in range(TRAJECTORIES):
        if index % GROUP_SIZE == 0:
            prompt = torch.randint(100, vocab, (PROMPT_TOKENS,), generator=generator).tolist()
        ids = prompt + torch.randint(100, vocab, (SAMPLED_TOKENS,), generator=generator).tolist()
        mask = [0] * PROMPT_TOKENS + [1] * SAMPLED_TOKENS
        out.append(
            Trajectory(
                episode_id=f"e{index}",
                job_id="bench",
                group_id=f"g{index // GROUP_SIZE}",
                sample_index=index % GROUP_SIZE,
                group_size=GROUP_SIZE,
                token_ids=ids,
                loss_mask=mask,
                behaviour_logprobs=[-2.0 * m for m in mask],
                reward=float(index % 2),
            )
        )
    return out


def timed(step: Callable[[], object], repeats: int, device: torch.device) -> float:
    step()  # warm-up
    _sync(device)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(
    model_dir: Path, variant: str, jobs: int, repeats: int, peaks: dict[str, float], device: str
) -> dict[str, Any]:
    dtype = "bfloat16" if variant.startswith("bf16") else "float32"
    shared = variant.endswith("_shared_prompt")
    policy = MultiAdapterPolicy(
        model_dir,
        compute_dtype=dtype,  # type: ignore[arg-type]
        device=device,
        share_prefixes=shared,
        # The plain causal-LM path: logits at every position, logprobs picked from them.
        loss_logits="all_positions" if variant == "fp32_full_logits" else "loss_positions",
    )
    on = policy.device
    config = policy.base_model.config
    decoder_params = sum(
        p.numel() for name, p in policy.base_model.named_parameters() if ".layers." in name
    )
    head_params = config.vocab_size * config.hidden_size
    job_ids = [f"job{i}" for i in range(jobs)]
    for index, job_id in enumerate(job_ids):
        policy.add_job(job_id, LORA, RL, seed=index)
    trajectories = batch(config.vocab_size, seed=0)
    advantages = [t.reward - 0.5 for t in trajectories]
    one_s = timed(lambda: policy.train_step(job_ids[0], trajectories, advantages), repeats, on)
    in_turn_s = timed(
        lambda: [policy.train_step(j, trajectories, advantages) for j in job_ids],
        max(repeats - 1, 1),
        on,
    )
    batched_s = None
    if variant != "fp32_full_logits":  # the old path had no per-row adapter routing
        batches = {j: (trajectories, advantages) for j in job_ids}
        batched_s = timed(lambda: policy.train_steps(batches), max(repeats - 1, 1), on)
    positions = TRAJECTORIES * (PROMPT_TOKENS + SAMPLED_TOKENS)
    projected = positions if variant == "fp32_full_logits" else TRAJECTORIES * SAMPLED_TOKENS
    if shared:  # each group's prompt but its last token once, then every sample's own part
        groups = TRAJECTORIES // GROUP_SIZE
        positions = groups * (PROMPT_TOKENS - 1) + TRAJECTORIES * (SAMPLED_TOKENS + 1)
    step_flops = 4 * decoder_params * positions + 4 * head_params * projected
    peak = peaks[dtype]
    return {
        "variant": variant,
        "compute_dtype": dtype,
        "one_job_step_s": one_s,
        "one_job_trained_tokens_per_s": TRAJECTORIES * SAMPLED_TOKENS / one_s,
        "one_job_positions_per_s": positions / one_s,
        "one_job_model_flops_per_s": step_flops / one_s,
        "one_job_share_of_peak": step_flops / one_s / peak,
        "jobs_in_turn": jobs,
        "jobs_in_turn_s": in_turn_s,
        "jobs_in_turn_trained_tokens_per_s": jobs * TRAJECTORIES * SAMPLED_TOKENS / in_turn_s,
        "jobs_batched_s": batched_s,
        "jobs_batched_trained_tokens_per_s": (
            None if batched_s is None else jobs * TRAJECTORIES * SAMPLED_TOKENS / batched_s
        ),
        "jobs_batched_share_of_peak": (
            None if batched_s is None else jobs * step_flops / batched_s / peak
        ),
        "batched_over_in_turn": None if batched_s is None else in_turn_s / batched_s,
        "step_model_flops": step_flops,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help='"cpu", "cuda" or "auto"')
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--variants", default="", help=f"comma-separated, of {', '.join(VARIANTS)}")
    args = parser.parse_args()
    bf16 = trainer_dtype() == "bfloat16"
    default = [v for v in VARIANTS if bf16 or not v.startswith("bf16")]
    variants = args.variants.split(",") if args.variants else default
    model_dir = resolve_base_model(args.model)
    device = resolve_device(args.device)
    peaks = {
        "float32": matmul_peak_flops(torch.float32, device),
        "bfloat16": matmul_peak_flops(torch.bfloat16, device),
    }
    runs = [
        measure(model_dir, variant, args.jobs, args.repeats, peaks, args.device)
        for variant in variants
    ]
    before = runs[0]["one_job_step_s"]
    for run in runs:
        run["speedup_vs_fp32_full_logits"] = before / run["one_job_step_s"]
        print(
            f"{run['variant']:>18}: one job {run['one_job_step_s']:.2f} s/step "
            f"({run['one_job_trained_tokens_per_s']:.0f} trained tok/s, "
            f"{run['one_job_share_of_peak']:.1%} of the {run['compute_dtype']} matmul peak), "
            f"{args.jobs} jobs in turn {run['jobs_in_turn_s']:.1f} s, "
            f"batched {run['jobs_batched_s'] or float('nan'):.1f} s, "
            f"x{run['speedup_vs_fp32_full_logits']:.2f} vs before"
        )
    result = {
        "bench": "trainer",
        "model": args.model,
        "model_source": model_source(model_dir),
        "machine": machine_fields(trainer="per variant"),
        "torch_threads": torch.get_num_threads(),
        "batch": {
            "trajectories": TRAJECTORIES,
            "group_size": GROUP_SIZE,
            "prompt": PROMPT_TOKENS,
            "sampled": SAMPLED_TOKENS,
        },
        "lora": {"rank": LORA.rank, "targets": LORA.target_modules},
        "matmul_peak_flops": peaks,
        "bf16_over_fp32_peak": peaks["bfloat16"] / peaks["float32"],
        "runs": runs,
    }
    out = args.out or result_path("trainer")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"peak fp32 {peaks['float32'] / 1e9:.0f} GFLOP/s, bf16 {peaks['bfloat16'] / 1e9:.0f}")
    print(f"written to {out}")


if __name__ == "__main__":
    main()

"""Matmul rate per precision on this CPU: what `auto` precision decides on
(common/runtime/hardware.py).

    .venv/bin/python bench/precision.py
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 .venv/bin/python bench/precision.py

The SmolLM2-135M MLP's up-projection shape (tokens x 576 @ 576 x 1536), in float32, bfloat16
and float16, on one thread and on every core of this process, side by side in one run; each
the best of `--repeats` one-second windows. The second command reproduces an AVX2-only CPU on
a bigger one (oneDNN and torch's kernels capped): bf16 then has no native matmul.

Writes `bench/results/precision-<date>-<machine>.json`: GFLOP/s per dtype and thread count,
and each dtype's rate over float32's (`over_float32`).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from machine import machine_fields, result_path  # bench/machine.py

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def gflops(dtype: torch.dtype, tokens: int, repeats: int) -> float:
    """The best rate of `repeats` one-second windows of tokens x 576 @ 576 x 1536."""
    a, b = torch.randn(tokens, 576).to(dtype), torch.randn(576, 1536).to(dtype)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(repeats):
        count, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < 1.0:
            a @ b
            count += 1
        best = max(best, 2 * tokens * 576 * 1536 * count / elapsed / 1e9)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    rates: dict[str, dict[str, float]] = {}
    for threads in sorted({1, cores}):
        torch.set_num_threads(threads)
        found = {name: gflops(dtype, args.tokens, args.repeats) for name, dtype in DTYPES.items()}
        rates[f"{threads}_threads"] = {k: round(v, 1) for k, v in found.items()}
        print(f"{threads} thread(s): " + ", ".join(f"{k} {v:.1f}" for k, v in found.items()))
    result = {
        "bench": "precision",
        "machine": machine_fields(),
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "shape": [args.tokens, 576, 1536],
        "gflops": rates,
        "over_float32": {
            threads: {k: round(v / by_dtype["float32"], 3) for k, v in by_dtype.items()}
            for threads, by_dtype in rates.items()
        },
    }
    out = result_path("precision")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()

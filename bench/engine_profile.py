"""Where the rollout engine's CPU time goes: prefill and decode rates, each process's share,
and the worker's operators while it decodes.

    .venv/bin/python bench/engine_profile.py
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 .venv/bin/python bench/engine_profile.py

One vLLM engine as rollout_svc builds it on a CPU (the precision `auto` picks, its KV block
size, eager), on `--cores` (default core 0: what the embedded stack gives the engine on 2
cores) with one OpenMP thread per core. After a warm-up round, `--sequences` prompts of
`--prompt-words` words are prefilled (one token each), then the same prompts decode
`--new-tokens` tokens each: the prompts are in the prefix cache by then, so the second round is
decode, profiled with vLLM's torch profiler in its worker. Each round records its wall time
and each process's CPU seconds (the front end, vLLM's engine core, its worker).

Writes `bench/results/engine-profile-<date>-<machine>.json` (rates, process shares, the
operators' self CPU time summed by name) and the profiler's own table beside it (`.txt`,
operators by input shape).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from cpu_account import cpu_s_by_name  # bench/cpu_account.py
from machine import engine_dtype, machine_fields, result_path  # bench/machine.py

from common.files.models import resolve_base_model
from common.runtime.cores import format_cores, parse_cores

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}
_TIME = re.compile(r"^([0-9.]+)(us|ms|s)$")


def process_cpu_s() -> dict[str, float]:
    """CPU seconds of this process (the front end) and its descendants, by name."""
    return cpu_s_by_name(os.getpid(), "front end")


def timed_round(run: Any) -> dict[str, Any]:
    """Wall seconds of `run()` and each process's CPU share of them."""
    before, started = process_cpu_s(), time.perf_counter()
    run()
    wall = time.perf_counter() - started
    after = process_cpu_s()
    return {
        "wall_s": round(wall, 3),
        "cpu_share": {k: round((v - before.get(k, 0.0)) / wall, 3) for k, v in after.items()},
    }


def operator_ms(table: str) -> dict[str, float]:
    """Self CPU milliseconds by operator name, summed over input shapes, from the text table
    torch's profiler writes (name, self CPU %, self CPU, ...)."""
    totals: dict[str, float] = {}
    for line in table.splitlines():
        columns = re.split(r"\s{2,}", line.strip())
        if len(columns) < 3 or not (match := _TIME.match(columns[2])):
            continue
        totals[columns[0]] = totals.get(columns[0], 0.0) + float(match[1]) * _UNITS[match[2]]
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=40)
    parser.add_argument("--cores", default="0", help="the engine's cores, e.g. 0 or 0-1")
    args = parser.parse_args()
    cores = parse_cores(args.cores)
    dtype = engine_dtype()
    machine = machine_fields(engine=dtype)  # the whole machine, before the mask narrows it
    out = result_path("engine-profile")
    # Before vLLM starts its processes: they inherit the mask, the worker binds its threads.
    os.sched_setaffinity(0, cores)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = format_cores(cores)

    from vllm import LLM, SamplingParams

    from rollout_svc.engine_settings import CPU_BLOCK_SIZE, CPU_KV_CACHE_GIB

    profile_dir = Path(tempfile.mkdtemp(prefix="marlaas-engine-profile-"))
    llm = LLM(
        model=str(resolve_base_model(args.model)),
        dtype=dtype,
        enforce_eager=True,
        kv_cache_memory_bytes=int(CPU_KV_CACHE_GIB * (1 << 30)),
        block_size=CPU_BLOCK_SIZE,
        max_num_seqs=max(args.sequences, 1),
        seed=0,
        profiler_config={
            "profiler": "torch",
            "torch_profiler_dir": str(profile_dir),
            "torch_profiler_with_stack": False,
            "torch_profiler_record_shapes": True,
        },
    )
    words = " ".join(f"w{i}" for i in range(args.prompt_words))
    prompts = [f"prompt {i} {words}" for i in range(args.sequences)]
    prefill = SamplingParams(max_tokens=1, temperature=1.0)
    decode = SamplingParams(
        max_tokens=args.new_tokens, min_tokens=args.new_tokens, temperature=1.0, logprobs=0
    )
    llm.generate([f"warm-up {p}" for p in prompts], decode, use_tqdm=False)
    prompt_tokens = sum(len(llm.get_tokenizer()(p).input_ids) for p in prompts)
    prefill_round = timed_round(lambda: llm.generate(prompts, prefill, use_tqdm=False))
    llm.start_profile()
    decode_round = timed_round(lambda: llm.generate(prompts, decode, use_tqdm=False))
    llm.stop_profile()
    generated = args.sequences * args.new_tokens
    for _ in range(60):  # the worker writes its table after stop_profile returns
        if tables := list(profile_dir.glob("*profiler_out*.txt")):
            break
        time.sleep(1)
    table = tables[0].read_text() if tables else ""
    operators = operator_ms(table)
    total_ms = sum(operators.values())
    result = {
        "machine": machine,
        "model": args.model,
        "cores": format_cores(cores),
        "sequences": args.sequences,
        "new_tokens": args.new_tokens,
        "prefill": {
            **prefill_round,
            "prompt_tokens": prompt_tokens,
            "tokens_per_s": round(prompt_tokens / prefill_round["wall_s"], 1),
        },
        "decode": {
            **decode_round,
            "generated_tokens": generated,
            "tokens_per_s": round(generated / decode_round["wall_s"], 1),
        },
        "decode_operators_ms": {k: round(v, 1) for k, v in list(operators.items())[:25]},
        "decode_operators_total_ms": round(total_ms, 1),
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".txt").write_text(table)
    print(json.dumps({k: result[k] for k in ("prefill", "decode")}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

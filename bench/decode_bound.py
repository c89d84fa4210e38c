"""The rollout engine's decode rate at batch 1, 8, 32 and 64 against the bound this CPU's own
matmul rate and memory bandwidth set, both measured in the same run (issue 43, item 4).

    .venv/bin/python bench/decode_bound.py [--batches 1,8,32,64] [--new-tokens 64] [--in-process]
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 .venv/bin/python bench/decode_bound.py

All on `--cores` (default core 0, the engine's in the embedded stack), one thread per core, in
the engine's precision (bench/machine.py). The bound is measured before and after the engines;
it uses the mean of the two timings, and `drift` is the bound after over before.
- `linear_gflop_s`: `F.linear` alone on each of the model's linears (from its config.json,
  fused as vLLM fuses them: qkv, o, gate_up, down per layer; the lm_head) at M = B rows, the
  median of repeated calls on one weight (so held in cache).
- `read_gb_s`: summing a `--bandwidth-mib` float32 tensor; `copy_gb_s`: copying it (read+write).
- A decode step at batch B: compute = the sum over layers of those times at M = B (the FLOPs
  2 * B * linear parameters, timed shape by shape); memory = (each weight once + the KV cache at
  the round's mean context) / read bandwidth; bound tok/s = B / max(compute, memory), `limit`
  naming the larger. Attention's FLOPs are not timed (`attention_flop_share`: what they add);
  embedding, norms, rotary and sampling are outside the bound. `streamed_tok_s` cross-checks
  it: one pass over every layer's own weights at M = B (each read once, as in a step).

The engine: rollout_svc's `RolloutEngine` from `EngineSettings` (precision `auto`, its KV block
size, eager), each configuration in a child process, one after another: `base` (LoRA off),
`lora` (one random rank-8 q/k/v/o adapter as bench/multilora.py writes it, stacked path, on
every request), and with `--in-process` both again under VLLM_ENABLE_V1_MULTIPROCESSING=0
(vLLM's worker inside its engine-core process). Per B, bench/engine_profile.py's two rounds: B
prompts prefilled (one token each), then the same prompts decode `--new-tokens` each from the
prefix cache; that round's tokens over its wall time are `engine_tok_s`, with each process's CPU
share. `loop_lag_ms`: how late a 5 ms sleep on the child's event loop (rollout_svc's, whose
handlers run there) woke during decode. `early_stops`: sequences ended before `--new-tokens`.

Writes `bench/results/decode-bound-<date>-<machine>.json` (or `--out`): `figures` (per engine
and B: engine and bound tok/s, `ratio`, `streamed_ratio`), `bound`, `kernels`, `engines`,
`machine`. Target: `ratio` >= 0.6 at B = 32, or a profile (bench/engine_profile.py) of the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine_profile import timed_round  # bench/engine_profile.py
from machine import engine_dtype, machine_fields, result_path  # bench/machine.py
from multilora import ATTENTION_TARGETS, RANK, write_adapter  # bench/multilora.py

from common.files.models import resolve_base_model
from common.runtime.cores import format_cores, pin_to_cores

if TYPE_CHECKING:
    from common.wire.adapters import AdapterRef
    from common.wire.messages import GenerationRequest, GenerationResult
    from rollout_svc.engine import RolloutEngine

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LAG_PERIOD_S = 0.005
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
Kernels = dict[str, Any]  # linear_s {name: {rows: s}}, streamed_s {rows: s}, read/copy_gb_s


@dataclass(frozen=True)
class LinearShape:
    """One linear layer as vLLM runs it, `count` times in a forward pass."""

    name: str
    in_features: int
    out_features: int
    count: int

    @property
    def params(self) -> int:
        return self.in_features * self.out_features * self.count


@dataclass(frozen=True)
class ModelShape:
    """What one token's decode step computes and reads in a Llama-shaped model."""

    linears: tuple[LinearShape, ...]
    kv_per_context_token: int  # K and V elements a token of context holds, all layers
    attention_flops_per_context_token: int  # QK and PV FLOPs of one query per context token

    @classmethod
    def of(cls, config: dict[str, Any]) -> ModelShape:
        """From a config.json, the linears fused as vLLM fuses them (q/k/v into one, gate/up
        into one) and the lm_head (tied to the embedding or not, a matmul every step)."""
        hidden, layers, heads = (
            config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads")
        )
        head_dim = config.get("head_dim") or hidden // heads
        q_out, kv_out = heads * head_dim, config["num_key_value_heads"] * head_dim
        inter = config["intermediate_size"]
        linears = (
            LinearShape("qkv_proj", hidden, q_out + 2 * kv_out, layers),
            LinearShape("o_proj", q_out, hidden, layers),
            LinearShape("gate_up_proj", hidden, 2 * inter, layers),
            LinearShape("down_proj", inter, hidden, layers),
            LinearShape("lm_head", hidden, config["vocab_size"], 1),
        )
        return cls(linears, 2 * kv_out * layers, 4 * q_out * layers)


def step_bound(
    model: ModelShape, kernels: Kernels, batch: int, context: float, dtype_bytes: int
) -> dict[str, Any]:
    """The fastest decode step at `batch` sequences of `context` tokens these kernels allow."""
    compute_s = sum(s.count * kernels["linear_s"][s.name][batch] for s in model.linears)
    params = sum(shape.params for shape in model.linears)
    weight_bytes = params * dtype_bytes
    kv_bytes = batch * context * model.kv_per_context_token * dtype_bytes
    memory_s = (weight_bytes + kv_bytes) / (kernels["read_gb_s"] * 1e9)
    linear_flops = 2 * batch * params
    attention_flops = batch * context * model.attention_flops_per_context_token
    return {
        "compute_ms": round(compute_s * 1e3, 3),
        "memory_ms": round(memory_s * 1e3, 3),
        "limit": "compute" if compute_s >= memory_s else "memory",
        "tok_s": round(batch / max(compute_s, memory_s), 2),
        "streamed_tok_s": round(batch / kernels["streamed_s"][batch], 2),
        "weight_mb": round(weight_bytes / 1e6, 1),
        "kv_mb": round(kv_bytes / 1e6, 1),
        "context_tokens": round(context, 1),
        "attention_flop_share": round(attention_flops / (linear_flops + attention_flops), 4),
    }


def mean_of(first: Any, second: Any) -> Any:
    """The mean of two equally nested dicts of numbers, leaf by leaf."""
    if isinstance(first, dict):
        return {key: mean_of(value, second[key]) for key, value in first.items()}
    return (first + second) / 2


def lag_summary(lags_s: Sequence[float]) -> dict[str, float]:
    """p50 / p99 / max of the event loop's lateness, in ms."""
    top = max(lags_s, default=0.0)
    cuts = statistics.quantiles(lags_s, n=100, method="inclusive") if lags_s[1:] else [top] * 99
    ms = {"p50": cuts[49], "p99": cuts[98], "max": top}
    return {key: round(value * 1e3, 2) for key, value in ms.items()} | {"samples": len(lags_s)}


def median_call_s(call: Callable[[], object], repeats: int = 3) -> float:
    """Median seconds of one `call()` over `repeats` loops of at least 0.2 s each."""
    timer = timeit.Timer(call)
    calls, _ = timer.autorange()
    return statistics.median(timer.repeat(repeats, calls)) / calls


def measure_kernels(
    shapes: Sequence[LinearShape], batches: Sequence[int], dtype: str, bandwidth_mib: int
) -> Kernels:
    """`F.linear` per shape and row count, one streamed pass per row count, and memory
    bandwidth, on this process's threads."""
    import torch
    import torch.nn.functional as F

    kind = getattr(torch, dtype)
    with torch.inference_mode():
        linear_s = {}
        for shape in shapes:
            weight = torch.randn(shape.out_features, shape.in_features, dtype=kind)
            inputs = {m: torch.randn(m, shape.in_features, dtype=kind) for m in batches}
            linear_s[shape.name] = {
                m: median_call_s(partial(F.linear, x, weight)) for m, x in inputs.items()
            }
        source = torch.ones(bandwidth_mib << 18)  # float32: 4 bytes each
        target, nbytes = torch.empty_like(source), source.numel() * source.element_size()
        read_s = median_call_s(source.sum)
        copy_s = median_call_s(partial(target.copy_, source))
    return {
        "linear_s": linear_s,
        "streamed_s": {m: streamed_pass_s(shapes, m, kind) for m in batches},
        "read_gb_s": nbytes / read_s / 1e9,
        "copy_gb_s": 2 * nbytes / copy_s / 1e9,
    }


def streamed_pass_s(shapes: Sequence[LinearShape], rows: int, kind: Any) -> float:
    """Seconds of one pass of `F.linear` over every layer's own weights at `rows` rows."""
    import torch
    import torch.nn.functional as F

    with torch.inference_mode():
        every = [shape for shape in shapes for _ in range(shape.count)]
        weights = [torch.randn(s.out_features, s.in_features, dtype=kind) for s in every]
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=kind) for w in weights}

        def one_pass() -> None:
            for weight in weights:
                F.linear(inputs[weight.shape[1]], weight)

        return median_call_s(one_pass)


def kernels_report(shapes: Sequence[LinearShape], kernels: Kernels) -> dict[str, Any]:
    """What the JSON records of one kernel measurement: GFLOP/s per shape and M, the streamed
    passes' ms, bandwidths."""
    gflop_s = {
        shape.name: {
            m: round(2 * m * shape.in_features * shape.out_features / s / 1e9, 1)
            for m, s in kernels["linear_s"][shape.name].items()
        }
        for shape in shapes
    }
    streamed_ms = {m: round(s * 1e3, 2) for m, s in kernels["streamed_s"].items()}
    rates = {k: round(kernels[k], 2) for k in ("read_gb_s", "copy_gb_s")}
    return {"linear_gflop_s": gflop_s, "streamed_ms": streamed_ms, **rates}


def prompt_ids(model_dir: Path, tag: str, count: int, words: int) -> list[list[int]]:
    """`count` distinct prompts of `words` words (bench/engine_profile.py's), as token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = " ".join(f"w{i}" for i in range(words))
    return [list(tokenizer(f"{tag} prompt {i} {text}").input_ids) for i in range(count)]


def requests_for(
    contexts: Sequence[list[int]], tag: str, new_tokens: int
) -> list[GenerationRequest]:
    from common.wire.messages import GenerationRequest, SamplingSettings

    sampling = SamplingSettings(temperature=1.0, max_new_tokens=new_tokens)
    return [
        GenerationRequest(
            request_id=f"{tag}-{index}",
            job_id="decode-bound",
            episode_id=f"{tag}-{index}",
            group_id=f"{tag}-{index}",
            sample_index=0,
            turn=0,
            context_token_ids=context,
            sampling=sampling,
        )
        for index, context in enumerate(contexts)
    ]


async def generate_all(
    engine: RolloutEngine,
    requests: Sequence[GenerationRequest],
    adapter: AdapterRef | None,
    lags_s: list[float],
) -> list[GenerationResult]:
    """Every request at once, appending meanwhile how late each `LAG_PERIOD_S` sleep woke."""

    async def probe() -> None:
        while True:
            started = time.perf_counter()
            await asyncio.sleep(LAG_PERIOD_S)
            lags_s.append(time.perf_counter() - started - LAG_PERIOD_S)

    task = asyncio.create_task(probe())
    try:
        return list(await asyncio.gather(*(engine.generate(r, adapter) for r in requests)))
    finally:
        task.cancel()


def batch_rounds(
    loop: asyncio.AbstractEventLoop,
    engine: RolloutEngine,
    adapter: AdapterRef | None,
    contexts: list[list[int]],
    new_tokens: int,
) -> dict[str, Any]:
    """bench/engine_profile.py's two rounds at one batch size: prefill, then decode with the
    prompts cached."""
    batch = len(contexts)
    finished: list[GenerationResult] = []
    lags_s: list[float] = []

    def timed(tag: str, tokens: int, lags: list[float]) -> dict[str, Any]:
        requests = requests_for(contexts, f"{tag}-b{batch}", tokens)
        finished.clear()
        run = generate_all(engine, requests, adapter, lags)
        return timed_round(lambda: finished.extend(loop.run_until_complete(run)))

    prefill_round = timed("prefill", 1, [])
    cached_before, prompt_before = engine.cached_prompt_tokens, engine.prompt_tokens
    decode_round = timed("decode", new_tokens, lags_s)
    generated = sum(len(result.completion_token_ids) for result in finished)
    cached = engine.cached_prompt_tokens - cached_before
    return {
        "batch": batch,
        "prompt_tokens_mean": statistics.mean(len(context) for context in contexts),
        "prefill": prefill_round,
        "decode": {
            **decode_round,
            "generated_tokens": generated,
            "tokens_per_s": round(generated / decode_round["wall_s"], 2),
            "early_stops": sum(result.finish_reason != "length" for result in finished),
            "cached_prompt_share": round(cached / max(1, engine.prompt_tokens - prompt_before), 3),
            "loop_lag_ms": lag_summary(lags_s),
        },
    }


def engine_run(config: dict[str, Any]) -> dict[str, Any]:
    """In the child: one engine as rollout_svc builds it, a warm-up, then each batch's rounds."""
    from common.wire.adapters import AdapterRef
    from rollout_svc.engine import RolloutEngine
    from rollout_svc.engine_settings import EngineSettings

    model_dir, batches = Path(config["model_dir"]), config["batches"]
    engine = RolloutEngine(
        EngineSettings(
            model_dir,
            enable_lora=config["lora"],
            max_loras=1,
            max_lora_rank=RANK,
            lora_target_modules=ATTENTION_TARGETS,
            max_num_seqs=max(batches),
            enforce_eager=config.get("eager", True),
        )
    )
    adapter = None
    if config["lora"]:
        adapter_dir = Path(tempfile.mkdtemp(prefix="marlaas-decode-bound-"))
        adapter = AdapterRef("decode-bound", 1, str(write_adapter(model_dir, adapter_dir, 0)))
    loop = asyncio.new_event_loop()
    loop.run_until_complete(engine.start())
    try:
        if adapter is not None:
            loop.run_until_complete(engine.load(adapter))
        words = config["prompt_words"]
        warm = requests_for(prompt_ids(model_dir, "warm-up", max(batches), words), "warm-up", 8)
        loop.run_until_complete(generate_all(engine, warm, adapter, []))
        rounds = []
        for batch in batches:
            contexts = prompt_ids(model_dir, f"batch {batch}", batch, words)
            rounds.append(batch_rounds(loop, engine, adapter, contexts, config["new_tokens"]))
            print(f"{config['name']} B={batch}: {rounds[-1]['decode']}", file=sys.stderr)
    finally:
        loop.run_until_complete(engine.stop())
        loop.close()
    return {**config, "start_s": round(engine.start_seconds, 1), "batches": rounds}


def run_engine(config: dict[str, Any], env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """`engine_run(config)` in a fresh interpreter with `env` added to this one's."""
    with tempfile.TemporaryDirectory(prefix="marlaas-decode-bound-") as tmp:
        out = Path(tmp) / "engine.json"
        subprocess.run(
            [sys.executable, __file__, "--child", json.dumps({**config, "out": str(out)})],
            env={**os.environ, **env},
            check=True,
            timeout=timeout_s,
        )
        return dict(json.loads(out.read_text()))


def bounds(
    model: ModelShape, kernels: dict[str, Kernels], contexts: dict[int, float], dtype_bytes: int
) -> dict[int, dict[str, Any]]:
    """The bound per batch from the mean of the kernels' times before and after the engines,
    with its drift (the bound after over before)."""
    per = {
        when: {b: step_bound(model, k, b, c, dtype_bytes) for b, c in contexts.items()}
        for when, k in {**kernels, "mean": mean_of(kernels["before"], kernels["after"])}.items()
    }
    drift = {b: per["after"][b]["tok_s"] / per["before"][b]["tok_s"] for b in contexts}
    return {b: bound | {"drift": round(drift[b], 3)} for b, bound in per["mean"].items()}


def figures(
    engines: Sequence[dict[str, Any]], bound: dict[int, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per engine and batch: its decode rate against the bound."""
    rows = []
    for name, rounds in ((e["name"], r) for e in engines for r in e["batches"]):
        rate, limit = rounds["decode"]["tokens_per_s"], bound[rounds["batch"]]
        row = {"engine": name, "batch": rounds["batch"], "engine_tok_s": rate}
        row |= {"bound_tok_s": round(limit["tok_s"], 1), "ratio": round(rate / limit["tok_s"], 3)}
        row |= {"streamed_ratio": round(rate / limit["streamed_tok_s"], 3), "limit": limit["limit"]}
        rows.append(row)
    return rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=40)
    parser.add_argument("--cores", default="0", help="the engine's cores, e.g. 0 or 0-1")
    parser.add_argument("--in-process", action="store_true", help="also with vLLM's MP off")
    parser.add_argument(
        "--compiled", action="store_true", help="also compiled (torch.compile), not eager"
    )
    parser.add_argument("--bandwidth-mib", type=int, default=512)
    parser.add_argument("--child-timeout-s", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.child:
        config = json.loads(args.child)
        Path(config.pop("out")).write_text(json.dumps(engine_run(config)))
        return
    import torch

    dtype, batches = engine_dtype(), [int(b) for b in args.batches.split(",")]
    machine = machine_fields(engine=dtype)  # the whole machine, before the mask narrows it
    threads = pin_to_cores(args.cores)  # before vLLM starts: its processes inherit the mask
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = format_cores(sorted(os.sched_getaffinity(0)))
    torch.set_num_threads(threads)
    model_dir = resolve_base_model(args.model)
    model = ModelShape.of(json.loads((model_dir / "config.json").read_text()))
    measure = partial(measure_kernels, model.linears, batches, dtype, args.bandwidth_mib)
    kernels = {"before": measure()}
    common = dict(model_dir=str(model_dir), batches=batches, new_tokens=args.new_tokens)
    common["prompt_words"] = args.prompt_words
    modes: dict[str, tuple[dict[str, str], bool]] = {"": ({}, True)}
    if args.in_process:
        modes["-in-process"] = (IN_PROCESS, True)
    if args.compiled:
        modes["-compiled"] = ({}, False)
    engines = [
        run_engine(
            common | dict(name=name + mode, lora=name == "lora", eager=eager),
            env,
            args.child_timeout_s,
        )
        for mode, (env, eager) in modes.items()
        for name in ("base", "lora")
    ]
    kernels["after"] = measure()
    contexts = {
        r["batch"]: r["prompt_tokens_mean"] + args.new_tokens / 2 for r in engines[0]["batches"]
    }
    bound = bounds(model, kernels, contexts, DTYPE_BYTES[dtype])
    result = {"bench": "decode-bound", "model": args.model, "machine": machine} | common
    result |= {"cores": args.cores, "threads": threads, "figures": figures(engines, bound)}
    result |= {"bound": bound, "shapes": [asdict(shape) for shape in model.linears]}
    result |= {"kernels": {when: kernels_report(model.linears, k) for when, k in kernels.items()}}
    result["engines"] = engines
    out = args.out or result_path("decode-bound")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(json.dumps(row) for row in result["figures"]))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

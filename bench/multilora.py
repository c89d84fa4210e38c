"""The rollout engine's tokens/s with many LoRA adapters beside the same engine without LoRA.

    python bench/multilora.py [--model smollm2-135m-instruct] [--requests 64] [--new-tokens 32]

One `RolloutEngine` per configuration, each in a child process started one after another (no
two engines share the cores): LoRA disabled, then 1, 8 and 32 distinct adapters (rank 8 on
q/k/v/o, random weights) with the engine's `max_loras` equal to the adapter count, once on
vLLM's own CPU LoRA path with LoRA slots on every supported layer (what the engine ran
before) and once on the stacked path (`rollout_svc/cpu_lora.py`) with slots only on q/k/v/o.
Each configuration submits `--requests` sampled requests at once (arithmetic prompts,
temperature 1, adapters round-robin) after a warm-up round, and reports generated tokens
per second of wall time. Beside it, greedy outputs of an all-zero adapter are compared with
the LoRA-less engine's.

Writes `bench/results/multilora-<date>-<machine>.json`:
`{"runs": [{"path", "adapters", "tokens_per_s", "base_tokens_per_s", "throughput_ratio"}]}`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from machine import engine_dtype, machine_fields, result_path  # bench/machine.py

LORA_PATHS = {
    "vllm": {"VLLM_PLUGINS": ""},  # vLLM's own CPU LoRA ops, slots on every layer
    "stacked": {},  # our plugin, slots on q/k/v/o only
}
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
RANK = 8
GREEDY_PROBES = 8


def write_adapter(model_dir: Path, out_dir: Path, seed: int, zero: bool = False) -> Path:
    """A PEFT LoRA of rank 8 on every layer's q/k/v/o: random (small B) or all-zero."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    out_sizes = {
        "q_proj": config["num_attention_heads"] * head_dim,
        "k_proj": config["num_key_value_heads"] * head_dim,
        "v_proj": config["num_key_value_heads"] * head_dim,
        "o_proj": hidden,
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, out_size in out_sizes.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            a = torch.randn(RANK, hidden, generator=generator) / hidden**0.5
            b = torch.randn(out_size, RANK, generator=generator) * 0.02
            if zero:
                a, b = torch.zeros_like(a), torch.zeros_like(b)
            tensors[f"{prefix}.lora_A.weight"] = a
            tensors[f"{prefix}.lora_B.weight"] = b
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "target_modules": list(ATTENTION_TARGETS),
        "bias": "none",
        "base_model_name_or_path": str(model_dir),
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config))
    return out_dir


def prompts(model_dir: Path, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for index in range(count):
        a, b = 1 + index % 9, 1 + (index * 7) % 9
        messages = [{"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


async def measure_one(config: dict[str, Any]) -> dict[str, Any]:
    """In the child: start one engine, time `requests` concurrent requests, probe greedy."""
    from common.wire.adapters import AdapterRef
    from common.wire.messages import GenerationRequest, SamplingSettings
    from rollout_svc.engine import RolloutEngine
    from rollout_svc.engine_settings import EngineSettings

    model_dir = Path(config["model_dir"])
    n_adapters = config["adapters"]
    work = Path(tempfile.mkdtemp(prefix="marlaas-multilora-"))
    adapters = [
        AdapterRef(f"job{index}", 1, str(write_adapter(model_dir, work / f"a{index}", index)))
        for index in range(n_adapters)
    ]
    zero = AdapterRef("zero", 1, str(write_adapter(model_dir, work / "zero", 0, zero=True)))
    engine = RolloutEngine(
        EngineSettings(
            model_dir,
            enable_lora=n_adapters > 0,
            max_loras=max(1, n_adapters),
            max_lora_rank=RANK,
            lora_target_modules=ATTENTION_TARGETS if config["path"] == "stacked" else None,
            max_num_seqs=max(config["requests"], 64),
        )
    )
    context = prompts(model_dir, config["requests"])
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=config["new_tokens"])
    greedy = SamplingSettings(temperature=0.0, max_new_tokens=config["new_tokens"])

    def request(index: int, settings: SamplingSettings, tag: str) -> GenerationRequest:
        return GenerationRequest(
            request_id=f"{tag}-{index}",
            job_id="bench",
            group_id=f"g{index}",
            sample_index=0,
            episode_id=f"{tag}-{index}",
            turn=0,
            context_token_ids=context[index % len(context)],
            sampling=settings,
            min_adapter_version=0,
        )

    async def round_(tag: str) -> tuple[float, int]:
        started = time.perf_counter()
        results = await asyncio.gather(
            *(
                engine.generate(
                    request(index, sampling, tag),
                    adapters[index % n_adapters] if n_adapters else None,
                )
                for index in range(config["requests"])
            )
        )
        return time.perf_counter() - started, sum(len(r.completion_token_ids) for r in results)

    await engine.start()
    try:
        for adapter in adapters:
            await engine.load(adapter)
        await round_("warm-up")
        wall_s, tokens = await round_("timed")
        probe_adapter = zero if n_adapters else None
        greedy_out = [
            list(
                (
                    await engine.generate(request(i, greedy, "greedy"), probe_adapter)
                ).completion_token_ids
            )
            for i in range(GREEDY_PROBES)
        ]
    finally:
        await engine.stop()
    return {
        "path": config["path"],
        "adapters": n_adapters,
        "requests": config["requests"],
        "generated_tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s,
        "greedy_token_ids": greedy_out,
        "engine_start_s": engine.start_seconds,
    }


def run_child(config: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, **LORA_PATHS[config["path"]]}
    completed = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(config)],
        env=env,
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--adapters", default="1,8,32")
    parser.add_argument("--paths", default="vllm,stacked")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(measure_one(json.loads(args.child)))))
        return

    from common.files.models import resolve_base_model

    model_dir = resolve_base_model(args.model)
    common = {"model_dir": str(model_dir), "requests": args.requests, "new_tokens": args.new_tokens}
    base = run_child({**common, "path": "stacked", "adapters": 0})
    print(f"LoRA disabled: {base['tokens_per_s']:.1f} tok/s")
    runs = []
    for path in args.paths.split(","):
        for n_adapters in (int(n) for n in args.adapters.split(",")):
            run = run_child({**common, "path": path, "adapters": n_adapters})
            run["base_tokens_per_s"] = base["tokens_per_s"]
            run["throughput_ratio"] = run["tokens_per_s"] / base["tokens_per_s"]
            run["zero_adapter_greedy_equals_base"] = (
                run.pop("greedy_token_ids") == base["greedy_token_ids"]
            )
            runs.append(run)
            print(
                f"{path:>8} {n_adapters:>3} adapters: {run['tokens_per_s']:.1f} tok/s, "
                f"x{run['throughput_ratio']:.2f} of no LoRA, zero adapter greedy = base: "
                f"{run['zero_adapter_greedy_equals_base']}",
                flush=True,
            )
    result = {
        "bench": "multilora",
        "model": args.model,
        "machine": machine_fields(engine=engine_dtype()),
        "requests": args.requests,
        "new_tokens": args.new_tokens,
        "lora": {"rank": RANK, "targets": list(ATTENTION_TARGETS)},
        "base": {k: v for k, v in base.items() if k != "greedy_token_ids"},
        "runs": runs,
    }
    out = args.out or result_path("multilora")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()

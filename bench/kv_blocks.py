"""A CPU engine's KV block size: what a group's shared prompt costs, and decoding, per size.

    .venv/bin/python bench/kv_blocks.py
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 .venv/bin/python bench/kv_blocks.py

vLLM's prefix cache shares whole KV blocks only. A GRPO group is G samples of one prompt, sent
as G requests: with vLLM's CPU default of 128-token blocks each sample recomputes the prompt's
tail past its last whole block. For each block size (one engine each, one after the other,
same process, SmolLM2 unless `--model`): the wall time of one prefill of a `--prompt-words`
prompt, of G requests of one prompt at once (G = 8, 16), of G different prompts, and the
decode rate of `--decode-sequences` sequences (16, 32, 64) of 64 tokens each.
rollout_svc/engine_settings.py's `CPU_BLOCK_SIZE` is chosen from this; the decode rates say
what fewer rollout slots (`ROLLOUT_MAX_IN_FLIGHT`, 64) would cost.

Writes `bench/results/kv-blocks-<date>-<machine>.json`.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from machine import machine_fields, result_path  # bench/machine.py

from common.files.models import resolve_base_model
from common.runtime.hardware import detect, engine_precision


def measure(
    model: str, block_size: int, dtype: str, words: int, decode_sequences: list[int]
) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype=dtype,  # type: ignore[arg-type]
        enforce_eager=True,
        kv_cache_memory_bytes=1 << 30,
        block_size=block_size,
        seed=0,
    )
    text = " ".join(f"word{i}" for i in range(words))
    prefill = SamplingParams(max_tokens=1, temperature=1.0)

    def timed(prompts: list[str], params: Any = prefill) -> float:
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return round(time.perf_counter() - started, 3)

    timed([f"warm-up {text}"])
    out: dict[str, Any] = {
        "block_size": block_size,
        "prompt_tokens": len(llm.get_tokenizer()(f"one {text}").input_ids),
        "one_prompt_s": min(timed([f"one {k} {text}"]) for k in range(2)),
    }
    for group in (8, 16):
        out[f"same_prompt_x{group}_s"] = min(
            timed([f"same {group} {k} {text}"] * group) for k in range(2)
        )
        out[f"different_prompts_x{group}_s"] = timed(
            [f"different {group} {i} {text}" for i in range(group)]
        )
    short = " ".join(f"w{i}" for i in range(40))
    decode = SamplingParams(max_tokens=64, min_tokens=64, temperature=1.0, logprobs=0)
    for sequences in decode_sequences:
        seconds = timed([f"decode {sequences} {i} {short}" for i in range(sequences)], decode)
        out[f"decode_x{sequences}_tokens_per_s"] = round(sequences * 64 / seconds, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompt-words", type=int, default=120)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--decode-sequences", type=int, nargs="+", default=[16, 32, 64])
    args = parser.parse_args()
    dtype = engine_precision("auto", detect(gpus=False), on_gpu=False).dtype  # as `auto` picks
    model = str(resolve_base_model(args.model))
    result = {
        "machine": machine_fields(engine=dtype),
        "model": args.model,
        "runs": [
            measure(model, size, dtype, args.prompt_words, args.decode_sequences)
            for size in args.block_sizes
        ],
    }
    out = result_path("kv-blocks")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["runs"], indent=2))


if __name__ == "__main__":
    main()

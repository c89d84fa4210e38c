"""`marlaas export --merged`: the base model with a job's adapter merged into its weights, as a
Hugging Face model directory that `transformers` and vLLM load with no PEFT.

The merge runs where the export is written (the CLI's machine), from the exported adapter and
a local copy of the base model: the tenant API ships adapters (megabytes), never the base.
The directory:

    config.json, generation_config.json, model.safetensors, tokenizer files   the merged model
    README.md                                                                  its model card
    adapter/    the PEFT export as `marlaas export` writes it (card, marlaas_export.json)

The adapter has a folder of its own: an `adapter_config.json` beside `config.json` makes
`transformers` load the directory as a PEFT adapter. The merge is computed in float32 (W +
scale * B @ A); the weights are saved at the base's own precision unless `dtype` says
otherwise (float32 keeps the merged model's logits within float32 rounding of the base's
with the adapter applied).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from common.files.artifacts import atomic_dir
from common.files.models import ModelNotFoundError, resolve_base_model
from marlaas.export import EXPORT_INFO, ExportError, held_out_section, refuse_occupied

ADAPTER_SUBDIR = "adapter"
DTYPES = ("auto", "float32", "bfloat16", "float16")
"""`auto`: the base model's own."""


@dataclass(frozen=True)
class MergedModel:
    out_dir: Path
    dtype: str
    base_dir: Path


def export_info(adapter_dir: Path) -> dict[str, object]:
    """The export's `marlaas_export.json`."""
    try:
        return dict(json.loads((adapter_dir / EXPORT_INFO).read_text()))
    except (OSError, ValueError) as exc:
        raise ExportError(f"{EXPORT_INFO}: unreadable ({exc})") from None


def base_model_dir(adapter_dir: Path, base: Path | None, cache_dir: Path | None = None) -> Path:
    """The local base model to merge into: `base` when given, else the job's base model as
    this machine resolves it (a known name is converted from its packaged file)."""
    name = str(base) if base is not None else str(export_info(adapter_dir)["base_model"])
    try:
        return resolve_base_model(name, cache_dir)
    except ModelNotFoundError as exc:
        raise ExportError(
            f"the base model {name!r} is not on this machine ({exc}): name a local copy of it "
            "with --base DIR"
        ) from None


def check_dtype(dtype: str, name: str = "dtype") -> None:
    """ExportError unless `dtype` is one of `DTYPES` (`name`: what the caller calls it)."""
    if dtype not in DTYPES:
        raise ExportError(f"{name} must be one of {', '.join(DTYPES)}, not {dtype!r}")


def merge_adapter(adapter_dir: Path, base_dir: Path, out_dir: Path, dtype: str = "auto") -> str:
    """Write the base at `base_dir` with the PEFT adapter at `adapter_dir` merged into
    `out_dir` (safetensors, config, tokenizer); returns the dtype saved."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_dtype(dtype)
    saved = _base_dtype(base_dir) if dtype == "auto" else dtype
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    try:
        adapted = PeftModel.from_pretrained(base, adapter_dir)
    except (RuntimeError, ValueError, KeyError) as exc:  # shapes or modules of another model
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(
            f"the adapter does not fit the base model at {base_dir}: {first}"
        ) from None
    merged = adapted.merge_and_unload().to(getattr(torch, saved))
    merged.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out_dir)
    return saved


def write_merged(
    adapter_dir: Path, base_dir: Path, out_dir: Path, dtype: str = "auto"
) -> MergedModel:
    """`out_dir` (new or empty) as the module's docstring lays it out, from the export at
    `adapter_dir`; it appears whole or not at all."""
    import shutil

    refuse_occupied(out_dir)
    info = export_info(adapter_dir)
    with atomic_dir(out_dir) as staging:
        saved = merge_adapter(adapter_dir, base_dir, staging, dtype)
        shutil.copytree(adapter_dir, staging / ADAPTER_SUBDIR)
        (staging / "README.md").write_text(_model_card(info, saved))
    return MergedModel(out_dir, saved, base_dir)


def _base_dtype(base_dir: Path) -> str:
    config = json.loads((base_dir / "config.json").read_text())
    found = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return found if found in DTYPES else "float32"


def _model_card(info: dict[str, object], dtype: str) -> str:
    """README.md with the Hub's model-card front matter, the job, its held-out results and
    how to load the merged model."""
    hub_id = info.get("hub_base_model")
    front = ["---", *([f"base_model: {hub_id}"] if hub_id else []), "library_name: transformers"]
    front += ["tags:", *(f"- {tag}" for tag in ("marlaas", "grpo", "merged-lora", info["env"]))]
    front += ["---", ""]
    title = f"# MARLaaS job `{info['job_id']}` (v{info['version']}), adapter merged into its base"
    base = hub_id or info["base_model"]
    return (
        "\n".join(front)
        + title
        + f"""

Tenant `{info["tenant"]}`, environment `{info["env"]}`, base model `{base}` with the job's
LoRA adapter v{info["version"]} merged into its weights ({dtype}). The adapter itself, its card
and the job's settings (`{EXPORT_INFO}`) are in `{ADAPTER_SUBDIR}/`.
{held_out_section(info)}
## transformers

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("<this directory>")
tokenizer = AutoTokenizer.from_pretrained("<this directory>")
```

## vLLM

```python
from vllm import LLM, SamplingParams

llm = LLM(model="<this directory>")
outputs = llm.generate(["What is 7 + 5?"], SamplingParams(max_tokens=16))
```
"""
    )

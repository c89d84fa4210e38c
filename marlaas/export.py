"""`marlaas export`: a job's adapter version copied out as a standalone PEFT directory.

The format is the artifact store's own (common/files/artifacts.py), PEFT's standard LoRA layout, so
`PeftModel.from_pretrained` and vLLM's `LoRARequest` load the export unchanged; it gains a
model card and `marlaas_export.json` (the job's settings). A tenant receives it (the API's
export), so neither it nor an export's error names a path or host of the servers: the base
model is its public id or the job's own name for it unless the caller names a local copy.

Nothing here imports torch or peft: exporting works on a machine with the core package only.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from common.files.artifacts import ADAPTER_CONFIG, ADAPTER_WEIGHTS, atomic_dir
from common.files.models import public_model_id, resolve_base_model
from common.state.registry import Job, JobRecord, job_id_of
from common.state.store import RedisStore
from common.wire.adapters import AdapterRef
from common.wire.messages import Event

EXPORT_INFO = "marlaas_export.json"
_LORA_KEY_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
_REQUIRED_CONFIG = ("peft_type", "r", "lora_alpha", "target_modules")


class ExportError(ValueError):
    """An adapter that cannot be exported; the text says why and what to do."""


@dataclass(frozen=True)
class ExportedAdapter:
    job_id: str
    tenant: str
    version: int
    out_dir: Path
    base_model_name_or_path: str


def best_version(events: Sequence[Event]) -> tuple[int, float] | None:
    """The trained version with the best held-out accuracy and that accuracy, from the job's
    `eval` events; None before any trained version was evaluated (`best_of`)."""
    return best_of(
        {
            e.step: accuracy
            for e in events
            if e.event == "eval" and (accuracy := e.metrics.get("eval_accuracy")) is not None
        }
    )


def best_of(accuracy: Mapping[int, float]) -> tuple[int, float] | None:
    """The trained version with the best held-out accuracy among `accuracy` (version ->
    accuracy) and that accuracy; a tie goes to the later version (more trained, as good). The
    base model (version 0) is not a candidate: it has no adapter, and a job worse than its
    base says so in its events (`eval_below_base`)."""
    trained = {version: value for version, value in accuracy.items() if version >= 1}
    if not trained:
        return None
    version = max(trained, key=lambda v: (trained[v], v))
    return version, trained[version]


HELD_OUT_METRICS = ("eval_accuracy", "eval_accuracy_stderr", "eval_episodes")


def held_out_results(events: Sequence[Event]) -> dict[int, dict[str, float]]:
    """Each evaluated version's held-out accuracy, its standard error and the tasks it was
    measured on (version 0: the base model), from the job's `eval` events; the last event of
    a version counts."""
    return {
        e.step: {name: e.metrics[name] for name in HELD_OUT_METRICS if name in e.metrics}
        for e in events
        if e.event == "eval" and "eval_accuracy" in e.metrics
    }


def local_base_model(base_model: str, cache_dir: Path | None = None) -> str | None:
    """Where the deployment's base model lies on this machine, for an export's config: only
    for a model without a public id. A known model is named by its Hub id, so exporting one
    needs no local copy (the api and cli images carry no model, nor what converts one)."""
    if public_model_id(base_model) is not None:
        return None
    return str(resolve_base_model(base_model, cache_dir))


def lora_tensor_names(adapter_dir: Path) -> list[str]:
    """Tensor names in the adapter's safetensors file, read from its header (no torch needed).

    Raises ExportError when the file is missing, not safetensors, or holds no LoRA weights.
    """
    path = adapter_dir / ADAPTER_WEIGHTS
    try:
        with path.open("rb") as weights:
            (header_len,) = struct.unpack("<Q", weights.read(8))
            if header_len > os.fstat(weights.fileno()).st_size - 8:  # not read: it is not there
                raise ValueError(f"a header of {header_len} bytes in a shorter file")
            header = json.loads(weights.read(header_len))
    except (OSError, struct.error, ValueError) as exc:
        raise ExportError(
            f"{ADAPTER_WEIGHTS}: not a readable safetensors file ({_why(exc)})"
        ) from None
    names = sorted(name for name in header if name != "__metadata__")
    if not names or not all(
        name.startswith("base_model.model.") and name.endswith(_LORA_KEY_SUFFIXES) for name in names
    ):
        raise ExportError(f"{ADAPTER_WEIGHTS}: not PEFT LoRA weights (tensor names {names[:3]}...)")
    return names


def _why(exc: Exception) -> str:
    """What went wrong, without the path an OSError's text names."""
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    return str(exc)


def refuse_occupied(out_dir: Path) -> None:
    """ExportError unless `out_dir` is new or an empty directory: an export never mixes with
    what is there."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir} exists and is not an empty directory")


def check_adapter_dir(adapter_dir: Path) -> dict[str, object]:
    """The adapter's config, after checking the directory is a loadable PEFT LoRA adapter."""
    try:
        config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"{ADAPTER_CONFIG}: unreadable ({_why(exc)})") from None
    missing = [key for key in _REQUIRED_CONFIG if key not in config]
    if missing or config.get("peft_type") != "LORA":
        raise ExportError(f"{ADAPTER_CONFIG}: not a PEFT LoRA config (missing {missing})")
    lora_tensor_names(adapter_dir)
    return dict(config)


async def export_adapter(
    store: RedisStore,
    job: Job,
    out_dir: Path,
    *,
    base_model_path: str | None = None,
    version: int | None = None,
    held_out: Mapping[int, Mapping[str, float]] | None = None,
) -> ExportedAdapter:
    """Copy the job's adapter (latest, or `version`) to `out_dir` as a standalone PEFT dir.

    The config's `base_model_name_or_path` becomes the base model's Hub id when it has one,
    else `base_model_path` when given (where the base model lies on the exporting machine),
    else the job's own `base_model`: never the trainer's copy. `out_dir` must not exist or be
    empty; it appears whole or not at all. `held_out`: the job's held-out results by version
    (`held_out_results`), written into its info and model card.
    """
    job_id = job_id_of(job)
    record = job if isinstance(job, JobRecord) else await store.jobs.get(job_id)
    if record is None:
        raise ExportError(f"unknown job {job_id!r}")
    source, latest = await _adapter_source(store, record, job_id, version)
    config = check_adapter_dir(source.path)
    out_dir = Path(out_dir)
    refuse_occupied(out_dir)
    trained_on = str(config.get("base_model_name_or_path", ""))
    hub_id = public_model_id(record.spec.base_model) or public_model_id(trained_on)
    # The trainer's copy is a path on its machine: loads nowhere else, and is none of the
    # reader's business.
    config["base_model_name_or_path"] = hub_id or base_model_path or record.spec.base_model
    info = _export_info(record, job_id, source.version, latest, hub_id, held_out or {})
    _write_atomically(out_dir, source.path, config, info)
    return ExportedAdapter(
        job_id, record.spec.tenant, source.version, out_dir, str(config["base_model_name_or_path"])
    )


async def _adapter_source(
    store: RedisStore, record: JobRecord, job_id: str, version: int | None
) -> tuple[AdapterRef, int]:
    """The job's adapter `version` (None: the latest), found in this machine's artifact
    store, and the latest version."""
    pointer = await store.adapters.get(job_id)
    if pointer is None or pointer.version < 1:
        raise ExportError(
            f"job {job_id!r} has no trained adapter yet ({record.status}); "
            "one appears after its first step"
        )
    wanted = pointer.version if version is None else version
    if not 1 <= wanted <= pointer.version:
        raise ExportError(f"job {job_id!r} has adapter versions 1..{pointer.version}, not {wanted}")
    uri = (
        pointer.uri
        if wanted == pointer.version
        else await store.adapters.published_uri(job_id, wanted)
    )
    # Versions published before their URIs were recorded sit beside the latest as v<n>.
    source = AdapterRef(job_id, wanted, uri or str(pointer.ref.path.parent / f"v{wanted}"))
    if not source.path.is_dir():
        raise ExportError(
            f"adapter v{wanted} of job {job_id!r} is not in this machine's artifact store: run "
            "export where the artifact store (MARLAAS_ARTIFACT_DIR) is mounted"
        )
    return source, pointer.version


def _export_info(
    record: JobRecord,
    job_id: str,
    version: int,
    latest: int,
    hub_id: str | None,
    held_out: Mapping[int, Mapping[str, float]],
) -> dict[str, object]:
    """What `marlaas_export.json` says of the export: the job, its versions and settings."""
    return {
        "job_id": job_id,
        "tenant": record.spec.tenant,
        "env": record.spec.env.name,
        "version": version,
        "latest_version": latest,
        "base_model": record.spec.base_model,
        "exported_at": time.time(),
        "job_state": record.status,
        "hub_base_model": hub_id,
        "held_out": {str(v): dict(held_out[v]) for v in sorted(held_out)},
        # Field by field: messages travel as arrays, a reader wants the field names.
        "spec": {
            name: msgspec.to_builtins(getattr(record.spec, name))
            for name in record.spec.__struct_fields__
        },
    }


def _write_atomically(
    out_dir: Path, source: Path, config: dict[str, object], info: dict[str, object]
) -> None:
    with atomic_dir(out_dir) as staging:
        shutil.copyfile(source / ADAPTER_WEIGHTS, staging / ADAPTER_WEIGHTS)
        (staging / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
        (staging / EXPORT_INFO).write_text(json.dumps(info, indent=2))
        (staging / "README.md").write_text(_model_card(info, config))
        check_adapter_dir(staging)


def _model_card(info: dict[str, object], config: dict[str, object]) -> str:
    """README.md with the Hub's model-card front matter (`base_model` only when the base
    has a public id), then how to load the adapter."""
    base = config["base_model_name_or_path"]
    hub_id = info["hub_base_model"]
    front = ["---", *([f"base_model: {hub_id}"] if hub_id else []), "library_name: peft"]
    front += ["tags:", *(f"- {tag}" for tag in ("lora", "marlaas", "grpo", info["env"]))]
    front += ["---", "", f"# LoRA adapter of MARLaaS job `{info['job_id']}` (v{info['version']})"]
    if hub_id is None:
        origin = f"Trained on `{info['base_model']}`, a base model without a public id."
    else:  # known models come from a packaged GGUF file (common/files/models.py)
        origin = (
            f"Trained on [{hub_id}](https://huggingface.co/{hub_id}) as de-quantised from its "
            "packaged GGUF file; the Hub's own weights differ from those slightly."
        )
    return (
        "\n".join(front)
        + f"""

Tenant `{info["tenant"]}`, environment `{info["env"]}`, base model `{info["base_model"]}`,
rank {config["r"]}, alpha {config["lora_alpha"]}, modules {config["target_modules"]}.
{origin}
The job's settings are in `{EXPORT_INFO}`.
{held_out_section(info)}
## transformers + peft

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
from peft import PeftModel

base = AutoModelForCausalLM.from_pretrained("{base}")
model = PeftModel.from_pretrained(base, "<this directory>")
tokenizer = AutoTokenizer.from_pretrained("{base}")
```

## vLLM

```python
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

llm = LLM(model="{base}", enable_lora=True, max_lora_rank={config["r"]})
outputs = llm.generate(["What is 7 + 5?"], SamplingParams(max_tokens=16),
                       lora_request=LoRARequest("{info["job_id"]}", 1, "<this directory>"))
```
"""
    )


def held_out_section(info: Mapping[str, object]) -> str:
    """A model card's table of the job's held-out accuracy by version ("" when it was never
    evaluated), the exported version marked."""
    results = info.get("held_out")
    if not isinstance(results, dict) or not results:
        return ""
    rows = [
        "",
        "## Held-out results",
        "",
        "| version | accuracy | ± SE | tasks |",
        "|---|---|---|---|",
    ]
    for version, metrics in sorted(results.items(), key=lambda item: int(item[0])):
        name = "base" if version == "0" else f"v{version}"
        if int(version) == info.get("version"):
            name += " (this export)"
        se = metrics.get("eval_accuracy_stderr")
        tasks = metrics.get("eval_episodes")
        rows.append(
            f"| {name} | {metrics['eval_accuracy']:.3f} | {'' if se is None else f'{se:.3f}'} "
            f"| {'' if tasks is None else int(tasks)} |"
        )
    return "\n".join(rows) + "\n"

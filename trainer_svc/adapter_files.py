"""A job's adapter and checkpoint on disk: a standard PEFT adapter directory (config +
safetensors, loadable by vLLM on its own), plus the optimizer state and the step/version for
a checkpoint; each written atomically."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.files.artifacts import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from common.wire.messages import LoraSettings

if TYPE_CHECKING:
    import torch
    from peft import PeftModel

OPTIMIZER_STATE = "optimizer.pt"
TRAINER_STATE = "trainer_state.json"
CHECKPOINT_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, OPTIMIZER_STATE, TRAINER_STATE)


def write_adapter(
    peft: PeftModel,
    adapter_name: str,
    base_model_dir: Path,
    weights: Mapping[str, torch.Tensor],
    out_dir: Path,
) -> None:
    """The adapter's config and `weights` into `out_dir`. Written by hand rather than with
    `save_pretrained`, which puts any adapter not named "default" into a subdirectory named
    after it."""
    from safetensors.torch import save_file

    config: dict[str, Any] = peft.peft_config[adapter_name].to_dict()
    config["base_model_name_or_path"] = str(base_model_dir)
    # vLLM's loader wants a list (peft holds a set); sorted keeps the file reproducible.
    config["target_modules"] = sorted(config["target_modules"])
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    save_file(dict(weights), out_dir / ADAPTER_WEIGHTS, metadata={"format": "pt"})


def checked_extra_files(extra_files: Mapping[str, str] | None) -> dict[str, str]:
    """Extra checkpoint files (name -> text): each a new plain file name."""
    extra = dict(extra_files or {})
    for name in extra:
        if name in CHECKPOINT_FILES or Path(name).name != name or name[:1] in ("", "."):
            raise ValueError(f"extra checkpoint file {name!r}: need a new plain file name")
    return extra


def write_trainer_state(
    out_dir: Path,
    optimizer: torch.optim.Optimizer,
    job_id: str,
    step: int,
    version: int,
    extra: Mapping[str, str],
) -> None:
    """The optimizer state, the step/version and the extra files, beside the adapter."""
    import torch

    torch.save(optimizer.state_dict(), out_dir / OPTIMIZER_STATE)
    state = {"job_id": job_id, "step": step, "version": version}
    (out_dir / TRAINER_STATE).write_text(json.dumps(state, indent=2))
    for name, text in extra.items():
        (out_dir / name).write_text(text)


def load_adapter_weights(
    ckpt_dir: Path, lora: LoraSettings, names: set[str]
) -> dict[str, torch.Tensor]:
    """The checkpoint's adapter tensors, checked against the job's LoRA settings and its
    adapter's tensor `names`."""
    from safetensors.torch import load_file

    saved_config = json.loads((ckpt_dir / ADAPTER_CONFIG).read_text())
    expected = (lora.rank, lora.alpha, sorted(lora.target_modules))
    found = (
        saved_config["r"],
        saved_config["lora_alpha"],
        sorted(saved_config["target_modules"]),
    )
    if found != expected:
        raise ValueError(f"checkpoint has LoRA (r, alpha, targets) {found}, job {expected}")
    weights = load_file(ckpt_dir / ADAPTER_WEIGHTS)
    if set(weights) != names:
        raise ValueError(f"checkpoint {ckpt_dir} does not hold this job's adapter tensors")
    return weights


def load_trainer_state(
    ckpt_dir: Path, optimizer: torch.optim.Optimizer, device: torch.device
) -> tuple[int, int]:
    """Restore the optimizer state; returns the checkpoint's (step, version)."""
    import torch

    optimizer.load_state_dict(
        torch.load(ckpt_dir / OPTIMIZER_STATE, weights_only=True, map_location=device)
    )
    state = json.loads((ckpt_dir / TRAINER_STATE).read_text())
    return int(state["step"]), int(state["version"])

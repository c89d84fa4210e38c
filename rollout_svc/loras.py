"""Adapters in vLLM's engine: the LoRA bookkeeping.

`LoraSlots` gives each adapter version the engine serves (an `AdapterRef`,
common/wire/adapters.py) a LoRA id, loads it once before a request needs it, and removes a
retired version when its last request in flight finishes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from common.wire.adapters import AdapterRef

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""`max_lora_rank` values vLLM accepts; an adapter's rank must not exceed the chosen one."""

NULL_ADAPTER_NAME = "marlaas-base@v0"


def write_null_adapter(model_dir: Path, out_dir: Path) -> Path:
    """A PEFT LoRA of rank 1 on layer 0's q_proj whose weights are zero: the base model.

    Assumes Llama-style module names (`model.layers.N.self_attn.q_proj`), as SmolLM2 has.
    """
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden_size = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden_size // config["num_attention_heads"]
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        {
            f"{prefix}.lora_A.weight": torch.zeros(1, hidden_size),
            f"{prefix}.lora_B.weight": torch.zeros(config["num_attention_heads"] * head_dim, 1),
        },
        str(out_dir / "adapter_model.safetensors"),
    )
    adapter_config = {
        "peft_type": "LORA",
        "r": 1,
        "lora_alpha": 1,
        "target_modules": ["q_proj"],
        "bias": "none",
        "base_model_name_or_path": str(model_dir),
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return out_dir


@dataclass
class _LoadedAdapter:
    """Engine-side bookkeeping of one adapter version: its LoRA id and who is using it."""

    ref: AdapterRef
    lora_int_id: int
    in_flight: int = 0
    retiring: bool = False
    """Remove from the engine as soon as `in_flight` drops to 0."""
    loaded: bool = False
    """The engine accepted it (`add_lora`): requests with it cannot fail its loading."""
    loading: asyncio.Lock = field(default_factory=asyncio.Lock)


class AdapterUnavailableError(RuntimeError):
    """An adapter version the engine cannot load (files missing or unreadable): its request
    fails alone. Handed to vLLM with the request instead, the load would fail inside the
    engine's step and kill the engine, and with it every tenant's requests."""


class LoraSlots:
    """The adapter versions registered with one engine, each with its LoRA id and users."""

    def __init__(self, engine: Callable[[], AsyncLLM | None], *, enabled: bool) -> None:
        """`engine`: the running vLLM engine (None before start and after stop); `enabled`
        False: the engine serves the base model only (every request must be version 0)."""
        self._engine = engine
        self._enabled = enabled
        self._adapters: dict[tuple[str, int], _LoadedAdapter] = {}
        self._lora_ids = itertools.count(1)  # vLLM rejects id 0
        self.null_lora: LoRARequest | None = None
        """What base-model requests carry: the null adapter on CPU when the stacked LoRA plugin
        is left out, None otherwise."""

    def __len__(self) -> int:
        """Adapter versions registered with the engine and not retired (the null one aside)."""
        return len(self._adapters)

    def clear(self) -> None:
        self._adapters.clear()
        self.null_lora = None

    def next_id(self) -> int:
        return next(self._lora_ids)

    def lora_int_id(self, job_id: str, version: int) -> int | None:
        """The engine's LoRA id for an adapter version; None if unknown or retired."""
        entry = self._adapters.get((job_id, version))
        return entry.lora_int_id if entry is not None else None

    def acquire(self, adapter: AdapterRef | None) -> LoRARequest | None:
        """The LoRA request for `adapter`, counted in use until `release`."""
        from vllm.lora.request import LoRARequest

        if adapter is None or adapter.version == 0:
            return self.null_lora
        if not self._enabled:
            raise ValueError(f"adapter {adapter.lora_name} requested from an engine without LoRA")
        entry = self._adapters.get(adapter.key)
        if entry is None:
            entry = _LoadedAdapter(adapter, self.next_id())
            self._adapters[adapter.key] = entry
        elif entry.ref.path != adapter.path:
            raise ValueError(
                f"adapter {adapter.lora_name} is already registered from {entry.ref.path}, "
                f"not {adapter.path}: a published version must not change"
            )
        entry.in_flight += 1
        return LoRARequest(
            lora_name=adapter.lora_name, lora_int_id=entry.lora_int_id, lora_path=str(adapter.path)
        )

    async def release(self, adapter: AdapterRef | None) -> None:
        if adapter is None or adapter.version == 0:
            return
        entry = self._adapters.get(adapter.key)
        if entry is None:
            return
        entry.in_flight -= 1
        if entry.retiring and entry.in_flight == 0:
            await self._remove(entry)

    async def ensure_loaded(self, adapter: AdapterRef | None, lora: LoRARequest | None) -> None:
        """Have the engine load an adapter version once, before any request uses it; raise
        AdapterUnavailableError when it cannot (and try again with the next request)."""
        entry = self._adapters.get(adapter.key) if adapter else None
        if adapter is None or lora is None or entry is None or entry.loaded:
            return
        async with entry.loading:
            if entry.loaded:
                return
            if not (adapter.path / "adapter_config.json").is_file():
                raise AdapterUnavailableError(
                    f"adapter {adapter.lora_name}: no adapter_config.json in {adapter.path}"
                )
            engine = self._engine()
            if engine is None:
                raise RuntimeError("RolloutEngine is not started")
            try:
                await engine.add_lora(lora)
            except Exception as exc:
                raise AdapterUnavailableError(
                    f"adapter {adapter.lora_name} not loaded from {adapter.path}: {exc}"
                ) from exc
            entry.loaded = True

    async def retire(self, job_id: str, version: int) -> None:
        """Remove an adapter version from the engine once no request in flight uses it.

        Requests that arrive for it before then still run with it; a request after the
        removal loads it again from its path under a new LoRA id.
        """
        entry = self._adapters.get((job_id, version))
        if entry is None:
            return
        entry.retiring = True
        if entry.in_flight == 0:
            await self._remove(entry)

    async def _remove(self, entry: _LoadedAdapter) -> None:
        # Forget it before awaiting: a request arriving meanwhile gets a fresh LoRA id.
        del self._adapters[entry.ref.key]
        if (engine := self._engine()) is not None:
            removed = await engine.remove_lora(entry.lora_int_id)
            log.info("retired adapter %s (removed from engine: %s)", entry.ref.lora_name, removed)

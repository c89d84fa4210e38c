"""A faster multi-LoRA path for vLLM's CPU engine, loaded as a vLLM general plugin.

vLLM 0.32's CPU wrapper (`PunicaWrapperCPU` over `vllm/lora/ops/torch_ops`) applies LoRA one
token at a time: for every token and every slice it gathers that token's adapter matrix
(rank x hidden) out of the stacked slots, converts it to float32 and runs a batched
matrix-vector product. The gather and the conversion cost more than the base layer they sit
beside (measured: bench/multilora.py). It also indexes the slots with the sentinel -1
("no adapter"), which PyTorch reads as the last slot, so a base-model request batched beside
LoRA requests silently gets another job's adapter.

`PunicaWrapperStacked` does one dense GEMM per slice instead. Once per engine step
(`update_metadata`) it finds the U distinct slots the batch's tokens use and a token x slot
one-hot mask (all-zero for "no adapter" rows). Per layer it then computes
`x @ [A_1 .. A_U]^T` (T x U*r, in the model's dtype), zeroes every block but the token's
own, and `@ [B_1 .. B_U]^T` adds the result into the base output: two GEMMs whose width
grows with the adapters actually in the batch, not with the engine's slots. Since "no
adapter" rows are masked, base-model requests need no placeholder adapter.

Registered through the `vllm.general_plugins` entry point (pyproject.toml), which vLLM loads
in each of its processes; `VLLM_PLUGINS` can leave it out (the bench compares both).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where used: the engine imports this module early
    import torch

PLUGIN_NAME = "marlaas_cpu_lora"
WRAPPER_QUALNAME = "rollout_svc.cpu_lora.PunicaWrapperStacked"


def plugin_enabled() -> bool:
    """Whether vLLM will load this plugin: `VLLM_PLUGINS` unset, or naming it."""
    allowed = os.environ.get("VLLM_PLUGINS")
    return allowed is None or PLUGIN_NAME in allowed.split(",")


def register() -> None:
    """The plugin's entry point: on the CPU platform, serve LoRA through the stacked path."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    platform_cls = type(current_platform)
    platform_cls.get_punica_wrapper = classmethod(lambda cls: WRAPPER_QUALNAME)  # type: ignore[method-assign,assignment]


def slot_mask(slots_T: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct adapter slots `slots_T` uses (sorted; -1 = none) and the T x U one-hot."""
    import torch

    active_U = torch.unique(slots_T[slots_T >= 0])
    onehot_TU = (slots_T.unsqueeze(1) == active_U.unsqueeze(0)).to(dtype)
    return active_U, onehot_TU


def stacked_lora_linear(
    y_TO: torch.Tensor,
    x_TI: torch.Tensor,
    lora_a: Sequence[torch.Tensor],
    lora_b: Sequence[torch.Tensor],
    output_slices: Sequence[int],
    active_U: torch.Tensor,
    onehot_TU: torch.Tensor,
    scale: float = 1.0,
) -> None:
    """`y[t, slice i] += scale * x[t] @ A_i[slot t]^T @ B_i[slot t]^T` for every token t.

    `lora_a[i]`: slots x 1 x r x I; `lora_b[i]`: slots x 1 x O_i x r (vLLM's stacked layout).
    Rows whose slot is not in `active_U` (the "no adapter" ones) get nothing.
    """
    import torch

    n_tokens, n_active = onehot_TU.shape
    if n_active == 0:
        return
    offset = 0
    for a_stacked, b_stacked, width in zip(lora_a, lora_b, output_slices, strict=True):
        a_URI = a_stacked.index_select(0, active_U).squeeze(1)
        n_active_, rank, n_in = a_URI.shape
        hidden_TUR = (x_TI.to(a_URI.dtype) @ a_URI.reshape(n_active_ * rank, n_in).T).view(
            n_tokens, n_active, rank
        )
        # where, not a product with the mask: another job's NaN times 0 is NaN.
        hidden_TUR = torch.where(onehot_TU.unsqueeze(2) > 0, hidden_TUR, 0.0)
        if scale != 1.0:
            hidden_TUR = hidden_TUR * scale
        b_UOR = b_stacked.index_select(0, active_U).squeeze(1)[:, :width]
        b_O_UR = b_UOR.permute(1, 0, 2).reshape(width, n_active * rank)
        delta_TO = hidden_TUR.reshape(n_tokens, n_active * rank) @ b_O_UR.T
        if not bool(torch.isfinite(delta_TO).all()):
            delta_TO = _each_adapter_alone(hidden_TUR, b_UOR, onehot_TU)
        y_TO[:, offset : offset + width] += delta_TO.to(y_TO.dtype)
        offset += width


def _each_adapter_alone(
    hidden_TUR: torch.Tensor, b_UOR: torch.Tensor, onehot_TU: torch.Tensor
) -> torch.Tensor:
    """The LoRA output with each adapter's B applied to its own tokens only: the one GEMM
    over all adapters adds 0 x B of every other adapter, which is NaN where B is not finite
    (an adapter that diverged must spoil no other job's tokens)."""

    delta_TO = hidden_TUR.new_zeros(hidden_TUR.shape[0], b_UOR.shape[1])
    for slot in range(b_UOR.shape[0]):
        own_T = onehot_TU[:, slot] > 0
        delta_TO[own_T] = hidden_TUR[own_T, slot] @ b_UOR[slot].T
    return delta_TO


def _wrapper_class() -> type:
    import torch
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    class PunicaWrapperStacked(PunicaWrapperCPU):
        """PunicaWrapperCPU with linear layers served by `stacked_lora_linear`."""

        def update_metadata(self, *args: Any, **kwargs: Any) -> None:
            super().update_metadata(*args, **kwargs)
            self._active_U, self._onehot_TU = slot_mask(self.token_lora_indices, torch.float32)

        def add_lora_linear(
            self,
            y: torch.Tensor,
            x: torch.Tensor,
            lora_a_stacked: tuple[torch.Tensor, ...],
            lora_b_stacked: tuple[torch.Tensor, ...],
            scale: float,
            output_slices: tuple[int, ...],
            *,
            buffer: tuple[torch.Tensor, ...] | None = None,
            **kwargs: Any,
        ) -> None:
            x_TI = x.view(-1, x.shape[-1])
            if x_TI.shape[0] != self._onehot_TU.shape[0]:
                raise RuntimeError(
                    f"LoRA mapping covers {self._onehot_TU.shape[0]} tokens, the layer got "
                    f"{x_TI.shape[0]}: vLLM's batch layout is not what this wrapper expects"
                )
            stacked_lora_linear(
                y.view(-1, y.shape[-1]),
                x_TI,
                lora_a_stacked,
                lora_b_stacked,
                output_slices,
                self._active_U,
                self._onehot_TU,
                scale,
            )

    PunicaWrapperStacked.__qualname__ = PunicaWrapperStacked.__name__
    PunicaWrapperStacked.__module__ = __name__
    return PunicaWrapperStacked


def __getattr__(name: str) -> Any:
    # vLLM resolves WRAPPER_QUALNAME by attribute; building the class lazily keeps importing
    # this module (to read PLUGIN_NAME or call register) free of vLLM's LoRA machinery.
    if name == "PunicaWrapperStacked":
        cls = _wrapper_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)

"""The stacked CPU LoRA path against a per-token reference and against vLLM's own kernels."""

from __future__ import annotations

import pytest
import torch

from rollout_svc.cpu_lora import PLUGIN_NAME, plugin_enabled, slot_mask, stacked_lora_linear

SLOTS, RANK, N_IN = 5, 16, 64
OUTPUT_SLICES = (32, 16, 16)  # a packed q/k/v projection


def _stacked(generator: torch.Generator, dtype: torch.dtype) -> tuple[list, list]:
    lora_a = [torch.randn(SLOTS, 1, RANK, N_IN, generator=generator) for _ in OUTPUT_SLICES]
    lora_b = [torch.randn(SLOTS, 1, width, RANK, generator=generator) for width in OUTPUT_SLICES]
    return [a.to(dtype) for a in lora_a], [b.to(dtype) for b in lora_b]


def _reference(y, x, lora_a, lora_b, slots, scale):
    out = y.clone().double()
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        offset = 0
        for a, b, width in zip(lora_a, lora_b, OUTPUT_SLICES, strict=True):
            delta = (x[t].double() @ a[slot, 0].double().T) @ b[slot, 0].double().T
            out[t, offset : offset + width] += scale * delta
            offset += width
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_path_matches_the_per_token_reference(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    lora_a, lora_b = _stacked(generator, dtype)
    slots = torch.tensor([-1, 0, 3, 3, -1, 4, 0, 2])
    x = torch.randn(len(slots), N_IN, generator=generator).to(dtype)
    y = torch.randn(len(slots), sum(OUTPUT_SLICES), generator=generator).to(dtype)
    expected = _reference(y, x, lora_a, lora_b, slots, scale=0.5)

    active, onehot = slot_mask(slots, torch.float32)
    assert active.tolist() == [0, 2, 3, 4]
    stacked_lora_linear(y, x, lora_a, lora_b, OUTPUT_SLICES, active, onehot, scale=0.5)

    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    scale = expected.abs().max().item()
    assert (y.double() - expected).abs().max().item() <= tolerance * scale
    # "No adapter" rows are left exactly as they were: no other job's adapter leaks in.
    assert torch.equal(y[0].double(), expected[0]) and torch.equal(y[4].double(), expected[4])


@pytest.mark.parametrize("broken", ["a", "b"])
def test_one_jobs_non_finite_adapter_spoils_no_other_jobs_tokens(broken: str) -> None:
    """A diverged adapter (NaN in A or in B) beside healthy ones: the other jobs' rows and the
    base-model rows get exactly what they would get without it (issue 24)."""
    generator = torch.Generator().manual_seed(3)
    lora_a, lora_b = _stacked(generator, torch.float32)
    slots = torch.tensor([0, 3, -1, 3, 0, 2])
    x = torch.randn(len(slots), N_IN, generator=generator)
    y = torch.randn(len(slots), sum(OUTPUT_SLICES), generator=generator)
    expected = _reference(y, x, lora_a, lora_b, slots, scale=1.0)
    for tensors in lora_a if broken == "a" else lora_b:
        tensors[3].fill_(float("nan"))
    active, onehot = slot_mask(slots, torch.float32)
    stacked_lora_linear(y, x, lora_a, lora_b, OUTPUT_SLICES, active, onehot)
    healthy = slots != 3
    assert torch.isfinite(y[healthy]).all()
    assert (y[healthy].double() - expected[healthy]).abs().max().item() <= 1e-4 * 100
    assert torch.isnan(y[~healthy]).all()


def test_a_batch_without_adapters_is_untouched() -> None:
    generator = torch.Generator().manual_seed(1)
    lora_a, lora_b = _stacked(generator, torch.float32)
    slots = torch.tensor([-1, -1, -1])
    y = torch.randn(3, sum(OUTPUT_SLICES), generator=generator)
    before = y.clone()
    active, onehot = slot_mask(slots, torch.float32)
    stacked_lora_linear(y, torch.randn(3, N_IN), lora_a, lora_b, OUTPUT_SLICES, active, onehot)
    assert torch.equal(y, before)


def test_matches_vllm_kernels_on_rows_with_an_adapter() -> None:
    """vLLM's CPU ops compute the same delta where the slot is valid (they misread -1)."""
    bgmv = pytest.importorskip("vllm.lora.ops.torch_ops")
    generator = torch.Generator().manual_seed(2)
    lora_a, lora_b = _stacked(generator, torch.float32)
    slots = torch.tensor([1, 0, 4, 1])
    x = torch.randn(len(slots), N_IN, generator=generator)
    y_ours = torch.zeros(len(slots), sum(OUTPUT_SLICES))
    y_vllm = y_ours.clone()

    active, onehot = slot_mask(slots, torch.float32)
    stacked_lora_linear(y_ours, x, lora_a, lora_b, OUTPUT_SLICES, active, onehot)
    offset = 0
    for a, b, width in zip(lora_a, lora_b, OUTPUT_SLICES, strict=True):
        hidden = torch.zeros(len(slots), RANK)
        bgmv.bgmv_shrink(x, a, hidden, slots, 1.0)
        bgmv.bgmv_expand_slice(hidden, b, y_vllm, slots, offset, width, add_inputs=True)
        offset += width
    torch.testing.assert_close(y_ours, y_vllm, rtol=1e-4, atol=1e-4)


def test_the_plugin_is_on_unless_vllm_plugins_leaves_it_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert plugin_enabled()
    monkeypatch.setenv("VLLM_PLUGINS", "")
    assert not plugin_enabled()
    monkeypatch.setenv("VLLM_PLUGINS", f"other,{PLUGIN_NAME}")
    assert plugin_enabled()

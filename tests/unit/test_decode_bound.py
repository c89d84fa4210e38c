"""bench/decode_bound.py's arithmetic: the model's linears from its config, the decode step's
bound from measured kernel times, the event loop's lag summary."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path += [str(ROOT / "bench")]  # after the packages

from decode_bound import ModelShape, bounds, lag_summary, mean_of, step_bound  # noqa: E402

SMOLLM2_135M = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "num_hidden_layers": 30,
    "head_dim": 64,
    "vocab_size": 49152,
}


def kernels(seconds_per_call: float, read_gb_s: float) -> dict[str, object]:
    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
    return {
        "linear_s": {name: {1: seconds_per_call, 8: seconds_per_call} for name in names},
        "streamed_s": {1: 0.1, 8: 0.1},
        "read_gb_s": read_gb_s,
        "copy_gb_s": read_gb_s,
    }


def test_smollm2s_linears_are_fused_as_vllm_runs_them_and_hold_its_134_5m_parameters() -> None:
    model = ModelShape.of(SMOLLM2_135M)
    shapes = {s.name: (s.in_features, s.out_features, s.count) for s in model.linears}
    assert shapes == {
        "qkv_proj": (576, 960, 30),
        "o_proj": (576, 576, 30),
        "gate_up_proj": (576, 3072, 30),
        "down_proj": (1536, 576, 30),
        "lm_head": (576, 49152, 1),
    }
    assert sum(s.params for s in model.linears) == 134_479_872
    assert model.kv_per_context_token == 2 * 3 * 64 * 30
    assert model.attention_flops_per_context_token == 4 * 576 * 30


def test_one_sequence_is_bound_by_reading_the_weights() -> None:
    model = ModelShape.of(SMOLLM2_135M)
    bound = step_bound(model, kernels(1e-6, 10.0), batch=1, context=100, dtype_bytes=2)
    weight_bytes = 134_479_872 * 2
    kv_bytes = 100 * 11_520 * 2
    assert bound["limit"] == "memory"
    assert bound["tok_s"] == pytest.approx(1 / ((weight_bytes + kv_bytes) / 10e9), rel=1e-3)
    assert bound["compute_ms"] == pytest.approx(121 * 1e-3, abs=1e-3)  # 121 linears a step
    assert bound["streamed_tok_s"] == pytest.approx(10.0)


def test_slow_matmuls_make_the_step_compute_bound_and_batch_multiplies_its_tokens() -> None:
    model = ModelShape.of(SMOLLM2_135M)
    bound = step_bound(model, kernels(1e-3, 100.0), batch=8, context=50, dtype_bytes=4)
    assert bound["limit"] == "compute"
    assert bound["tok_s"] == pytest.approx(8 / 0.121, rel=1e-3)
    attention = 50 * 4 * 576 * 30  # per sequence, against 2 * 134.5 M in the linears
    assert bound["attention_flop_share"] == pytest.approx(
        attention / (attention + 268_959_744), abs=1e-4
    )


def test_the_bound_takes_the_mean_of_the_kernels_before_and_after_and_reports_drift() -> None:
    model = ModelShape.of(SMOLLM2_135M)
    slow, fast = kernels(2e-3, 100.0), kernels(1e-3, 100.0)
    per_batch = bounds(model, {"before": slow, "after": fast}, {8: 50.0}, dtype_bytes=4)
    assert per_batch[8]["tok_s"] == pytest.approx(8 / (121 * 1.5e-3), rel=1e-3)
    assert per_batch[8]["drift"] == pytest.approx(2.0)
    assert mean_of({"a": {1: 1.0}, "b": 3.0}, {"a": {1: 3.0}, "b": 5.0}) == {
        "a": {1: 2.0},
        "b": 4.0,
    }


def test_lag_summary_reports_milliseconds_and_copes_with_one_sample() -> None:
    summary = lag_summary([0.001] * 98 + [0.010, 0.050])
    assert summary["p50"] == pytest.approx(1.0)
    assert summary["max"] == pytest.approx(50.0)
    assert summary["samples"] == 100
    assert lag_summary([0.002]) == {"p50": 2.0, "p99": 2.0, "max": 2.0, "samples": 1}

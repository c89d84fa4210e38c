"""Fixtures shared by every test directory."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a safetensors directory, converted from the packaged GGUF.

    Deliberately the real default cache (`$MARLAAS_CACHE` or `~/.cache/marlaas`), not a tmp
    dir: the conversion takes ~30-60 s, so repeated local runs and CI (which caches that dir)
    convert once per machine instead of once per test session.
    """
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from common.models import resolve_base_model

    return resolve_base_model("smollm2-135m-instruct")

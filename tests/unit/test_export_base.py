"""What an export needs of the base model on the exporting machine: nothing for a known one."""

from __future__ import annotations

from pathlib import Path

import pytest

import marlaas.export
from marlaas.export import local_base_model


def test_a_known_base_model_needs_no_local_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    # The api and cli images lack the model's wheel: resolving it there fails, and must not
    # be tried for a model the export names by its Hub id.
    def unavailable(name: str, cache_dir: Path | None = None) -> Path:
        raise AssertionError(f"resolved {name} where no model is installed")

    monkeypatch.setattr(marlaas.export, "resolve_base_model", unavailable)
    assert local_base_model("smollm2-135m-instruct") is None


def test_a_local_base_model_is_named_by_its_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert local_base_model(str(tmp_path)) == str(tmp_path.resolve())

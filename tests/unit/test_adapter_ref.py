"""`AdapterRef`, the one name of a job's adapter version: the message and the Redis pointer give
it back as they got it, and vLLM's name and the local path come from it alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.state.pointers import AdapterPointer
from common.wire.adapters import AdapterRef, adapter_path
from common.wire.messages import AdapterUpdate


def test_an_adapter_update_carries_a_ref_flat_and_gives_it_back(tmp_path: Path) -> None:
    ref = AdapterRef("acme-1", 3, (tmp_path / "v3 e1").as_uri(), step=3)
    update = AdapterUpdate.of(ref, metrics={"loss": 0.5})
    assert (update.job_id, update.version, update.uri, update.step) == ("acme-1", 3, ref.uri, 3)
    assert update.ref == ref and update.metrics == {"loss": 0.5}


def test_a_redis_pointer_gives_the_ref_it_holds() -> None:
    fields = {b"version": b"2", b"uri": b"file:///a/v2", b"step": b"2", b"updated_at": b"1.0"}
    assert AdapterPointer.of("j", fields).ref == AdapterRef("j", 2, "file:///a/v2", step=2)


def test_its_lora_name_path_and_key(tmp_path: Path) -> None:
    ref = AdapterRef("acme-1", 4, (tmp_path / "a b").as_uri())
    assert ref.lora_name == "acme-1@v4" and ref.key == ("acme-1", 4)
    assert ref.path == tmp_path / "a b"  # percent-encoding undone
    assert AdapterRef("j", 1, "/plain/dir").path == Path("/plain/dir")


def test_a_uri_naming_another_host_is_refused() -> None:
    with pytest.raises(ValueError, match="names host 'elsewhere'"):
        adapter_path("file://elsewhere/a/v1")

"""The CLI unpacks an export the tenant API sends: plain files inside the target only, on
every Python 3.11 (tarfile's "data" filter came in 3.11.4; Debian bookworm has 3.11.2)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from marlaas.api_client import _unpack_into


def archive(*members: tuple[str, bytes | None]) -> bytes:
    """A .tar.gz of files (bytes) and symlinks to `/etc/passwd` (None)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.fixture(params=["filter", "by hand"])
def python(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "by hand":  # as on Python < 3.11.4
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    return str(request.param)


def test_an_export_unpacks_into_the_directory(python: str, tmp_path: Path) -> None:
    _unpack_into(archive(("job-v2/adapter_config.json", b"{}")), tmp_path / "out")
    assert (tmp_path / "out" / "adapter_config.json").read_bytes() == b"{}"


@pytest.mark.parametrize(
    "member", [("../escaped", b"x"), ("/abs/escaped", b"x"), ("job-v2/link", None)]
)
def test_a_hostile_archive_writes_nothing_outside_and_makes_no_link(
    python: str, member: tuple[str, bytes | None], tmp_path: Path
) -> None:
    with pytest.raises((ValueError, tarfile.TarError)):
        _unpack_into(archive(("job-v2/a", b"a"), member), tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "escaped").exists()

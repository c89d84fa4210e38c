from pathlib import Path

import pytest

from common.files.artifacts import adapter_path, atomic_dir, atomic_write_text, staging_leftovers


@pytest.mark.parametrize(
    "directory",
    [Path("/srv/artifacts/adapters/job-1/v3"), Path("/tmp/my runs/ünïcode/v1"), Path("/a/%20b")],
)
def test_the_path_of_a_file_uri_is_the_directory_it_was_made_from(directory: Path) -> None:
    assert adapter_path(directory.as_uri()) == directory


def test_a_plain_path_is_taken_as_it_is() -> None:
    assert adapter_path("/srv/artifacts/a b/v1") == Path("/srv/artifacts/a b/v1")
    assert adapter_path("file://localhost/srv/x") == Path("/srv/x")


def test_a_remote_file_uri_is_refused() -> None:
    with pytest.raises(ValueError, match="names host 'nas'"):
        adapter_path("file://nas/srv/x")


def test_atomic_dir_replaces_the_target_only_when_the_block_completes(tmp_path: Path) -> None:
    target = tmp_path / "v1"
    target.mkdir()
    (target / "old").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(target) as staging:
        (staging / "new").write_text("half")
        raise RuntimeError("crashed while writing")
    assert sorted(p.name for p in target.iterdir()) == ["old"]
    assert staging_leftovers(target) == []
    with atomic_dir(target) as staging:
        (staging / "sub").mkdir()
        (staging / "sub" / "new").write_text("whole")
    assert (target / "sub" / "new").read_text() == "whole"
    assert not (target / "old").exists()
    # The service user's alone: not world- or group-readable (a tenant's adapter is its own).
    assert (target.stat().st_mode & 0o777, (target / "sub" / "new").stat().st_mode & 0o777) == (
        0o700,
        0o600,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]


def test_atomic_write_text_leaves_the_old_file_or_the_new_one(tmp_path: Path) -> None:
    target = tmp_path / "latest"
    atomic_write_text(target, "v1")
    atomic_write_text(target, "v2")
    assert target.read_text() == "v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]

from pathlib import Path

import pytest

from common.adapters import adapter_path


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

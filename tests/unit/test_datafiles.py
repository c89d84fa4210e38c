"""A job's files are its tenant's: a dataset path cannot reach anything else env_svc can read
(issue 24). Each refusal names the rule and the job's own path, never the file's contents."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import pytest

from common.wire.messages import EnvSettings, JobSpec
from env_svc import datafiles
from env_svc.datafiles import DataFileError, confine, read_lines
from env_svc.protocol import EnvParamsError, environment_for

SECRET = "secret-A1"
ROWS = "".join(json.dumps({"question": f"q{i}", "answer": i}) + "\n" for i in range(20))


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`<data>/acme/` with a good file; `<data>/globex/` with another tenant's secret; a file
    beside the data directory."""
    root = tmp_path / "data"
    (root / "acme").mkdir(parents=True)
    (root / "acme" / "d.jsonl").write_text(ROWS)
    (root / "globex").mkdir()
    (root / "globex" / "secret.jsonl").write_text(
        json.dumps({"question": "secret Q1", "answer": SECRET}) + "\n"
    )
    (tmp_path / "outside.jsonl").write_text(ROWS)
    monkeypatch.setenv("MARLAAS_DATA_DIR", str(root))
    return root


def job(path: str, tenant: str = "acme", **params: str) -> JobSpec:
    return JobSpec(
        job_id="j1",
        tenant=tenant,
        env=EnvSettings(name="dataset", params={"path": path, "match": "number", **params}),
    )


def refusal(path: str, eval_path: str = "") -> str:
    extra = {"eval_path": eval_path} if eval_path else {}
    with pytest.raises(EnvParamsError) as raised:
        environment_for(job(path, **extra))
    return str(raised.value)


def test_the_tenants_own_file_is_read(data_dir: Path) -> None:
    env = environment_for(job("d.jsonl"))
    assert env.data_dir == data_dir / "acme"


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("/etc/passwd", "relative to your data folder"),
        ("/proc/self/environ", "relative to your data folder"),
        ("/dev/zero", "relative to your data folder"),
        ("~/x.jsonl", "relative to your data folder"),
        ("../x.jsonl", "must not contain '..'"),
        ("../globex/secret.jsonl", "must not contain '..'"),
        ("sub/../../globex/secret.jsonl", "must not contain '..'"),
        ("", "relative to your data folder"),
        ("missing.jsonl", "no such file in your data folder"),
    ],
)
def test_paths_outside_the_tenants_folder_are_refused(data_dir: Path, path: str, says: str) -> None:
    said = refusal(path)
    assert says in said and "'path'" in said
    assert str(data_dir) not in said  # where the data lies is not the tenant's business


def test_another_tenants_file_is_refused_without_quoting_it(data_dir: Path) -> None:
    secret = data_dir / "globex" / "secret.jsonl"
    for path in (str(secret), "../globex/secret.jsonl"):
        said = refusal(path)
        assert SECRET not in said and "secret Q1" not in said
    # Its owner reads it; a non-number answer is named by its row, not quoted.
    with pytest.raises(EnvParamsError) as raised:
        environment_for(job("secret.jsonl", tenant="globex"))
    assert "row 1" in str(raised.value) and SECRET not in str(raised.value)


def test_a_link_out_of_the_folder_is_refused(data_dir: Path) -> None:
    (data_dir / "acme" / "etc").symlink_to("/etc")
    (data_dir / "acme" / "peer.jsonl").symlink_to(data_dir / "globex" / "secret.jsonl")
    (data_dir / "acme" / "out.jsonl").symlink_to(data_dir.parent / "outside.jsonl")
    for path in ("etc/passwd", "peer.jsonl", "out.jsonl"):
        said = refusal(path)
        assert "leads out of your data folder" in said and SECRET not in said
    (data_dir / "acme" / "inside.jsonl").symlink_to("d.jsonl")  # a link that stays in: fine
    environment_for(job("inside.jsonl"))


def test_only_regular_files_are_read_and_nothing_grows(data_dir: Path) -> None:
    folder = data_dir / "acme"
    (folder / "zero").symlink_to("/dev/zero")  # resolves out of the folder: refused as a link
    os.mkfifo(folder / "pipe")  # opening a FIFO would block until someone writes
    (folder / "dir").mkdir()
    tracemalloc.start()
    try:
        assert "leads out" in refusal("zero")
        assert "not a regular file" in refusal("pipe")
        assert "an empty folder" in refusal("dir")  # a folder is a save_to_disk dataset
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak


def test_size_and_line_caps(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = data_dir / "acme"
    monkeypatch.setattr(datafiles, "MAX_FILE_BYTES", 1000)
    monkeypatch.setattr(datafiles, "MAX_LINE_BYTES", 100)
    (folder / "big.jsonl").write_text(ROWS * 10)
    assert "a data file may have 1000 at most" in refusal("big.jsonl")
    (folder / "long.jsonl").write_text(json.dumps({"question": "q" * 200, "answer": 1}) + "\n")
    said = refusal("long.jsonl")
    assert "long.jsonl:1:" in said and "a line may have 100 at most" in said
    assert "qqq" not in said


def test_a_file_swapped_after_the_check_is_not_read(data_dir: Path) -> None:
    folder = data_dir / "acme"
    checked = confine(folder, "d.jsonl")
    (folder / "d.jsonl").unlink()
    (folder / "d.jsonl").symlink_to(data_dir / "globex" / "secret.jsonl")
    with pytest.raises(DataFileError, match=r"cannot read|changed while"):
        read_lines(checked, "d.jsonl")


def test_an_eval_path_is_confined_too(data_dir: Path) -> None:
    said = refusal("d.jsonl", eval_path="../globex/secret.jsonl")
    assert "'eval_path'" in said and SECRET not in said

"""trainer_svc.checkpoints on the tiny random Llama of test_policy: the artifact layout,
`latest`, pruning, groups.json, exact resume, and what a crash mid-save leaves behind."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import trainer_svc.checkpoints
from common.files.artifacts import ADAPTER_CONFIG, ADAPTER_WEIGHTS, staging_leftovers
from common.files.models import tiny_model
from common.wire.adapters import AdapterRef
from tests.unit.test_policy import LORA, RL, _assert_same_state, _batch
from trainer_svc.adapter_files import OPTIMIZER_STATE, TRAINER_STATE
from trainer_svc.checkpoints import GROUPS_FILE, STEP_FILE, Checkpoint, CheckpointStore
from trainer_svc.policy import MultiAdapterPolicy

ADVANTAGES = [1.0, -1.0, 0.5, -0.5]
CHECKPOINT_FILES = sorted(
    [ADAPTER_CONFIG, ADAPTER_WEIGHTS, GROUPS_FILE, OPTIMIZER_STATE, STEP_FILE, TRAINER_STATE]
)


@pytest.fixture(scope="module")
def base_dir() -> Path:
    return tiny_model()


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _policy(base_dir: Path, seed: int = 0) -> MultiAdapterPolicy:
    policy = MultiAdapterPolicy(base_dir)
    policy.add_job("a", LORA, RL, seed=seed)
    return policy


def _train_and_save(store: CheckpointStore, policy: MultiAdapterPolicy, version: int) -> AdapterRef:
    policy.train_step("a", _batch(), ADVANTAGES)
    return store.save(policy, "a", version, [f"g{version}-0", f"g{version}-1"])


def _assert_same_optimizer(a: MultiAdapterPolicy, b: MultiAdapterPolicy, job_id: str) -> None:
    state_a: dict[str, Any] = a._jobs[job_id].optimizer.state_dict()
    state_b: dict[str, Any] = b._jobs[job_id].optimizer.state_dict()
    assert state_a["param_groups"] == state_b["param_groups"]
    assert state_a["state"] and state_a["state"].keys() == state_b["state"].keys()
    for index in state_a["state"]:
        _assert_same_state(state_a["state"][index], state_b["state"][index], atol=0)


def test_saves_publish_every_adapter_and_keep_the_newest_two_checkpoints(
    base_dir: Path, tmp_path: Path
) -> None:
    store = CheckpointStore(tmp_path)
    policy = _policy(base_dir)
    adapters, checkpoints = tmp_path / "adapters" / "a", tmp_path / "checkpoints" / "a"
    assert store.latest("a") is None

    for version in (1, 2):
        adapter = _train_and_save(store, policy, version)
        assert adapter.path == (adapters / f"v{version}").resolve()
        assert adapter.key == ("a", version) and adapter.step == version
    assert _names(checkpoints) == ["latest", "v1", "v2"]
    assert (checkpoints / "latest").read_text() == "v2"

    adapter = _train_and_save(store, policy, 3)
    assert adapter.path == store.adapter_dir("a", 3).resolve()
    assert adapter.uri == adapter.path.as_uri()
    assert _names(adapters) == ["v1", "v2", "v3"]
    assert _names(checkpoints) == ["latest", "v2", "v3"]
    assert (checkpoints / "latest").read_text() == "v3"
    assert _names(adapters / "v3") == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    for version in (2, 3):
        assert _names(checkpoints / f"v{version}") == CHECKPOINT_FILES
        groups = json.loads((checkpoints / f"v{version}" / GROUPS_FILE).read_text())
        assert groups == [f"g{version}-0", f"g{version}-1"]
    state = json.loads((checkpoints / "v3" / TRAINER_STATE).read_text())
    assert (state["step"], state["version"]) == (3, 3)
    # The published adapter and the checkpoint hold the weights the policy has now.
    for directory in (adapters / "v3", checkpoints / "v3"):
        _assert_same_state(load_file(directory / ADAPTER_WEIGHTS), policy.adapter_state("a"), 0)
    assert store.latest("a") == Checkpoint(checkpoints / "v3", 3, ("g3-0", "g3-1"))


def test_resume_restores_the_adapter_and_optimizer_of_the_latest_checkpoint(
    base_dir: Path, tmp_path: Path
) -> None:
    store = CheckpointStore(tmp_path)
    trained = _policy(base_dir)
    for version in (1, 2):
        _train_and_save(store, trained, version)

    fresh = _policy(base_dir, seed=99)  # another init: the load must overwrite all of it
    fresh.add_job("b", LORA, RL)
    b_before = fresh.adapter_state("b")
    checkpoint = store.resume(fresh, "a")
    assert checkpoint == Checkpoint(tmp_path / "checkpoints" / "a" / "v2", 2, ("g2-0", "g2-1"))
    _assert_same_state(fresh.adapter_state("a"), trained.adapter_state("a"), atol=0)
    _assert_same_optimizer(fresh, trained, "a")

    assert store.resume(fresh, "b") is None  # no checkpoint: the fresh adapter stays
    _assert_same_state(fresh.adapter_state("b"), b_before, atol=0)


def _crash_while_writing_the_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    # The adapter files are already in the staging directory when this raises.
    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", disk_full)


def _crash_while_writing_the_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    # Everything else of v3 is written by then: groups.json must not come after the rename.
    write_text = Path.write_text

    def disk_full(path: Path, text: str, *args: Any, **kwargs: Any) -> int:
        if path.name == GROUPS_FILE:
            raise OSError("disk full")
        return write_text(path, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", disk_full)


def _crash_before_latest_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    def disk_full(target: Path, text: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(trainer_svc.checkpoints, "atomic_write_text", disk_full)


@pytest.mark.parametrize(
    ("crash", "left"),
    [
        (_crash_while_writing_the_optimizer, ["latest", "v1", "v2"]),
        (_crash_while_writing_the_groups, ["latest", "v1", "v2"]),
        # v3 is complete (groups.json included) but `latest` never named it: unused.
        (_crash_before_latest_moves, ["latest", "v1", "v2", "v3"]),
    ],
)
def test_a_crash_mid_save_leaves_latest_at_the_previous_checkpoint(
    base_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    crash: Any,
    left: list[str],
) -> None:
    store = CheckpointStore(tmp_path)
    policy = _policy(base_dir)
    for version in (1, 2):
        _train_and_save(store, policy, version)
    at_v2 = policy.adapter_state("a")

    crash(monkeypatch)
    with pytest.raises(OSError, match="disk full"):
        _train_and_save(store, policy, 3)
    monkeypatch.undo()

    checkpoints = tmp_path / "checkpoints" / "a"
    assert _names(checkpoints) == left  # nothing pruned, no staging directory left
    assert (checkpoints / "latest").read_text() == "v2"
    if "v3" in left:
        assert _names(checkpoints / "v3") == CHECKPOINT_FILES
    assert staging_leftovers(checkpoints / "v3") == []
    assert staging_leftovers(checkpoints / "latest") == []
    resumed = _policy(base_dir, seed=99)
    assert store.resume(resumed, "a") == Checkpoint(checkpoints / "v2", 2, ("g2-0", "g2-1"))
    _assert_same_state(resumed.adapter_state("a"), at_v2, atol=0)

    # The next save of that version (the resumed job retrains it) replaces whatever was left.
    store.save(policy, "a", 3, ["g3-again"])
    assert _names(checkpoints) == ["latest", "v2", "v3"]
    assert store.latest("a") == Checkpoint(checkpoints / "v3", 3, ("g3-again",))


def test_latest_naming_a_missing_or_incomplete_checkpoint_is_an_error(
    base_dir: Path, tmp_path: Path
) -> None:
    """Not "no checkpoint": restarting from scratch would go back to v0 and lose the job's
    progress, so resume refuses and says which file is wrong."""
    store = CheckpointStore(tmp_path)
    policy = _policy(base_dir)
    _train_and_save(store, policy, 1)
    checkpoints = tmp_path / "checkpoints" / "a"

    (checkpoints / "latest").write_text("v7")
    with pytest.raises(FileNotFoundError, match=r"latest names v7, but .*/v7 is missing"):
        store.latest("a")
    with pytest.raises(FileNotFoundError, match="latest names v7"):
        store.resume(_policy(base_dir), "a")

    (checkpoints / "v1" / GROUPS_FILE).unlink()
    (checkpoints / "latest").write_text("v1")
    with pytest.raises(FileNotFoundError, match=f"incomplete \\(no {GROUPS_FILE}\\)"):
        store.latest("a")

    (checkpoints / "latest").write_text("v1.tmp")
    with pytest.raises(ValueError, match="not a checkpoint name"):
        store.latest("a")


def test_a_version_mismatch_between_name_and_trainer_state_is_refused(
    base_dir: Path, tmp_path: Path
) -> None:
    store = CheckpointStore(tmp_path)
    policy = _policy(base_dir)
    _train_and_save(store, policy, 1)
    checkpoints = tmp_path / "checkpoints" / "a"
    (checkpoints / "v1").rename(checkpoints / "v4")
    (checkpoints / "latest").write_text("v4")
    with pytest.raises(ValueError, match="holds version 1, not 4"):
        store.resume(_policy(base_dir), "a")


def test_extra_checkpoint_files_cannot_replace_the_checkpoints_own(
    base_dir: Path, tmp_path: Path
) -> None:
    policy = _policy(base_dir)
    for name in (OPTIMIZER_STATE, "../groups.json", ".hidden", ""):
        with pytest.raises(ValueError, match="need a new plain file name"):
            policy.save_checkpoint(
                "a", tmp_path / "v1", step=1, version=1, extra_files={name: "[]"}
            )
    assert _names(tmp_path) == []


@pytest.mark.parametrize("job_id", ["../a", "a/b", ".", ""])
def test_job_ids_that_are_not_names_never_become_paths(tmp_path: Path, job_id: str) -> None:
    store = CheckpointStore(tmp_path)
    with pytest.raises(ValueError, match="not a valid job name"):
        store.adapter_dir(job_id, 1)
    with pytest.raises(ValueError, match="not a valid job name"):
        store.latest(job_id)


def documented_layout() -> list[tuple[re.Pattern[str], list[str]]]:
    """docs/architecture.md's artifact store: each path pattern as a regex, and the files it
    says the directory holds."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    block = text.split("### Artifact store", 1)[1].split("```\n", 2)[1]
    layout = []
    for line in block.splitlines():
        path, what = line.split(maxsplit=1)
        pattern = re.escape(path).replace(re.escape("<job>"), "[^/]+")
        pattern = pattern.replace(re.escape("<n>"), r"\d+").replace(re.escape("<epoch>"), r"\d+")
        layout.append((re.compile(pattern), re.findall(r"[\w.]+\.(?:json|pt|safetensors)", what)))
    return layout


def test_the_documented_artifact_layout_is_what_a_step_writes(
    base_dir: Path, tmp_path: Path
) -> None:
    """docs/architecture.md said `v<n>/` while a trainer wrote `v1.e1/`."""
    store = CheckpointStore(tmp_path)
    policy = _policy(base_dir)  # job "a"
    policy.train_step("a", _batch(), ADVANTAGES)
    store.save(policy, "a", 1, ["g"], epoch=1)
    written = sorted(
        f"{path.relative_to(tmp_path)}{'/' if path.is_dir() else ''}"
        for path in tmp_path.glob("*/*/*")
    )
    layout = documented_layout()
    assert len(layout) == 3 and written
    for path in written:
        matches = [files for pattern, files in layout if pattern.fullmatch(path)]
        assert matches, f"{path} is not in docs/architecture.md's layout"
        if path.endswith("/"):
            present = {p.name for p in (tmp_path / path).iterdir()}
            assert set(matches[0]) <= present, (path, matches[0], present)

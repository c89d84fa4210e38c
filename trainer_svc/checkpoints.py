"""The trainer's artifacts: published adapter versions and the checkpoints a job resumes from.

Layout under the artifact dir (MARLAAS_ARTIFACT_DIR):

    adapters/<job>/v<n>.e<e>/   the PEFT adapter of version n written by the owner of fencing
                                epoch e; rollout_svc loads it by URI and `marlaas export`
                                copies it out. Every version is kept.
    checkpoints/<job>/v<n>.e<e>/ adapter + optimizer + trainer_state.json (MultiAdapterPolicy's
                                checkpoint) + groups.json: the ids of the groups version n
                                was trained on. Only the newest `keep` (2) are kept.
    checkpoints/<job>/latest    text `v<n>.e<e>`: the newest complete checkpoint.

Each owner of a job writes under its own epoch (trainer_svc takes a new one from Redis when it
takes a job over), so two replicas that both believe they own a job never write the same
directory: a published version's bytes never change. `latest` only moves to an epoch at least
as new as the one it names, so a replica that lost the job cannot move it back. (`v<n>` with
no epoch, from before fencing or without it, still reads as epoch 0.)

A save writes the adapter, then the whole checkpoint directory (groups.json included) in one
atomic rename, then moves `latest`, then prunes. A crash at any point leaves `latest` naming a
complete checkpoint: the previous one until `latest` has moved. A directory newer than
`latest` (a crash after its rename) is not used and the next save of that version replaces it.

`latest` naming a directory that is missing or incomplete is an error, not "no checkpoint": the
job has published versions and marked groups trained, so starting it again from scratch
would go back in versions and lose its progress. `CheckpointStore.latest` raises
FileNotFoundError then, and an operator decides.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common.files.artifacts import (
    LATEST,
    VERSION_DIR,
    adapter_dir,
    atomic_write_text,
    epoch_of,
    version_dir_name,
)
from common.runtime.faults import fault_point
from common.wire.adapters import AdapterRef
from common.wire.jobspec import is_name
from trainer_svc.adapter_files import TRAINER_STATE
from trainer_svc.policy import MultiAdapterPolicy

KEEP_CHECKPOINTS = 2
GROUPS_FILE = "groups.json"
STEP_FILE = "step.json"
"""The step's metrics, for the step event a resuming trainer sends when the crashed one did
not (older checkpoints lack it: {})."""


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: its directory, its version, the groups that version trained."""

    path: Path
    version: int
    group_ids: tuple[str, ...]
    epoch: int = 0
    step_metrics: dict[str, float] = field(default_factory=dict)


class CheckpointStore:
    """Adapters and checkpoints of every job under one artifact directory."""

    def __init__(self, artifacts: Path, *, keep: int = KEEP_CHECKPOINTS) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, not {keep}")
        self.artifacts = Path(artifacts)
        self.keep = keep

    def adapter_dir(self, job_id: str, version: int, epoch: int = 0) -> Path:
        return adapter_dir(self.artifacts, _checked(job_id)) / version_dir_name(version, epoch)

    def checkpoint_dir(self, job_id: str, version: int, epoch: int = 0) -> Path:
        return self._root(job_id) / version_dir_name(version, epoch)

    def save(
        self,
        policy: MultiAdapterPolicy,
        job_id: str,
        version: int,
        group_ids: Sequence[str],
        epoch: int = 0,
        step_metrics: Mapping[str, float] | None = None,
    ) -> AdapterRef:
        """Publishable adapter + checkpoint of `version`, trained on `group_ids` by the owner
        of `epoch`; then `latest` moves to it (unless a newer epoch's checkpoint is there)
        and older checkpoints are pruned. Returns the adapter, at its `file://` URI."""
        adapter_dir = policy.save_adapter(job_id, self.adapter_dir(job_id, version, epoch))
        policy.save_checkpoint(
            job_id,
            self.checkpoint_dir(job_id, version, epoch),
            step=version,
            version=version,
            extra_files={
                GROUPS_FILE: json.dumps(list(group_ids)),
                STEP_FILE: json.dumps(dict(step_metrics or {})),
            },
        )
        fault_point("trainer.after_checkpoint")
        current = self._latest_name(job_id)
        if current is None or epoch_of(current) <= epoch:
            atomic_write_text(self._root(job_id) / LATEST, version_dir_name(version, epoch))
            self._prune(job_id, version)
        fault_point("trainer.after_latest")
        return _published(job_id, version, adapter_dir)

    def adapter_ref(self, checkpoint: Checkpoint, job_id: str) -> AdapterRef:
        """The published adapter that was saved with `checkpoint`."""
        path = self.adapter_dir(job_id, checkpoint.version, checkpoint.epoch)
        return _published(job_id, checkpoint.version, path)

    def _latest_name(self, job_id: str) -> str | None:
        try:
            return (self._root(job_id) / LATEST).read_text().strip()
        except FileNotFoundError:
            return None

    def latest(self, job_id: str) -> Checkpoint | None:
        """The checkpoint `latest` names; None when the job has none (no `latest` file).

        Raises FileNotFoundError when `latest` names a missing or incomplete directory, and
        ValueError when it holds something other than `v<n>`.
        """
        pointer = self._root(job_id) / LATEST
        name = self._latest_name(job_id)
        if name is None:
            return None
        match = VERSION_DIR.fullmatch(name)
        if match is None:
            raise ValueError(f"{pointer} holds {name!r}, not a checkpoint name v<n>")
        path = self._root(job_id) / name
        missing = [f for f in (TRAINER_STATE, GROUPS_FILE) if not (path / f).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{pointer} names {name}, but {path} is missing or incomplete (no {missing[0]});"
                " not restarting the job from scratch"
            )
        group_ids = json.loads((path / GROUPS_FILE).read_text())
        step_file = path / STEP_FILE
        step_metrics = json.loads(step_file.read_text()) if step_file.is_file() else {}
        return Checkpoint(
            path=path,
            version=int(match[1]),
            group_ids=tuple(group_ids),
            epoch=epoch_of(name),
            step_metrics=step_metrics,
        )

    def resume(self, policy: MultiAdapterPolicy, job_id: str) -> Checkpoint | None:
        """Load the latest checkpoint into the job's adapter and optimizer, which `policy`
        already has (`add_job`); None, leaving them as they are, when the job has none."""
        checkpoint = self.latest(job_id)
        if checkpoint is None:
            return None
        _, version = policy.load_checkpoint(job_id, checkpoint.path)
        if version != checkpoint.version:
            raise ValueError(f"{checkpoint.path} holds version {version}, not {checkpoint.version}")
        return checkpoint

    def _prune(self, job_id: str, saved: int) -> None:
        """Keep `saved` and the `keep - 1` newest checkpoints before it; delete older ones.

        Newer directories (left by a crash before `latest` moved) stay: the next saves
        replace them.
        """
        older = sorted({v for v, _ in self._versions(job_id) if v < saved})
        doomed = set(older[: max(len(older) - (self.keep - 1), 0)])
        for version, path in self._versions(job_id):
            if version in doomed:
                shutil.rmtree(path, ignore_errors=True)

    def _versions(self, job_id: str) -> list[tuple[int, Path]]:
        """(version, directory) of every checkpoint directory, any epoch."""
        root = self._root(job_id)
        if not root.is_dir():
            return []
        found = [(VERSION_DIR.fullmatch(p.name), p) for p in root.iterdir() if p.is_dir()]
        return [(int(m[1]), p) for m, p in found if m is not None]

    def _root(self, job_id: str) -> Path:
        return self.artifacts / "checkpoints" / _checked(job_id)


def _published(job_id: str, version: int, adapter_dir: Path) -> AdapterRef:
    # The trainer publishes version n at step n, at the directory's resolved file:// URI.
    return AdapterRef(job_id, version, adapter_dir.resolve().as_uri(), step=version)


def _checked(job_id: str) -> str:
    # Job ids become directory names: refuse anything that could leave the artifact tree.
    if not is_name(job_id):
        raise ValueError(f"job id {job_id!r} is not a valid job name")
    return job_id

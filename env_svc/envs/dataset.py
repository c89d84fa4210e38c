"""`dataset`: single-turn tasks from a JSONL file, one `{"question": ..., "answer": ...}` per
line (field names are params), checked against the reference answer.

The file is read where the environment is built: by env_svc, and by `marlaas submit`,
which checks a job's params when the environment is installed on its machine. A path is
relative to the job's tenant's folder of the data directory, `$MARLAAS_DATA_DIR/<tenant>/`,
and is confined there (env_svc/datafiles.py: no absolute path, no `..`, no link out, regular
files of bounded size only). A missing or refused file, a line that is not a JSON object
with both fields, or an empty split is a bad param, named with its line and never quoting
the file, so the job is refused before it runs.

Held-out evaluation (`eval_task_for`) draws from `eval_path` when given; otherwise a share
`eval_fraction` of the rows, chosen by a hash of each question (so the same question is
never in both splits, and the split does not move when lines are added or reordered).
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import re
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Literal

from env_svc.datafiles import DataFile, confine, read_lines
from env_svc.envs.arithmetic import last_number
from env_svc.protocol import ChatMessage, Environment, EnvParams, Reward, Task, last_assistant_text

Match = Literal["auto", "number", "exact", "contains"]
_NUMERIC = re.compile(r"\s*-?\d+(?:\.\d+)?(?:/\d+)?\s*")
_EDGE_PUNCTUATION = " \t\n.!?\"'`*"


class DatasetParams(EnvParams, frozen=True):
    path: str
    """The JSONL file of training tasks, relative to the tenant's data folder
    (`$MARLAAS_DATA_DIR/<tenant>/`)."""
    eval_path: str = ""
    """A JSONL file of held-out tasks; empty: hold out `eval_fraction` of `path`'s rows."""
    eval_fraction: float = 0.1
    """Share of `path`'s distinct questions held out for evaluation when there is no
    `eval_path`, in (0, 0.5]."""
    question_field: str = "question"
    answer_field: str = "answer"
    match: Match = "auto"
    """How a reply is checked: `number` (its last number equals the answer), `exact`
    (equal ignoring case, surrounding whitespace and punctuation), `contains` (the answer
    appears in it, ignoring case); `auto`: `number` for a numeric answer, else `exact`."""
    prompt_suffix: str = ""
    """Appended to every question, e.g. " Answer with just the number." """


class DatasetTask(Task, frozen=True):
    answer: str


class DatasetEnv(Environment[DatasetTask]):
    """Single-turn tasks from a JSONL file (question, reference answer)."""

    name = "dataset"
    params_type = DatasetParams
    task_type = DatasetTask
    params: DatasetParams

    def check_params(self) -> None:
        params = self.params
        if not params.eval_path and not 0 < params.eval_fraction <= 0.5:
            raise self.bad_param("eval_fraction", "must be in (0, 0.5] without an eval_path")
        fields = (params.question_field, params.answer_field)
        try:
            rows = _read_rows(self.data_dir, "path", params.path, *fields)
            given = (
                _read_rows(self.data_dir, "eval_path", params.eval_path, *fields)
                if params.eval_path
                else ()
            )
        except DatasetError as exc:
            raise self.bad_param(exc.param, str(exc)) from None
        self.train: list[tuple[str, str]] = []
        self.held_out: list[tuple[str, str]] = list(given)
        if params.eval_path:  # a question in both files is held out only
            questions = {question for question, _ in given}
            self.train = [row for row in rows if row[0] not in questions]
        else:
            for row in rows:
                held = _held_out(row[0], params.eval_fraction)
                (self.held_out if held else self.train).append(row)
        self._eval_orders: dict[int, list[int]] = {}
        """The held-out rows' order per evaluation seed, drawn once."""
        if params.match == "number":
            for name, given_rows in (("path", rows), ("eval_path", given)):
                for number, (_, answer) in enumerate(given_rows, start=1):
                    if not _NUMERIC.fullmatch(answer):
                        reason = f"row {number} of {name}: the answer is not a number"
                        raise self.bad_param("match", reason)
        if not self.train:
            raise self.bad_param("path", "no training rows left after the held-out split")
        if not self.held_out:
            where = "eval_path" if params.eval_path else "eval_fraction"
            raise self.bad_param(where, "no held-out rows for evaluation")

    def make_rewards(self) -> list[Reward[DatasetTask]]:
        return [Reward("correct", self._correct, 1.0)]

    def sample_task(self, rng: random.Random) -> DatasetTask:
        return self._task(rng.choice(self.train))

    def eval_task_for(self, seed: int, index: int) -> DatasetTask:
        # Without replacement: an evaluation of N <= len(held_out) tasks asks N questions.
        if (order := self._eval_orders.get(seed)) is None:
            order = self._eval_orders[seed] = list(range(len(self.held_out)))
            random.Random(f"{self.name}:eval:{seed}").shuffle(order)
        return self._task(self.held_out[order[index % len(order)]])

    def _task(self, row: tuple[str, str]) -> DatasetTask:
        question, answer = row
        return DatasetTask(question=question + self.params.prompt_suffix, answer=answer)

    def _correct(self, task: DatasetTask, completion: Sequence[ChatMessage]) -> float:
        reply = last_assistant_text(completion)
        match = self.params.match
        if match == "auto":
            match = "number" if _NUMERIC.fullmatch(task.answer) else "exact"
        if match == "number":
            return float(last_number(reply) == Fraction(task.answer.strip()))
        if match == "contains":
            return float(task.answer.strip().casefold() in reply.casefold())
        return float(_normal(reply) == _normal(task.answer))


class DatasetError(ValueError):
    def __init__(self, param: str, reason: str) -> None:
        super().__init__(reason)
        self.param = param


def _normal(text: str) -> str:
    return " ".join(text.strip(_EDGE_PUNCTUATION).casefold().split())


def _held_out(question: str, fraction: float) -> bool:
    digest = hashlib.sha256(question.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def _read_rows(
    folder: Path, param: str, path: str, question_field: str, answer_field: str
) -> tuple[tuple[str, str], ...]:
    """The rows of the file that `param` names, inside `folder` only; a problem is a
    `DatasetError` of `param`."""
    try:
        return _rows(confine(folder, path), path, question_field, answer_field)
    except ValueError as exc:  # refused, unreadable, or a line that is not a task
        raise DatasetError(param, str(exc)) from None


@functools.lru_cache(maxsize=16)
def _rows(
    file: DataFile, path: str, question_field: str, answer_field: str
) -> tuple[tuple[str, str], ...]:
    """The file's (question, answer) rows, read once per version of the file (every job of
    a dataset builds an environment; env_svc builds one per job). Messages name the job's
    own `path` and a line number, never the file's text."""
    rows: list[tuple[str, str]] = []
    for number, line in enumerate(read_lines(file, path), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON: {exc.msg}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: not a JSON object")
        fields = []
        for name in (question_field, answer_field):
            value = row.get(name)
            if isinstance(value, bool) or not isinstance(value, str | int | float):
                raise ValueError(f"{path}:{number}: field {name!r} missing or not text/number")
            fields.append(str(value))
        if not fields[0].strip():
            raise ValueError(f"{path}:{number}: empty {question_field!r}")
        rows.append((fields[0], fields[1]))
    if not rows:
        raise ValueError(f"{path}: no rows")
    return tuple(rows)

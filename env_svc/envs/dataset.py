"""`dataset`: single-turn tasks from the tenant's own data, checked against each row's reference
answer: a JSONL file (one `{"question": ..., "answer": ...}` per line), or a Hugging Face
dataset on local storage (parquet, arrow, a `save_to_disk` folder), with a column mapping (a
question column or a chat `messages` column, the answer, an optional system prompt).

Data is read where the environment is built: by env_svc, and by `marlaas submit`, which checks
a job's params when the environment is installed on its machine. A path is relative to the
job's tenant's folder of the data directory, `$MARLAAS_DATA_DIR/<tenant>/`, and is confined
there (env_svc/datafiles.py: no absolute path, no `..`, no link out, regular files of bounded
size only); the formats, and how a columnar file is read with bounded memory, are
env_svc/taskdata/sources.py's. A missing or refused file, a row that is not a task, or an
empty split is a bad param, named with its row and never quoting the data, so the job is
refused before it runs.

Held-out evaluation (`eval_task_for`) draws from `eval_path` or `eval_split` when given;
otherwise a share `eval_fraction` of the rows, chosen by a hash of each question (so the same
question is never in both splits, and the split does not move when rows are added or
reordered).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

from env_svc.protocol import ChatMessage, Environment, EnvParams, Reward, Task, last_assistant_text
from env_svc.taskdata import answers
from env_svc.taskdata.answers import NUMERIC, Match
from env_svc.taskdata.columns import Columns, Row
from env_svc.taskdata.errors import DatasetError
from env_svc.taskdata.sources import Format, read_rows

__all__ = ["DatasetEnv", "DatasetError", "DatasetParams", "DatasetTask"]


class DatasetParams(EnvParams, frozen=True):
    path: str
    """The training data, relative to the tenant's data folder (`$MARLAAS_DATA_DIR/<tenant>/`):
    a JSONL, parquet or arrow file, or a `save_to_disk` folder."""
    format: Format = "auto"
    """`jsonl`, `parquet`, `arrow` or `disk` (a `save_to_disk` folder); `auto`: by the
    suffix, or `disk` for a folder."""
    split: str = ""
    """The split of a `save_to_disk` folder of a `DatasetDict` to train on (empty: `train`)."""
    eval_path: str = ""
    """Held-out tasks in a file or folder of their own; empty: `eval_split`, else hold out
    `eval_fraction` of `path`'s rows."""
    eval_split: str = ""
    """A split of the `save_to_disk` folder (`path`, or `eval_path` when given) held out for
    evaluation, e.g. `test`."""
    eval_fraction: float = 0.1
    """Share of `path`'s distinct questions held out for evaluation when there is neither an
    `eval_path` nor an `eval_split`, in (0, 0.5]."""
    question_field: str = "question"
    """The column of the question's text (unless `messages_field` is given)."""
    messages_field: str = ""
    """A column of chat messages (`[{"role": ..., "content": ...}]`, ending with the user's
    turn, or with an assistant's whose content is the answer when the row has no answer)."""
    answer_field: str = "answer"
    system_field: str = ""
    """A column of each row's system prompt (empty or null in a row: none)."""
    system_prompt: str = ""
    """One system prompt before every task (after a row's own, if it has one)."""
    match: Match = "auto"
    """How a reply is checked: `number` (its last number equals the answer), `exact`
    (equal ignoring case, surrounding whitespace and punctuation), `contains` (the answer
    appears in it, ignoring case), `math` (its final answer, e.g. `\\boxed{}`, equals the
    answer's by `math-verify`); `auto`: `number` for a numeric answer, else `exact`."""
    prompt_suffix: str = ""
    """Appended to every question, e.g. " Answer with just the number." """


class DatasetTask(Task, frozen=True):
    answer: str
    prompt: tuple[ChatMessage, ...] = ()
    """The row's messages when it has more than its question (a system prompt, earlier
    turns); empty: the question alone."""


class DatasetEnv(Environment[DatasetTask]):
    """Single-turn tasks from the tenant's data (question or messages, reference answer)."""

    name = "dataset"
    params_type = DatasetParams
    task_type = DatasetTask
    params: DatasetParams

    def check_params(self) -> None:
        params = self.params
        held_apart = bool(params.eval_path or params.eval_split)
        if not held_apart and not 0 < params.eval_fraction <= 0.5:
            raise self.bad_param(
                "eval_fraction", "must be in (0, 0.5] without an eval_path or eval_split"
            )
        columns = Columns(
            params.question_field, params.answer_field, params.messages_field, params.system_field
        )
        try:
            rows = read_rows(
                self.data_dir, "path", params.path, params.format, params.split, columns
            )
            given: tuple[Row, ...] = ()
            if held_apart:
                param = "eval_path" if params.eval_path else "eval_split"
                where = params.eval_path or params.path
                given = read_rows(
                    self.data_dir, param, where, params.format, params.eval_split, columns
                )
        except DatasetError as exc:
            raise self.bad_param(exc.param, str(exc)) from None
        self.train: list[Row] = []
        self.held_out: list[Row] = list(given)
        if held_apart:  # a question in both is held out only
            keys = {row.key for row in given}
            self.train = [row for row in rows if row.key not in keys]
        else:
            for row in rows:
                (self.held_out if _held_out(row.key, params.eval_fraction) else self.train).append(
                    row
                )
        self._eval_orders: dict[int, list[int]] = {}
        """The held-out rows' order per evaluation seed, drawn once."""
        if params.match == "number":
            for name, given_rows in (("path", rows), ("eval", given)):
                for number, row in enumerate(given_rows, start=1):
                    if not NUMERIC.fullmatch(row.answer):
                        reason = f"row {number} of {name}: the answer is not a number"
                        raise self.bad_param("match", reason)
        if not self.train:
            raise self.bad_param("path", "no training rows left after the held-out split")
        if not self.held_out:
            where = (
                "eval_path" if params.eval_path else "eval_split" if held_apart else "eval_fraction"
            )
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

    def initial_messages(self, task: DatasetTask) -> list[ChatMessage]:
        prompt = list(task.prompt) or [{"role": "user", "content": task.question}]
        if self.params.system_prompt:
            at = next((i for i, m in enumerate(prompt) if m["role"] != "system"), 0)
            prompt.insert(at, {"role": "system", "content": self.params.system_prompt})
        return prompt

    def _task(self, row: Row) -> DatasetTask:
        question = row.question + self.params.prompt_suffix
        if len(row.prompt) == 1:
            return DatasetTask(question=question, answer=row.answer)
        last: ChatMessage = {"role": "user", "content": question}
        return DatasetTask(question=question, answer=row.answer, prompt=(*row.prompt[:-1], last))

    def _correct(self, task: DatasetTask, completion: Sequence[ChatMessage]) -> float:
        return answers.score(self.params.match, task.answer, last_assistant_text(completion))


def _held_out(key: str, fraction: float) -> bool:
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction

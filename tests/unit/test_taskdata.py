"""A tenant's Hugging Face datasets as tasks (issue 45): parquet with a chat `messages` column,
`save_to_disk` folders and their splits, arrow files, answers checked by `math-verify` where
its time limits work; and what a tenant's data may not do to env_svc (a link out of a dataset
folder, a parquet file that decompresses past memory, a reply that sends sympy away)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from env_svc.checker import check_environment
from env_svc.envs.dataset import DatasetEnv
from env_svc.protocol import EnvParamsError, encode_state, get_environment
from env_svc.taskdata import mathcheck, sources
from env_svc.taskdata.answers import score
from env_svc.taskdata.workers import Child, ChildFailedError, ChildTimeoutError

datasets.disable_progress_bars()


def env(data_dir: Path, **params: Any) -> DatasetEnv:
    built = get_environment("dataset", params, data_dir=data_dir)
    assert isinstance(built, DatasetEnv)
    return built


def sums(count: int, start: int = 0) -> list[dict[str, Any]]:
    """Rows in TRL's conversational shape: a system and a user message, the answer apart."""
    return [
        {
            "messages": [
                {"role": "system", "content": "Put the final answer in \\boxed{}."},
                {"role": "user", "content": f"What is {i} + {i + 1}?"},
            ],
            "answer": str(2 * i + 1),
        }
        for i in range(start, start + count)
    ]


def test_a_parquet_file_with_a_messages_column_is_a_dataset_job(tmp_path: Path) -> None:
    datasets.Dataset.from_list(sums(40)).to_parquet(str(tmp_path / "sums.parquet"))
    job = env(
        tmp_path,
        path="sums.parquet",
        messages_field="messages",
        match="math",
        eval_fraction=0.25,
        prompt_suffix=" Think briefly.",
    )
    assert len(job.train) + len(job.held_out) == 40 and job.held_out
    task = job.task_for(0, 0)
    state, prompt = job.reset(task)
    assert [m["role"] for m in prompt] == ["system", "user"]
    assert prompt[0]["content"] == "Put the final answer in \\boxed{}."
    assert prompt[1]["content"].endswith("? Think briefly.")
    right = f"So it is \\boxed{{{task.answer}}}."
    assert job.step(state, right).reward.total == 1.0  # type: ignore[union-attr]
    assert job.step(state, "\\boxed{-1}").reward.total == 0.0  # type: ignore[union-attr]
    # The state travels as bytes between replicas: the prompt's messages travel with it.
    assert job.decode_state(encode_state(state)).task == task


def test_a_save_to_disk_folder_trains_on_one_split_and_evaluates_on_another(
    tmp_path: Path,
) -> None:
    train = datasets.Dataset.from_list(
        [
            {"q": f"What is {i} times 2?", "a": 2 * i, "sys": "Be brief." if i % 2 else None}
            for i in range(30)
        ]
    )
    test = datasets.Dataset.from_list(
        [{"q": f"What is {i} times 2?", "a": 2 * i, "sys": None} for i in range(100, 108)]
    )
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "doubles"))
    job = env(
        tmp_path,
        path="doubles",
        eval_split="test",
        question_field="q",
        answer_field="a",
        system_field="sys",
        system_prompt="You are a calculator.",
    )
    assert len(job.train) == 30 and len(job.held_out) == 8
    assert {job.eval_task_for(0, i).answer for i in range(8)} == {
        str(2 * i) for i in range(100, 108)
    }
    odd = next(row for row in job.train if row.answer == "2")
    assert [m["role"] for m in odd.prompt] == ["system", "user"]
    prompt = job.initial_messages(job._task(odd))
    assert [m["content"] for m in prompt[:2]] == ["Be brief.", "You are a calculator."]
    # A single Dataset folder and an arrow file read too.
    train.save_to_disk(str(tmp_path / "one"))
    assert len(env(tmp_path, path="one", question_field="q", answer_field="a").train) > 20
    arrow = next((tmp_path / "one").glob("*.arrow"))
    arrow.rename(tmp_path / "doubles.arrow")
    assert env(tmp_path, path="doubles.arrow", question_field="q", answer_field="a").held_out


def test_the_answer_may_be_the_final_assistant_message(tmp_path: Path) -> None:
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"q{i}"},
                {"role": "assistant", "content": str(i)},
            ]
        }
        for i in range(20)
    ]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "chat.parquet"))
    job = env(tmp_path, path="chat.parquet", messages_field="messages", eval_fraction=0.5)
    assert all(row.answer == row.question[1:] for row in [*job.train, *job.held_out])


@pytest.mark.parametrize(
    ("build", "params", "param", "says"),
    [
        (
            "parquet",
            {"question_field": "prompt"},
            "path",
            "no column 'prompt'; it has messages, answer",
        ),
        ("parquet", {"split": "test"}, "path", "a split is chosen only in a save_to_disk folder"),
        ("disk", {"split": "validation"}, "path", "no split 'validation'; it has train, test"),
        ("disk", {"eval_split": "dev"}, "eval_split", "no split 'dev'"),
        (
            "bad-messages",
            {"messages_field": "messages"},
            "path",
            "row 1: 'messages'[0] needs a role",
        ),
        ("no-user", {"messages_field": "messages"}, "path", "must end with a user message"),
        ("garbage", {}, "path", "not a readable parquet dataset"),
    ],
)
def test_data_that_is_not_tasks_is_a_bad_param_naming_the_row(
    tmp_path: Path, build: str, params: dict[str, Any], param: str, says: str
) -> None:
    if build == "disk":
        split = datasets.Dataset.from_list([{"question": "q", "answer": "1"}] * 3)
        datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "d"))
        path = "d"
    else:
        path = "d.parquet"
        if build == "garbage":
            (tmp_path / path).write_bytes(b"PAR1 not really")
        else:
            rows = {
                "parquet": sums(4),
                "bad-messages": [{"messages": [{"who": "user", "content": "q"}], "answer": "1"}],
                "no-user": [{"messages": [{"role": "system", "content": "s"}], "answer": "1"}],
            }[build]
            datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / path))
    with pytest.raises(EnvParamsError) as raised:
        env(tmp_path, path=path, **params)
    assert raised.value.param == param and says in raised.value.reason, raised.value.reason


def test_a_dataset_folder_with_a_link_in_it_is_refused(tmp_path: Path) -> None:
    (tmp_path / "acme").mkdir()
    (tmp_path / "secret.arrow").write_bytes(b"another tenant's")
    datasets.Dataset.from_list(sums(5)).save_to_disk(str(tmp_path / "acme" / "d"))
    (tmp_path / "acme" / "d" / "extra.arrow").symlink_to(tmp_path / "secret.arrow")
    with pytest.raises(EnvParamsError, match=r"'extra\.arrow' is a link"):
        env(tmp_path / "acme", path="d", messages_field="messages")


def test_a_parquet_file_that_decompresses_past_memory_is_refused_and_env_svc_keeps_its_own(
    tmp_path: Path,
) -> None:
    """300 kB on disk, 3 GB as rows: one dictionary entry repeated. The child reading it runs
    out of its address space; this process never holds the rows."""
    count = 3_000_000
    repeated = pa.DictionaryArray.from_arrays(
        pa.array(np.zeros(count, np.int32)), pa.array(["x" * 1000])
    )
    answers = pa.DictionaryArray.from_arrays(pa.array(np.zeros(count, np.int32)), pa.array(["1"]))
    pq.write_table(pa.table({"question": repeated, "answer": answers}), tmp_path / "bomb.parquet")
    assert (tmp_path / "bomb.parquet").stat().st_size < 1_000_000
    with pytest.raises(EnvParamsError) as raised:
        env(tmp_path, path="bomb.parquet")
    assert "ran out of its memory limit" in raised.value.reason


def test_a_dataset_past_the_table_cap_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sources, "MAX_TABLE_BYTES", 10_000)  # read in the child: passed there
    datasets.Dataset.from_list(sums(400)).to_parquet(str(tmp_path / "d.parquet"))
    with pytest.raises(EnvParamsError, match="a dataset may have"):
        env(tmp_path, path="d.parquet", messages_field="messages")


@pytest.mark.parametrize(
    ("answer", "reply", "expected"),
    [
        ("42", "The answer is 42.", 1.0),
        ("0.5", "so the answer is \\boxed{\\frac{2}{4}}", 1.0),
        ("\\frac{1}{2}", "It is 1/2.", 1.0),
        ("x + 1", "$1 + x$", 1.0),
        ("42", "I think 41", 0.0),
        ("42", "", 0.0),
    ],
)
def test_math_answers_are_checked_by_math_verify(answer: str, reply: str, expected: float) -> None:
    assert score("math", answer, reply) == expected


def test_a_reply_that_sends_sympy_away_costs_one_bounded_call_in_a_worker_thread() -> None:
    """env_svc scores in worker threads, where math-verify's own alarms raise: the check runs
    in a child's main thread, and a tower of powers stops at math-verify's limit."""
    said: list[tuple[float, float]] = []

    def check() -> None:
        started = time.monotonic()
        said.append((score("math", "42", "$9^{9^{9^{9}}}$"), time.monotonic() - started))
        said.append((score("math", "42", "\\boxed{42}"), 0.0))

    thread = threading.Thread(target=check)
    thread.start()
    thread.join(60)
    (runaway, took), (right, _) = said
    assert runaway == 0.0 and took < mathcheck.DEADLINE_S + 1
    assert right == 1.0


def test_a_child_past_its_deadline_is_killed_and_the_next_call_gets_a_fresh_one() -> None:
    child = Child("test", 1 << 30)
    try:
        with pytest.raises(ChildTimeoutError):
            child.call(time.sleep, 30, deadline_s=0.5)
        assert child.call(sum, [1, 2, 3], deadline_s=30) == 6
        with pytest.raises(ChildFailedError, match="ZeroDivisionError"):
            child.call(divmod, 1, 0, deadline_s=30)
        assert child.call(abs, -2, deadline_s=30) == 2
    finally:
        child.stop()


def test_a_dataset_job_passes_the_environment_checker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    datasets.Dataset.from_list(sums(40)).to_parquet(str(tmp_path / "sums.parquet"))
    monkeypatch.setenv("MARLAAS_DATA_DIR", str(tmp_path))
    params = {"path": "sums.parquet", "messages_field": "messages", "match": "math"}
    report = check_environment("dataset", params)
    assert report.ok, [f for f in report.findings if not f.ok]

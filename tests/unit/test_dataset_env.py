"""The `dataset` environment: JSONL tasks, a held-out split, answer matching, clear errors."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from env_svc.checker import check_environment
from env_svc.envs.dataset import DatasetEnv
from env_svc.protocol import EnvParamsError, get_environment

EXAMPLE = Path(__file__).parents[2] / "examples" / "data" / "acme" / "capitals.jsonl"


def write_rows(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def env(data_dir: Path = EXAMPLE.parent, **params: Any) -> DatasetEnv:
    built = get_environment("dataset", params, data_dir=data_dir)
    assert isinstance(built, DatasetEnv)
    return built


def reward(environment: DatasetEnv, question: str, answer: str, reply: str) -> float:
    task = environment.task_type(question=question, answer=answer)  # type: ignore[call-arg]
    state, _ = environment.reset(task)
    result = environment.step(state, reply).reward
    assert result is not None
    return result.total


def test_the_held_out_split_is_disjoint_stable_and_drawn_without_repeats() -> None:
    example = env(path=EXAMPLE.name, eval_fraction=0.25)
    train = {row.question for row in example.train}
    held_out = [row.question for row in example.held_out]
    assert train.isdisjoint(held_out) and len(train) + len(held_out) == 80
    assert 8 <= len(held_out) <= 32
    asked = [example.eval_task_for(0, i).question for i in range(len(held_out))]
    assert sorted(asked) == sorted(held_out)
    assert {example.task_for(1, i).question for i in range(200)} <= train
    again = env(path=EXAMPLE.name, eval_fraction=0.25)
    assert again.held_out == example.held_out
    assert example.eval_task_for(0, 3) == again.eval_task_for(0, 3)


def test_an_eval_file_is_the_held_out_split(tmp_path: Path) -> None:
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(10)]
    train = write_rows(tmp_path / "train.jsonl", rows)
    held = write_rows(tmp_path / "test.jsonl", [*rows[:2], {"question": "q99", "answer": 99}])
    split = env(tmp_path, path=train.name, eval_path=held.name)
    assert [row.question for row in split.held_out] == ["q0", "q1", "q99"]
    assert [row.question for row in split.train] == [f"q{i}" for i in range(2, 10)]  # never both


@pytest.mark.parametrize(
    ("match", "answer", "reply", "expected"),
    [
        ("auto", "12", "7 + 5 = 12.", 1.0),
        ("auto", "12", "12 or 13", 0.0),
        ("auto", "0.5", "It is 1/2, i.e. 0.50", 1.0),
        ("auto", "Paris", "  paris. ", 1.0),
        ("auto", "Paris", "The capital is Paris.", 0.0),
        ("exact", "New  Delhi", "new delhi!", 1.0),
        ("contains", "Paris", "The capital is Paris.", 1.0),
        ("contains", "Paris", "Lyon", 0.0),
    ],
)
def test_replies_are_matched_as_the_match_param_says(
    tmp_path: Path, match: str, answer: str, reply: str, expected: float
) -> None:
    path = write_rows(tmp_path / "d.jsonl", [{"question": "q", "answer": answer}])
    held = write_rows(tmp_path / "e.jsonl", [{"question": "e", "answer": answer}])
    environment = env(tmp_path, path=path.name, eval_path=held.name, match=match)
    assert reward(environment, "q", answer, reply) == expected


def test_questions_get_the_prompt_suffix() -> None:
    example = env(path=EXAMPLE.name, prompt_suffix=" Answer with just the city.")
    assert example.task_for(0, 0).question.endswith("? Answer with just the city.")


@pytest.mark.parametrize(
    ("lines", "params", "param", "reason"),
    [
        (None, {}, "path", "no such file"),
        ('{"question": "q", "answer": 1}\n{oops\n', {}, "path", "d.jsonl:2: not JSON"),
        ("[1, 2]\n", {}, "path", "d.jsonl:1: not a JSON object"),
        ('{"question": "q"}\n', {}, "path", "d.jsonl:1: column 'answer' missing"),
        (
            '{"q": "x", "a": true}\n',
            {"question_field": "q", "answer_field": "a"},
            "path",
            "column 'a' missing or not text/number",
        ),
        ("\n\n", {}, "path", "no rows"),
        ('{"question": "q", "answer": 1}\n', {"eval_fraction": 0.9}, "eval_fraction", "(0, 0.5]"),
        (
            '{"question": "q", "answer": "x"}\n',
            {"eval_path": "SELF", "match": "number"},
            "match",
            "not a number",
        ),
        ('{"question": "q", "answer": 1}\n', {"eval_path": "SELF"}, "path", "no training rows"),
    ],
)
def test_a_bad_file_is_a_bad_param_naming_the_line(
    tmp_path: Path, lines: str | None, params: dict[str, Any], param: str, reason: str
) -> None:
    path = tmp_path / "d.jsonl"
    if lines is not None:
        path.write_text(lines)
    params = {k: path.name if v == "SELF" else v for k, v in params.items()}
    with pytest.raises(EnvParamsError) as raised:
        env(tmp_path, path=path.name, **params)
    assert raised.value.param == param and reason in raised.value.reason


def test_a_bad_eval_file_is_a_bad_eval_path(tmp_path: Path) -> None:
    train = write_rows(tmp_path / "train.jsonl", [{"question": "q", "answer": 1}])
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "broken.jsonl").write_text("{oops\n")
    for bad in ("missing.jsonl", "a-folder", "broken.jsonl"):
        with pytest.raises(EnvParamsError) as raised:
            env(tmp_path, path=train.name, eval_path=bad)
        assert raised.value.param == "eval_path" and bad in raised.value.reason


def test_a_split_with_no_held_out_question_is_refused(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "d.jsonl", [{"question": "only one", "answer": 1}])
    with pytest.raises(EnvParamsError, match=r"no (held-out|training) rows"):
        env(tmp_path, path=path.name, eval_fraction=0.01)


def test_an_edited_file_is_read_again(tmp_path: Path) -> None:
    rows = [{"question": f"q{i}", "answer": i} for i in range(40)]
    path = write_rows(tmp_path / "d.jsonl", rows)
    assert (
        len(env(tmp_path, path=path.name).train) + len(env(tmp_path, path=path.name).held_out) == 40
    )
    write_rows(path, [*rows, {"question": "q40", "answer": 40}])
    os.utime(path, ns=(1, 10**18))  # a later mtime even on a coarse clock
    assert (
        len(env(tmp_path, path=path.name).train) + len(env(tmp_path, path=path.name).held_out) == 41
    )


def test_the_example_passes_the_environment_checker() -> None:
    report = check_environment("dataset", {"path": "acme/capitals.jsonl", "match": "contains"})
    assert report.ok, [f for f in report.findings if not f.ok]

"""Job files (TOML): the examples are valid, and every mistake is named with file and field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from common.wire.messages import JobSpec
from console.env_params import check_env_params
from marlaas.jobfile import JobFileError, load_job_file

EXAMPLES = Path(__file__).parents[2] / "examples" / "jobs"
BASE = "smollm2-135m-instruct"

GOOD = """
tenant = "acme"
[env]
name = "arithmetic"
params = { max_operand = 20 }
[rl]
group_size = 4
max_steps = 3
[rl.sampling]
max_new_tokens = 8
"""


def load_as_cli(path: Path, **limits: Any) -> JobSpec:
    """The file as `marlaas submit` loads it: environment params checked where installed."""
    return load_job_file(path, check_env=check_env_params, **limits)


def write(tmp_path: Path, text: str, name: str = "job.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.stem)
def test_every_example_is_a_valid_job(path: Path) -> None:
    spec = load_as_cli(path, base_model=BASE, max_lora_rank=16)
    assert spec.env.name == path.stem  # one example per built-in environment
    assert spec.job_id.startswith(f"{spec.tenant}-{path.stem}-")
    assert spec.base_model == BASE and spec.submitted_at > 0


def test_examples_cover_every_built_in_environment() -> None:
    from env_svc.protocol import available_environments

    assert {p.stem for p in EXAMPLES.glob("*.toml")} == set(available_environments())


def test_fields_map_onto_the_job_spec_and_defaults_fill_the_rest(tmp_path: Path) -> None:
    spec = load_as_cli(write(tmp_path, GOOD), base_model=BASE)
    assert (spec.tenant, spec.env.params, spec.rl.group_size, spec.rl.max_steps) == (
        "acme",
        {"max_operand": 20},
        4,
        3,
    )
    assert spec.rl.sampling.max_new_tokens == 8 and spec.rl.sampling.temperature == 1.0
    assert spec.lora.rank == 8  # the default LoraSettings


def test_without_job_id_each_load_gets_a_fresh_id_and_with_one_it_is_kept(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD)
    assert load_as_cli(path, base_model=BASE).job_id != load_as_cli(path, base_model=BASE).job_id
    fixed = write(tmp_path, 'job_id = "my-run"\n' + GOOD, "fixed.toml")
    assert load_as_cli(fixed, base_model=BASE).job_id == "my-run"


def test_a_file_name_with_spaces_still_gives_a_usable_job_id(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD, "my first (try).toml")
    job_id = load_as_cli(path, base_model=BASE).job_id
    assert job_id.startswith("acme-my-first-try-") and job_id.count("--") == 0
    long_name = write(tmp_path, GOOD, f"{'x' * 200}.toml")
    assert len(load_as_cli(long_name, base_model=BASE).job_id) == 128


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            GOOD.replace("group_size = 4", "group_size = 1"),
            "rl.group_size: must be in [2, 256], got 1",
        ),
        (
            GOOD.replace("group_size = 4", 'group_size = "4"'),
            "rl.group_size: expected int, got str",
        ),
        (
            GOOD.replace("max_new_tokens = 8", "max_new_tokens = 8\ntopk = 3"),
            "rl.sampling.topk: unknown field",
        ),
        (
            GOOD.replace("[rl]", "[rl]\nlearning_rate = 2.0"),
            "rl.learning_rate: must be in (0, 1), got 2.0",
        ),
        (GOOD.replace('tenant = "acme"', ""), "tenant: missing (required)"),
        (GOOD.replace('tenant = "acme"', "tenant = 3"), "tenant: expected str, got int"),
        (GOOD.replace('name = "arithmetic"', "seed = 1"), "env.name: missing (required)"),
        ("colour = 'red'\n" + GOOD, "colour: unknown field"),
        (GOOD + "\n[eval]\ntasks = 5000\n", "eval.tasks: must be in [0, 1024], got 5000"),
        (GOOD + "\n[eval]\nevery = 2\n", "eval.every: unknown field"),
        (
            GOOD.replace("max_operand = 20", "max_operand = 'x'"),
            "env: environment 'arithmetic': bad param 'max_operand'",
        ),
        ('base_model = "llama-70b"\n' + GOOD, "base_model: this deployment serves"),
        (GOOD + "[lora]\nrank = 64\n", "lora.rank: 64 exceeds the rollout engine's max_lora_rank"),
        ("tenant = 'a'\nenv = 'arithmetic'\n", "env: expected a table, got str"),
        ("tenant = \n", "invalid TOML: "),
    ],
)
def test_mistakes_are_named_by_file_and_field(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(JobFileError) as caught:
        load_as_cli(path, base_model=BASE, max_lora_rank=16)
    assert str(caught.value).startswith(f"{path}: ")
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_an_environment_only_the_deployment_has_is_left_to_env_svc(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace('name = "arithmetic"', 'name = "my-plugin-env"'))
    assert load_as_cli(path, base_model=BASE).env.name == "my-plugin-env"


def test_unreadable_paths_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(JobFileError, match="no such file"):
        load_as_cli(tmp_path / "missing.toml", base_model=BASE)
    with pytest.raises(JobFileError, match="is a directory"):
        load_as_cli(tmp_path, base_model=BASE)


def test_what_only_env_svc_registers_is_left_to_it_and_checked_where_registered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verifiers taskset or an MCP server is registered with env_svc, not with the machine
    that submits: unregistered there, the param is env_svc's to judge; registered, it is
    checked at once."""
    monkeypatch.delenv("MARLAAS_VERIFIERS_TASKSETS", raising=False)
    taskset = GOOD.replace('name = "arithmetic"', 'name = "verifiers"').replace(
        "max_operand = 20", 'taskset = "gsm8k"'
    )
    assert load_as_cli(write(tmp_path, taskset), base_model=BASE).env.name == "verifiers"
    monkeypatch.setenv("MARLAAS_VERIFIERS_TASKSETS", "mini-arith")
    with pytest.raises(JobFileError, match="unknown taskset 'gsm8k'; registered: mini-arith"):
        load_as_cli(write(tmp_path, taskset), base_model=BASE)


def test_the_library_alone_leaves_environment_params_to_env_svc(tmp_path: Path) -> None:
    """A tenant's program without the environments installed submits what env_svc judges."""
    path = write(tmp_path, GOOD.replace("max_operand = 20", "max_operand = 'x'"))
    assert load_job_file(path, base_model=BASE).env.params == {"max_operand": "x"}


def test_a_data_file_not_found_names_the_data_directory_looked_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's first `marlaas submit examples/jobs/*.toml` failed on the dataset job
    without naming MARLAAS_DATA_DIR."""
    monkeypatch.delenv("MARLAAS_DATA_DIR")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(JobFileError) as unset:
        load_as_cli(EXAMPLES / "dataset.toml", base_model=BASE, max_lora_rank=16)
    said = str(unset.value)
    assert "'capitals.jsonl': no such file (you have no data folder)" in said
    assert f"looked in {tmp_path / 'acme'} (MARLAAS_DATA_DIR is not set: the working" in said
    assert "set MARLAAS_DATA_DIR to the folder holding acme/ before `marlaas up`" in said
    (tmp_path / "acme").mkdir()
    monkeypatch.setenv("MARLAAS_DATA_DIR", str(tmp_path))
    with pytest.raises(JobFileError) as empty:
        load_as_cli(EXAMPLES / "dataset.toml", base_model=BASE, max_lora_rank=16)
    assert f"(MARLAAS_DATA_DIR={tmp_path})" in str(empty.value)

"""env_svc's parts alone: the environment cache, parameter declaration, errors in words, and
the `Environment` base class split into the task contract and what drives episodes."""

from __future__ import annotations

import pytest

from common.state.tenants import QuotaError
from env_svc.calls import EnvCalls
from env_svc.chat_template import ChatTokenizer
from env_svc.envs.arithmetic import ArithmeticEnv, ArithmeticParams
from env_svc.jobs.environments import JobEnvironments
from env_svc.jobs.reasons import reason
from env_svc.protocol import Environment, EnvParamsError, TaskContract, encode_state
from env_svc.protocol.params import checked_params
from tests.handler_kit import job_spec


async def test_a_jobs_environment_is_built_once_and_forgotten_when_its_job_is_not_active(
    tokenizer: ChatTokenizer,
) -> None:
    calls = EnvCalls(timeout_s=10, workers=1)
    try:
        environments = JobEnvironments(calls, tokenizer)
        spec = job_spec("cached", group_size=2, groups_per_step=1, max_staleness=0, max_steps=1)
        env = await environments.get(spec)
        assert await environments.get(spec) is env
        assert env.template_takes_tools == tokenizer.takes_tools
        assert await environments.build(spec) is not env  # a fresh one, not cached
        environments.keep("other", env)
        environments.keep_only(["other"])
        assert list(environments.by_job) == ["other"]
        environments.forget("other")
        environments.forget("never")  # nothing to forget: no error
        assert environments.by_job == {}
    finally:
        calls.close()


def test_params_are_checked_against_their_declaration_and_named_when_wrong() -> None:
    params = checked_params("arithmetic", {"max_operand": 7}, ArithmeticParams)
    assert isinstance(params, ArithmeticParams) and params.max_operand == 7
    assert checked_params("arithmetic", None, ArithmeticParams) == ArithmeticParams()
    with pytest.raises(EnvParamsError) as wrong_type:
        checked_params("arithmetic", {"max_operand": "seven"}, ArithmeticParams)
    assert wrong_type.value.param == "max_operand"
    with pytest.raises(EnvParamsError) as unknown:
        checked_params("arithmetic", {"max_oprand": 7}, ArithmeticParams)
    assert (unknown.value.param, unknown.value.reason) == ("max_oprand", "unknown param")


def test_errors_of_our_own_say_what_is_wrong_and_others_also_name_their_type() -> None:
    assert reason(QuotaError("over 2 jobs")) == "over 2 jobs"
    assert reason(KeyError("x")) == "KeyError: 'x'"


def test_an_environment_is_its_task_contract_and_what_drives_its_episodes() -> None:
    assert issubclass(ArithmeticEnv, Environment) and issubclass(Environment, TaskContract)
    own = {n for n, v in vars(Environment).items() if callable(v) or isinstance(v, property)}
    assert {"reset", "astep", "score", "decode_state"} <= own
    assert {"sample_task", "task_for", "check_params"} <= set(vars(TaskContract))
    env = ArithmeticEnv()
    state, prompt = env.reset(env.task_for(seed=1, index=0))
    assert prompt[0]["role"] == "user" and env.decode_state(encode_state(state)) == state

"""common.wire.jobspec: every bad field is named, with what was given."""

from __future__ import annotations

import re

import msgspec
import pytest

from common.state.tenants import TenantLimits
from common.wire.codec import decode, job_named_in, json_schema
from common.wire.jobspec import (
    Deployment,
    JobSpecError,
    admit,
    bound_problems,
    fresh_job_id,
    validate_job,
)
from common.wire.messages import (
    MAX_REASON_CHARS,
    EnvSettings,
    EvalSettings,
    JobSpec,
    LoraSettings,
    MessageDecodeError,
    RLSettings,
    SamplingSettings,
    Topic,
    job_event,
)


def spec(**changes: object) -> JobSpec:
    base = JobSpec(
        job_id="j1",
        tenant="acme",
        base_model="smollm2-135m-instruct",
        env=EnvSettings(name="arithmetic"),
    )
    return msgspec.structs.replace(base, **changes)


def test_a_good_spec_passes() -> None:
    validate_job(spec(), base_model="smollm2-135m-instruct", max_lora_rank=16)


def test_admitting_stamps_the_tenant_and_fills_the_defaults_once() -> None:
    deployment = Deployment(base_model="smollm2-135m-instruct", max_lora_rank=16)
    bare = spec(job_id="", base_model="", tenant="whoever")
    job = admit(bare, deployment=deployment, tenant="acme", label="my first (try)")
    assert job.tenant == "acme" and job.spec.base_model == "smollm2-135m-instruct"
    assert re.fullmatch(r"acme-my-first-try-[0-9a-f]{12}", job.job_id)
    assert job.samples_in_flight == 8 * 4 * 2 + 32 and job.max_groups == 20 * 4
    named = admit(spec(), deployment=deployment)
    assert named.job_id == "j1" and named.spec == spec()


def test_the_cli_and_the_api_name_fresh_jobs_alike() -> None:
    assert re.fullmatch(r"acme-[0-9a-f]{12}", fresh_job_id("acme"))
    assert re.fullmatch(r"acme-run-[0-9a-f]{12}", fresh_job_id("acme", "run"))
    assert len(fresh_job_id("acme", "x" * 200)) == 128


def test_admitting_runs_every_rule_of_the_deployment_and_the_tenant() -> None:
    deployment = Deployment(base_model="other", max_lora_rank=4, max_model_len=256)
    with pytest.raises(JobSpecError) as info:
        admit(spec(), deployment=deployment, limits=TenantLimits(max_steps=5))
    assert str(info.value) == "; ".join(
        [
            "lora.rank: 8 exceeds the rollout engine's max_lora_rank 4",
            "rl.max_context_tokens: 512 exceeds the rollout engine's max_model_len 256 "
            "(ROLLOUT_MAX_MODEL_LEN): no episode could finish",
            "base_model: this deployment serves 'other', not 'smollm2-135m-instruct'",
            "quota max_steps: rl.max_steps 20 exceeds the limit 5 of tenant 'acme'",
        ]
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rl": RLSettings(group_size=1)}, "rl.group_size: must be in [2, 256], got 1"),
        ({"rl": RLSettings(max_staleness=-1)}, "rl.max_staleness: must be in [0, 64], got -1"),
        # Upper bounds, whatever the tenant's limits: a window of 10^6 versions, a huge group.
        (
            {"rl": RLSettings(max_staleness=10**6)},
            "rl.max_staleness: must be in [0, 64], got 1000000",
        ),
        ({"rl": RLSettings(group_size=10**6)}, "rl.group_size: must be in [2, 256]"),
        ({"rl": RLSettings(max_steps=10**7)}, "rl.max_steps: must be in [1, 1000000]"),
        ({"rl": RLSettings(max_turns=1000)}, "rl.max_turns: must be in [1, 64] or unset"),
        (
            {"lora": LoraSettings(target_modules=[f"m{i}" for i in range(40)])},
            "lora.target_modules: must have 1-32 items, got 40",
        ),
        (
            {"lora": LoraSettings(rank=64)},
            "lora.rank: 64 exceeds the rollout engine's max_lora_rank 16",
        ),
        ({"base_model": "llama-70b"}, "base_model: this deployment serves 'smollm2-135m-instruct'"),
        (
            {"job_id": "a/b"},
            "job_id: must be 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, got 'a/b'",
        ),
        ({"job_id": ".."}, "job_id: must be 1-128 letters"),
        ({"job_id": "a b"}, "job_id: must be 1-128 letters"),
        ({"job_id": "x@v1"}, "job_id: must be 1-128 letters"),
        ({"job_id": "j" * 129}, "job_id: must be 1-128 letters"),
        ({"tenant": " "}, "tenant: must be 1-128 letters"),
        (
            {"rl": RLSettings(sampling=SamplingSettings(temperature=0.0))},
            "rl.sampling.temperature: must be > 0",
        ),
        (
            {"rl": RLSettings(max_context_tokens=16, sampling=SamplingSettings(max_new_tokens=32))},
            "rl.max_context_tokens: must exceed rl.sampling.max_new_tokens (32), got 16",
        ),
    ],
)
def test_bad_fields_are_named(changes: dict[str, object], message: str) -> None:
    with pytest.raises(JobSpecError) as info:
        validate_job(spec(**changes), base_model="smollm2-135m-instruct", max_lora_rank=16)
    assert message in str(info.value)


def test_a_job_naming_no_base_model_takes_the_one_the_deployment_serves() -> None:
    # The API's door (a posted spec without base_model) as env_svc's: both accept it.
    validate_job(spec(base_model=""), base_model="smollm2-135m-instruct")


def test_modules_the_engine_has_no_lora_slots_for_are_rejected() -> None:
    served = ["q_proj", "k_proj", "v_proj", "o_proj"]
    validate_job(spec(), lora_target_modules=served)
    mlp = spec(lora=LoraSettings(target_modules=["q_proj", "up_proj", "down_proj"]))
    with pytest.raises(JobSpecError) as info:
        validate_job(mlp, lora_target_modules=served)
    assert "lora.target_modules: ['down_proj', 'up_proj'] not served by the rollout engine" in str(
        info.value
    )
    validate_job(mlp)  # unchecked where the deployment is not known


def test_all_problems_are_reported_at_once() -> None:
    bad = spec(rl=RLSettings(group_size=0, max_steps=0))
    with pytest.raises(JobSpecError) as info:
        validate_job(bad)
    assert "rl.group_size" in str(info.value) and "rl.max_steps" in str(info.value)


def test_a_context_longer_than_the_engine_serves_is_rejected() -> None:
    validate_job(spec(), max_model_len=1024)
    with pytest.raises(JobSpecError, match="exceeds the rollout engine's max_model_len 256"):
        validate_job(spec(), max_model_len=256)


def test_a_tenants_per_job_limits_are_named_when_exceeded() -> None:
    limits = TenantLimits(max_steps=50, max_new_tokens=64, max_lora_rank=8)
    validate_job(spec(), limits=TenantLimits())
    greedy = spec(
        rl=RLSettings(max_steps=51, sampling=SamplingSettings(max_new_tokens=65)),
        lora=LoraSettings(rank=16),
    )
    with pytest.raises(JobSpecError) as info:
        validate_job(greedy, limits=limits)
    text = str(info.value)
    assert "quota max_steps: rl.max_steps 51 exceeds the limit 50 of tenant 'acme'" in text
    assert "quota max_new_tokens: rl.sampling.max_new_tokens 65 exceeds" in text
    assert "quota max_lora_rank: lora.rank 16 exceeds the limit 8 of tenant 'acme'" in text
    wide = spec(rl=RLSettings(group_size=8, groups_per_step=4, max_staleness=3))
    with pytest.raises(
        JobSpecError, match=r"quota max_samples_in_flight: G x B x \(S \+ 1\) \+ eval\.tasks 160"
    ):
        validate_job(wide, limits=TenantLimits(max_samples_in_flight=127))


def test_bounds_are_declared_once_and_carried_by_decoding_and_the_schema() -> None:
    """A field's bounds live on the field: validate_job names every one a job breaks, decoding
    refuses the first, and the JSON Schema producers read states them."""
    bad = spec(rl=RLSettings(group_size=1, learning_rate=2.0), eval=EvalSettings(tasks=5000))
    assert bound_problems(bad) == [
        ("rl.group_size", "must be in [2, 256], got 1"),
        ("rl.learning_rate", "must be in (0, 1), got 2.0"),
        ("eval.tasks", "must be in [0, 1024], got 5000"),
    ]
    with pytest.raises(JobSpecError, match=r"rl\.group_size.*rl\.learning_rate.*eval\.tasks"):
        validate_job(bad)
    with pytest.raises(MessageDecodeError, match=r"Expected `int` >= 2 - at `\$.rl.group_size`"):
        decode(Topic.JOBS, msgspec.json.encode(bad))
    rl = json_schema(Topic.JOBS)["$defs"]["RLSettings"]["properties"]
    assert (rl["group_size"]["minimum"], rl["group_size"]["maximum"]) == (2, 256)
    assert (rl["learning_rate"]["exclusiveMinimum"], rl["learning_rate"]["exclusiveMaximum"]) == (
        0,
        1,
    )


MEGABYTE = "x" * 2**20


@pytest.mark.parametrize(
    ("changes", "named", "decoded"),
    [
        # A hostile tenant's job (issue 42): each field as large as the body limit allows.
        (
            {"env": EnvSettings(name=MEGABYTE)},
            "env.name: must have 1-128 characters, got 1048576",
            "Expected `str` of length <= 128 - at `$.env.name`",
        ),
        (
            {"base_model": MEGABYTE},
            "base_model: must have 0-4096 characters, got 1048576",
            "Expected `str` of length <= 4096 - at `$.base_model`",
        ),
        (
            {"rl": RLSettings(sampling=SamplingSettings(stop=["\n"] * 60_000))},
            "rl.sampling.stop: must have 0-16 items, got 60000",
            "Expected `array` of length <= 16 - at `$.rl.sampling.stop`",
        ),
        (
            {"rl": RLSettings(sampling=SamplingSettings(stop=["ok", "y" * 300]))},
            "rl.sampling.stop[1]: must have 1-256 characters, got 300",
            "Expected `str` of length <= 256 - at `$.rl.sampling.stop[1]`",
        ),
        (
            {"lora": LoraSettings(target_modules=["q_proj", MEGABYTE])},
            "lora.target_modules[1]: must have 1-128 characters",
            "Expected `str` of length <= 128 - at `$.lora.target_modules[1]`",
        ),
        (
            {"env": EnvSettings(name="dataset", params={f"k{i}": i for i in range(100)})},
            "env.params: must have 0-64 keys, got 100",
            "Expected `object` of length <= 64 - at `$.env.params`",
        ),
        (
            {"env": EnvSettings(name="dataset", params={MEGABYTE: 1})},
            "env.params key 'xxxxxxxxxxxxxxxxxxxx... (1048576 chars)': must have 1-128 characters",
            "Expected `str` of length <= 128 - at `key` in `$.env.params`",
        ),
    ],
)
def test_every_string_list_and_map_is_bounded_with_the_limit_named(
    changes: dict[str, object], named: str, decoded: str
) -> None:
    bad = spec(**changes)
    with pytest.raises(JobSpecError) as info:
        validate_job(bad)
    assert named in str(info.value)
    assert len(str(info.value)) < 2000  # the limit named, not the value quoted
    with pytest.raises(MessageDecodeError) as refused:
        decode(Topic.JOBS, msgspec.json.encode(bad))
    assert decoded in refused.value.reason


def test_params_are_bounded_as_a_whole_in_depth_and_size() -> None:
    deep: object = 1
    for _ in range(9):
        deep = [deep]
    path = {"path": "data/" + "d" * 70_000 + ".jsonl"}  # a dataset path of any length
    for params, message in (
        ({"a": deep}, "env.params: must nest at most 8 maps or lists deep, got 9"),
        (path, "env.params: must encode in at most 65536 bytes, got 70"),
    ):
        with pytest.raises(JobSpecError, match=message):
            validate_job(spec(env=EnvSettings(name="dataset", params=params)))
    shallow: object = 1
    for _ in range(7):
        shallow = {"k": shallow}
    validate_job(spec(env=EnvSettings(name="dataset", params={"a": shallow, "path": "d.jsonl"})))


def test_json_nested_past_the_decoders_stack_is_refused_not_raised() -> None:
    """100,000 brackets: Python's and msgspec's decoders raise RecursionError, which is no
    decode error a handler expects; the record is refused as undecodable."""
    raw = b'{"kind": "job_spec", "job_id": "j", "tenant": "t", "env": {"name": "x", "params": '
    raw += b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}}"
    with pytest.raises(MessageDecodeError, match="nested too deeply"):
        decode(Topic.JOBS, raw)


def test_a_record_naming_no_usable_job_id_leaves_nothing_to_key_a_rejection_by() -> None:
    good = msgspec.json.encode({"kind": "job_spec", "job_id": "j1", "tenant": "acme"})
    assert job_named_in(good) == ("j1", "acme")
    for job_id, tenant in ((MEGABYTE, "acme"), ("a/b", "acme"), ("j1", MEGABYTE)):
        named = job_named_in(
            msgspec.json.encode({"kind": "job_spec", "job_id": job_id, "tenant": tenant})
        )
        assert named in (None, ("j1", "")), (job_id[:10], tenant[:10], named)
    assert job_named_in(b'{"kind": "job_spec", "job_id": ' + b"[" * 100_000) is None


def test_a_reason_kept_or_sent_is_clipped() -> None:
    unknown = msgspec.json.encode(
        {"kind": "job_spec", "job_id": "j", "tenant": "t", "env": {"name": "x"}, MEGABYTE: 1}
    )
    with pytest.raises(MessageDecodeError) as info:
        decode(Topic.JOBS, unknown)
    assert len(info.value.reason) <= MAX_REASON_CHARS
    assert info.value.reason.endswith(f"({len(MEGABYTE) + len(': unknown field')} chars)")
    assert len(job_event("j", "rejected", "env_svc", reason=MEGABYTE).reason) <= MAX_REASON_CHARS

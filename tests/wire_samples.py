"""One message of every type with every field set away from its default: what the wire
compatibility tests encode, decode and compare with the committed golden bytes
(tests/golden/)."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from common.wire.codec import replaced_at
from common.wire.messages import (
    AdapterUpdate,
    DeadLetter,
    EnvSettings,
    EvalSettings,
    Event,
    GenerationRequest,
    GenerationResult,
    GroupDropped,
    JobCommand,
    JobSpec,
    LoraSettings,
    Message,
    RLSettings,
    SamplingSettings,
    Trajectory,
)

ADDED_AFTER: dict[int, dict[str, dict[str, object]]] = {
    2: {"job_spec": {"eval": EvalSettings()}, "generation_request": {"pinned_adapter_version": -1}},
    3: {"generation_request": {"tenant": ""}},
    4: {"job_spec": {"rl.score_cut_off": False}},
    5: {"job_spec": {"rl.resample_uniform_groups": 0}},
    6: {"job_spec": {"rl.sampling.seed": None}, "generation_request": {"sampling.seed": None}},
    7: {"job_spec": {"rl.lr_schedule": "constant", "rl.warmup_steps": 0}},
}
"""Fields each schema's writers did not know yet, by schema and kind (a dotted path reaches
into a settings block): read from such a writer's bytes, they hold their defaults."""


def as_read_from(schema: int, kind: str) -> Message:
    """The sample as this build reads it from a `schema` writer's bytes."""
    read = msgspec.structs.replace(SAMPLES[kind], schema=schema)
    for older, kinds in ADDED_AFTER.items():
        if schema <= older:
            for path, default in kinds.get(kind, {}).items():
                *block, field = path.split(".")
                read = replaced_at(read, block, {field: default})
    return read


SAMPLING = SamplingSettings(temperature=0.7, top_p=0.9, max_new_tokens=24, stop=["\n\n"], seed=11)

SAMPLES: dict[str, Message] = {
    "job_spec": JobSpec(
        job_id="acme-calc-1",
        tenant="acme",
        base_model="smollm2-135m-instruct",
        env=EnvSettings(name="calculator", params={"digits": 2, "tools": ["add"]}, seed=3),
        lora=LoraSettings(rank=4, alpha=8, dropout=0.05, target_modules=["q_proj", "v_proj"]),
        rl=RLSettings(
            group_size=4,
            groups_per_step=2,
            max_steps=7,
            max_staleness=2,
            learning_rate=3e-5,
            clip_low=0.1,
            clip_high=0.3,
            is_cap=3.0,
            std_normalize=True,
            max_turns=3,
            max_context_tokens=256,
            score_cut_off=True,
            resample_uniform_groups=3,
            lr_schedule="cosine",
            warmup_steps=2,
            sampling=SAMPLING,
        ),
        eval=EvalSettings(tasks=16, every_steps=3, seed=5),
        submitted_at=1_796_300_000.25,
    ),
    "job_command": JobCommand(
        command_id="c0ffee", job_id="acme-calc-1", action="pause", issued_at=1_796_300_001.5
    ),
    "generation_request": GenerationRequest(
        request_id="r1",
        job_id="acme-calc-1",
        episode_id="acme-calc-1/0/1",
        group_id="acme-calc-1/g0",
        sample_index=1,
        turn=2,
        context_token_ids=[1, 2, 3],
        sampling=SAMPLING,
        env_state=b"\x00state",
        issued_at=1_796_300_002.0,
        min_adapter_version=2,
        pinned_adapter_version=4,
        tenant="acme",
    ),
    "generation_result": GenerationResult(
        request_id="r1",
        job_id="acme-calc-1",
        episode_id="acme-calc-1/0/1",
        group_id="acme-calc-1/g0",
        sample_index=1,
        turn=2,
        context_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5],
        logprobs=[-0.5, -1.25],
        adapter_version=2,
        finish_reason="stop",
        env_state=b"\x00state",
        queue_s=0.5,
        generate_s=1.5,
    ),
    "trajectory": Trajectory(
        episode_id="acme-calc-1/0/1",
        job_id="acme-calc-1",
        group_id="acme-calc-1/g0",
        sample_index=1,
        group_size=4,
        token_ids=[1, 2, 3, 4, 5],
        loss_mask=[0, 0, 0, 1, 1],
        behaviour_logprobs=[0.0, 0.0, 0.0, -0.5, -1.25],
        reward=0.75,
        reward_components={"format": 0.25, "answer": 0.5},
        adapter_versions=[2],
        error="tool timed out",
        finished_at=1_796_300_003.0,
    ),
    "adapter_update": AdapterUpdate(
        job_id="acme-calc-1",
        version=3,
        uri="file:///artifacts/adapters/acme-calc-1/v3.e1",
        step=3,
        metrics={"loss": 0.125},
        published_at=1_796_300_004.0,
    ),
    "group_dropped": GroupDropped(
        job_id="acme-calc-1",
        group_id="acme-calc-1/g0",
        verdict="dropped_stale",
        reason="behind by 3 versions",
        dropped_at=1_796_300_005.0,
    ),
    "event": Event(
        event_id="e1",
        job_id="acme-calc-1",
        event="step",
        service="trainer_svc",
        tenant="acme",
        step=3,
        reason="because",
        metrics={"reward": 0.5},
        at=1_796_300_006.0,
        groups=["acme-calc-1/g0", "acme-calc-1/g1"],
    ),
    "dead_letter": DeadLetter(
        source_topic="marlaas.rollouts",
        source_partition=3,
        source_offset=42,
        source_key=b"acme-calc-1",
        raw_value=b"\xc1garbage",
        error="cannot decode",
        service="env_svc",
        at=1_796_300_007.0,
    ),
}
"""Keyed by each message's `kind` tag."""


README = Path(__file__).resolve().parents[1] / "README.md"


def readme_json_job() -> tuple[str, str, str]:
    """(JSON value, key, the shell line that signs it) of the README's `kcat -P` example of
    producing a job."""
    text = README.read_text()
    block = text[text.index("<!-- json-job:") :]
    match = re.search(
        r"value='(?P<value>\{.*\})'\n(?P<sign>sig=\$\(.*\))\n.*kcat -P .* -k (?P<key>\S+) "
        r"-H \"marlaas-sig=\$sig\"\n",
        block,
    )
    assert match, "the README's kcat example moved or changed shape"
    return match["value"], match["key"], match["sign"]

"""Every payload that crosses a Kafka topic, and the topic each one travels on.

This module owns the wire contract (docs/architecture.md, "Topics and messages"). Payloads
are `msgspec.Struct`s encoded as msgpack maps keyed by field name, with a `kind` tag; a
record may also be a JSON object of the same shape (jobs produced by any Kafka client).
Each carries the `schema` version of the build that wrote it and names the field consumers
de-duplicate on and the one that keys its record (`DEDUP_FIELD`, `KEY_FIELD`). This module
holds the types only: `common/wire/codec.py` turns them into bytes and back.

How messages evolve: a field is only ever added, with a default, and `SCHEMA_VERSION` goes
up by one; a field is never removed, renamed or given another meaning. A reader fills in
defaults for fields an older writer did not know and ignores fields of a newer writer, so
services of different builds read each other both ways (rolling upgrades). Unknown fields
in a job (`marlaas.jobs`) of this reader's schema or older are typos and refused. Schema 1
(positional msgpack arrays, before 2026-12) is still read, and written when
`MARLAAS_WIRE_SCHEMA=1`, while readers of that build remain.
"""

from __future__ import annotations

import time
import uuid
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

SCHEMA_VERSION = 8
"""The wire schema this build writes: 1 positional arrays; 2 maps keyed by field name; 3 adds
`JobSpec.eval` and `GenerationRequest.pinned_adapter_version`; 4 adds
`GenerationRequest.tenant`; 5 adds `RLSettings.score_cut_off`; 6 adds
`RLSettings.resample_uniform_groups` (and with it the drop kind and event
`dropped_uniform`); 7 adds `SamplingSettings.seed`; 8 adds `RLSettings.lr_schedule` and
`RLSettings.warmup_steps`. Up by one with every field added to any message."""


class Topic(StrEnum):
    JOBS = "marlaas.jobs"
    PROMPTS = "marlaas.prompts"
    ROLLOUTS = "marlaas.rollouts"
    TRAJECTORIES = "marlaas.trajectories"
    ADAPTERS = "marlaas.adapters"
    EVENTS = "marlaas.events"
    CONTROL = "marlaas.control"
    DLQ = "marlaas.dlq"


def new_id() -> str:
    """A random id, unique enough to de-duplicate on."""
    return uuid.uuid4().hex


MAX_REASON_CHARS = 1000
"""Longest reason kept or sent (a rejection, a dead letter): a reason may quote what came,
a field name of any length, and is stored for days."""


def clipped(reason: str, limit: int = MAX_REASON_CHARS) -> str:
    """`reason`, cut to `limit` characters with the cut said."""
    return reason if len(reason) <= limit else f"{reason[: limit - 20]}... ({len(reason)} chars)"


class MessageDecodeError(ValueError):
    """Bytes on a topic that are not a valid message of that topic."""

    def __init__(self, topic: str, reason: str) -> None:
        reason = clipped(reason)
        super().__init__(f"cannot decode message on {topic}: {reason}")
        self.topic = topic
        self.reason = reason


class ContextTooLongError(ValueError):
    """A generation context that leaves no room to sample within a length limit: the job's
    `max_context_tokens` (env_svc, at submission) or the engine's `max_model_len` (rollout_svc).
    """


class _Wire(msgspec.Struct, omit_defaults=True, kw_only=True, tag_field="kind"):
    """Base of every message; `kind` (the tag) tells apart messages sharing a topic. Fields
    left at their default are not written; `schema` always is (a record without one, e.g.
    a hand-written JSON job, is read as this build's)."""

    schema: int = msgspec.field(default_factory=lambda: SCHEMA_VERSION)

    DEDUP_FIELD: ClassVar[str]
    """The field consumers de-duplicate on (`dedup_id`); a class may compute it instead."""
    KEY_FIELD: ClassVar[str]
    """The field whose value is the record's Kafka key (`kafka_key`): its partition."""

    @property
    def dedup_id(self) -> str:
        return str(getattr(self, self.DEDUP_FIELD))

    @property
    def kafka_key(self) -> str | bytes | None:
        value: str | bytes | None = getattr(self, self.KEY_FIELD)
        return value


class _Part(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Nested settings blocks (job files and messages share their field names). Unknown
    fields are ignored on the wire, where they come from newer writers, and refused in job
    files (`unknown_fields`)."""


# --- job settings (nested in JobSpec) -------------------------------------------------

# Upper bounds on every number of a job, whatever its tenant's limits: beyond them a job is a
# mistake or an attack (a window of 10^6 groups, a rank no engine slot has). Each field carries
# its bounds (`Meta`): decoding refuses a value outside them, the JSON Schema states them, and
# `common.wire.jobspec.validate_job` names every one a job breaks.
MAX_GROUP_SIZE = 256
MAX_GROUPS_PER_STEP = 256
MAX_STEPS = 1_000_000
MAX_STALENESS = 64
MAX_TURNS = 64
MAX_CONTEXT_TOKENS = 131_072
MAX_LORA_RANK = 512
MAX_TARGET_MODULES = 32
MAX_EVAL_TASKS = 1024
MAX_SEED = 2**63 - 1
# ... and on every string and map, which reach Redis keys, metric labels, log lines and the
# shared engine (a stop string is matched against every token the job samples).
NAME_MAX_LEN = 128
"""A job id, tenant, environment or module name."""
MAX_PATH_LEN = 4096
"""A base model's name or directory (PATH_MAX)."""
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_PARAMS = 64
"""Keys of `env.params` (each map inside it too)."""
MAX_PARAMS_BYTES = 64 * 2**10
"""`env.params` encoded (msgpack): the whole of an environment's settings, a dataset path
included."""
MAX_PARAMS_DEPTH = 8
"""Maps and lists inside `env.params`, nested."""

Name = Annotated[str, Meta(min_length=1, max_length=NAME_MAX_LEN)]


class EnvSettings(_Part):
    name: Name
    """Registered environment name, e.g. `arithmetic`, `calculator`, `countdown`."""
    params: Annotated[
        dict[Name, Any],
        Meta(
            max_length=MAX_PARAMS,
            description=f"At most {MAX_PARAMS} keys, maps and lists nested at most "
            f"{MAX_PARAMS_DEPTH} deep, at most {MAX_PARAMS_BYTES} bytes encoded as msgpack.",
        ),
    ] = {}
    """Environment-specific parameters (operand ranges, max turns, ...); the environment
    checks them at submission, and a bad one rejects the job. At most 64 keys, nested at most
    8 deep and 64 KiB encoded (`common.wire.jobspec`)."""
    seed: int = 0
    """Seeds the task sampler (and the adapter's initial LoRA weights), so a job's task stream
    is reproducible."""


class LoraSettings(_Part):
    rank: Annotated[int, Meta(ge=1, le=MAX_LORA_RANK)] = 8
    """LoRA rank r, >= 1 and at most the deployment's `MARLAAS_MAX_LORA_RANK` (default 16);
    trainable parameters grow linearly with it."""
    alpha: Annotated[int, Meta(gt=0, le=16 * MAX_LORA_RANK)] = 16
    """LoRA scaling numerator, > 0: the adapter's update is scaled by alpha / rank."""
    dropout: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    """LoRA dropout probability in [0, 1), passed to PEFT. The trainer keeps the model in eval
    mode, so it has no effect at present."""
    target_modules: Annotated[list[Name], Meta(min_length=1, max_length=MAX_TARGET_MODULES)] = (
        msgspec.field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    )
    """Names of the base model's linear modules that get an adapter (Llama-style names); at
    least one, and ones vLLM can serve LoRA on."""


class SamplingSettings(_Part):
    temperature: Annotated[float, Meta(ge=0)] = 1.0
    """Sampling temperature, >= 0 (0: greedy, as evaluations sample; a job's own must be > 0,
    RL needs exploration); the recorded logprobs are the model's own, before temperature."""
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    """Nucleus sampling mass in (0, 1]: sample only from the most likely tokens covering it;
    1 = off."""
    max_new_tokens: Annotated[int, Meta(ge=1, le=MAX_CONTEXT_TOKENS)] = 32
    """Most tokens sampled per turn, >= 1; a turn that reaches it ends with finish reason
    `length`. Counts against `max_context_tokens`."""
    stop: Annotated[
        list[Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]],
        Meta(max_length=MAX_STOP_STRINGS),
    ] = []
    """Strings that end a turn early, besides the end-of-turn token: at most 16, of 1-256
    characters; empty = none (rollout_svc then skips detokenizing)."""
    seed: Annotated[int, Meta(ge=0, le=MAX_SEED)] | None = None
    """Seeds sampling, in [0, 2^63): each turn draws from its own stream, named by this seed,
    the group's place in its job (not the job's id), the sample and the turn
    (`rollout_svc.engine.turn_seed`), so the same spec samples the same tokens wherever the
    adapter gives the same probabilities: a rerun, the other phase of a benchmark. None:
    unseeded."""


LrSchedule = Literal["constant", "linear", "cosine"]
"""`RLSettings.lr_schedule`'s values."""


class RLSettings(_Part):
    group_size: Annotated[int, Meta(ge=2, le=MAX_GROUP_SIZE)] = 8
    """G, >= 2: samples per task; advantages are relative within a group."""
    groups_per_step: Annotated[int, Meta(ge=1, le=MAX_GROUPS_PER_STEP)] = 4
    """B, >= 1: groups per optimizer step (each step trains G * B episodes)."""
    max_steps: Annotated[int, Meta(ge=1, le=MAX_STEPS)] = 20
    """Optimizer steps (= adapter versions), >= 1, after which the job completes; also caps
    the groups ever issued at max_steps * B."""
    max_staleness: Annotated[int, Meta(ge=0, le=MAX_STALENESS)] = 1
    """S, >= 0: how many adapter versions generation may run ahead of training (0 = on-policy);
    a group sampled more than S versions behind is dropped and replaced."""
    learning_rate: Annotated[float, Meta(gt=0, lt=1)] = 1e-4
    """AdamW learning rate of the job's adapter, in (0, 1); no weight decay. The peak of
    `lr_schedule`."""
    lr_schedule: LrSchedule = "constant"
    """How the learning rate moves over the job's `max_steps` (`trainer_svc.schedule`):
    `constant`; `linear` or `cosine`: after the warm-up, step k of the n left takes
    (n - k + 1) / n of `learning_rate`, or cosine's share of it, towards 0 after the last step
    (TRL's default is linear). On the demo's 12-step jobs a linear decay learned arithmetic
    no better than the constant rate and the calculator's tool use less surely
    (bench/README.md, issue 22)."""
    warmup_steps: Annotated[int, Meta(ge=0, le=MAX_STEPS)] = 0
    """Steps over which the learning rate rises linearly to `learning_rate` (step k of W
    takes k / W of it), before `lr_schedule` applies; 0 = none."""
    clip_low: Annotated[float, Meta(ge=0, lt=1)] = 0.2
    """PPO clip below, in [0, 1): the policy ratio is clipped at 1 - clip_low."""
    clip_high: Annotated[float, Meta(ge=0)] = 0.28
    """PPO clip above, >= 0: the ratio is clipped at 1 + clip_high (DAPO's clip-higher when
    above clip_low: more room for unlikely tokens with a positive advantage to grow)."""
    is_cap: Annotated[float, Meta(ge=1)] = 2.0
    """Truncated importance-sampling cap, >= 1, on the weight correcting the sampler/trainer
    mismatch (staleness, kernel differences)."""
    std_normalize: bool = False
    """Divide advantages by the group's reward std (GRPO); off = Dr. GRPO."""
    max_turns: Annotated[int, Meta(ge=1, le=MAX_TURNS)] | None = None
    """Cap on model turns per episode, >= 1; None leaves the environment's own limit."""
    max_context_tokens: Annotated[int, Meta(ge=2, le=MAX_CONTEXT_TOKENS)] = 512
    """Longest episode context in tokens, > max_new_tokens: a prompt that leaves no room for a
    turn rejects the job, and an episode whose next turn would not fit is scored as it stands."""
    score_cut_off: bool = False
    """Grade a final answer that `sampling.max_new_tokens` cut off as it stands (true), or
    count it as no answer (false, the default): reward 0 in training and unsolved in
    evaluation, with the reward component `cut_off` = 1. A cut-off reply's last number is
    wherever the limit fell, so grading it rewards text that only happens to stop well."""
    resample_uniform_groups: Annotated[int, Meta(ge=0, le=MAX_GROUPS_PER_STEP)] = 0
    """Dynamic sampling (DAPO): up to this many groups per step whose rewards are all equal
    (no advantage, so no gradient: all solved or all failed) are dropped and replaced by
    fresh ones, so that a step trains on groups that carry a signal; 0..256, 0 = off (such
    groups are trained on, adding nothing; a step of nothing else leaves the adapter as it
    was). Each replacement is one more group generated; the cap bounds that cost when a job
    solves, or fails, everything."""
    sampling: SamplingSettings = msgspec.field(default_factory=SamplingSettings)
    """How rollout_svc samples every turn of the job's episodes."""


class EvalSettings(_Part):
    tasks: Annotated[int, Meta(ge=0, le=MAX_EVAL_TASKS)] = 32
    """Held-out tasks per evaluation, 0..1024 (0 = no evaluation): one greedy episode each,
    from the environment's evaluation stream (`Environment.eval_task_for`), never trained."""
    every_steps: Annotated[int, Meta(ge=0, le=MAX_STEPS)] = 0
    """Also evaluate every this many adapter versions, >= 0; 0 = only the base model
    (version 0) and the final adapter."""
    seed: int = 0
    """Seeds the evaluation task stream; the same seed evaluates every version on the same
    tasks."""


# --- marlaas.jobs ---------------------------------------------------------------------


class JobSpec(_Wire, tag="job_spec", kw_only=True):
    """CLI (or any Kafka client) -> env_svc: a tenant asks for an RL job. De-duplicated on
    `job_id`."""

    job_id: Name
    tenant: Name
    base_model: Annotated[str, Meta(max_length=MAX_PATH_LEN)] = ""
    """The deployment's base model (its name or directory); empty: whatever it serves
    (env_svc registers the job with that filled in)."""
    env: EnvSettings
    lora: LoraSettings = msgspec.field(default_factory=LoraSettings)
    rl: RLSettings = msgspec.field(default_factory=RLSettings)
    eval: EvalSettings = msgspec.field(default_factory=EvalSettings)
    submitted_at: float = 0.0

    DEDUP_FIELD = "job_id"
    KEY_FIELD = "job_id"


JobAction = Literal["pause", "resume", "cancel"]


class JobCommand(_Wire, tag="job_command"):
    """CLI -> env_svc: change a running job's state. De-duplicated on `command_id`."""

    command_id: Name
    job_id: Name
    action: JobAction
    issued_at: float = 0.0

    DEDUP_FIELD = "command_id"
    KEY_FIELD = "job_id"


# --- marlaas.prompts / marlaas.rollouts -----------------------------------------------


class _Turn(_Wire):
    """What names one turn of one episode: a generation request's ids and context, which its
    result echoes. De-duplicated on `request_id`, keyed by episode."""

    request_id: str
    job_id: str
    episode_id: str
    group_id: str
    sample_index: int
    turn: int
    context_token_ids: list[int]
    """The whole context so far (prompt + earlier turns + tool results), never re-tokenized."""

    DEDUP_FIELD = "request_id"
    KEY_FIELD = "episode_id"


class GenerationRequest(_Turn, tag="generation_request"):
    """env_svc -> rollout_svc: sample one turn of one episode."""

    sampling: SamplingSettings
    env_state: bytes = b""
    """The episode's state, opaque to rollout_svc, echoed back in the result."""
    issued_at: float = 0.0
    min_adapter_version: int = 0
    """The job's trained version when the group was issued; sampling waits for it."""
    pinned_adapter_version: int = -1
    """Sample with exactly this adapter version (0: the base model), as evaluations do; -1:
    the job's latest, at least `min_adapter_version`."""
    tenant: str = ""
    """The job's tenant, carried from the spec env_svc holds, so rollout_svc's fair
    admission need not read the job record back; "" from writers before schema 4 (rollout_svc
    then looks it up)."""


FinishReason = Literal["stop", "length", "abort"]


class GenerationResult(_Turn, tag="generation_result"):
    """rollout_svc -> env_svc: one sampled turn."""

    completion_token_ids: list[int]
    logprobs: list[float]
    """Sampler logprob of each completion token (same length as completion_token_ids)."""
    adapter_version: int
    """Adapter version that produced this turn; 0 is the bare base model."""
    finish_reason: FinishReason
    env_state: bytes = b""
    queue_s: float = 0.0
    generate_s: float = 0.0


_ECHOED = (*(name for name in _Turn.__struct_fields__ if name != "schema"), "env_state")
"""What a result echoes of its request: the turn's ids and context (not `schema`), and the
episode's state."""


def result_for(
    request: GenerationRequest,
    *,
    completion_token_ids: list[int],
    logprobs: list[float],
    adapter_version: int,
    finish_reason: FinishReason,
    queue_s: float = 0.0,
    generate_s: float = 0.0,
) -> GenerationResult:
    """The answer to `request`: its ids and context echoed, with what was sampled."""
    echoed = {name: getattr(request, name) for name in _ECHOED}
    return GenerationResult(
        **echoed,
        completion_token_ids=completion_token_ids,
        logprobs=logprobs,
        adapter_version=adapter_version,
        finish_reason=finish_reason,
        queue_s=queue_s,
        generate_s=generate_s,
    )


# --- marlaas.trajectories -------------------------------------------------------------


class Trajectory(_Wire, tag="trajectory"):
    """env_svc -> trainer_svc: one finished episode. De-duplicated on `episode_id`."""

    episode_id: str
    job_id: str
    group_id: str
    sample_index: int
    group_size: int
    token_ids: list[int]
    loss_mask: list[int]
    """1 where the policy sampled the token; 0 for prompt, tool and observation tokens."""
    behaviour_logprobs: list[float]
    """Sampler logprob aligned with token_ids (0.0 where loss_mask is 0)."""
    reward: float
    reward_components: dict[str, float] = {}
    adapter_versions: list[int] = []
    """Adapter version of each sampled turn, in turn order."""
    error: str = ""
    """Why the reward could not be computed: recorded, never silently scored 0."""
    finished_at: float = 0.0

    DEDUP_FIELD = "episode_id"
    KEY_FIELD = "job_id"


# --- marlaas.adapters -----------------------------------------------------------------


class AdapterUpdate(_Wire, tag="adapter_update"):
    """trainer_svc -> rollout_svc, env_svc: a new adapter version is durable.

    De-duplicated on job@version.
    """

    job_id: str
    version: int
    uri: str
    """Where the PEFT adapter directory lies in the artifact store."""
    step: int
    metrics: dict[str, float] = {}
    published_at: float = 0.0

    KEY_FIELD = "job_id"

    @property
    def dedup_id(self) -> str:  # a version is published once per job
        return f"{self.job_id}@v{self.version}"


# --- marlaas.control -----------------------------------------------------------------

DropKind = Literal["dropped_stale", "dropped_invalid", "dropped_uniform"]


class GroupDropped(_Wire, tag="group_dropped"):
    """trainer_svc -> env_svc: a group will never be trained; issue a replacement.

    The flow-control window counts it out (`flow:{job}.dropped_groups`) before this is sent.
    De-duplicated on `group_id`: a group is dropped at most once.
    """

    job_id: str
    group_id: str
    verdict: DropKind
    """Why: too stale to train, too few rewarded trajectories to compare, or rewards all
    equal in a job that resamples such groups (`RLSettings.resample_uniform_groups`)."""
    reason: str = ""
    dropped_at: float = 0.0

    DEDUP_FIELD = "group_id"
    KEY_FIELD = "job_id"


# --- marlaas.events -------------------------------------------------------------------

EventKind = Literal[
    "accepted",
    "rejected",
    "step",
    "dropped_stale",
    "dropped_invalid",
    "dropped_uniform",
    "paused",
    "resumed",
    "cancelled",
    "completed",
    "failed",
    "eval",
]


class Event(_Wire, tag="event"):
    """every service -> CLI, dashboards: a job's lifecycle and metrics. De-dup on `event_id`."""

    event_id: str
    job_id: str
    event: EventKind
    service: str
    tenant: str = ""
    step: int = 0
    reason: str = ""
    metrics: dict[str, float] = {}
    at: float = 0.0
    groups: list[str] = []
    """`step`: the ids of the groups that version trained (the audit ledger has them too)."""

    DEDUP_FIELD = "event_id"
    KEY_FIELD = "job_id"


# --- marlaas.dlq ----------------------------------------------------------------------


class DeadLetter(_Wire, tag="dead_letter"):
    """every service -> operators: a record that could not be decoded or processed."""

    source_topic: str
    source_partition: int
    source_offset: int
    source_key: bytes | None
    raw_value: bytes
    error: str
    service: str
    at: float = 0.0

    KEY_FIELD = "source_key"

    @property
    def dedup_id(self) -> str:  # one letter per source record
        return f"{self.source_topic}/{self.source_partition}/{self.source_offset}"


Message = (
    JobSpec
    | JobCommand
    | GenerationRequest
    | GenerationResult
    | Trajectory
    | AdapterUpdate
    | Event
    | GroupDropped
    | DeadLetter
)

TOPIC_MESSAGES: dict[Topic, Any] = {
    Topic.JOBS: JobSpec | JobCommand,
    Topic.PROMPTS: GenerationRequest,
    Topic.ROLLOUTS: GenerationResult,
    Topic.TRAJECTORIES: Trajectory,
    Topic.ADAPTERS: AdapterUpdate,
    Topic.EVENTS: Event,
    Topic.CONTROL: GroupDropped,
    Topic.DLQ: DeadLetter,
}
"""Which message types a topic may carry; producing anything else is a bug."""


def job_event(
    job_id: str,
    event: EventKind,
    service: str,
    *,
    tenant: str = "",
    step: int = 0,
    reason: str = "",
    metrics: dict[str, float] | None = None,
    groups: list[str] | None = None,
) -> Event:
    """An `Event` stamped with a fresh id and the current time."""
    return Event(
        event_id=new_id(),
        job_id=job_id,
        event=event,
        service=service,
        tenant=tenant,
        step=step,
        reason=clipped(reason),
        metrics=metrics or {},
        at=time.time(),
        groups=groups or [],
    )

"""The settings blocks nested in a `JobSpec` (env, lora, rl with its sampling, eval), and the
upper bounds on every number and string of a job.

Part of the wire contract of common/wire/messages.py, which re-exports every name here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from common.wire.envelope import _Part

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
    (`rollout_svc.sampling.turn_seed`), so the same spec samples the same tokens wherever the
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
    (bench/HISTORY.md)."""
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

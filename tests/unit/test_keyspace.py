"""Keys the store's Lua names without declaring them agree with common/keyspace.py."""

from __future__ import annotations

from common import flow, registry
from common.keyspace import ADAPTER_PREFIX, JOB_PREFIX, adapter_key, job_key


def test_undeclared_keys_in_lua_use_the_keyspace_prefixes() -> None:
    assert f"'{ADAPTER_PREFIX}' .. ARGV[5]" in flow._TRY_ISSUE_GROUP
    assert f"'{JOB_PREFIX}' .. member" in registry._QUOTA_RULE
    assert adapter_key("j") == f"{ADAPTER_PREFIX}j"
    assert job_key("j") == f"{JOB_PREFIX}j"

"""Keys the store's Lua names without declaring them agree with common/state/keyspace.py."""

from __future__ import annotations

from common.state import flow, registry
from common.state.keyspace import adapter_key, dedup_key, job_key, tenant_load_key


def test_undeclared_keys_in_lua_use_the_keyspace_prefixes() -> None:
    assert f"'{adapter_key.prefix}' .. ARGV[5]" in flow._TRY_ISSUE_GROUP
    assert f"'{job_key.prefix}' .. member" in registry._BACKFILL_ACTIVE
    assert f"'{tenant_load_key.prefix}' .. job[1]" in registry._SET_STATUS
    assert f"'{tenant_load_key.prefix}' .. job[2]" in registry._BACKFILL_ACTIVE
    assert adapter_key("j") == "adapter:j"
    assert dedup_key("trained", "j") == "dedup:trained:j"

"""The operator's registrations of the example MCP server (examples/mcp/units_server.py), the
agentic example environments (examples/envs/) and the tests' verifiers taskset
(tests/tasksets/mini_arith), for the services tests start: the pipeline test's
(tests/conftest.py) and tests/integration/test_agentic_jobs.py's."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from env_svc.envs.verifiers_taskset import TASKSETS_VAR
from env_svc.mcp.hub import SERVERS_VAR
from env_svc.protocol import ENVIRONMENTS_VAR

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
UNITS_SERVER = EXAMPLES / "mcp" / "units_server.py"
EXAMPLE_ENVIRONMENTS = {"unit_conversion": "unit_conversion:UnitConversionEnv"}


def operator_registrations() -> dict[str, str]:
    """The services' variables that register the example MCP server (`units`), the example
    environments and the verifiers taskset `mini-arith` (their folders on the services' Python
    path, and the repository for tests/agent_engine.py)."""
    path = [str(EXAMPLES / "envs"), str(ROOT / "tests" / "tasksets"), str(ROOT)]
    path.append(os.environ.get("PYTHONPATH", ""))
    return {
        "PYTHONPATH": os.pathsep.join(filter(None, path)),
        ENVIRONMENTS_VAR: ",".join(f"{n}={where}" for n, where in EXAMPLE_ENVIRONMENTS.items()),
        TASKSETS_VAR: "mini-arith",
        SERVERS_VAR: json.dumps(
            {"units": {"command": sys.executable, "args": [str(UNITS_SERVER)]}}
        ),
    }

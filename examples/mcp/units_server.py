"""An example MCP server (stdio): unit conversion, a tool a small model cannot do in its head.

Register it with env_svc (the operator's setting; a tenant only names it):

    MARLAAS_MCP_SERVERS='{"units": {"command": "python", "args": ["examples/mcp/units_server.py"]}}'

and a job's tool environment lists `mcp_servers = ["units"]` in its params; its tools appear
to the model as `units.convert`. Stateless: any replica's session answers any call.
"""

from __future__ import annotations

from typing import Literal

from mcp.server.mcpserver import MCPServer

Unit = Literal["m", "km", "cm", "mm", "mi", "ft", "in"]
METRES: dict[str, float] = {
    "m": 1.0,
    "km": 1000.0,
    "cm": 0.01,
    "mm": 0.001,
    "mi": 1609.344,
    "ft": 0.3048,
    "in": 0.0254,
}

server = MCPServer("units")


@server.tool()
def convert(value: float, from_unit: Unit, to_unit: Unit) -> str:
    """Convert a length from one unit to another."""
    return f"{value * METRES[from_unit] / METRES[to_unit]:.6g}"


if __name__ == "__main__":
    server.run()

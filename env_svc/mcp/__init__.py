"""MCP servers the operator registered, as tools of tool environments."""

from env_svc.mcp.hub import (
    McpError,
    McpHub,
    McpServer,
    close_mcp_hub,
    mcp_hub,
    registered_servers,
)

__all__ = ["McpError", "McpHub", "McpServer", "close_mcp_hub", "mcp_hub", "registered_servers"]

"""Tools the model can call: the registry, the @tool marker and the built-in tools."""

from fsm_kernel.tools.builtin import DONE_TOOL, builtin_registry
from fsm_kernel.tools.registry import (
    RegisteredTool,
    ToolRegistry,
    collect_tools,
    import_tools,
    is_tool,
    tool,
)

__all__ = [
    "DONE_TOOL",
    "RegisteredTool",
    "ToolRegistry",
    "builtin_registry",
    "collect_tools",
    "import_tools",
    "is_tool",
    "tool",
]

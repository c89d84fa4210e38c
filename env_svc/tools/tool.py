"""A tool: a documented Python function whose JSON schema comes from its signature.

    def calculator(expression: Annotated[str, Meta(description="e.g. 47 * 86")]) -> str:
        \"\"\"Evaluate an arithmetic expression.\"\"\"

    Tool.of(calculator)   # name, description, OpenAI function schema, argument validation

As verifiers makes plain functions tools: the first paragraph of the docstring is the
description, the parameters' annotations (msgspec types, `Annotated[..., Meta(...)]` for
descriptions and bounds) and defaults are the schema, and the same annotations validate a
call's arguments (`msgspec.convert`), so what the model is shown and what is checked cannot
drift apart. The function may be `async def` (awaited on env_svc's loop) or plain (run in a
worker thread); it returns the tool message's text (anything else is shown as JSON).
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, get_type_hints

import msgspec

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
"""What a tool may be called (OpenAI's function names, with dots for MCP servers' tools)."""
DEFAULT_TIMEOUT_S = 10.0


class ToolDefinitionError(ValueError):
    """A function that cannot be a tool (no name, an untyped parameter, a bad schema)."""


class ToolArgumentsError(ValueError):
    """A call's arguments that do not fit the tool's parameters; the model reads this text."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: Mapping[str, Any]
    """JSON schema of the arguments object (OpenAI's `function.parameters`)."""
    fn: Callable[..., Any]
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Time limit of one call; past it the call is abandoned and the model told so."""
    arguments_type: type[msgspec.Struct] | None = field(default=None, repr=False)
    """Validates and converts a call's arguments; None: checked against `parameters` only
    for being an object (tools whose schema comes from elsewhere, e.g. an MCP server)."""

    @classmethod
    def of(
        cls,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        parameters: Mapping[str, Any] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> Tool:
        """The tool `fn` is. `parameters` replaces the schema shown to the model (validation
        still follows the signature), e.g. to keep a prompt byte for byte."""
        name = name or str(getattr(fn, "__name__", ""))
        if not NAME.match(name):
            raise ToolDefinitionError(f"{name!r} is not a tool name (letters, digits, _ . -)")
        if not timeout_s > 0:
            raise ToolDefinitionError(f"tool {name!r}: timeout_s must be positive")
        arguments_type = _arguments_type(fn, name)
        if parameters is None:
            parameters = _schema_of(arguments_type)
        if description is None:
            description = inspect.cleandoc(fn.__doc__ or "").split("\n\n")[0].replace("\n", " ")
        return cls(name, description, dict(parameters), fn, timeout_s, arguments_type)

    @property
    def awaits(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    def schema(self) -> dict[str, Any]:
        """OpenAI's function-calling form: what a chat template's `tools=` takes."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }

    def arguments(self, raw: object) -> dict[str, Any]:
        """`raw` checked against the parameters, converted to what `fn` takes (keyword
        arguments); raises `ToolArgumentsError` saying what is wrong."""
        if not isinstance(raw, dict):
            raise ToolArgumentsError("bad arguments: not a JSON object")
        if self.arguments_type is None:
            if problem := _schema_problem(self.parameters, raw):
                raise ToolArgumentsError(f"bad arguments: {problem}")
            return raw
        try:
            converted = msgspec.convert(raw, self.arguments_type, strict=False)
        except msgspec.ValidationError as exc:
            raise ToolArgumentsError(f"bad arguments: {exc}") from None
        return {name: getattr(converted, name) for name in converted.__struct_fields__}


def reply_text(value: object) -> str:
    """What a tool's return value reads as in its tool message."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except ValueError:
        return str(value)


def _schema_problem(schema: Mapping[str, Any], value: dict[str, Any]) -> str:
    """What is wrong with `value` under a JSON schema given as is (an MCP server's), or ""."""
    import jsonschema  # the `mcp` SDK's dependency; only schema-only tools need it

    try:
        error = jsonschema.exceptions.best_match(
            jsonschema.Draft202012Validator(dict(schema)).iter_errors(value)
        )
    except jsonschema.exceptions.SchemaError as exc:
        return f"the tool's schema is invalid: {exc.message}"
    if error is None:
        return ""
    where = "".join(f"[{part!r}]" for part in error.absolute_path)
    return f"{error.message}" + (f" at {where}" if where else "")


def _arguments_type(fn: Callable[..., Any], name: str) -> type[msgspec.Struct]:
    """A struct of `fn`'s parameters (annotations and defaults), unknown fields refused."""
    try:
        hints = get_type_hints(fn, include_extras=True)
    except Exception as exc:
        raise ToolDefinitionError(f"tool {name!r}: unreadable annotations: {exc}") from exc
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for parameter in inspect.signature(fn).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise ToolDefinitionError(f"tool {name!r}: *args and **kwargs cannot be shown")
        if parameter.name not in hints:
            raise ToolDefinitionError(f"tool {name!r}: parameter {parameter.name!r} has no type")
        if parameter.default is parameter.empty:
            fields.append((parameter.name, hints[parameter.name]))
        else:
            fields.append((parameter.name, hints[parameter.name], parameter.default))
    try:
        return msgspec.defstruct(name, fields, forbid_unknown_fields=True)
    except TypeError as exc:
        raise ToolDefinitionError(f"tool {name!r}: {exc}") from exc


def _schema_of(arguments_type: type[msgspec.Struct]) -> dict[str, Any]:
    """The struct's JSON schema, inlined (msgspec puts it under `$defs`) and untitled."""
    try:
        schema = msgspec.json.schema(arguments_type)
    except TypeError as exc:
        raise ToolDefinitionError(f"{exc}") from exc
    definitions = schema.pop("$defs", {})
    top = definitions.pop(arguments_type.__name__, schema)
    top.pop("title", None)
    if definitions:
        top["$defs"] = definitions
    return dict(top)

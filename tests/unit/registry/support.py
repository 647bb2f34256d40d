"""What the agents-file and registry tests share: the Python targets their YAML names, and
helpers that write a file and load it."""

from __future__ import annotations

import functools
import textwrap
from pathlib import Path
from typing import Any

import pytest

from app.errors import ConfigError
from app.tools.agents_file import load_registry
from app.tools.base import ToolContext

CTX = ToolContext(session_id="sess-1", run_id="run-1", tool_call_id="toolu_1")
HERE = "tests.unit.registry.support"
PING = f'python: "{HERE}:Namespace.ping"'


# --- python targets referenced by the YAML below ------------------------------------------------


async def documented_tool(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    """Say hello.

    More detail that is not part of the description.
    """
    return {"hello": arguments.get("name")}


async def undocumented_tool(arguments: dict[str, Any], ctx: ToolContext) -> None:
    return None


def sync_tool(arguments: dict[str, Any], ctx: ToolContext) -> None:
    """Not async."""


async def one_arg_tool(arguments: dict[str, Any]) -> None:
    """Takes no ctx."""


class AsyncCallable:
    """A callable object tool."""

    async def __call__(self, arguments: dict[str, Any], ctx: ToolContext) -> str:
        return "called"


class Namespace:
    @staticmethod
    async def ping(arguments: dict[str, Any], ctx: ToolContext) -> str:
        """Ping."""
        return "pong"


callable_object = AsyncCallable()
partial_tool = functools.partial(documented_tool)
NOT_CALLABLE = 42


# --- helpers -----------------------------------------------------------------------------------


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "agents.yaml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def config_error(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_registry(write(tmp_path, text))
    return str(info.value)


def tool_yaml(body: str, *, name: str = "x") -> str:
    """A file with one tool `name` (entry indented from `body`) and an agent using it."""
    entry = textwrap.indent(textwrap.dedent(body).strip(), " " * 4)
    return f"tools:\n  {name}:\n{entry}\nagents:\n  a:\n    model: m\n    tools: [{name}]\n"


def agent_yaml(body: str, *, name: str = "a") -> str:
    entry = textwrap.indent(textwrap.dedent(body).strip(), " " * 4)
    return f"tools: {{}}\nagents:\n  {name}:\n{entry}\n"

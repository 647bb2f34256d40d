"""ToolRegistry.execute: results, validation, errors, timeouts, cancellation."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest

from app.domain import ToolCall, ToolResult
from app.tools import registry as registry_module
from app.tools.agents_file import load_registry
from app.tools.base import AgentConfig, Tool, ToolContext, ToolFailed
from app.tools.registry import ToolRegistry
from tests.unit.registry.support import (
    CTX,
    HERE,
    config_error,
    tool_yaml,
    write,
)

# --- execute -----------------------------------------------------------------------------------


class Recorder:
    """A handler that records its calls and then behaves as told."""

    def __init__(self, outcome: Any = None, *, raises: BaseException | None = None) -> None:
        self.calls: list[tuple[dict[str, Any], ToolContext]] = []
        self.outcome = outcome
        self.raises = raises

    async def __call__(self, arguments: dict[str, Any], ctx: ToolContext) -> Any:
        self.calls.append((arguments, ctx))
        if self.raises is not None:
            raise self.raises
        return self.outcome


SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["n"],
    "additionalProperties": False,
}


# How a handler's exception ends its error: it says nothing of what the call did before it.
MAY_HAVE_TAKEN_EFFECT = "; it may or may not have taken effect"


def make_registry(handler: Recorder, *, schema: dict[str, Any] | None = None) -> ToolRegistry:
    tool = Tool(name="t", description="d", input_schema=schema or SCHEMA, handler=handler)
    return ToolRegistry({"t": tool}, agents={"a": AgentConfig(name="a", model="m", tools=("t",))})


def error_of(result: ToolResult) -> str:
    assert result.is_error
    body = json.loads(result.content)
    assert set(body) == {"error"}
    return str(body["error"])


async def test_ok_result_and_context_passed() -> None:
    handler = Recorder({"ok": True, "n": 1})
    registry = make_registry(handler)
    call = ToolCall("toolu_1", "t", {"n": 1})
    result = await registry.execute(call, ctx=CTX, allowed={"t"})
    assert result == ToolResult("toolu_1", "t", '{"ok":true,"n":1}', False)
    assert handler.calls == [({"n": 1}, CTX)]


async def test_a_result_keeps_its_text_and_loses_only_what_no_store_holds() -> None:
    # Escaped (\u00e9, \ud83c\udf0d) the model read six characters and more tokens for each;
    # a lone surrogate, which UTF-8 cannot carry, becomes U+FFFD as in what the model says.
    handler = Recorder({"title": "héllo 🌍 日本", "odd": "x\ud800", "nul": "a\x00b"})
    registry = make_registry(handler)
    result = await registry.execute(ToolCall("toolu_1", "t", {"n": 1}), ctx=CTX, allowed={"t"})
    assert not result.is_error
    assert result.content == '{"title":"héllo 🌍 日本","odd":"x\ufffd","nul":"a\\u0000b"}'
    assert json.loads(result.content)["nul"] == "a\x00b"  # NUL stays escaped JSON


async def test_unknown_tool() -> None:
    handler = Recorder()
    registry = make_registry(handler)
    result = await registry.execute(ToolCall("c", "nope", {}), ctx=CTX, allowed={"t", "nope"})
    assert error_of(result) == "unknown tool 'nope'"
    assert (result.tool_call_id, result.tool_name) == ("c", "nope")


async def test_tool_not_allowed_is_unknown() -> None:
    handler = Recorder()
    registry = make_registry(handler)
    result = await registry.execute(ToolCall("c", "t", {"n": 1}), ctx=CTX, allowed=())
    assert error_of(result) == "unknown tool 't'"
    assert handler.calls == []


@pytest.mark.parametrize(
    ("arguments", "problems"),
    [
        ({}, ["'n' is a required property"]),
        ({"n": "1"}, ["'1' is not of type 'integer'", "(at $.n)"]),
        ({"n": -1}, ["-1 is less than the minimum of 0", "(at $.n)"]),
        ({"n": 1, "tags": ["a", 2]}, ["2 is not of type 'string'", "(at $.tags[1])"]),
        ({"n": 1, "extra": True}, ["Additional properties are not allowed ('extra'"]),
    ],
)
async def test_invalid_arguments(arguments: dict[str, Any], problems: list[str]) -> None:
    handler = Recorder()
    registry = make_registry(handler)
    result = await registry.execute(ToolCall("c", "t", arguments), ctx=CTX, allowed={"t"})
    message = error_of(result)
    assert message.startswith("invalid arguments for tool 't': ")
    for problem in problems:
        assert problem in message
    assert handler.calls == []


async def test_validators_are_compiled_once(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = make_registry(Recorder({}))

    def no_compiling(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("validator compiled per call")

    monkeypatch.setattr(registry_module, "Draft202012Validator", no_compiling)
    for n in range(3):
        result = await registry.execute(ToolCall(f"c{n}", "t", {"n": n}), ctx=CTX, allowed={"t"})
        assert not result.is_error


async def test_tool_failed_message_is_the_result() -> None:
    registry = make_registry(Recorder(raises=ToolFailed("order not found")))
    result = await registry.execute(ToolCall("c", "t", {"n": 1}), ctx=CTX, allowed={"t"})
    assert error_of(result) == "order not found"


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (ValueError("bad value"), "ValueError: bad value"),
        (RuntimeError(), "RuntimeError"),
        (KeyError("k"), "KeyError: 'k'"),
        (TimeoutError(), "TimeoutError"),
    ],
)
async def test_handler_exception_becomes_error_result(exc: Exception, expected: str) -> None:
    registry = make_registry(Recorder(raises=exc))
    result = await registry.execute(ToolCall("c", "t", {"n": 1}), ctx=CTX, allowed={"t"})
    assert error_of(result) == expected + MAY_HAVE_TAKEN_EFFECT


@pytest.mark.parametrize("value", [object(), {1, 2}, {"x": math.nan}, [math.inf]])
async def test_non_serialisable_return_value(value: Any) -> None:
    registry = make_registry(Recorder(value))
    result = await registry.execute(ToolCall("c", "t", {"n": 1}), ctx=CTX, allowed={"t"})
    message = error_of(result)
    assert message.startswith("tool 't' returned a value that is not JSON-serialisable")
    # The handler ran to its end: the model must not take the error for "nothing happened".
    assert message.endswith("; it ran to its end, so it may have taken effect")


class _LibraryTimeout(BaseException):
    """As some libraries derive their own (gevent.Timeout, trio.Cancelled)."""


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (asyncio.CancelledError(), "CancelledError"),
        (SystemExit(3), "SystemExit: 3"),
        (KeyboardInterrupt(), "KeyboardInterrupt"),
        # Nor what only derives from BaseException (a library's own, as gevent.Timeout):
        # it passed every handler and was a plain-text 500 with the run left `running`.
        (GeneratorExit(), "GeneratorExit"),
        (_LibraryTimeout("3 s"), "_LibraryTimeout: 3 s"),
    ],
)
async def test_a_handler_raising_what_ends_tasks_is_an_error_result(
    exc: BaseException, expected: str
) -> None:
    # Raised by the handler while nobody cancels the run: a handler bug like any other (it
    # was a 500 that left the run `running` and its call to be repaired as if lost).
    registry = make_registry(Recorder(raises=exc))
    result = await registry.execute(ToolCall("c", "t", {"n": 1}), ctx=CTX, allowed={"t"})
    assert error_of(result) == expected + MAY_HAVE_TAKEN_EFFECT


async def test_a_result_nested_too_deep_to_serialise_is_an_error_result() -> None:
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    registry = make_registry(Recorder(deep))
    result = await registry.execute(ToolCall("c", "t", {"n": 1}), ctx=CTX, allowed={"t"})
    assert error_of(result).startswith("tool 't' returned a value that is not JSON-serialisable")


async def test_a_python_tool_past_its_timeout_is_stopped() -> None:
    stopped = asyncio.Event()

    async def never(arguments: dict[str, Any], ctx: ToolContext) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            stopped.set()

    tool = Tool(name="t", description="d", input_schema=SCHEMA, handler=never, timeout_s=0.05)
    registry = ToolRegistry({"t": tool}, agents={})
    result = await registry.execute(ToolCall("c", "t", {"n": 1}), ctx=CTX, allowed={"t"})
    assert error_of(result) == (
        "tool 't' did not finish within 0.05s and was stopped; it may or may not have taken effect"
    )
    assert stopped.is_set()


def test_python_tools_time_out_after_60_s_unless_set(tmp_path: Path) -> None:
    text = f"""\
        tools:
          default: {{python: "{HERE}:documented_tool"}}
          set: {{python: "{HERE}:documented_tool", timeout_s: 0.5}}
          web: {{http: {{url: "http://h", timeout_s: 3}}}}
        agents: {{}}
        """
    tools = load_registry(write(tmp_path, text)).tools
    assert (tools["default"].timeout_s, tools["set"].timeout_s, tools["web"].timeout_s) == (
        60,
        0.5,
        None,  # the HTTP handler bounds its exchange by http.timeout_s
    )
    message = config_error(tmp_path, tool_yaml('http: {url: "http://h"}\ntimeout_s: 5'))
    assert "timeout_s is for python tools; an http tool sets http.timeout_s" in message


async def test_cancelling_a_running_handler_propagates() -> None:
    started = asyncio.Event()

    async def hang(arguments: dict[str, Any], ctx: ToolContext) -> None:
        started.set()
        await asyncio.sleep(60)

    tool = Tool(name="t", description="d", input_schema=SCHEMA, handler=hang)
    registry = ToolRegistry({"t": tool}, agents={})
    task = asyncio.create_task(
        registry.execute(ToolCall("c", "t", {"n": 1}), ctx=CTX, allowed={"t"})
    )
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_broken_schema_does_not_raise() -> None:
    # Constructed directly (not loaded), so nothing checked the schema.
    broken: dict[str, Any] = {"type": "object", "$ref": "https://unreachable.invalid/x.json"}
    handler = Recorder()
    registry = make_registry(handler, schema=broken)
    result = await registry.execute(ToolCall("c", "t", {}), ctx=CTX, allowed={"t"})
    assert error_of(result).startswith("cannot validate arguments for tool 't'")
    assert handler.calls == []


async def test_python_tool_loaded_from_file_executes(tmp_path: Path) -> None:
    registry = load_registry(write(tmp_path, tool_yaml(f'python: "{HERE}:documented_tool"')))
    call = ToolCall("c", "x", {"name": "Ada"})
    result = await registry.execute(call, ctx=CTX, allowed=registry.agent("a").tools)
    assert json.loads(result.content) == {"hello": "Ada"}
    await registry.aclose()


async def test_a_handler_changing_its_arguments_leaves_the_call_as_the_model_sent_it() -> None:
    # The call is stored as it came and sent back to the model with the history: a handler
    # editing its arguments once changed what the model was sent later in the turn, but not
    # what was stored, so a resumed session replayed another history.
    async def editing(arguments: dict[str, Any], ctx: ToolContext) -> str:
        arguments["n"] = 99
        arguments["tags"].append("added")
        arguments["injected"] = True
        return "done"

    tool = Tool(name="t", description="d", input_schema=SCHEMA, handler=editing)
    registry = ToolRegistry(
        {"t": tool}, agents={"a": AgentConfig(name="a", model="m", tools=("t",))}
    )
    call = ToolCall("c", "t", {"n": 1, "tags": ["x"]})
    result = await registry.execute(call, ctx=CTX, allowed={"t"})

    assert not result.is_error
    assert call.arguments == {"n": 1, "tags": ["x"]}

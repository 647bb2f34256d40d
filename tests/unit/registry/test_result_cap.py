"""TOOL_RESULT_MAX_BYTES: a tool result past it is kept truncated, as valid JSON text, and an
HTTP tool reads no more of a body than the limit."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from app.domain import ToolCall, ToolResult, truncated_result
from app.tools.agents_file import parse_registry
from app.tools.base import AgentConfig, Tool, ToolContext, ToolFailed
from app.tools.registry import ToolRegistry
from tests.support.threaded import ThreadedServer
from tests.unit.registry.support import CTX

LIMIT = 2048
ROT13_JSON = "application/json; charset=rot13"
KIND = "tool-result-truncated"


def size(result: ToolResult) -> int:
    return len(result.content.encode())


def truncated_head(result: ToolResult) -> str:
    """The head of a truncated result, checking its shape on the way."""
    body = json.loads(result.content)
    assert set(body) == {"kind", "note", "head"}, body
    assert body["kind"] == KIND
    assert "TOOL_RESULT_MAX_BYTES" in body["note"]
    head: str = body["head"]
    return head


# --- the truncated result ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "a" * 10_000,
        '"' * 10_000,  # each one escaped to two bytes
        "\x01" * 10_000,  # each one escaped to six
        "é" * 10_000,  # two bytes each in UTF-8
        "😀" * 10_000,  # four
        "x" * 2_100,  # just past the limit
    ],
    ids=["ascii", "quotes", "control", "two-byte", "four-byte", "just-over"],
)
def test_a_truncated_result_fits_the_limit_and_keeps_the_start(text: str) -> None:
    original = ToolResult("toolu_1", "t", text)
    result = truncated_result(original, limit=LIMIT)
    assert LIMIT - 8 <= size(result) <= LIMIT  # as much as fits, within one escaped character
    head = truncated_head(result)
    assert head and text.startswith(head)
    assert (result.tool_call_id, result.tool_name, result.is_error) == ("toolu_1", "t", False)
    assert f"{len(text.encode()):,} bytes" in json.loads(result.content)["note"]


def test_a_truncated_error_stays_an_error() -> None:
    original = ToolResult.error(ToolCall("toolu_1", "t", {}), message="boom " * 5_000)
    result = truncated_result(original, limit=LIMIT)
    assert result.is_error and size(result) <= LIMIT
    assert truncated_head(result).startswith('{"error": "boom boom')


# --- the registry ------------------------------------------------------------------------------


def registry_of(handler: Any, *, limit: int = LIMIT) -> ToolRegistry:
    tool = Tool(name="t", description="d", input_schema={"type": "object"}, handler=handler)
    agents = {"a": AgentConfig(name="a", model="m", tools=("t",))}
    return ToolRegistry({"t": tool}, agents=agents, max_result_bytes=limit)


async def execute(registry: ToolRegistry, name: str = "t") -> ToolResult:
    return await registry.execute(ToolCall("toolu_1", name, {}), ctx=CTX, allowed=registry.tools)


def returning(value: Any) -> Any:
    async def handler(arguments: dict[str, Any], ctx: ToolContext) -> Any:
        return value

    return handler


def failing(message: str) -> Any:
    async def handler(arguments: dict[str, Any], ctx: ToolContext) -> Any:
        raise ToolFailed(message)

    return handler


async def test_a_result_within_the_limit_is_kept_whole() -> None:
    value = {"rows": ["r" * 100] * 19}  # just under 2 KB of JSON
    result = await execute(registry_of(returning(value)))
    assert size(result) <= LIMIT
    assert json.loads(result.content) == value


async def test_a_result_past_the_limit_is_kept_truncated() -> None:
    value = {"rows": [f"row {i}" for i in range(100_000)]}
    result = await execute(registry_of(returning(value)))
    assert not result.is_error and size(result) <= LIMIT
    assert truncated_head(result).startswith('{"rows":["row 0","row 1",')


async def test_an_error_past_the_limit_is_kept_truncated() -> None:
    result = await execute(registry_of(failing("x" * 1_000_000)))
    assert result.is_error and size(result) <= LIMIT
    assert truncated_head(result).startswith('{"error": "xxx')


async def test_the_default_limit_is_256_kib() -> None:
    registry = ToolRegistry({}, agents={})
    assert registry.max_result_bytes == 256 * 1024
    result = await execute(registry_of(returning("y" * 300_000), limit=256 * 1024))
    assert 255 * 1024 < size(result) <= 256 * 1024
    truncated_head(result)


# --- HTTP tools --------------------------------------------------------------------------------


async def _endless() -> AsyncIterator[bytes]:
    yield b'{"rows": ['
    while True:
        yield b'"' + b"z" * 8190 + b'",'
        await asyncio.sleep(0)


def _tool_app() -> Starlette:
    async def endpoint(request: Request) -> Response:
        name = request.path_params["name"]
        if name == "endless":  # a body that never ends: reading it all would never finish
            return StreamingResponse(_endless(), media_type="application/json")
        if name == "large":
            body = json.dumps({"rows": [f"row {i}" for i in range(100_000)]})
            return Response(body, media_type="application/json")
        if name == "large-error":
            return Response("down " * 100_000, status_code=503)
        if name == "odd-charset":  # a codec, but not of bytes to text
            status = 200 if request.query_params.get("ok") else 500
            return Response('{"ok": "é"}'.encode(), status, media_type=ROT13_JSON)
        return Response(json.dumps({"ok": True}), media_type="application/json")

    return Starlette(routes=[Route("/{name}", endpoint, methods=["POST"])])


@pytest.fixture(scope="module")
def tool_url() -> Iterator[str]:
    with ThreadedServer(_tool_app(), name="cap-tools") as server:
        yield server.url


@pytest.fixture
async def http_registry(tool_url: str) -> AsyncIterator[ToolRegistry]:
    paths = {n: n for n in ("endless", "large", "large-error", "small", "odd-charset")}
    paths["odd-charset-ok"] = "odd-charset?ok=1"
    text = "tools:\n" + "".join(
        f'  {n}:\n    http: {{url: "{tool_url}/{path}", timeout_s: 10}}\n'
        for n, path in paths.items()
    )
    registry = parse_registry(text + "agents: {}\n", label="agents.yaml", max_result_bytes=LIMIT)
    try:
        yield registry
    finally:
        await registry.aclose()


async def test_an_endless_http_body_is_read_up_to_the_limit(http_registry: ToolRegistry) -> None:
    result = await asyncio.wait_for(execute(http_registry, "endless"), timeout=5)
    assert not result.is_error and size(result) <= LIMIT
    assert truncated_head(result).startswith('{"rows": ["zzz')
    assert f"more than {LIMIT:,} bytes" in json.loads(result.content)["note"]


async def test_a_large_http_body_is_kept_truncated(http_registry: ToolRegistry) -> None:
    result = await execute(http_registry, "large")
    assert not result.is_error and size(result) <= LIMIT
    assert truncated_head(result).startswith('{"rows": ["row 0", "row 1",')


async def test_a_large_http_error_body_is_quoted_in_part(http_registry: ToolRegistry) -> None:
    result = await execute(http_registry, "large-error")
    assert result.is_error and size(result) <= LIMIT
    message = json.loads(result.content)["error"]
    assert message.startswith("HTTP 503 from ") and message.endswith("down ")


async def test_a_small_http_body_is_the_result(http_registry: ToolRegistry) -> None:
    result = await execute(http_registry, "small")
    assert (result.is_error, json.loads(result.content)) == (False, {"ok": True})


async def test_a_body_in_a_charset_that_is_no_text_encoding_is_read_as_utf_8(
    http_registry: ToolRegistry,
) -> None:
    ok = await execute(http_registry, "odd-charset-ok")
    assert (ok.is_error, json.loads(ok.content)) == (False, {"ok": "é"})
    failed = await execute(http_registry, "odd-charset")
    assert json.loads(failed.content)["error"].endswith(': {"ok": "é"}')

"""HTTP tools against a real local server, and the built-in example tools."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from app.domain import ToolCall, ToolResult
from app.serving import free_port
from app.tools.agents_file import load_registry, parse_registry
from app.tools.base import ToolContext, ToolFailed
from app.tools.builtin import clock, lookup_order, send_email
from app.tools.builtin.orders import fake_order
from app.tools.http import HttpToolHandler, SharedHttpClient
from app.tools.registry import ToolRegistry

SESSION_CTX = ToolContext(session_id="sess-1", run_id="run-1", tool_call_id="toolu_abc")
STATELESS_CTX = ToolContext(session_id=None, run_id="run-9", tool_call_id="toolu_xyz")
SLOW_ENDPOINT_S = 2.0  # well past the 0.05 s timeout, however loaded the machine
A_WHILE_S = 2.0


# --- a real HTTP server in a thread -----------------------------------------------------------


@dataclass
class Seen:
    """One request the test server received."""

    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class LocalServer:
    url: str
    seen: list[Seen] = field(default_factory=list)


def build_app(seen: list[Seen]) -> Starlette:
    async def endpoint(request: Request) -> Response:
        name = request.path_params["name"]
        raw = await request.body()
        seen.append(Seen(name, dict(request.headers), json.loads(raw) if raw else None))
        if name == "echo":
            return JSONResponse({"received": json.loads(raw)})
        if name == "scalar":
            return JSONResponse(42, status_code=201)
        if name == "unavailable":
            return PlainTextResponse("down for maintenance " + "x" * 1000, status_code=503)
        if name == "bad-request":
            return JSONResponse({"detail": "no such order"}, status_code=400)
        if name == "slow":
            await asyncio.sleep(SLOW_ENDPOINT_S)
            return JSONResponse({"late": True})
        if name == "a-while":
            await asyncio.sleep(A_WHILE_S)
            return JSONResponse({"done": True})
        if name == "text":
            return PlainTextResponse("plain words")
        if name == "empty":
            return Response(status_code=204)
        if name == "nan":
            return Response('{"ratio": NaN}', media_type="application/json")
        if name == "gzip":  # compressed though asked for identity: 20 MB once inflated
            packed = gzip.compress(b'{"pad": "' + b" " * 20_000_000 + b'"}', compresslevel=1)
            return Response(packed, headers={"content-encoding": "gzip"})
        if name == "set-cookie":  # another session's credentials, say
            return JSONResponse({}, headers={"set-cookie": "auth=secret; Path=/"})
        if name == "huge":  # a number past a float's range: Python reads it as inf
            return Response('{"sent": true, "amount": 1e400}', media_type="application/json")
        if name == "deep":  # too deep for json to parse
            return Response("[" * 100_000 + "]" * 100_000, media_type="application/json")
        return PlainTextResponse("", status_code=302, headers={"Location": "/echo"})

    return Starlette(routes=[Route("/{name}", endpoint, methods=["POST"])])


@pytest.fixture(scope="module")
def server() -> Iterator[LocalServer]:
    seen: list[Seen] = []
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        build_app(seen), lifespan="off", ws="none", loop="asyncio", log_level="warning"
    )
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        assert time.monotonic() < deadline, "test server did not start"
        time.sleep(0.01)
    try:
        yield LocalServer(f"http://127.0.0.1:{port}", seen)
    finally:
        uv.should_exit = True
        thread.join(timeout=10)
        sock.close()


def http_tools_yaml(base: str, *, timeout_s: float = 5) -> str:
    tools = {
        name: f'    {name}:\n      http: {{url: "{base}/{name}", timeout_s: {timeout_s}}}\n'
        for name in (
            "echo",
            "scalar",
            "unavailable",
            "bad-request",
            "text",
            "empty",
            "redirect",
            "nan",
            "set-cookie",
            "gzip",
            "huge",
            "deep",
        )
    }
    credentials = base.replace("http://", "http://agent:s3cret@")
    tools["secrets"] = (
        f'    secrets:\n      http: {{url: "{credentials}/unavailable?api_key=k3y"}}\n'
    )
    tools["slow"] = f'    slow:\n      http: {{url: "{base}/slow", timeout_s: 0.05}}\n'
    tools["a-while"] = f'    a-while:\n      http: {{url: "{base}/a-while", timeout_s: 3.5}}\n'
    tools["headers"] = (
        f'    headers:\n      http: {{url: "{base}/echo", headers: {{X-Api-Key: secret}}}}\n'
    )
    tools["refused"] = (
        f'    refused:\n      http: {{url: "http://127.0.0.1:{free_port()}/x", timeout_s: 2}}\n'
    )
    return "tools:\n" + "".join(tools.values()) + "agents: {}\n"


@pytest.fixture
async def registry(server: LocalServer) -> AsyncIterator[ToolRegistry]:
    server.seen.clear()
    registry = parse_registry(http_tools_yaml(server.url), label="agents.yaml")
    try:
        yield registry
    finally:
        await registry.aclose()


async def run(registry: ToolRegistry, name: str, arguments: dict[str, Any]) -> ToolResult:
    call = ToolCall(SESSION_CTX.tool_call_id, name, arguments)
    return await registry.execute(call, ctx=SESSION_CTX, allowed=registry.tools)


def error_of(result: ToolResult) -> str:
    assert result.is_error
    return str(json.loads(result.content)["error"])


# --- HTTP tools --------------------------------------------------------------------------------


async def test_http_tool_posts_json_and_returns_json(
    registry: ToolRegistry, server: LocalServer
) -> None:
    arguments = {"order_id": "A-1", "nested": {"n": [1, 2]}}
    result = await run(registry, "echo", arguments)
    assert not result.is_error
    assert json.loads(result.content) == {"received": arguments}
    [seen] = server.seen
    assert seen.body == arguments
    assert seen.headers["content-type"] == "application/json"
    assert seen.headers["idempotency-key"] == "sess-1:toolu_abc"
    # Uncompressed: a gzip answer is inflated a chunk at a time past the result's limit.
    assert seen.headers["accept-encoding"] == "identity"


async def test_http_answer_compressed_though_asked_for_identity_is_not_read(
    registry: ToolRegistry, server: LocalServer
) -> None:
    # Inflated, a body of some 200 KB took 130 MB against a 256 KiB result limit.
    message = error_of(await run(registry, "gzip", {}))
    assert message == (
        f"HTTP 200 from {server.url} came compressed (gzip) though asked for identity, and was"
        " not read; the request was accepted, so it may have taken effect"
    )


async def test_http_tools_keep_no_cookie_an_answer_sets(
    registry: ToolRegistry, server: LocalServer
) -> None:
    # One client serves every session and tenant: the cookie went with every later call.
    assert not (await run(registry, "set-cookie", {})).is_error
    assert not (await run(registry, "echo", {})).is_error
    assert "cookie" not in server.seen[-1].headers


async def test_http_idempotency_key_without_session(
    registry: ToolRegistry, server: LocalServer
) -> None:
    call = ToolCall("toolu_xyz", "echo", {})
    result = await registry.execute(call, ctx=STATELESS_CTX, allowed={"echo"})
    assert not result.is_error
    assert server.seen[-1].headers["idempotency-key"] == "run-9:toolu_xyz"


async def test_http_configured_headers_are_sent(
    registry: ToolRegistry, server: LocalServer
) -> None:
    await run(registry, "headers", {})
    assert server.seen[-1].headers["x-api-key"] == "secret"
    assert server.seen[-1].headers["idempotency-key"] == "sess-1:toolu_abc"


async def test_http_any_2xx_json_is_the_result(registry: ToolRegistry) -> None:
    result = await run(registry, "scalar", {})
    assert (result.is_error, result.content) == (False, "42")


async def test_http_empty_2xx_is_null(registry: ToolRegistry) -> None:
    result = await run(registry, "empty", {})
    assert (result.is_error, result.content) == (False, "null")


async def test_http_calls_at_once_do_not_queue_for_a_connection(registry: ToolRegistry) -> None:
    # httpx's default pool holds 100 connections: the 101st call waited for one, and its
    # timeout_s ran out in that queue (results "timed out" for calls that ran, or were never
    # sent). 150 calls of 2 s each, 3.5 s allowed: the queued ones needed 4 s.
    calls = [ToolCall(f"toolu_{i}", "a-while", {}) for i in range(150)]
    results = await asyncio.gather(
        *(registry.execute(call, ctx=SESSION_CTX, allowed=registry.tools) for call in calls)
    )
    assert [json.loads(r.content) for r in results] == [{"done": True}] * 150


async def test_http_non_2xx_is_an_error_with_a_body_excerpt(
    registry: ToolRegistry, server: LocalServer
) -> None:
    message = error_of(await run(registry, "unavailable", {}))
    prefix = f"HTTP 503 from {server.url}: down for maintenance "
    assert message.startswith(prefix)
    assert len(message) == len(prefix) - len("down for maintenance ") + 500
    message = error_of(await run(registry, "bad-request", {}))
    assert message == f'HTTP 400 from {server.url}: {{"detail":"no such order"}}'


async def test_http_errors_name_the_origin_only(
    registry: ToolRegistry, server: LocalServer
) -> None:
    # A URL's password, query and path (a webhook's token) can be secrets; error results
    # reach the model and the store.
    message = error_of(await run(registry, "secrets", {}))
    assert message.startswith(f"HTTP 503 from {server.url}: down for maintenance")
    for secret in ("s3cret", "agent", "k3y", "api_key", "/unavailable"):
        assert secret not in message
    assert server.seen[-1].path == "unavailable"  # the whole URL was called


async def test_http_redirect_is_not_followed(registry: ToolRegistry, server: LocalServer) -> None:
    message = error_of(await run(registry, "redirect", {}))
    assert message.startswith(f"HTTP 302 from {server.url}: ")
    assert [s.path for s in server.seen] == ["redirect"]


async def test_http_2xx_non_json_is_an_error(registry: ToolRegistry, server: LocalServer) -> None:
    message = error_of(await run(registry, "text", {}))
    assert message.startswith(f"HTTP 200 from {server.url} but the body is not JSON")
    assert "may have taken effect" in message
    assert message.endswith("plain words")


@pytest.mark.parametrize("name", ["nan", "huge", "deep"])
async def test_http_2xx_that_no_result_can_hold_is_not_json(
    registry: ToolRegistry, server: LocalServer, name: str
) -> None:
    # NaN (no result can hold it) and nesting too deep to parse were errors that did not say
    # the call was accepted: the model could repeat a side effect that had happened.
    message = error_of(await run(registry, name, {}))
    assert message.startswith(f"HTTP 200 from {server.url} but the body is not JSON")
    assert "(the request was accepted, so it may have taken effect)" in message


async def test_http_timeout(registry: ToolRegistry) -> None:
    started = time.monotonic()
    message = error_of(await run(registry, "slow", {}))
    assert message.startswith("timed out after 0.05s")
    assert message.endswith("; it may or may not have taken effect")
    assert time.monotonic() - started < SLOW_ENDPOINT_S


async def test_http_connection_refused(registry: ToolRegistry) -> None:
    message = error_of(await run(registry, "refused", {}))
    assert message.startswith("request to http://127.0.0.1:")
    assert "failed: " in message
    assert "taken effect" not in message  # it never reached the tool


async def test_http_connection_dropped_after_sending_may_have_taken_effect() -> None:
    # The tool read the request and closed the connection without an answer: it may have
    # acted on it, so the error must not read as "nothing happened".
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def hang_up() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.close()

    thread = threading.Thread(target=hang_up, daemon=True)
    thread.start()
    client = SharedHttpClient()
    handler = HttpToolHandler(f"http://127.0.0.1:{port}/x", client=client, timeout_s=5)
    try:
        with pytest.raises(ToolFailed) as failed:
            await handler({"charge": 5}, SESSION_CTX)
    finally:
        await client.aclose()
        thread.join(timeout=5)
        listener.close()
    assert str(failed.value).startswith(f"request to http://127.0.0.1:{port} failed: ")
    assert str(failed.value).endswith("; it may or may not have taken effect")


async def test_http_schema_failure_sends_nothing(server: LocalServer) -> None:
    text = (
        "tools:\n  strict:\n    input_schema: {type: object, required: [id]}\n"
        f'    http: {{url: "{server.url}/echo"}}\nagents: {{}}\n'
    )
    registry = parse_registry(text, label="agents.yaml")
    server.seen.clear()
    try:
        message = error_of(await run(registry, "strict", {}))
    finally:
        await registry.aclose()
    assert message == "invalid arguments for tool 'strict': 'id' is a required property"
    assert server.seen == []


async def test_http_tools_share_one_client(registry: ToolRegistry) -> None:
    handlers = [t.handler for t in registry.tools.values()]
    assert all(isinstance(h, HttpToolHandler) for h in handlers)
    clients = {id(h._client) for h in handlers if isinstance(h, HttpToolHandler)}
    assert len(clients) == 1


async def test_shared_client_is_lazy_and_reclosable() -> None:
    shared = SharedHttpClient()
    await shared.aclose()  # never created: nothing to close
    client = shared.get()
    assert shared.get() is client
    await shared.aclose()
    assert client.is_closed
    await shared.aclose()


async def test_http_handler_raises_tool_failed_directly() -> None:
    shared = SharedHttpClient()
    handler = HttpToolHandler(f"http://127.0.0.1:{free_port()}/x", client=shared, timeout_s=1)
    try:
        with pytest.raises(ToolFailed, match="failed"):
            await handler({}, SESSION_CTX)
    finally:
        await shared.aclose()


# --- built-in example tools --------------------------------------------------------------------


async def test_clock() -> None:
    value = await clock({}, SESSION_CTX)
    assert value["utc"].endswith("+00:00")


async def test_lookup_order_is_deterministic() -> None:
    first = await lookup_order({"order_id": "A-1001"}, SESSION_CTX)
    assert first == await lookup_order({"order_id": "A-1001"}, STATELESS_CTX)
    assert first == fake_order("A-1001")
    assert first["order_id"] == "A-1001"
    assert first["status"] in {"processing", "shipped", "delivered", "delayed"}
    assert 1 <= len(first["items"]) <= 3
    expected = sum(i["quantity"] * round(i["unit_price"] * 100) for i in first["items"])
    assert round(first["total"] * 100) == expected
    others = [fake_order(f"A-{n}") for n in range(1000, 1020)]
    assert len({json.dumps(o["items"]) for o in others}) > 1


async def test_lookup_order_rejects_a_blank_id() -> None:
    with pytest.raises(ToolFailed):
        await lookup_order({"order_id": "  "}, SESSION_CTX)


def outbox_lines(path: Path) -> list[dict[str, Any]]:
    """The outbox records; [] when nothing was ever sent. (Sync: a tiny local file.)"""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def outbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "outbox.jsonl"
    monkeypatch.setenv("DEMO_OUTBOX", str(path))
    return path


async def test_send_email_appends_to_the_outbox(outbox: Path) -> None:
    arguments = {"to": "c@example.com", "subject": "Hi", "body": "Hello"}
    first = await send_email(arguments, SESSION_CTX)
    await send_email({**arguments, "delay_s": 0.01}, STATELESS_CTX)
    assert first["sent"] is True
    assert first["message_id"].startswith("msg_")
    lines = outbox_lines(outbox)
    assert len(lines) == 2
    assert set(lines[0]) == {"at", "tool_call_id", "idempotency_key", "to", "subject"}
    assert lines[0]["tool_call_id"] == "toolu_abc"
    assert lines[0]["idempotency_key"] == "sess-1:toolu_abc"
    assert (lines[0]["to"], lines[0]["subject"]) == ("c@example.com", "Hi")
    assert lines[1]["idempotency_key"] == "run-9:toolu_xyz"


@pytest.mark.parametrize("delay_s", [-1, 61, "soon"])
async def test_send_email_rejects_bad_delays(outbox: Path, delay_s: Any) -> None:
    arguments = {"to": "c@example.com", "subject": "Hi", "body": "", "delay_s": delay_s}
    with pytest.raises(ToolFailed, match="delay_s"):
        await send_email(arguments, SESSION_CTX)
    assert outbox_lines(outbox) == []


async def test_send_email_cancelled_mid_delay_sends_nothing(outbox: Path) -> None:
    arguments = {"to": "c@example.com", "subject": "Hi", "body": "", "delay_s": 30}
    task = asyncio.create_task(send_email(arguments, SESSION_CTX))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert outbox_lines(outbox) == []


async def test_example_tools_through_the_registry(outbox: Path) -> None:
    registry = load_registry(None)
    allowed = registry.agent("support").tools
    lookup = await registry.execute(
        ToolCall("c1", "lookup_order", {"order_id": "B-7"}), ctx=SESSION_CTX, allowed=allowed
    )
    assert json.loads(lookup.content) == fake_order("B-7")
    too_slow = ToolCall("c2", "send_email", {"to": "a", "subject": "s", "body": "b", "delay_s": 61})
    assert "invalid arguments" in error_of(
        await registry.execute(too_slow, ctx=SESSION_CTX, allowed=allowed)
    )
    assert outbox_lines(outbox) == []
    sent = await registry.execute(
        ToolCall("c3", "send_email", {"to": "a", "subject": "s", "body": "b"}),
        ctx=SESSION_CTX,
        allowed=allowed,
    )
    assert json.loads(sent.content)["sent"] is True
    assert len(outbox_lines(outbox)) == 1
    now = await registry.execute(ToolCall("c4", "clock", {}), ctx=SESSION_CTX, allowed=allowed)
    assert "utc" in json.loads(now.content)
    await registry.aclose()


async def test_send_email_with_demo_outbox_set_but_empty_uses_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Empty, it named "." (a folder): every send failed "Is a directory".
    monkeypatch.setenv("DEMO_OUTBOX", "")
    monkeypatch.chdir(tmp_path)
    sent = await send_email({"to": "c@example.com", "subject": "Hi", "body": "x"}, SESSION_CTX)
    assert sent["sent"] is True
    assert len(outbox_lines(tmp_path / "demo-outbox.jsonl")) == 1

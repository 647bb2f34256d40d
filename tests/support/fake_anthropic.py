"""A local fake of the Anthropic Messages API; tests point the real SDK at it.

Behaviour is picked by the request's `model` and derived only from the conversation, so a
crashed-and-resumed run gets consistent answers:

* `echo` (or any unknown name): final text `echo: <current user text>`.
* `plan:a,b;c`: step 1 calls tools a and b, step 2 calls c, then a final summary.
* `steps:<n>:<tool>`: n steps each calling <tool> once, then a final summary.
* `fail:<status>`: always that error (529 overloaded_error, 429 rate_limit_error, ...).
* `cutoff:<tool>`: a call of <tool> cut off by max_tokens (`stop_reason: "max_tokens"`);
  `cutoff:<tool>:<stop_reason>` with that stop reason instead.
* `stopped:<stop_reason>`: a text-only answer (no tool call) with that stop reason, its text
  `echo: <current user text>` cut short (`stopped:max_tokens`: an answer cut off midway).
* `unstorable:<plan>`: as `plan:<plan>`, with a NUL and a lone surrogate (neither storable
  as text) ending every text and every string of the tool inputs.
* `outsized:<plan>`: as `plan:<plan>`, with tool_use ids of 300 characters, one more call of
  a tool named with 100 characters (which no agent has), and 3,000,000,000 input tokens.
* `badid:<plan>`: as `plan:<plan>`, with tool_use ids the API would refuse back (`call:…`).
* `reuse:<plan>`: as `plan:<plan>`, with tool_use ids that depend only on the step and the
  call's place in it, so every turn of a session reuses the ids of the turn before.
* A request with `tool_choice: {"type": "none"}` is answered as `echo` is, whatever its model.

The summary is `done after N steps; errors: <names>; durability errors: <call ids>` (lists
joined by ","): N counts this turn's assistant messages; `errors` names the tools whose results
seen in this turn had `is_error`, `durability errors` the ids whose result is a
`tool-durability-error`. "This turn" starts at the last user message holding text, and includes
results merged into that message ahead of its text (repairs the model sees for the first time).

Run `python -m tests.support.fake_anthropic --port N` to serve from another process; drive it
with `GET /_requests`, `POST /_reset`, `POST /_fail_next` {count, status, error_type},
`POST /_delay` {seconds}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import secrets
import socket
import threading
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.serving import ThreadedServer

ERROR_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
_ERROR_TEXT = {
    "overloaded_error": "Overloaded",
    "rate_limit_error": "Number of request tokens has exceeded your per-minute rate limit",
    "api_error": "Internal server error",
    "authentication_error": "invalid x-api-key",
}
STOPPED_TEXT_CHARS = 12  # how much of its echo a `stopped:` answer gives
_TOP_LEVEL_KEYS = {
    "model", "max_tokens", "messages", "system", "tools", "tool_choice", "metadata",
    "stop_sequences", "temperature", "top_k", "top_p", "thinking", "service_tier", "stream",
}  # fmt: skip


# The keys the API takes on a message, on each kind of content block, and on a tool: any
# other is "Extra inputs are not permitted".
_MESSAGE_KEYS = {"role", "content"}
_BLOCK_KEYS = {
    "text": {"type", "text", "cache_control", "citations"},
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
}
_TOOL_KEYS = {"name", "description", "input_schema", "cache_control", "type"}


class InvalidRequest(Exception):
    """The request breaks a Messages API rule; the text mimics the real API's."""


class FakeState:
    """What the fake recorded and what it was told to do; shared with the server thread."""

    def __init__(self, *, retry_after_ms: int | None = 10) -> None:
        self.retry_after_ms = retry_after_ms
        self.closing = threading.Event()
        self._lock = threading.Lock()
        self._requests: list[Any] = []
        self._failures: list[tuple[int, str]] = []
        self._delay = 0.0
        self._generation = 0  # bumped by reset(): a request in flight across it gets no failure

    @property
    def requests(self) -> list[Any]:
        """A snapshot of every `POST /v1/messages` body received, oldest first."""
        with self._lock:
            return list(self._requests)

    @property
    def delay(self) -> float:
        """Seconds to wait before answering."""
        with self._lock:
            return self._delay

    def record(self, body: Any) -> int:
        """Keep one request body; returns the generation to pass to `take_failure`."""
        with self._lock:
            self._requests.append(body)
            return self._generation

    def reset(self) -> None:
        """Forget requests, pending failures and the delay."""
        with self._lock:
            self._requests.clear()
            self._failures.clear()
            self._delay = 0.0
            self._generation += 1

    def fail_next(self, count: int, status: int, error_type: str | None = None) -> None:
        """Answer the next `count` requests with this error (type derived from the status)."""
        kind = error_type or ERROR_TYPE_BY_STATUS.get(status, "api_error")
        with self._lock:
            self._failures.extend([(status, kind)] * count)

    def set_delay(self, seconds: float) -> None:
        """Sleep this long before each answer."""
        with self._lock:
            self._delay = seconds

    def take_failure(self, generation: int) -> tuple[int, str] | None:
        """The next scheduled failure, if any, for a request recorded in `generation`."""
        with self._lock:
            if generation != self._generation or not self._failures:
                return None
            return self._failures.pop(0)


def error_response(
    status: int, error_type: str, message: str, *, retry_after_ms: int | None = None
) -> JSONResponse:
    """An error in the real API's shape."""
    request_id = "req_" + secrets.token_hex(12)
    headers = {"request-id": request_id}
    # A short retry-after keeps SDK retries in tests fast; the SDK honours it over its backoff.
    if retry_after_ms and (status == 429 or status >= 500):
        headers["retry-after-ms"] = str(retry_after_ms)
    body = {"type": "error", "error": {"type": error_type, "message": message}}
    return JSONResponse({**body, "request_id": request_id}, status_code=status, headers=headers)


def validate(body: Any) -> None:
    """Raise InvalidRequest where the real API would answer 400 (stricter on role alternation)."""
    if not isinstance(body, dict):
        raise InvalidRequest("Request body must be a JSON object")
    for key in body:
        if key not in _TOP_LEVEL_KEYS:
            raise InvalidRequest(f"{key}: Extra inputs are not permitted")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise InvalidRequest("model: Field required")
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidRequest("max_tokens: Field required (a positive integer)")
    if body.get("stream"):
        raise InvalidRequest("stream: the fake does not stream")
    _validate_system(body.get("system"))
    _validate_tools(body.get("tools"))
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise InvalidRequest("messages: Field required")
    if not messages:
        raise InvalidRequest("messages: at least one message is required")
    for index, message in enumerate(messages):
        _validate_message(messages, index, message)
    _validate_tool_use(messages, body.get("tools"))
    _validate_tool_choice(body.get("tool_choice"), body.get("tools"))


_TOOL_USE_ID = re.compile(r"[a-zA-Z0-9_-]+")
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")


def _validate_tool_use(messages: list[Any], tools: Any) -> None:
    """Ids unique over the whole request and of the API's characters; tools defined."""
    seen: set[str] = set()
    uses_tools = False
    for index, message in enumerate(messages):
        for j, block in enumerate(_blocks(message)):
            kind = _kind(block)
            uses_tools = uses_tools or kind in ("tool_use", "tool_result")
            if kind != "tool_use":
                continue
            call_id = block["id"]
            if not _TOOL_USE_ID.fullmatch(call_id):
                raise InvalidRequest(
                    f"messages.{index}.content.{j}.tool_use.id: String should match pattern "
                    "'^[a-zA-Z0-9_-]+$'"
                )
            if call_id in seen:
                raise InvalidRequest(f"messages.{index}: `tool_use` ids must be unique")
            seen.add(call_id)
    if uses_tools and not tools:
        raise InvalidRequest(
            "Requests which include `tool_use` or `tool_result` blocks must define tools."
        )


def _validate_tool_choice(choice: Any, tools: Any) -> None:
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise InvalidRequest("tool_choice: Input tag does not match any of the expected tags")
    if kind == "tool" and choice.get("name") not in {t["name"] for t in tools or []}:
        raise InvalidRequest("tool_choice.name: no tool of that name")


def _validate_system(system: Any) -> None:
    if isinstance(system, str) and system and not system.strip():
        raise InvalidRequest("system: text content blocks must contain non-whitespace text")
    if system is None or isinstance(system, str):
        return
    if not isinstance(system, list) or any(_text_of(b) is None for b in system):
        raise InvalidRequest("system: Input should be a string or a list of text blocks")


def _validate_tools(tools: Any) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise InvalidRequest("tools: Input should be a valid list")
    names = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise InvalidRequest(f"tools.{i}.name: Field required")
        if not isinstance(tool.get("input_schema"), dict):
            raise InvalidRequest(f"tools.{i}.input_schema: Field required")
        if tool["input_schema"].get("type") != "object":
            raise InvalidRequest(f"tools.{i}.input_schema.type: Input should be 'object'")
        _no_extra_keys(tool, _TOOL_KEYS, f"tools.{i}")
        if not _TOOL_NAME.fullmatch(tool["name"]):
            raise InvalidRequest(
                f"tools.{i}.name: String should match pattern '^[a-zA-Z0-9_-]{{1,128}}$'"
            )
        if tool["name"] in names:
            raise InvalidRequest("tools: Tool names must be unique.")
        names.add(tool["name"])


def _validate_message(messages: list[Any], index: int, message: Any) -> None:
    where = f"messages.{index}"
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise InvalidRequest(f"{where}.role: Input should be 'user' or 'assistant'")
    role = message["role"]
    _no_extra_keys(message, _MESSAGE_KEYS, where)
    if index == 0 and role != "user":
        raise InvalidRequest('messages: first message must use the "user" role')
    if index > 0 and messages[index - 1].get("role") == role:
        raise InvalidRequest(
            f'{where}: roles must alternate between "user" and "assistant", '
            f'but found multiple "{role}" roles in a row'
        )
    blocks = _blocks(message)
    if not blocks and not (role == "assistant" and index == len(messages) - 1):
        raise InvalidRequest(
            f"{where}: all messages must have non-empty content except for the optional "
            "final assistant message"
        )
    seen_other = False
    for j, block in enumerate(blocks):
        kind = _kind(block)
        if kind in _BLOCK_KEYS:
            _no_extra_keys(block, _BLOCK_KEYS[kind], f"{where}.content.{j}.{kind}")
        if kind == "text":
            text = block.get("text")
            if not isinstance(text, str) or not text.strip():
                raise InvalidRequest(f"{where}.content.{j}: text content blocks must be non-empty")
            seen_other = True
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("input"), dict):
                raise InvalidRequest(f"{where}.content.{j}.tool_use: id and input are required")
        elif kind == "tool_result" and role == "user":
            _validate_tool_result(block, f"{where}.content.{j}.tool_result")
            if seen_other:
                raise InvalidRequest(
                    f"{where}.content.{j}: `tool_result` blocks must come first in the "
                    "message content, before any text"
                )
        else:
            raise InvalidRequest(f"{where}.content.{j}: unexpected block type {kind!r} for {role}")
    if role == "assistant":
        _check_results_follow(messages, index)
    elif index > 0:
        _check_results_match(messages, index)


def _no_extra_keys(value: dict[str, Any], allowed: set[str], where: str) -> None:
    for key in value:
        if key not in allowed:
            raise InvalidRequest(f"{where}.{key}: Extra inputs are not permitted")


def _validate_tool_result(block: dict[str, Any], where: str) -> None:
    """`content` a string or a list of text blocks (images aside); `is_error` a boolean."""
    if not isinstance(block.get("tool_use_id"), str):
        raise InvalidRequest(f"{where}.tool_use_id: Field required")
    content = block.get("content", "")
    if not isinstance(content, str) and (
        not isinstance(content, list) or any(_text_of(b) is None for b in content)
    ):
        raise InvalidRequest(f"{where}.content: Input should be a string or a list of blocks")
    if "is_error" in block and not isinstance(block["is_error"], bool):
        raise InvalidRequest(f"{where}.is_error: Input should be a valid boolean")


def _check_results_follow(messages: list[Any], index: int) -> None:
    wanted = _tool_use_ids(messages[index])
    if len(set(wanted)) != len(wanted):
        raise InvalidRequest(f"messages.{index}: `tool_use` ids must be unique")
    following = messages[index + 1] if index + 1 < len(messages) else None
    answered = _tool_result_ids(following) if following is not None else []
    missing = [i for i in wanted if i not in answered]
    if missing:
        raise InvalidRequest(
            f"messages.{index + 1}: `tool_use` ids were found without `tool_result` blocks "
            f"immediately after: {', '.join(missing)}. Each `tool_use` block must have a "
            "corresponding `tool_result` block in the next message."
        )


def _check_results_match(messages: list[Any], index: int) -> None:
    known = set(_tool_use_ids(messages[index - 1]))
    answered = _tool_result_ids(messages[index])
    if len(set(answered)) != len(answered):
        raise InvalidRequest(
            f"messages.{index}: each `tool_use` id may have only one `tool_result`"
        )
    for call_id in answered:
        if call_id not in known:
            raise InvalidRequest(
                f"messages.{index}: unexpected `tool_use_id` found in `tool_result` blocks: "
                f"{call_id}. Each `tool_result` block must have a corresponding `tool_use` "
                "block in the previous message."
            )


def _blocks(message: Any) -> list[Any]:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return content if isinstance(content, list) else []


def _text_of(block: Any) -> str | None:
    if isinstance(block, dict) and block.get("type") == "text":
        text = block.get("text")
        return text if isinstance(text, str) else None
    return None


def _tool_use_ids(message: Any) -> list[str]:
    return [str(b.get("id")) for b in _blocks(message) if _kind(b) == "tool_use"]


def _tool_result_ids(message: Any) -> list[str]:
    return [str(b.get("tool_use_id")) for b in _blocks(message) if _kind(b) == "tool_result"]


def _kind(block: Any) -> Any:
    return block.get("type") if isinstance(block, dict) else None


def parse_steps(model: str) -> list[list[str]] | None:
    """The tool names of each step for `plan:`/`steps:` models; None for echo."""
    if model.startswith(("plan:", "unstorable:", "outsized:", "badid:", "reuse:")):
        plan = model.partition(":")[2]
        steps = [[n.strip() for n in s.split(",") if n.strip()] for s in plan.split(";")]
        return [s for s in steps if s]
    if model.startswith("steps:"):
        count, _, tool = model[6:].partition(":")
        if count.isdigit() and tool:
            return [[tool]] * int(count)
    return None


def scenario_reply(body: dict[str, Any]) -> dict[str, Any]:
    """The assistant message a valid, non-failing request gets (see the module docstring)."""
    messages: list[dict[str, Any]] = body["messages"]
    start, user_text = _current_turn(messages)
    k = sum(1 for m in messages[start + 1 :] if m["role"] == "assistant")
    steps = parse_steps(body["model"])
    content: list[dict[str, Any]]
    if body["model"].startswith("cutoff:"):
        name, _, stop = body["model"].removeprefix("cutoff:").partition(":")
        content = [
            {"type": "text", "text": "Posting"},
            {"type": "tool_use", "id": "toolu_" + secrets.token_hex(12), "name": name, "input": {}},
        ]
        stop = stop or "max_tokens"
    elif body["model"].startswith("stopped:"):
        stop = body["model"].removeprefix("stopped:")
        content = [{"type": "text", "text": f"echo: {user_text}"[:STOPPED_TEXT_CHARS]}]
    elif steps is None or (body.get("tool_choice") or {}).get("type") == "none":
        content, stop = [{"type": "text", "text": f"echo: {user_text}"}], "end_turn"
    elif k < len(steps):
        schemas = {t["name"]: t["input_schema"] for t in body.get("tools") or []}
        content = [{"type": "text", "text": f"step {k + 1}"}]
        for index, name in enumerate(steps[k]):
            arguments = _fill_input(schemas.get(name), k + 1)
            call_id = _call_id(body["model"], k, index)
            content.append({"type": "tool_use", "id": call_id, "name": name, "input": arguments})
        stop = "tool_use"
    else:
        content, stop = [{"type": "text", "text": _summary(messages, start, k)}], "end_turn"
    if body["model"].startswith("unstorable:"):
        content = [_unstorable(block) for block in content]
    out_chars = sum(
        len(b["text"]) if b["type"] == "text" else len(json.dumps(b["input"])) for b in content
    )
    input_tokens = len(json.dumps(messages)) // 4 + 1
    if body["model"].startswith("outsized:"):
        content, input_tokens = _outsized(content), 3_000_000_000
    return {
        "id": "msg_" + secrets.token_hex(12),
        "type": "message",
        "role": "assistant",
        "model": body["model"],
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": {
            "input_tokens": input_tokens,
            "output_tokens": out_chars // 4 + 1,
        },
    }


def _call_id(model: str, step: int, index: int) -> str:
    if model.startswith("badid:"):
        return "call:" + secrets.token_hex(12)
    if model.startswith("reuse:"):
        return f"toolu_step{step}_call{index}"
    return "toolu_" + secrets.token_hex(12)


def _unstorable(block: dict[str, Any]) -> dict[str, Any]:
    """The block with its text, or every string of its input, ending in NUL and a lone
    surrogate."""

    def spoil(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: spoil(v) for k, v in value.items()}
        if isinstance(value, list):
            return [spoil(item) for item in value]
        return value + " \x00\ud800" if isinstance(value, str) else value

    if block["type"] == "text":
        return {**block, "text": spoil(block["text"])}
    return {**block, "input": spoil(block["input"])}


def _outsized(content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool calls with 300-character ids, and one more of a tool with a 100-character name."""
    calls = [b for b in content if b["type"] == "tool_use"]
    if not calls:
        return content
    invented = {"type": "tool_use", "id": "", "name": "n" * 100, "input": {}}
    return [
        {**b, "id": "toolu_" + secrets.token_hex(147)} if b["type"] == "tool_use" else b
        for b in [*content, invented]
    ]


def _current_turn(messages: list[dict[str, Any]]) -> tuple[int, str]:
    """Index and text of the last user message holding text (tool results alone start none)."""
    for index in range(len(messages) - 1, -1, -1):
        if messages[index]["role"] == "user":
            texts = [t for t in map(_text_of, _blocks(messages[index])) if t is not None]
            if texts:
                return index, "\n".join(texts)
    return 0, ""


def _fill_input(schema: Any, step: int) -> dict[str, Any]:
    if not isinstance(schema, dict):
        return {}
    properties = schema.get("properties") or {}
    arguments: dict[str, Any] = {}
    for name in schema.get("required") or []:
        spec = properties.get(name) or {}
        kind = spec.get("type", "string")
        if isinstance(kind, list):
            kind = next((t for t in kind if t != "null"), "string")
        if spec.get("enum"):
            arguments[name] = spec["enum"][0]
        elif kind in ("integer", "number"):
            arguments[name] = step
        elif kind == "boolean":
            arguments[name] = True
        elif kind == "array":
            arguments[name] = []
        elif kind == "object":
            arguments[name] = {}
        else:
            arguments[name] = f"{name}-{step}"
    return arguments


def _summary(messages: list[dict[str, Any]], start: int, k: int) -> str:
    names = {
        b["id"]: b["name"]
        for m in messages
        if m["role"] == "assistant"
        for b in _blocks(m)
        if b.get("type") == "tool_use"
    }
    errors: list[str] = []
    durability: list[str] = []
    for message in messages[start:]:
        for block in _blocks(message):
            if message["role"] != "user" or block.get("type") != "tool_result":
                continue
            call_id = str(block.get("tool_use_id"))
            if block.get("is_error"):
                errors.append(names.get(call_id, call_id))
            if _is_durability_error(block.get("content")):
                durability.append(call_id)
    return (
        f"done after {k} steps; errors: {','.join(errors)}; "
        f"durability errors: {','.join(durability)}"
    )


def _is_durability_error(content: Any) -> bool:
    if isinstance(content, list):
        content = "".join(t for t in map(_text_of, content) if t is not None)
    try:
        value = json.loads(content) if isinstance(content, str) else None
    except ValueError:
        return False
    return isinstance(value, dict) and value.get("kind") == "tool-durability-error"


def build_app(state: FakeState) -> Starlette:
    """The Starlette app: `POST /v1/messages` plus the `/_...` control endpoints."""

    async def create_message(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        generation = state.record(body)
        await _wait(state)
        failure = state.take_failure(generation)
        if failure is not None:
            status, kind = failure
            text = _ERROR_TEXT.get(kind, f"fake {kind}")
            return error_response(status, kind, text, retry_after_ms=state.retry_after_ms)
        try:
            validate(body)
        except InvalidRequest as err:
            return error_response(400, "invalid_request_error", str(err))
        model: str = body["model"]
        if model.startswith("fail:"):
            status = int(model[5:]) if model[5:].isdigit() else 500
            kind = ERROR_TYPE_BY_STATUS.get(status, "api_error")
            text = _ERROR_TEXT.get(kind, f"fake {kind}")
            return error_response(status, kind, text, retry_after_ms=state.retry_after_ms)
        headers = {"request-id": "req_" + secrets.token_hex(12)}
        # JSON with \u escapes: a lone surrogate has no UTF-8 form, but the API may send one.
        reply = json.dumps(scenario_reply(body)).encode()
        return Response(reply, media_type="application/json", headers=headers)

    async def list_requests(request: Request) -> JSONResponse:
        return JSONResponse(state.requests)

    async def reset(request: Request) -> JSONResponse:
        state.reset()
        return JSONResponse({"ok": True})

    async def fail_next(request: Request) -> JSONResponse:
        spec = await request.json()
        state.fail_next(int(spec["count"]), int(spec["status"]), spec.get("error_type"))
        return JSONResponse({"ok": True})

    async def set_delay(request: Request) -> JSONResponse:
        state.set_delay(float((await request.json())["seconds"]))
        return JSONResponse({"ok": True})

    return Starlette(
        routes=[
            Route("/v1/messages", create_message, methods=["POST"]),
            Route("/_requests", list_requests, methods=["GET"]),
            Route("/_reset", reset, methods=["POST"]),
            Route("/_fail_next", fail_next, methods=["POST"]),
            Route("/_delay", set_delay, methods=["POST"]),
        ]
    )


async def _wait(state: FakeState) -> None:
    # Waiting on the `closing` event, not sleeping, so stopping never waits out a long delay.
    if state.delay > 0:
        await asyncio.to_thread(state.closing.wait, state.delay)


class FakeAnthropic(ThreadedServer):
    """The fake served from a background thread; `with FakeAnthropic() as fake: ... fake.url`."""

    def __init__(self, *, port: int = 0, retry_after_ms: int | None = 10) -> None:
        self._state = FakeState(retry_after_ms=retry_after_ms)
        super().__init__(build_app(self._state), name="fake-anthropic", port=port)

    @property
    def requests(self) -> list[Any]:
        """Every `POST /v1/messages` body received so far (a snapshot)."""
        return self._state.requests

    def reset(self) -> None:
        """Forget requests, pending failures and the delay."""
        self._state.reset()

    def fail_next(self, count: int, status: int, error_type: str | None = None) -> None:
        """Answer the next `count` requests with `status` (type derived from it if omitted)."""
        self._state.fail_next(count, status, error_type)

    def set_delay(self, seconds: float) -> None:
        """Sleep this long before answering each request."""
        self._state.set_delay(seconds)

    def stop(self) -> None:
        """Stop serving (a request waiting out a delay answers at once); safe to call twice."""
        self._state.closing.set()
        super().stop()


def main(argv: list[str] | None = None) -> None:
    """Serve the fake in this process until killed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--retry-after-ms", type=int, default=10)
    args = parser.parse_args(argv)
    sock = socket.socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # see app/serving.py
    sock.bind((args.host, args.port))  # --port 0: the kernel picks; the first line tells
    sock.listen(128)  # listening before the URL is printed: an early client queues, not fails
    print(f"fake anthropic on http://{args.host}:{sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(
        build_app(FakeState(retry_after_ms=args.retry_after_ms)),
        log_config=None,
        log_level="warning",
        access_log=False,
        lifespan="off",
    )
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()


if __name__ == "__main__":
    main()

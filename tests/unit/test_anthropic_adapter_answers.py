"""AnthropicLLMClient on 2xx answers: those that are not valid messages, and odd ones it keeps."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.domain import Message, ToolCall
from app.llm.anthropic import AnthropicLLMClient
from app.serving import ThreadedServer
from tests.unit.adapter_support import ISSUE, answer, failure, request


def nested(levels: int) -> dict[str, Any]:
    """An object whose objects nest `levels` deep."""
    value: dict[str, Any] = {"x": 1}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


def deep_answer(levels: int) -> bytes:
    """An answer whose tool input nests deeper than json.dumps (or json.loads) can go."""
    marker = json.dumps({"marker": 1})
    body = answer(tool_use(arguments={"marker": 1})).decode()
    return body.replace(marker, '{"a":' * levels + "1" + "}" * levels).encode()


def out_of_range_answer() -> bytes:
    """An answer whose tool input holds 1e400, which JSON readers take for inf."""
    marker = json.dumps({"marker": 1})
    body = answer(tool_use(arguments={"marker": 1})).decode()
    return body.replace(marker, '{"amount": 1e400}').encode()


def tool_use(call_id: Any = "toolu_1", name: Any = "get_issue", arguments: Any = None) -> Any:
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments or {"id": "1"}}


@contextmanager
def model_answering(body: bytes, content_type: str = "application/json") -> Iterator[str]:
    """A model API whose every answer is 200 with this body; its base URL."""

    async def messages(_: Request) -> Response:
        return Response(body, media_type=content_type)

    app = Starlette(routes=[Route("/v1/messages", messages, methods=["POST"])])
    with ThreadedServer(app, name="odd-model") as server:
        yield server.url


NOT_MESSAGES: dict[str, tuple[bytes, str]] = {
    "other-object": (b'{"hello": "world"}', "application/json"),
    "no-usage": (b'{"content": [], "role": "assistant"}', "application/json"),
    "array": (b"[1, 2, 3]", "application/json"),
    "null": (b"null", "application/json"),
    "plain-text": (b"hello", "text/plain"),
    "html-said-json": (b"<html>502</html>", "application/json"),
    "usage-null": (answer(usage={"input_tokens": None, "output_tokens": 1}), "application/json"),
    "usage-strings": (
        answer(usage={"input_tokens": "3", "output_tokens": "4"}),
        "application/json",
    ),
    "usage-negative": (answer(usage={"input_tokens": -5, "output_tokens": 1}), "application/json"),
    "usage-float": (answer(usage={"input_tokens": 1.5, "output_tokens": 1}), "application/json"),
    # Past what a turn's 64-bit sums can hold: the final write failed, a 500 after the tools ran.
    "usage-past-int64": (
        answer(usage={"input_tokens": 2**63, "output_tokens": 1}),
        "application/json",
    ),
    "usage-past-bound": (
        answer(usage={"input_tokens": 1, "output_tokens": 2**32}),
        "application/json",
    ),
    "text-not-string": (answer({"type": "text", "text": 123}), "application/json"),
    # A stop reason is stored with the run, as text.
    "stop-reason-number": (answer(tool_use(), stop_reason=7), "application/json"),
    "stop-reason-object": (answer(stop_reason={"type": "end_turn"}), "application/json"),
    "call-id-int": (answer(tool_use(call_id=123)), "application/json"),
    "call-id-empty": (answer(tool_use(call_id="")), "application/json"),
    "call-without-name": (answer(tool_use(name=None)), "application/json"),
    "input-pairs": (answer(tool_use(arguments=[["x", "y"]])), "application/json"),
    "input-number": (answer(tool_use(arguments=42)), "application/json"),
    "same-id-twice": (answer(tool_use(), tool_use(arguments={"id": "2"})), "application/json"),
    # Run and stored, then every answer holding it was a 500 (too deep to serialise back).
    "input-too-deep": (answer(tool_use(arguments=nested(65))), "application/json"),
    "input-far-too-deep": (deep_answer(5000), "application/json"),
    # Run, then stored as Infinity (SQLite: no later request could be sent) or a 500
    # (PostgreSQL's json refuses it).
    "input-out-of-range": (out_of_range_answer(), "application/json"),
    # Ids and names the API refuses when the history is sent back (a NUL or a lone surrogate
    # would become U+FFFD, which it refuses too).
    "call-id-colon": (answer(tool_use(call_id="call:1")), "application/json"),
    "call-id-space": (answer(tool_use(call_id="toolu 1")), "application/json"),
    "call-id-nul": (answer(tool_use(call_id="toolu_\x00")), "application/json"),
    "name-surrogate": (answer(tool_use(name="get_\udfff")), "application/json"),
    "name-dot": (answer(tool_use(name="tools.get_issue")), "application/json"),
    "name-too-long": (answer(tool_use(name="n" * 129)), "application/json"),
}


@pytest.mark.parametrize("case", NOT_MESSAGES)
async def test_a_2xx_that_is_not_a_valid_message_is_an_api_error(case: str) -> None:
    # The SDK builds whatever came without validating it: each of these once ended the run
    # with Python's words, ran a tool on arguments the model never sent, or stored a call
    # that broke every later read or turn of the session.
    with model_answering(*NOT_MESSAGES[case]) as url:
        error = await failure(url)

    assert error.type == "api_error"
    assert error.message.startswith(
        "The model API answered something that is not a valid message: "
    ), error.message


async def test_blocks_it_does_not_know_are_skipped_and_text_is_made_storable() -> None:
    body = answer(
        {"type": "text", "text": "before \x00 "},
        {"type": "container_upload_v9", "file_id": "f"},  # newer than the SDK
        {"type": "thinking", "thinking": "hm", "signature": "s"},
        {"type": "text", "text": "after \ud800"},
        tool_use("toolu_1", "get_issue", {"id\x00": ["\ud83d", "ok \U0001f600"]}),
        stop_reason="tool_use\x00\udfff",
    )
    with model_answering(body) as url:
        llm = AnthropicLLMClient(max_retries=0, timeout_s=5, api_key="k", base_url=url)
        try:
            response = await llm.complete(request([Message.user("hi")], tools=[ISSUE]))
        finally:
            await llm.aclose()

    # NUL (PostgreSQL text) and lone surrogates (not UTF-8) cannot be stored: U+FFFD.
    assert response.text == "before \ufffd after \ufffd"
    assert response.tool_calls == [
        ToolCall("toolu_1", "get_issue", {"id\ufffd": ["\ufffd", "ok \U0001f600"]})
    ]
    assert (response.usage.input_tokens, response.usage.output_tokens) == (3, 4)
    assert response.stop_reason == "tool_use\ufffd\ufffd"

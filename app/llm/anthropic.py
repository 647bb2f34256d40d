"""LLMClient over the official async Anthropic SDK: maps our history to Messages API params."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, Literal

import anthropic
from anthropic import Omit, omit
from anthropic.types import (
    AssistantMessageParam,
    MessageParam,
    TextBlockParam,
    ToolChoiceNoneParam,
    ToolParam,
    ToolResultBlockParam,
    ToolUseBlockParam,
    UserMessageParam,
)
from typing_extensions import override

from app.domain import (
    Message,
    Role,
    ToolCall,
    Usage,
    is_plain_json,
    nests_deeper_than,
    storable,
)
from app.llm.base import LLMClient, LLMError, ModelRequest, ModelResponse, not_a_message

log = logging.getLogger(__name__)

# Sent when no credential is configured, so the client still builds offline; the API then
# answers 401, which surfaces as LLMError(type="authentication_error") at call time.
_PLACEHOLDER_API_KEY = "missing-anthropic-api-key"

# Used only when an error body carries no `error.type` (e.g. a proxy's HTML error page).
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}

# A request id quoted in an error (the API's are `req_…`); anything else is not quoted.
_REQUEST_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")

# What the API accepts back in a tool_use block it is sent (its own ids are `toolu_…`).
_TOOL_USE_ID = re.compile(r"[A-Za-z0-9_-]+")
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")
# More than any model reads or writes in one call; each count is stored as a 64-bit sum
# over a turn's calls, so a larger one could not be stored.
MAX_TOKEN_COUNT = 2**32 - 1
# How long one attempt may take to connect (the SDK's own default).
CONNECT_TIMEOUT_S = 5.0
# Tool inputs deeper than this could be run but not answered back (see nests_deeper_than).
MAX_TOOL_INPUT_DEPTH = 64
# Stands in for a tool that history names and the agent no longer has (see `_tools`).
_GONE_TOOL = "A tool this conversation used earlier; it is no longer available."

_ApiRole = Literal["user", "assistant"]
_Block = TextBlockParam | ToolUseBlockParam | ToolResultBlockParam


class AnthropicLLMClient(LLMClient):
    """The production model client; retries of 429/5xx/overloaded are left to the SDK."""

    def __init__(
        self,
        *,
        max_retries: int,
        timeout_s: float,
        api_key: str | None = None,
        base_url: str | None = None,
    ) -> None:
        # Each attempt may take the whole budget, but its connection only the SDK's usual
        # few seconds: an API host that drops packets is then retried, not waited out.
        timeout = anthropic.Timeout(timeout_s, connect=min(CONNECT_TIMEOUT_S, timeout_s))

        def build(key: str | None) -> anthropic.AsyncAnthropic:
            # key/base_url None: the SDK reads ANTHROPIC_API_KEY / ANTHROPIC_BASE_URL itself.
            return anthropic.AsyncAnthropic(
                api_key=key, base_url=base_url, max_retries=max_retries, timeout=timeout
            )

        # What a failed call adds to its error when the client has no credential to send.
        self._no_credential = ""
        try:
            sdk = build(api_key)
        except anthropic.CredentialsError as err:
            # A broken profile must not stop the service (agents on scripted models still
            # work); calls to the API then fail with authentication_error.
            log.warning("anthropic credentials unusable: %s", type(err).__name__)
            sdk = build(_PLACEHOLDER_API_KEY)
            self._no_credential = " (The Anthropic credentials could not be loaded.)"
        if sdk.api_key is None and sdk.auth_token is None and sdk.credentials is None:
            # Without any credential the SDK raises a bare TypeError per call; a placeholder
            # turns that into a regular 401 from the API.
            sdk.api_key = _PLACEHOLDER_API_KEY
            self._no_credential = " (No Anthropic credential is set: ANTHROPIC_API_KEY.)"
            log.warning(
                "no Anthropic credential is set (ANTHROPIC_API_KEY): calls of agents on API"
                " models will fail"
            )
        self._client = sdk
        self._timeout_s = timeout_s
        self._timeout = timeout

    @override
    async def complete(self, request: ModelRequest) -> ModelResponse:
        """Send one Messages API request and map the answer back to our types."""
        tools, tool_choice = _tools(request)
        try:
            # The SDK bounds each attempt, and sleeps as long as a 429's Retry-After says
            # between them; the call as a whole, retries included, gets the same bound.
            async with asyncio.timeout(self._timeout_s):
                message = await self._client.messages.create(
                    model=request.model,
                    max_tokens=request.max_tokens,
                    messages=to_api_messages(request.messages),
                    # The API refuses a system prompt of white space only.
                    system=request.system if request.system and request.system.strip() else omit,
                    tools=tools if tools else omit,
                    tool_choice=tool_choice,
                    # Given per call: left to the client, a timeout equal to the SDK's default
                    # makes it refuse, unsent, a large max_tokens ("streaming is required").
                    timeout=self._timeout,
                )
        except (anthropic.AnthropicError, TimeoutError) as err:
            error = _to_llm_error(err, timeout_s=self._timeout_s, note=self._no_credential)
            # Type and status only: the error text may quote the request, which holds prompts.
            log.warning(
                "model call failed",
                extra={"error_type": error.type, "retryable": error.retryable},
            )
            raise error from err
        except (ValueError, RecursionError) as err:  # a 2xx whose body says JSON and is not
            raise _logged_not_a_message("its body is not JSON, or nests too deep to read") from err
        try:
            return read_answer(message)
        except _NotAMessage as err:
            raise _logged_not_a_message(str(err)) from err

    @override
    async def aclose(self) -> None:
        """Close the SDK's HTTP connections."""
        await self._client.close()


def _tools(request: ModelRequest) -> tuple[list[ToolParam], ToolChoiceNoneParam | Omit]:
    """The request's `tools` and `tool_choice`.

    The API refuses a request whose history holds tool_use or tool_result blocks and that
    defines no tools: an agent whose tools were all taken away in the agents file could then
    never continue its sessions. It gets a stand-in for each tool its history names, and
    `tool_choice: none`, so the model can read its history and call nothing. (A history
    without calls has no results either: a call is stored before its result.)"""
    if request.tools:
        tools: list[ToolParam] = [
            {"name": t.name, "description": t.description, "input_schema": t.input_schema}
            for t in request.tools
        ]
        return tools, omit
    names = dict.fromkeys(call.name for m in request.messages for call in m.tool_calls)
    if not names:
        return [], omit
    stand_ins: list[ToolParam] = [
        {"name": name, "description": _GONE_TOOL, "input_schema": {"type": "object"}}
        for name in names
    ]
    return stand_ins, ToolChoiceNoneParam(type="none")


def _logged_not_a_message(why: str) -> LLMError:
    log.warning("model call failed", extra={"error_type": "api_error", "retryable": False})
    return not_a_message(why)


class _NotAMessage(Exception):
    """What is wrong with an answer (its shape only: never the model's words)."""


def read_answer(message: Any) -> ModelResponse:
    """The runner's view of a Messages API answer, or _NotAMessage.

    The SDK builds the answer without validating it, so a 2xx that is not a message (a
    proxy's page), a block of a type newer than the SDK, or a malformed tool call would
    otherwise fail later with Python's words, or be stored and break the session's history.
    A tool call must have an id of A-Z a-z 0-9 _ - that no other call of the answer has (the
    step's results are paired with its calls by id), a name of 1-128 such characters, and an
    object of plain JSON (no number out of range) as its input, nested at most
    MAX_TOOL_INPUT_DEPTH deep. Token counts must be
    storable, the stop reason a string or absent. Strings are made storable (see `storable`)."""
    content = getattr(message, "content", None)
    usage = getattr(message, "usage", None)
    if not isinstance(content, list) or usage is None:
        raise _NotAMessage("no content list or no usage")
    tokens = (getattr(usage, "input_tokens", None), getattr(usage, "output_tokens", None))
    if not all(type(n) is int and 0 <= n <= MAX_TOKEN_COUNT for n in tokens):
        raise _NotAMessage(f"usage is not two token counts of 0 to {MAX_TOKEN_COUNT}")
    stop_reason = getattr(message, "stop_reason", None)
    if stop_reason is not None and not isinstance(stop_reason, str):
        raise _NotAMessage("a stop_reason that is not a string")
    texts: list[str] = []
    calls: list[ToolCall] = []
    ids: set[str] = set()
    for block in content:
        kind = getattr(block, "type", None)
        if kind == "text":
            text = getattr(block, "text", None)
            if not isinstance(text, str):
                raise _NotAMessage("a text block without text")
            texts.append(storable(text))
        elif kind == "tool_use":
            call = _read_tool_use(block)
            if call.id in ids:
                raise _NotAMessage(f"tool_use id {call.id!r} is used twice in the answer")
            ids.add(call.id)
            calls.append(call)
        # Other kinds (thinking, server tools, kinds newer than the SDK) carry nothing the
        # runner uses.
    return ModelResponse(
        text="".join(texts),
        tool_calls=calls,
        usage=Usage(*tokens),  # type: ignore[arg-type]  # checked above: two ints
        stop_reason=storable(stop_reason),
    )


def _read_tool_use(block: Any) -> ToolCall:
    """A tool_use block as a call, or _NotAMessage: its id and name are stored and sent back
    with the history, so one the API refuses there would fail every later turn."""
    call_id, name = getattr(block, "id", None), getattr(block, "name", None)
    arguments = getattr(block, "input", None)
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise _NotAMessage("a tool_use block without a string id and name")
    if not _TOOL_USE_ID.fullmatch(call_id):
        raise _NotAMessage(f"tool_use id {call_id[:64]!r} is not of A-Z a-z 0-9 _ -")
    if not _TOOL_NAME.fullmatch(name):
        raise _NotAMessage(f"tool_use name {name[:64]!r} is not 1-128 of A-Z a-z 0-9 _ -")
    if not isinstance(arguments, dict):
        raise _NotAMessage(f"tool_use {call_id!r} has an input that is not an object")
    if nests_deeper_than(arguments, levels=MAX_TOOL_INPUT_DEPTH):
        raise _NotAMessage(
            f"tool_use {call_id!r} has an input nested deeper than {MAX_TOOL_INPUT_DEPTH} levels"
        )
    if not is_plain_json(arguments):  # 1e400, read as inf: neither store nor the API takes it
        raise _NotAMessage(f"tool_use {call_id!r} has a number in its input out of range")
    return ToolCall(call_id, name, storable(arguments))


def to_api_messages(history: list[Message]) -> list[MessageParam]:
    """Map stored history to API messages, merging neighbours that land on the same role.

    Tool results become `tool_result` blocks in a user message; a tool result followed by a new
    user text (a turn after crash repair) becomes one user message, results first as the API
    requires. An assistant message with blank text and no tool calls is skipped: the API rejects
    empty content and blank text blocks, and such a message tells the model nothing.
    """
    turns: list[tuple[_ApiRole, list[_Block]]] = []
    for message in history:
        role, blocks = _to_blocks(message)
        if not blocks:
            continue
        if turns and turns[-1][0] == role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((role, blocks))
    result: list[MessageParam] = []
    for role, blocks in turns:
        if role == "user":
            result.append(UserMessageParam(role="user", content=blocks))
        else:
            result.append(AssistantMessageParam(role="assistant", content=blocks))
    return result


def _to_blocks(message: Message) -> tuple[_ApiRole, list[_Block]]:
    if message.role is Role.USER:
        return "user", [TextBlockParam(type="text", text=message.content)]
    if message.role is Role.TOOL:
        result = ToolResultBlockParam(
            type="tool_result", tool_use_id=message.tool_call_id or "", content=message.content
        )
        if message.is_error:
            result["is_error"] = True
        return "user", [result]
    blocks: list[_Block] = []
    if message.content.strip():
        blocks.append(TextBlockParam(type="text", text=message.content))
    for call in message.tool_calls:
        blocks.append(
            ToolUseBlockParam(type="tool_use", id=call.id, name=call.name, input=call.arguments)
        )
    return "assistant", blocks


def _to_llm_error(
    err: anthropic.AnthropicError | TimeoutError, *, timeout_s: float, note: str = ""
) -> LLMError:
    """Name an SDK failure, `note` added to its message; `retryable` mirrors the SDK's own
    retry policy."""
    error = _named(err, timeout_s=timeout_s)
    if note:
        return LLMError(f"{error}{note}", type=error.type, retryable=error.retryable)
    return error


def _named(err: anthropic.AnthropicError | TimeoutError, *, timeout_s: float) -> LLMError:
    if isinstance(err, anthropic.APITimeoutError | TimeoutError):
        # Also what a 429 asking to wait longer than the bound ends as: say what the bound is.
        return LLMError(
            f"The model call did not finish within ANTHROPIC_TIMEOUT_S ({timeout_s:g} s),"
            " its retries and their waits included.",
            type="api_timeout",
            retryable=True,
        )
    if isinstance(err, anthropic.APIConnectionError):
        # The SDK's name for both: no connection, and one that broke before the answer ended.
        return LLMError(
            "The connection to the model API failed: it could not be opened, or it broke"
            " before the answer was complete.",
            type="api_connection_error",
            retryable=True,
        )
    if isinstance(err, anthropic.APIStatusError):
        status = err.status_code
        sent: object = err.type  # whatever the body's error.type held
        error_type = (
            sent if isinstance(sent, str) and sent else _TYPE_BY_STATUS.get(status, "api_error")
        )
        should_retry = err.response.headers.get("x-should-retry")
        if should_retry in ("true", "false"):
            retryable = should_retry == "true"
        else:
            retryable = status in (408, 409, 429) or status >= 500
        detail = err.api_message or "no message"
        # What Anthropic's support asks for to find the call.
        request_id = err.request_id
        if isinstance(request_id, str) and _REQUEST_ID.fullmatch(request_id):
            detail += f" (request-id {request_id})"
        return LLMError(
            f"Model API error {status} ({error_type}): {detail}",
            type=error_type,
            retryable=retryable,
        )
    if isinstance(err, anthropic.CredentialsError):
        return LLMError("Model API credentials could not be loaded.", type="authentication_error")
    if isinstance(err, anthropic.APIResponseValidationError):
        return LLMError("The model API answered an unexpected shape.", type="api_response_error")
    return LLMError(f"Model call failed: {type(err).__name__}", type="model_error")

"""The Messages API's request rules, as the fake checks them before it answers."""

from __future__ import annotations

import re
from typing import Any

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
        for j, block in enumerate(content_blocks(message)):
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
    if not isinstance(system, list) or any(text_of(b) is None for b in system):
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
    blocks = content_blocks(message)
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
        not isinstance(content, list) or any(text_of(b) is None for b in content)
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


def content_blocks(message: Any) -> list[Any]:
    """A message's content as a list of blocks (a string is one text block)."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return content if isinstance(content, list) else []


def text_of(block: Any) -> str | None:
    """A text block's text; None for any other block."""
    if isinstance(block, dict) and block.get("type") == "text":
        text = block.get("text")
        return text if isinstance(text, str) else None
    return None


def _tool_use_ids(message: Any) -> list[str]:
    return [str(b.get("id")) for b in content_blocks(message) if _kind(b) == "tool_use"]


def _tool_result_ids(message: Any) -> list[str]:
    return [str(b.get("tool_use_id")) for b in content_blocks(message) if _kind(b) == "tool_result"]


def _kind(block: Any) -> Any:
    return block.get("type") if isinstance(block, dict) else None

"""What the fake answers a valid request: the scenario its `model` picks (see `fake_anthropic`)."""

from __future__ import annotations

import json
import secrets
from typing import Any

from tests.support.fake_anthropic_validation import content_blocks, text_of

STOPPED_TEXT_CHARS = 12  # how much of its echo a `stopped:` answer gives


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
    """The assistant message a valid, non-failing request gets (see `fake_anthropic`)."""
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
            texts = [t for t in map(text_of, content_blocks(messages[index])) if t is not None]
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
        for b in content_blocks(m)
        if b.get("type") == "tool_use"
    }
    errors: list[str] = []
    durability: list[str] = []
    for message in messages[start:]:
        for block in content_blocks(message):
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
        content = "".join(t for t in map(text_of, content) if t is not None)
    try:
        value = json.loads(content) if isinstance(content, str) else None
    except ValueError:
        return False
    return isinstance(value, dict) and value.get("kind") == "tool-durability-error"

"""What the adapter tests share: their tools, a request, a fresh client's failure, an answer."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app.domain import Message
from app.llm.anthropic import AnthropicLLMClient
from app.llm.base import LLMError, ModelRequest, ToolSpec

ISSUE = ToolSpec(
    "get_issue",
    "Fetch an issue by id",
    {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]},
)
SLACK = ToolSpec(
    "post_slack",
    "Post a message",
    {
        "type": "object",
        "properties": {"channel": {"type": "string"}, "urgent": {"type": "boolean"}},
        "required": ["channel", "urgent"],
    },
)


def request(
    messages: list[Message],
    *,
    model: str = "echo",
    tools: list[ToolSpec] | None = None,
    max_tokens: int = 256,
) -> ModelRequest:
    return ModelRequest(model, "You triage issues.", messages, tools or [], max_tokens)


async def failure(
    base_url: str, *, max_retries: int = 0, timeout_s: float = 5, model: str = "echo"
) -> LLMError:
    """The LLMError a fresh client raises for one request to `base_url`."""
    llm = AnthropicLLMClient(
        max_retries=max_retries, timeout_s=timeout_s, api_key="k", base_url=base_url
    )
    try:
        with pytest.raises(LLMError) as caught:
            await llm.complete(request([Message.user("hi")], model=model))
    finally:
        await llm.aclose()
    return caught.value


USAGE = {"input_tokens": 3, "output_tokens": 4}


def answer(*blocks: Any, usage: Any = USAGE, stop_reason: Any = "end_turn") -> bytes:
    """A Messages API answer holding these content blocks."""
    body: dict[str, Any] = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m"}
    body |= {"content": list(blocks), "stop_reason": stop_reason, "usage": usage}
    return json.dumps(body).encode()

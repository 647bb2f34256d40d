"""Pick the client by the agent's model: `scripted:<name>` offline, anything else Anthropic."""

from __future__ import annotations

from app.llm.anthropic import AnthropicLLMClient
from app.llm.base import LLMClient, ModelRequest, ModelResponse
from app.llm.scripted import PREFIX as SCRIPTED_PREFIX
from app.llm.scripted import ScriptedLLMClient


class ModelRouter:
    """An LLMClient that forwards each request to the client its model names."""

    def __init__(self, *, anthropic: LLMClient, scripted: LLMClient) -> None:
        self._anthropic = anthropic
        self._scripted = scripted

    @classmethod
    def from_settings(cls, *, max_retries: int, timeout_s: float) -> ModelRouter:
        """The production router; the SDK reads ANTHROPIC_API_KEY / ANTHROPIC_BASE_URL."""
        return cls(
            anthropic=AnthropicLLMClient(max_retries=max_retries, timeout_s=timeout_s),
            scripted=ScriptedLLMClient(),
        )

    async def complete(self, request: ModelRequest) -> ModelResponse:
        """Forward to the scripted or the Anthropic client."""
        if request.model.startswith(SCRIPTED_PREFIX):
            return await self._scripted.complete(request)
        return await self._anthropic.complete(request)

    async def aclose(self) -> None:
        """Close both clients."""
        await self._anthropic.aclose()
        await self._scripted.aclose()

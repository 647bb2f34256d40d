"""Pick the client by the agent's model: `scripted:<name>` offline, anything else Anthropic."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from typing_extensions import override

from app.llm.base import LLMClient, ModelRequest, ModelResponse
from app.llm.scripted import ScriptedLLMClient, is_scripted


class ModelRouter:
    """An LLMClient that forwards each request to the client its model names."""

    def __init__(self, *, anthropic: LLMClient, scripted: LLMClient) -> None:
        self._anthropic = anthropic
        self._scripted = scripted

    @classmethod
    def from_settings(cls, *, max_retries: int, timeout_s: float, api_models: bool) -> ModelRouter:
        """The production router; the SDK reads ANTHROPIC_API_KEY / ANTHROPIC_BASE_URL.

        `import anthropic` is half of a server's start (1.5 s of 3 here). So the SDK's client
        is built on a worker thread while the service starts and serves, and the first call
        to the API waits for it: from now if an agent names an API model (`api_models`),
        otherwise from the first call, which then none makes. Call it on the event loop."""

        def build() -> LLMClient:
            from app.llm.anthropic import AnthropicLLMClient  # here: see above

            return AnthropicLLMClient(max_retries=max_retries, timeout_s=timeout_s)

        return cls(anthropic=_BuiltAside(build, now=api_models), scripted=ScriptedLLMClient())

    async def complete(self, request: ModelRequest) -> ModelResponse:
        """Forward to the scripted or the Anthropic client."""
        if is_scripted(request.model):
            return await self._scripted.complete(request)
        return await self._anthropic.complete(request)

    async def aclose(self) -> None:
        """Close both clients."""
        await self._anthropic.aclose()
        await self._scripted.aclose()


class _BuiltAside(LLMClient):
    """A client built on a worker thread (`now`, or at the first call), which calls wait for;
    closed only if it was built."""

    def __init__(self, build: Callable[[], LLMClient], *, now: bool) -> None:
        self._build = build
        self._client: asyncio.Future[LLMClient] | None = None
        if now:
            self._start()

    def _start(self) -> asyncio.Future[LLMClient]:
        if self._client is None:
            self._client = asyncio.get_running_loop().run_in_executor(None, self._build)
        return self._client

    async def _built(self) -> LLMClient:
        # Shielded: a call cancelled while it waits must not cancel the build for the rest.
        return await asyncio.shield(self._start())

    @override
    async def complete(self, request: ModelRequest) -> ModelResponse:
        return await (await self._built()).complete(request)

    @override
    async def aclose(self) -> None:
        if self._client is not None:
            await (await self._built()).aclose()

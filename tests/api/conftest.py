"""The app in-process over ASGITransport, its lifespan run, the real SDK pointed at the fake."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from app.llm.anthropic import AnthropicLLMClient
from app.llm.router import ModelRouter
from app.llm.scripted import ScriptedLLMClient
from app.main import create_app
from app.settings import Settings
from tests.api.helpers import serve
from tests.support.agents import write_agents_file
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.tool_server import ToolServer


@pytest.fixture
def agents_file(tmp_path: Path, tool_server: ToolServer) -> Path:
    """The test agents, their HTTP tools on the tool server."""
    return write_agents_file(tmp_path, tool_server.url)


def build_app(database_url: str, agents_file: Path, fake_model: FakeAnthropic) -> FastAPI:
    """The app on `database_url`, the real anthropic SDK talking to the fake model."""
    settings = Settings(database_url=database_url, agents_file=agents_file, anthropic_max_retries=0)
    llm = ModelRouter(
        anthropic=AnthropicLLMClient(
            max_retries=0, timeout_s=10, api_key="test", base_url=fake_model.url
        ),
        scripted=ScriptedLLMClient(),
    )
    return create_app(settings, llm=llm)


@pytest.fixture
async def client(
    database_url: str, agents_file: Path, fake_model: FakeAnthropic
) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the app on a fresh database of each backend."""
    async with serve(build_app(database_url, agents_file, fake_model)) as http:
        yield http


@pytest.fixture
async def memory_client(
    agents_file: Path, fake_model: FakeAnthropic
) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the app on DATABASE_URL=memory://."""
    async with serve(build_app("memory://", agents_file, fake_model)) as http:
        yield http

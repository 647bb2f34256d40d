"""The runner tests' fixtures: a fresh probe per test, and the tool registry."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from app.tools.agents_file import parse_registry
from app.tools.registry import ToolRegistry
from tests.unit.runner import support
from tests.unit.runner.support import AGENTS_YAML, Probe


@pytest.fixture(autouse=True)
def probe() -> Iterator[Probe]:
    """The probe the tools record into, new for each test."""
    support.PROBE = Probe()
    support.PROBE.release.set()
    yield support.PROBE
    support.PROBE = Probe()


@pytest.fixture
def registry() -> ToolRegistry:
    return parse_registry(AGENTS_YAML, label="test_runner.yaml")

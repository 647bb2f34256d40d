"""Fixtures of the ops tests."""

from __future__ import annotations

import pytest

from tests.ops.scenario import Scenario, run_scenario
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.tool_server import ToolServer


@pytest.fixture(scope="package")
def ops(
    tmp_path_factory: pytest.TempPathFactory,
    fake_model_server: FakeAnthropic,
    tool_server_session: ToolServer,
) -> Scenario:
    """The crash-resume-and-runs scenario, played once for the metrics and log tests."""
    return run_scenario(tmp_path_factory.mktemp("ops"), fake_model_server, tool_server_session)

"""A replica out of file descriptors on its way to PostgreSQL answers 503 saying so, not 500,
and serves again once it has them back."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest

from app.db.outages import REPLICA_EXHAUSTED_DETAIL
from tests.api.conftest import build_app
from tests.api.helpers import assert_problem, get_ok, serve
from tests.support.fake_anthropic import FakeAnthropic

pytestmark = pytest.mark.parametrize("backend", ["postgres"], indirect=True)


def lowest_free_descriptor() -> int:
    """The number a new descriptor would get: the lowest free one."""
    probe = os.open(os.devnull, os.O_RDONLY)
    os.close(probe)
    return probe


async def test_a_replica_out_of_file_descriptors_answers_503_and_recovers(
    database_url: str, agents_file: Path, fake_model: FakeAnthropic
) -> None:
    app = build_app(database_url, agents_file, fake_model)
    async with serve(app) as client:
        await get_ok(client, "/v1/sessions")
        await app.state.services.sessions.db.engine.dispose()  # the next read connects anew
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        # A new descriptor takes the lowest free number: allow none below it.
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free_descriptor(), hard))
        try:
            refused = await client.get("/v1/sessions")
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        body = assert_problem(refused, 503, "database_unavailable")
        assert body["detail"] == REPLICA_EXHAUSTED_DETAIL
        assert (await get_ok(client, "/v1/sessions"))["data"] == []

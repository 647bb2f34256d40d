"""SQLite on a full disk: runs and deletes answer 503 saying the database cannot be written,
reads go on, nothing runs twice, and the server recovers once there is room again."""

from __future__ import annotations

import resource

import pytest

from app.db.outages import UNWRITABLE_DETAIL
from tests.api.helpers import PROBLEM_JSON
from tests.support.server import AgentsServer
from tests.support.tool_server import ToolServer

pytestmark = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)


def test_a_full_disk_is_a_503_that_says_so_and_the_server_recovers(
    database_url: str, agents_server: AgentsServer, tool_server: ToolServer
) -> None:
    server = agents_server(database_url=database_url)
    with server, server.client() as client:
        turn = {"agent": "triage", "message": "triage issue 9", "session_id": "full"}
        first = client.post("/v1/runs", json={**turn, "message": "triage issue 8"})
        assert first.status_code == 200, first.text
        assert server.process is not None
        pid = server.process.pid
        soft, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        # No write past the first byte of any file: as a full disk is to SQLite.
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (1, hard))
        try:
            for refused in (client.post("/v1/runs", json=turn), client.delete("/v1/sessions/full")):
                assert refused.status_code == 503, refused.text
                assert refused.headers["content-type"].startswith(PROBLEM_JSON)
                assert refused.json()["code"] == "database_unavailable"
                assert refused.json()["detail"] == UNWRITABLE_DETAIL
            kept = client.get("/v1/sessions/full/messages")
            assert kept.status_code == 200, kept.text
            assert len(kept.json()["data"]) == 5
        finally:
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (soft, hard))
        again = client.post("/v1/runs", json=turn)
        assert again.status_code == 200, again.text
        assert again.json()["status"] == "complete"
    assert tool_server.count("post_slack") == 2  # one per turn that ran: none twice

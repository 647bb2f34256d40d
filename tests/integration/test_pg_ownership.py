"""PostgresOwnership on a real PostgreSQL: what a holder whose heartbeat is late may do."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from app.errors import SessionConflict
from app.services.pg_ownership import PostgresOwnership

pytestmark = pytest.mark.parametrize(
    "backend", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)

TAKEOVER_AFTER_S = 4.0


@pytest.fixture
async def ownership(database_url: str) -> AsyncIterator[PostgresOwnership]:
    # Beats far apart: the test sets how late the last one was.
    held = PostgresOwnership(database_url, heartbeat_s=3600, takeover_after_s=TAKEOVER_AFTER_S)
    await held.start()
    try:
        yield held
    finally:
        await held.stop()


async def unanswered(*, if_stale: bool = False) -> None:
    raise ConnectionError("the database does not answer")


async def test_a_holder_whose_last_beat_is_past_half_the_takeover_time_dispatches_nothing(
    ownership: PostgresOwnership, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another replica may take a session whose holder has been idle TAKEOVER_AFTER_S; the
    # holder stops at half that, so that a beat answered late still lands before it.
    async with ownership.hold("s-late"):
        await ownership.check("s-late")  # beat just now: may go on
        monkeypatch.setattr(ownership, "_heartbeat", unanswered)
        ownership._last_beat = time.monotonic() - 0.25 * TAKEOVER_AFTER_S
        await ownership.check("s-late")  # late, but not past half
        ownership._last_beat = time.monotonic() - 0.75 * TAKEOVER_AFTER_S
        with pytest.raises(SessionConflict):
            await ownership.check("s-late")

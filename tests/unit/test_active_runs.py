"""ActiveRuns: one turn per session in this process, and the run a refusal names."""

from __future__ import annotations

import asyncio
import threading

import pytest

from app.errors import SessionBusy
from app.services.ownership import ActiveRuns


async def refusal(runs: ActiveRuns, session_id: str) -> SessionBusy:
    with pytest.raises(SessionBusy) as refused:
        await runs.claim(session_id)
    return refused.value


async def test_a_session_whose_run_is_stored_is_refused_at_once_naming_it() -> None:
    runs = ActiveRuns()
    await runs.claim("s")
    runs.confirm("s", run_id="run-1")

    assert (await asyncio.wait_for(refusal(runs, "s"), 0.5)).extra["active_run_id"] == "run-1"
    await runs.claim("other")  # other sessions are free


async def test_a_second_request_waits_for_a_pending_claim_and_names_its_run() -> None:
    runs = ActiveRuns()
    await runs.claim("s")
    waiter = asyncio.create_task(refusal(runs, "s"))
    await asyncio.sleep(0.05)
    assert not waiter.done()  # pending: no run to name yet
    runs.confirm("s", run_id="run-1")

    assert (await asyncio.wait_for(waiter, 1)).extra["active_run_id"] == "run-1"


async def test_a_claim_given_back_without_a_run_lets_the_waiter_take_the_session() -> None:
    runs = ActiveRuns()
    await runs.claim("s")
    waiter = asyncio.create_task(runs.claim("s"))
    await asyncio.sleep(0.05)
    runs.release("s")  # a refused or replayed request: it never ran a turn

    await asyncio.wait_for(waiter, 1)
    assert runs.holds("s")


def test_a_claim_still_pending_after_the_settle_wait_is_refused_naming_no_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ActiveRuns, "SETTLE_WAIT_S", 0.1)
    answers: list[SessionBusy] = []

    async def scenario() -> None:
        runs = ActiveRuns()
        await runs.claim("s")  # never confirmed: its turn is stuck before its start write
        answers.append(await refusal(runs, "s"))

    # In a thread of its own: a claim that spun without yielding would hang the test's loop.
    thread = threading.Thread(target=asyncio.run, args=(scenario(),), daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "the second claim never gave up"
    assert [a.extra["active_run_id"] for a in answers] == [None]

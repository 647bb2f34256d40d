"""DurableJournal on a real database (SQLite file and PostgreSQL): what each write stores,
what conflicts, and what a failed write leaves."""

from __future__ import annotations

import sqlite3
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from app.db.journal import StoredTail, journal_store
from app.db.repositories import SessionRepository
from app.db.session import Database
from app.domain import Message, Role, RunStatus, ToolCall, Usage
from app.errors import SessionConflict
from app.failpoints import Failpoints
from app.metrics import Metrics
from app.services.journal import DurableJournal, RunEnd
from app.services.ownership import LocalOwnership
from tests.integration.journal.support import (
    CALLS,
    SESSION,
    journal_on,
    new_turn,
    overtaken_after_write_1,
    read,
    results_for,
    shape,
    start,
    write_counts,
)
from tests.support.transactions import Crash, CrashAt, results_sent_uncommitted


async def test_the_start_stores_a_new_session_and_the_running_run(
    db: Database, journal: DurableJournal, metrics: Metrics
) -> None:
    turn = new_turn("buy it")
    turn.idempotency_key = "key-1"
    turn.fingerprint = "f" * 64
    await journal.record_start(turn, interrupted=[])

    stored = await read(db, turn.run_id)
    assert stored.session is not None
    assert stored.session.agent == "main"
    assert stored.session.tenant_id == "tenant-1"
    assert stored.session.user_id == "user-1"
    assert stored.session.metadata_ == {"source": "test"}
    assert stored.session.message_count == 0
    assert stored.history == []
    run = stored.runs[turn.run_id]
    assert run.status == RunStatus.RUNNING
    assert run.session_id == SESSION
    assert run.agent == "main"
    assert run.user_id == "user-1"
    assert run.metadata_ == {"ticket": 7}
    assert (run.idempotency_key, run.request_fingerprint) == ("key-1", "f" * 64)
    assert run.created_at == turn.created_at
    assert run.finished_at is None
    assert (run.iterations, run.input_tokens, run.output_tokens) == (0, 0, 0)
    assert run.stop_reason is None
    assert (turn.stored_count, turn.session_exists, turn.stored_status, turn.user_stored) == (
        0,
        True,
        "running",
        False,
    )
    assert write_counts(metrics) == {"start": 1}


async def test_the_store_reports_the_stored_count_and_run_status(db: Database) -> None:
    # What a re-take compares with the turn's own account (Turn.stored_state).
    ownership = LocalOwnership()
    store = journal_store(db, fence_sql=ownership.fence_sql)
    journal = DurableJournal(
        store, failpoints=Failpoints.parse(None), ownership=ownership, metrics=Metrics()
    )
    assert await store.stored(SESSION, run_id="no-such-run") == (None, None)
    turn = await start(journal, "buy it")
    await journal.record_step(turn, assistant=Message.assistant("on it", tool_calls=CALLS))
    assert await store.stored(SESSION, run_id=turn.run_id) == (2, RunStatus.RUNNING.value)
    assert await store.stored(SESSION, run_id=turn.run_id) == turn.stored_state()
    assert await store.stored(SESSION, run_id="no-such-run") == (2, None)


async def test_the_store_tells_whose_the_last_message_is(db: Database) -> None:
    # What a re-take after a write of unknown outcome compares with that write's last message.
    ownership = LocalOwnership()
    store = journal_store(db, fence_sql=ownership.fence_sql)
    journal = DurableJournal(
        store, failpoints=Failpoints.parse(None), ownership=ownership, metrics=Metrics()
    )
    assert await store.last_message(SESSION) is None
    turn = await start(journal, "buy it")
    assert await store.last_message(SESSION) is None
    step = Message.assistant("on it", tool_calls=CALLS)
    await journal.record_step(turn, assistant=step)
    assert await store.last_message(SESSION) == StoredTail.of(step)
    other_ids = Message.assistant("on it", tool_calls=[ToolCall("toolu_other", "buy", {})])
    other_ids.created_at = step.created_at
    assert await store.last_message(SESSION) != StoredTail.of(other_ids)
    # The same text and ids, as a model whose ids follow the history makes them: written
    # by another write (another replica's, at another time), it is not this one's.
    assert step.created_at is not None
    same_but_later = replace(step, created_at=step.created_at + timedelta(microseconds=1))
    assert await store.last_message(SESSION) != StoredTail.of(same_but_later)
    results = results_for(*CALLS)
    await journal.record_results(turn, results=results)
    assert await store.last_message(SESSION) == StoredTail.of(results[-1])


async def test_the_first_step_writes_user_and_assistant_together(
    db: Database, journal: DurableJournal, metrics: Metrics
) -> None:
    turn = await start(journal, "buy it")
    assistant = Message.assistant("on it", tool_calls=CALLS)
    await journal.record_step(turn, assistant=assistant)

    stored = await read(db, turn.run_id)
    assert stored.session is not None
    assert stored.session.message_count == 2
    assert shape(stored.history) == [(1, Role.USER, None), (2, Role.ASSISTANT, None)]
    user, stored_assistant = stored.history
    assert user.content == "buy it"
    assert stored_assistant.content == "on it"
    assert stored_assistant.tool_calls == CALLS
    assert {user.run_id, stored_assistant.run_id} == {turn.run_id}
    # One transaction: one timestamp for both rows. The session's updated_at moves at the
    # start and the end of a turn only (an indexed column is not rewritten every step).
    assert user.created_at == stored_assistant.created_at
    assert user.created_at is not None
    assert stored.session.updated_at <= user.created_at
    assert stored.session.created_at <= user.created_at  # the session came with the start
    run = stored.runs[turn.run_id]
    assert run.status == RunStatus.RUNNING
    assert run.finished_at is None
    assert (turn.stored_count, turn.session_exists, turn.stored_status, turn.user_stored) == (
        2,
        True,
        "running",
        True,
    )
    assert write_counts(metrics) == {"start": 1, "write1": 1}


async def test_results_take_the_next_seqs_and_the_end_stores_final_and_status(
    db: Database, journal: DurableJournal, metrics: Metrics
) -> None:
    turn = await start(journal, "buy it")
    await journal.record_step(turn, assistant=Message.assistant("on it", tool_calls=CALLS))
    turn.iterations = 1
    turn.usage.add(Usage(input_tokens=100, output_tokens=20))
    await journal.record_results(turn, results=results_for(*CALLS))

    after_results = await read(db, turn.run_id)
    assert shape(after_results.history) == [
        (1, Role.USER, None),
        (2, Role.ASSISTANT, None),
        (3, Role.TOOL, "toolu_a"),
        (4, Role.TOOL, "toolu_b"),
    ]
    assert [m.run_id for m in after_results.history[2:]] == [turn.run_id] * 2
    assert after_results.history[2].created_at == after_results.history[3].created_at
    assert after_results.runs[turn.run_id].iterations == 1
    assert after_results.runs[turn.run_id].status == RunStatus.RUNNING
    assert write_counts(metrics) == {"start": 1, "write1": 1, "write2": 1}

    assert after_results.runs[turn.run_id].stop_reason is None  # stored at the end only
    turn.iterations = 2
    turn.usage.add(Usage(input_tokens=150, output_tokens=30))
    turn.stop_reason = "max_tokens"
    turn.finished_at = turn.created_at
    final = Message.assistant("bought")
    await journal.record_end(turn, final=final, end=RunEnd(RunStatus.COMPLETE, "bought"))

    stored = await read(db, turn.run_id)
    assert stored.session is not None
    assert stored.session.message_count == 5
    assert shape(stored.history)[-1] == (5, Role.ASSISTANT, None)
    assert stored.history[-1].content == "bought"
    assert stored.history[-1].run_id == turn.run_id
    run = stored.runs[turn.run_id]
    assert run.status == RunStatus.COMPLETE
    assert run.response == "bought"
    assert (run.iterations, run.input_tokens, run.output_tokens) == (2, 250, 50)
    assert run.error_type is None
    assert run.stop_reason == "max_tokens"
    assert run.finished_at == turn.created_at
    assert write_counts(metrics) == {"start": 1, "write1": 1, "write2": 1, "final": 1}


async def test_a_session_ended_on_a_whole_second_is_not_listed_again_after_itself(
    db: Database, journal: DurableJournal
) -> None:
    # The journal binds each value as the ORM would. Handed a raw datetime, SQLite's driver
    # stored "16:00:00" where the ORM binds "16:00:00.000000": as text the row then sorted
    # before the page's own cursor (and Python 3.12 deprecates that driver default).
    turn = await start(journal, "buy it")
    turn.finished_at = datetime(2026, 12, 3, 16, 0, tzinfo=UTC)
    final = Message.assistant("bought")
    await journal.record_end(turn, final=final, end=RunEnd(RunStatus.COMPLETE, "bought"))

    async with db.reads() as session:
        sessions = SessionRepository(session)
        listed = await sessions.list(
            tenant_id="tenant-1", agent=None, user_id=None, after=None, limit=10, budget=1000
        )
        assert [(s.id, s.updated_at) for s in listed.rows] == [(SESSION, turn.finished_at)]
        after = (listed.rows[0].updated_at, listed.rows[0].id)
        later = await sessions.list(
            tenant_id="tenant-1", agent=None, user_id=None, after=after, limit=10, budget=1000
        )
        assert later.rows == []
    stored = await read(db, turn.run_id)
    assert stored.history[-1].created_at == stored.runs[turn.run_id].finished_at


async def test_a_second_turn_continues_the_seqs(
    db: Database, journal: DurableJournal, metrics: Metrics
) -> None:
    first = await start(journal, "one")
    await journal.record_step(first, assistant=Message.assistant("", tool_calls=CALLS))
    await journal.record_results(first, results=results_for(*CALLS))
    await journal.record_end(
        first, final=Message.assistant("first"), end=RunEnd(RunStatus.COMPLETE, "first")
    )
    assert first.stored_count == 5

    second = await start(journal, "two", stored_count=first.stored_count)
    await journal.record_end(
        second, final=Message.assistant("second"), end=RunEnd(RunStatus.COMPLETE, "second")
    )

    stored = await read(db, first.run_id, second.run_id)
    assert stored.session is not None
    assert stored.session.message_count == 7
    assert [(m.seq, m.content, m.run_id) for m in stored.history[5:]] == [
        (6, "two", second.run_id),
        (7, "second", second.run_id),
    ]
    assert stored.runs[second.run_id].status == RunStatus.COMPLETE
    assert stored.runs[first.run_id].status == RunStatus.COMPLETE
    assert write_counts(metrics) == {"start": 2, "write1": 1, "write2": 1, "final": 2}


async def test_a_stale_turn_conflicts_and_writes_nothing(
    db: Database, journal: DurableJournal
) -> None:
    first = await start(journal, "one")
    await journal.record_step(first, assistant=Message.assistant("", tool_calls=CALLS[:1]))
    # Two writers read the session at the same count; the first one wins.
    winner = await start(journal, "two", stored_count=2)
    await journal.record_end(
        winner, final=Message.assistant("won"), end=RunEnd(RunStatus.COMPLETE, "won")
    )
    loser = new_turn("three", stored_count=2)
    before = await read(db, first.run_id, winner.run_id)

    with pytest.raises(SessionConflict):
        await journal.record_start(loser, interrupted=[first.run_id])
    repairs = results_for(CALLS[0])
    repairs[0].run_id = first.run_id
    with pytest.raises(SessionConflict):
        await journal.record_repairs(loser, repairs=repairs)
    with pytest.raises(SessionConflict):
        await journal.record_step(loser, assistant=Message.assistant("", tool_calls=CALLS[1:]))
    with pytest.raises(SessionConflict):
        await journal.record_end(
            loser, final=Message.assistant("lost"), end=RunEnd(RunStatus.COMPLETE, "")
        )

    after = await read(db, first.run_id, winner.run_id, loser.run_id)
    assert after.session is not None
    assert before.session is not None
    assert after.session.message_count == before.session.message_count == 4
    assert shape(after.history) == shape(before.history)
    assert loser.run_id not in after.runs
    assert after.runs[first.run_id].status == RunStatus.RUNNING
    assert after.runs[winner.run_id].status == RunStatus.COMPLETE
    assert (loser.stored_count, loser.stored_status, loser.user_stored) == (2, None, False)


async def test_a_runner_taken_over_after_its_start_fails_every_later_write(
    db: Database, journal: DurableJournal
) -> None:
    # Another runner took the session over: it repaired the step and ended its own turn.
    stalled, taker = await overtaken_after_write_1(journal)
    before = await read(db, stalled.run_id, taker.run_id)

    # The stalled runner wakes up with its handlers' results.
    with pytest.raises(SessionConflict):
        await journal.record_results(stalled, results=results_for(*CALLS))
    with pytest.raises(SessionConflict):
        await journal.record_end(
            stalled, final=Message.assistant("x"), end=RunEnd(RunStatus.COMPLETE, "x")
        )

    after = await read(db, stalled.run_id, taker.run_id)
    assert after.session is not None
    assert after.session.message_count == 6
    assert shape(after.history) == shape(before.history)
    assert after.runs[stalled.run_id].status == RunStatus.INTERRUPTED
    assert after.runs[taker.run_id].status == RunStatus.COMPLETE
    assert stalled.stored_count == 2


async def test_two_turns_creating_the_same_session_conflict(
    db: Database, journal: DurableJournal
) -> None:
    # Both read the session before either created it.
    winner = new_turn("one")
    loser = new_turn("two")
    await journal.record_start(winner, interrupted=[])

    with pytest.raises(SessionConflict):
        await journal.record_start(loser, interrupted=[])
    with pytest.raises(SessionConflict):
        await journal.record_step(loser, assistant=Message.assistant("", tool_calls=CALLS))
    with pytest.raises(SessionConflict):
        await journal.record_end(
            loser, final=Message.assistant("lost"), end=RunEnd(RunStatus.COMPLETE, "")
        )
    await journal.record_step(winner, assistant=Message.assistant("", tool_calls=CALLS))

    stored = await read(db, winner.run_id, loser.run_id)
    assert [m.content for m in stored.history] == ["one", ""]
    assert {m.run_id for m in stored.history} == {winner.run_id}
    assert stored.session is not None
    assert stored.session.message_count == 2
    assert loser.run_id not in stored.runs
    assert stored.runs[winner.run_id].status == RunStatus.RUNNING
    assert (loser.stored_count, loser.session_exists, loser.stored_status, loser.user_stored) == (
        0,
        False,
        None,
        False,
    )


async def test_a_write_the_schema_refuses_is_an_error_not_a_conflict(
    db: Database, journal: DurableJournal
) -> None:
    # Only another writer's keys make a conflict ("another runner took it over", a 409); a
    # NOT NULL violation is a bug, and must not be reported as one.
    turn = new_turn("hello")
    turn.agent = None  # type: ignore[assignment]  # run.agent is NOT NULL
    with pytest.raises((sqlite3.IntegrityError, asyncpg.NotNullViolationError)):
        await journal.record_start(turn, interrupted=[])

    stored = await read(db, turn.run_id)
    assert stored.session is None
    assert stored.runs == {}


async def test_a_model_failure_before_any_write_stores_the_run_and_no_messages(
    db: Database, journal: DurableJournal, metrics: Metrics
) -> None:
    turn = await start(journal, "hello")
    turn.iterations = 1
    turn.finished_at = turn.created_at
    end = RunEnd(RunStatus.ERROR, None, error_type="overloaded_error", error_message="try later")
    await journal.record_end(turn, final=None, end=end)

    stored = await read(db, turn.run_id)
    assert stored.history == []
    assert stored.session is not None
    assert stored.session.message_count == 0
    run = stored.runs[turn.run_id]
    assert run.status == RunStatus.ERROR
    assert (run.error_type, run.error_message) == ("overloaded_error", "try later")
    assert run.response is None
    assert run.stop_reason is None
    assert run.iterations == 1
    assert run.finished_at == turn.created_at
    assert turn.user_stored is False
    assert write_counts(metrics) == {"start": 1, "final": 1}


async def test_a_model_failure_on_an_existing_session_leaves_its_history(
    db: Database, journal: DurableJournal
) -> None:
    first = await start(journal, "one")
    await journal.record_end(
        first, final=Message.assistant("hi"), end=RunEnd(RunStatus.COMPLETE, "hi")
    )
    before = await read(db)

    failed = await start(journal, "two", stored_count=2)
    await journal.record_end(
        failed,
        final=None,
        end=RunEnd(RunStatus.ERROR, None, error_type="api_error", error_message="500"),
    )

    after = await read(db, failed.run_id)
    assert shape(after.history) == shape(before.history)
    assert after.session is not None
    assert after.session.message_count == 2
    assert after.runs[failed.run_id].status == RunStatus.ERROR


async def test_in_write_2_is_reached_with_the_rows_sent_and_nothing_committed(
    db: Database, metrics: Metrics
) -> None:
    # CONTRACT §6: `in-write-2` is write #2's rows sent, not yet committed.
    sent: list[bool] = []
    failpoints = CrashAt("in-write-2", lambda: sent.append(results_sent_uncommitted(db, 2)))
    journal = journal_on(db, metrics, failpoints=failpoints)
    turn = await start(journal, "buy it")
    await journal.record_step(turn, assistant=Message.assistant("on it", tool_calls=CALLS))

    with pytest.raises(Crash):
        await journal.record_results(turn, results=results_for(*CALLS))
    assert sent == [True]  # write #2's rows were sent, and not committed, at the point
    stored = await read(db, turn.run_id)
    assert shape(stored.history) == [(1, Role.USER, None), (2, Role.ASSISTANT, None)]
    assert stored.session is not None and stored.session.message_count == 2

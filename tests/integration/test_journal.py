"""DurableJournal on a real database (SQLite file and PostgreSQL): what each write stores."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from app.db import models
from app.db.repositories import MessageRepository, RunRepository, SessionRepository
from app.db.session import Database
from app.domain import Message, Role, RunStatus, ToolCall, ToolResult, Usage, durability_error
from app.errors import SessionConflict
from app.failpoints import Failpoints
from app.services.journal import DurableJournal, RunEnd, Turn

SESSION = "sess-journal"
CALLS = [ToolCall("toolu_a", "lookup", {"id": "A-1"}), ToolCall("toolu_b", "charge", {"n": 5})]


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    database = await Database.connect(database_url)
    try:
        yield database
    finally:
        await database.dispose()


@pytest.fixture
def journal(db: Database) -> DurableJournal:
    return DurableJournal(db.sessions, Failpoints.parse(None))


def new_turn(text: str, *, stored_count: int = 0, session_id: str = SESSION) -> Turn:
    """A turn as the run service builds it from what it read of the session."""
    return Turn(
        run_id=str(uuid.uuid4()),
        agent="main",
        user_message=Message.user(text),
        session_id=session_id,
        tenant_id="tenant-1",
        user_id="user-1",
        session_metadata={"source": "test"},
        run_metadata={"ticket": 7},
        stored_count=stored_count,
        session_exists=stored_count > 0,
    )


def results_for(*calls: ToolCall) -> list[Message]:
    return [Message.tool(ToolResult.ok(c, {"done": c.id})) for c in calls]


@dataclass
class Stored:
    session: models.Session | None
    history: list[Message]
    runs: dict[str, models.Run]


async def read(db: Database, *run_ids: str, session_id: str = SESSION) -> Stored:
    async with db.sessions() as session:
        row = await SessionRepository(session).get(session_id)
        history = await MessageRepository(session).history(session_id)
        runs = {}
        for run_id in run_ids:
            run = await RunRepository(session).get(run_id)
            if run is not None:
                runs[run_id] = run
        return Stored(row, history, runs)


def shape(history: list[Message]) -> list[tuple[int | None, Role, str | None]]:
    """(seq, role, tool_call_id) per message."""
    return [(m.seq, m.role, m.tool_call_id) for m in history]


async def test_the_first_step_writes_session_run_user_and_assistant_together(
    db: Database, journal: DurableJournal
) -> None:
    turn = new_turn("buy it")
    assistant = Message.assistant("on it", CALLS)
    await journal.record_step(turn, assistant)

    stored = await read(db, turn.run_id)
    assert stored.session is not None
    assert stored.session.agent == "main"
    assert stored.session.tenant_id == "tenant-1"
    assert stored.session.user_id == "user-1"
    assert stored.session.metadata_ == {"source": "test"}
    assert stored.session.message_count == 2
    assert shape(stored.history) == [(1, Role.USER, None), (2, Role.ASSISTANT, None)]
    user, stored_assistant = stored.history
    assert user.content == "buy it"
    assert stored_assistant.content == "on it"
    assert stored_assistant.tool_calls == CALLS
    assert {user.run_id, stored_assistant.run_id} == {turn.run_id}
    # One transaction: one timestamp for both rows.
    assert user.created_at == stored_assistant.created_at == stored.session.created_at
    run = stored.runs[turn.run_id]
    assert run.status == RunStatus.RUNNING
    assert run.session_id == SESSION
    assert run.agent == "main"
    assert run.user_id == "user-1"
    assert run.metadata_ == {"ticket": 7}
    assert run.finished_at is None
    assert (turn.stored_count, turn.session_exists, turn.run_stored, turn.user_stored) == (
        2,
        True,
        True,
        True,
    )


async def test_results_take_the_next_seqs_and_the_end_stores_final_and_status(
    db: Database, journal: DurableJournal
) -> None:
    turn = new_turn("buy it")
    await journal.record_step(turn, Message.assistant("on it", CALLS))
    turn.iterations = 1
    turn.usage.add(Usage(input_tokens=100, output_tokens=20))
    await journal.record_results(turn, results_for(*CALLS))

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

    turn.iterations = 2
    turn.usage.add(Usage(input_tokens=150, output_tokens=30))
    turn.finished_at = turn.created_at
    final = Message.assistant("bought")
    await journal.record_end(turn, final, RunEnd(RunStatus.COMPLETE, "bought"))

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
    assert run.finished_at == turn.created_at


async def test_a_second_turn_continues_the_seqs(db: Database, journal: DurableJournal) -> None:
    first = new_turn("one")
    await journal.record_step(first, Message.assistant("", CALLS))
    await journal.record_results(first, results_for(*CALLS))
    await journal.record_end(first, Message.assistant("first"), RunEnd(RunStatus.COMPLETE, "first"))
    assert first.stored_count == 5

    second = new_turn("two", stored_count=first.stored_count)
    await journal.record_end(
        second, Message.assistant("second"), RunEnd(RunStatus.COMPLETE, "second")
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


async def test_a_stale_turn_conflicts_and_writes_nothing(
    db: Database, journal: DurableJournal
) -> None:
    first = new_turn("one")
    await journal.record_step(first, Message.assistant("", CALLS[:1]))
    # Two writers read the session at the same count; the first one wins.
    winner = new_turn("two", stored_count=2)
    loser = new_turn("three", stored_count=2)
    await journal.record_end(winner, Message.assistant("won"), RunEnd(RunStatus.COMPLETE, "won"))
    before = await read(db, first.run_id, winner.run_id)

    with pytest.raises(SessionConflict):
        await journal.record_step(loser, Message.assistant("", CALLS[1:]))
    with pytest.raises(SessionConflict):
        await journal.record_end(loser, Message.assistant("lost"), RunEnd(RunStatus.COMPLETE, ""))
    with pytest.raises(SessionConflict):
        await journal.record_repair(loser, results_for(CALLS[0]), [first.run_id])

    after = await read(db, first.run_id, winner.run_id, loser.run_id)
    assert after.session is not None
    assert before.session is not None
    assert after.session.message_count == before.session.message_count == 4
    assert shape(after.history) == shape(before.history)
    assert loser.run_id not in after.runs
    assert after.runs[first.run_id].status == RunStatus.RUNNING
    assert (loser.stored_count, loser.run_stored, loser.user_stored) == (2, False, False)


async def test_two_turns_creating_the_same_session_conflict(
    db: Database, journal: DurableJournal
) -> None:
    winner = new_turn("one")
    loser = new_turn("two")
    await journal.record_step(winner, Message.assistant("", CALLS))

    with pytest.raises(SessionConflict):
        await journal.record_step(loser, Message.assistant("", CALLS))

    stored = await read(db, winner.run_id, loser.run_id)
    assert [m.content for m in stored.history] == ["one", ""]
    assert loser.run_id not in stored.runs


async def test_a_model_failure_before_any_write_stores_the_run_and_no_messages(
    db: Database, journal: DurableJournal
) -> None:
    turn = new_turn("hello")
    turn.iterations = 1
    turn.finished_at = turn.created_at
    end = RunEnd(RunStatus.ERROR, None, "overloaded_error", "try later")
    await journal.record_end(turn, None, end)

    stored = await read(db, turn.run_id)
    assert stored.history == []
    assert stored.session is not None
    assert stored.session.message_count == 0
    run = stored.runs[turn.run_id]
    assert run.status == RunStatus.ERROR
    assert (run.error_type, run.error_message) == ("overloaded_error", "try later")
    assert run.response is None
    assert run.iterations == 1
    assert run.finished_at == turn.created_at


async def test_a_model_failure_on_an_existing_session_leaves_its_history(
    db: Database, journal: DurableJournal
) -> None:
    first = new_turn("one")
    await journal.record_end(first, Message.assistant("hi"), RunEnd(RunStatus.COMPLETE, "hi"))
    before = await read(db)

    failed = new_turn("two", stored_count=2)
    await journal.record_end(failed, None, RunEnd(RunStatus.ERROR, None, "api_error", "500"))

    after = await read(db, failed.run_id)
    assert shape(after.history) == shape(before.history)
    assert after.session is not None
    assert after.session.message_count == 2
    assert after.runs[failed.run_id].status == RunStatus.ERROR


async def test_repair_writes_results_after_the_assistant_and_marks_runs_interrupted(
    db: Database, journal: DurableJournal
) -> None:
    crashed = new_turn("buy it")
    await journal.record_step(crashed, Message.assistant("on it", CALLS))
    # The runner died here. The next run repairs both orphans under the crashed run's id.
    resumed = new_turn("again", stored_count=2)
    repairs = [
        Message.tool(ToolResult.ok(CALLS[0], {"id": "A-1"})),
        Message.tool(durability_error("charge", "toolu_b")),
    ]
    for message in repairs:
        message.run_id = crashed.run_id
    await journal.record_repair(resumed, repairs, [crashed.run_id])

    stored = await read(db, crashed.run_id, resumed.run_id)
    assert shape(stored.history) == [
        (1, Role.USER, None),
        (2, Role.ASSISTANT, None),
        (3, Role.TOOL, "toolu_a"),
        (4, Role.TOOL, "toolu_b"),
    ]
    assert [m.run_id for m in stored.history[2:]] == [crashed.run_id] * 2
    assert [m.is_error for m in stored.history[2:]] == [False, True]
    assert stored.history[3].content == repairs[1].content
    assert stored.session is not None
    assert stored.session.message_count == 4
    interrupted = stored.runs[crashed.run_id]
    assert interrupted.status == RunStatus.INTERRUPTED
    assert interrupted.finished_at is not None
    assert resumed.run_id not in stored.runs  # the repair does not start the new run
    assert resumed.stored_count == 4

    await journal.record_end(resumed, Message.assistant("ok"), RunEnd(RunStatus.COMPLETE, "ok"))
    final = await read(db, resumed.run_id)
    assert [(m.seq, m.content) for m in final.history[4:]] == [(5, "again"), (6, "ok")]
    assert final.runs[resumed.run_id].status == RunStatus.COMPLETE


async def test_repair_with_only_unfinished_runs_marks_them_interrupted(
    db: Database, journal: DurableJournal
) -> None:
    crashed = new_turn("one")
    await journal.record_step(crashed, Message.assistant("", CALLS))
    await journal.record_results(crashed, results_for(*CALLS))
    resumed = new_turn("two", stored_count=4)
    await journal.record_repair(resumed, [], [crashed.run_id])

    stored = await read(db, crashed.run_id)
    assert stored.runs[crashed.run_id].status == RunStatus.INTERRUPTED
    assert stored.session is not None
    assert stored.session.message_count == 4
    assert resumed.stored_count == 4


async def test_repair_with_nothing_to_do_writes_nothing(
    db: Database, journal: DurableJournal
) -> None:
    turn = new_turn("one", session_id="never-written")
    await journal.record_repair(turn, [], [])
    stored = await read(db, session_id="never-written")
    assert stored.session is None
    assert stored.history == []

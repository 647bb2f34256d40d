"""DurableJournal on a real database: repairs after a crash, runs found dead, continued turns."""

from __future__ import annotations

from app.db.session import Database
from app.domain import Message, Role, RunStatus
from app.metrics import Metrics
from app.services.journal import DurableJournal, RunEnd, Turn
from tests.integration.journal.support import (
    CALLS,
    new_turn,
    overtaken_after_write_1,
    read,
    repairs_for,
    results_for,
    shape,
    start,
    write_counts,
)


async def test_repairs_go_after_their_assistant_and_dead_runs_are_marked_interrupted(
    db: Database, journal: DurableJournal, metrics: Metrics
) -> None:
    crashed = await start(journal, "buy it")
    await journal.record_step(crashed, assistant=Message.assistant("on it", tool_calls=CALLS))
    # The runner died here. The next run repairs both orphans under the crashed run's id.
    resumed = new_turn("again", stored_count=2)
    repairs = repairs_for(crashed.run_id)
    await journal.record_start(resumed, interrupted=[crashed.run_id])
    await journal.record_repairs(resumed, repairs=repairs)

    stored = await read(db, crashed.run_id, resumed.run_id)
    assert shape(stored.history) == [
        (1, Role.USER, None),
        (2, Role.ASSISTANT, None),
        (3, Role.TOOL, "toolu_a"),
        (4, Role.TOOL, "toolu_b"),
    ]
    assert [m.seq for m in repairs] == [3, 4]
    assert [m.run_id for m in stored.history[2:]] == [crashed.run_id] * 2
    assert [m.is_error for m in stored.history[2:]] == [False, True]
    assert stored.history[3].content == repairs[1].content
    assert stored.session is not None
    assert stored.session.message_count == 4
    interrupted = stored.runs[crashed.run_id]
    assert interrupted.status == RunStatus.INTERRUPTED
    assert interrupted.finished_at is not None
    # The transaction that starts the new run ends the dead one; the repairs come after it,
    # together.
    run = stored.runs[resumed.run_id]
    assert run.status == RunStatus.RUNNING
    assert run.created_at == resumed.created_at
    assert run.finished_at is None
    assert interrupted.finished_at == stored.session.updated_at
    repaired_at = stored.history[2].created_at
    assert repaired_at is not None and repaired_at == stored.history[3].created_at
    assert interrupted.finished_at <= repaired_at
    assert (resumed.stored_count, resumed.stored_status, resumed.user_stored) == (
        4,
        "running",
        False,
    )
    assert write_counts(metrics) == {"start": 2, "write1": 1, "repair": 1}

    await journal.record_end(
        resumed, final=Message.assistant("ok"), end=RunEnd(RunStatus.COMPLETE, "ok")
    )
    final = await read(db, resumed.run_id)
    assert [(m.seq, m.content) for m in final.history[4:]] == [(5, "again"), (6, "ok")]
    assert final.runs[resumed.run_id].status == RunStatus.COMPLETE


async def test_the_start_with_only_unfinished_runs_marks_them_interrupted(
    db: Database, journal: DurableJournal, metrics: Metrics
) -> None:
    crashed = await start(journal, "one")
    await journal.record_step(crashed, assistant=Message.assistant("", tool_calls=CALLS))
    await journal.record_results(crashed, results=results_for(*CALLS))
    resumed = await start(journal, "two", stored_count=4, interrupted=[crashed.run_id])

    stored = await read(db, crashed.run_id, resumed.run_id)
    assert stored.runs[crashed.run_id].status == RunStatus.INTERRUPTED
    assert stored.runs[crashed.run_id].finished_at is not None
    assert stored.runs[resumed.run_id].status == RunStatus.RUNNING
    assert stored.session is not None
    assert stored.session.message_count == 4
    assert len(stored.history) == 4
    assert resumed.stored_count == 4
    assert write_counts(metrics) == {"start": 2, "write1": 1, "write2": 1}


async def test_a_start_with_nothing_to_repair_writes_only_the_session_and_the_run(
    db: Database, journal: DurableJournal, metrics: Metrics
) -> None:
    earlier = await start(journal, "one")
    await journal.record_end(
        earlier, final=Message.assistant("hi"), end=RunEnd(RunStatus.COMPLETE, "hi")
    )
    fresh = await start(journal, "two", session_id="never-written")

    stored = await read(db, fresh.run_id, session_id="never-written")
    assert stored.session is not None
    assert stored.session.message_count == 0
    assert stored.history == []
    assert stored.runs[fresh.run_id].status == RunStatus.RUNNING
    assert fresh.stored_count == 0
    # The other session is untouched.
    other = await read(db, earlier.run_id)
    assert other.session is not None
    assert other.session.message_count == 2
    assert other.runs[earlier.run_id].status == RunStatus.COMPLETE
    assert write_counts(metrics) == {"start": 2, "final": 1}


async def interrupted_then_continued(db: Database, journal: DurableJournal) -> tuple[Turn, Turn]:
    """A turn that crashed after write #1, marked interrupted by a later turn, now continued.

    Returns (crashed, continued): the continued turn is the crashed run picked up again
    (same Idempotency-Key), built as RunService._continue builds it, and started.
    """
    crashed, _ = await overtaken_after_write_1(journal)
    continued = new_turn("buy it", stored_count=6)
    continued.run_id = crashed.run_id
    continued.created_at = crashed.created_at
    continued.stored_status = RunStatus.INTERRUPTED.value  # as the later turn left it
    continued.user_stored = True
    continued.iterations = 1
    await journal.record_start(continued, interrupted=[])
    return crashed, continued


async def test_a_continued_turn_sets_its_run_back_to_running_and_stores_no_second_user_message(
    db: Database, journal: DurableJournal, metrics: Metrics
) -> None:
    crashed, continued = await interrupted_then_continued(db, journal)

    resumed = await read(db, crashed.run_id)
    assert resumed.runs[crashed.run_id].status == RunStatus.RUNNING
    assert resumed.session is not None
    assert resumed.session.message_count == 6
    assert continued.stored_count == 6

    continued.iterations = 2
    continued.finished_at = continued.created_at
    await journal.record_end(
        continued, final=Message.assistant("bought"), end=RunEnd(RunStatus.COMPLETE, "bought")
    )
    stored = await read(db, crashed.run_id)
    assert [(m.seq, m.role, m.content, m.run_id) for m in stored.history[6:]] == [
        (7, Role.ASSISTANT, "bought", crashed.run_id)
    ]
    assert [m.role for m in stored.history].count(Role.USER) == 2  # "buy it" and "other"
    run = stored.runs[crashed.run_id]
    assert run.status == RunStatus.COMPLETE
    assert run.iterations == 2
    assert run.created_at == crashed.created_at
    assert run.finished_at == continued.created_at
    assert write_counts(metrics) == {"start": 3, "write1": 1, "repair": 1, "final": 2}


async def test_a_continued_run_back_to_running_has_no_finished_at(
    db: Database, journal: DurableJournal
) -> None:
    # A `running` run with a finish time would tell GET /v1/runs/{id} it ended already.
    crashed, _ = await interrupted_then_continued(db, journal)
    stored = await read(db, crashed.run_id)
    assert stored.runs[crashed.run_id].status == RunStatus.RUNNING
    assert stored.runs[crashed.run_id].finished_at is None

"""What the DurableJournal tests share: a turn as the run service builds and starts it, and
what a test reads back of the store.

Every turn starts with `record_start` (the run row, runs found dead), then `record_repairs`
(results for the calls they orphaned, if any), then its steps and its end. Ownership is
`LocalOwnership` on both stores: its fence is always true, so what conflicts here is the
message-count compare-and-set and the session's primary key (the PostgreSQL advisory-lock
fence has its own tests).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from app.db import models
from app.db.journal import journal_store
from app.db.repositories import MessageRepository, RunRepository, SessionRepository
from app.db.session import Database
from app.domain import Message, Role, RunStatus, ToolCall, ToolResult, durability_error
from app.failpoints import Failpoints
from app.metrics import Metrics
from app.services.journal import DurableJournal, RunEnd, Turn
from app.services.ownership import LocalOwnership, Ownership

SESSION = "sess-journal"
CALLS = [ToolCall("toolu_a", "lookup", {"id": "A-1"}), ToolCall("toolu_b", "charge", {"n": 5})]
WRITE_KINDS = ("start", "repair", "write1", "write2", "final")


def journal_on(
    db: Database,
    metrics: Metrics,
    *,
    ownership: Ownership | None = None,
    failpoints: Failpoints | None = None,
) -> DurableJournal:
    """A DurableJournal on `db`, fenced by `ownership` (LocalOwnership unless given: see
    above), reaching `failpoints` (none unless given)."""
    ownership = ownership or LocalOwnership()
    store = journal_store(db, fence_sql=ownership.fence_sql)
    return DurableJournal(
        store, failpoints=failpoints or Failpoints.parse(None), ownership=ownership, metrics=metrics
    )


def new_turn(text: str, *, stored_count: int = 0, session_id: str = SESSION) -> Turn:
    """A turn as the run service builds it from what it read of the session (not started)."""
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


async def start(
    journal: DurableJournal,
    text: str,
    *,
    stored_count: int = 0,
    session_id: str = SESSION,
    repairs: Sequence[Message] = (),
    interrupted: Sequence[str] = (),
) -> Turn:
    """A new turn, started as the run service starts it: record_start before any other write,
    then the repairs."""
    turn = new_turn(text, stored_count=stored_count, session_id=session_id)
    await journal.record_start(turn, interrupted=interrupted)
    if repairs:
        await journal.record_repairs(turn, repairs=repairs)
    return turn


async def overtaken_after_write_1(journal: DurableJournal) -> tuple[Turn, Turn]:
    """A turn whose runner stopped after write #1 (its calls orphaned), and the later turn
    that took the session over: it repaired those calls, marked the first interrupted and
    ended complete. Returns (first, later)."""
    first = await start(journal, "buy it")
    first.iterations = 1
    await journal.record_step(first, assistant=Message.assistant("on it", tool_calls=CALLS))
    later = await start(
        journal,
        "other",
        stored_count=2,
        repairs=repairs_for(first.run_id),
        interrupted=[first.run_id],
    )
    await journal.record_end(
        later, final=Message.assistant("fine"), end=RunEnd(RunStatus.COMPLETE, "fine")
    )
    return first, later


def results_for(*calls: ToolCall) -> list[Message]:
    return [Message.tool(ToolResult.ok(c, value={"done": c.id})) for c in calls]


def repairs_for(run_id: str) -> list[Message]:
    """What AgentRunner.repair stores for CALLS: lookup run again, charge a durability error."""
    repairs = [
        Message.tool(ToolResult.ok(CALLS[0], value={"id": "A-1"})),
        Message.tool(durability_error("charge", tool_call_id="toolu_b")),
    ]
    for message in repairs:
        message.run_id = run_id
    return repairs


def write_counts(metrics: Metrics) -> dict[str, float]:
    """How many durable writes of each kind were timed (kinds never seen left out)."""
    counts = {}
    for kind in WRITE_KINDS:
        value = metrics.registry.get_sample_value(
            "agent_runner_durable_write_seconds_count", {"kind": kind}
        )
        if value is not None:
            counts[kind] = value
    return counts


@dataclass
class Stored:
    session: models.Session | None
    history: list[Message]
    runs: dict[str, models.Run]


async def read(db: Database, *run_ids: str, session_id: str = SESSION) -> Stored:
    async with db.reads() as session:
        row = await SessionRepository(session).get(session_id)
        history = await MessageRepository(session).history(row.key) if row else []
        runs = {}
        for run_id in run_ids:
            run = await RunRepository(session).get(run_id)
            if run is not None:
                runs[run_id] = run
        return Stored(row, history, runs)


def shape(history: list[Message]) -> list[tuple[int | None, Role, str | None]]:
    """(seq, role, tool_call_id) per message."""
    return [(m.seq, m.role, m.tool_call_id) for m in history]

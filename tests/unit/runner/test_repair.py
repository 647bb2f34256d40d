"""AgentRunner.repair on resume: safe calls re-run, the others a durability error."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest

from app.domain import Message, Role, RunStatus, ToolCall, ToolResult, durability_error
from app.errors import SessionConflict
from app.llm.scripted import ScriptedLLMClient
from app.metrics import Metrics
from app.services.journal import Turn
from app.services.runner import AgentRunner
from app.tools.registry import ToolRegistry
from tests.unit.runner import support
from tests.unit.runner.support import (
    LosingJournal,
    Model,
    Probe,
    RecordingJournal,
    body,
    call,
    counted_tool_calls,
    new_turn,
    run,
    stored,
)


def orphaned_step(*calls: ToolCall) -> list[Message]:
    return [
        stored(Message.user("buy it"), seq=1, run_id="run-0"),
        stored(Message.assistant("on it", tool_calls=list(calls)), seq=2, run_id="run-0"),
    ]


async def repair(
    registry: ToolRegistry, history: list[Message], *, metrics: Metrics | None = None
) -> list[Message]:
    """The results `AgentRunner.repair` stores, all in one write (none when nothing is
    orphaned); it leaves `history` as it was."""
    journal = support.PROBE.journal = RecordingJournal()  # a re-run tool sees nothing stored yet
    before = list(history)
    runner = AgentRunner(
        llm=ScriptedLLMClient(scripts={}), registry=registry, metrics=metrics or Metrics()
    )
    results = await runner.repair(
        new_turn(), journal=journal, history=history, agent=registry.agent("main")
    )
    assert history == before
    assert journal.records == ([("repairs", results)] if results else [])
    return results


class FailingRepairs(RecordingJournal):
    async def record_repairs(self, turn: Turn, *, repairs: Sequence[Message]) -> None:
        raise SessionConflict("sess-1")


async def test_a_repair_is_counted_and_logged_only_once_stored(
    registry: ToolRegistry, probe: Probe, caplog: pytest.LogCaptureFixture
) -> None:
    history = orphaned_step(call("toolu_a", "lookup", id="A-1"), call("toolu_b", "charge"))
    metrics = Metrics()
    runner = AgentRunner(llm=ScriptedLLMClient(scripts={}), registry=registry, metrics=metrics)
    caplog.set_level(logging.INFO, logger="app.services.runner")

    with pytest.raises(SessionConflict):
        await runner.repair(
            new_turn(), journal=FailingRepairs(), history=history, agent=registry.agent("main")
        )
    assert "repaired" not in caplog.text
    assert counted_tool_calls(metrics) == {}
    await runner.repair(
        new_turn(), journal=RecordingJournal(), history=history, agent=registry.agent("main")
    )
    logged = [r for r in caplog.records if r.getMessage() == "repaired orphaned tool call"]
    assert [(r.tool_name, r.outcome) for r in logged] == [  # type: ignore[attr-defined]
        ("lookup", "reinvoked"),
        ("charge", "durability_error"),
    ]
    assert counted_tool_calls(metrics) == {
        ("lookup", "reinvoked"): 1,
        ("charge", "durability_error"): 1,
    }


async def test_a_runner_that_lost_the_session_reinvokes_nothing_in_a_repair(
    registry: ToolRegistry, probe: Probe
) -> None:
    history = orphaned_step(call("toolu_a", "lookup", id="A-1"), call("toolu_b", "charge"))
    journal = LosingJournal(owned=0)
    metrics = Metrics()
    runner = AgentRunner(llm=ScriptedLLMClient(scripts={}), registry=registry, metrics=metrics)

    with pytest.raises(SessionConflict):
        await runner.repair(
            new_turn(), journal=journal, history=history, agent=registry.agent("main")
        )
    assert probe.calls == []  # even the safe_to_retry lookup did not run again
    assert journal.checks == [0]
    assert journal.records == []
    assert counted_tool_calls(metrics) == {}


def assert_durability_error(message: Message, tool_name: str, tool_call_id: str) -> None:
    assert message.role is Role.TOOL
    assert message.is_error
    assert message.tool_name == tool_name
    assert message.tool_call_id == tool_call_id
    content = body(message)
    assert set(content) == {"error", "kind", "toolName", "toolCallId"}
    assert content["kind"] == "tool-durability-error"
    assert content["toolName"] == tool_name
    assert content["toolCallId"] == tool_call_id
    assert tool_name in content["error"]
    assert tool_call_id in content["error"]


async def test_repair_reinvokes_safe_calls_and_gives_the_others_a_durability_error(
    registry: ToolRegistry, probe: Probe
) -> None:
    history = orphaned_step(
        call("toolu_a", "lookup", id="A-1"), call("toolu_b", "charge", amount=5)
    )
    metrics = Metrics()
    results = await repair(registry, history, metrics=metrics)

    assert [m.tool_call_id for m in results] == ["toolu_a", "toolu_b"]
    assert [m.run_id for m in results] == ["run-0", "run-0"]  # the orphaned message's run
    assert [m.seq for m in results] == [None, None]  # numbered when the journal stores them
    assert results[0].role is Role.TOOL
    assert not results[0].is_error
    assert body(results[0]) == {"id": "A-1", "found": True}
    assert_durability_error(results[1], "charge", "toolu_b")
    assert probe.calls == [("lookup", {"id": "A-1"})]  # charge was not invoked again
    assert probe.writes_seen == [0]  # stored after the re-run, with the durability error
    assert probe.contexts[0].idempotency_key == "sess-1:toolu_a"
    assert counted_tool_calls(metrics) == {
        ("lookup", "reinvoked"): 1,
        ("charge", "durability_error"): 1,
    }


async def test_repair_only_answers_the_calls_still_missing(
    registry: ToolRegistry, probe: Probe
) -> None:
    history = orphaned_step(
        call("toolu_a", "lookup", id="A-1"),
        call("toolu_b", "charge", amount=5),
        call("toolu_c", "lookup", id="C-3"),
    )
    answered = Message.tool(
        ToolResult.ok(history[1].tool_calls[0], value={"id": "A-1", "found": True})
    )
    history.append(stored(answered, seq=3, run_id="run-0"))
    metrics = Metrics()
    results = await repair(registry, history, metrics=metrics)

    assert [m.tool_call_id for m in results] == ["toolu_b", "toolu_c"]
    assert [m.run_id for m in results] == ["run-0", "run-0"]
    assert_durability_error(results[0], "charge", "toolu_b")
    assert body(results[1]) == {"id": "C-3", "found": True}
    assert probe.calls == [("lookup", {"id": "C-3"})]
    assert [m.tool_call_id for m in [*history[2:], *results]] == ["toolu_a", "toolu_b", "toolu_c"]
    assert counted_tool_calls(metrics) == {
        ("charge", "durability_error"): 1,
        ("lookup", "reinvoked"): 1,
    }


async def test_repair_of_a_tool_the_agent_no_longer_has_is_a_durability_error(
    registry: ToolRegistry, probe: Probe
) -> None:
    # `retired` is still configured and safe_to_retry, but not one of this agent's tools;
    # `gone` is configured nowhere.
    history = orphaned_step(call("toolu_r", "retired", id="R-1"), call("toolu_g", "gone"))
    metrics = Metrics()
    results = await repair(registry, history, metrics=metrics)

    assert len(results) == 2
    assert_durability_error(results[0], "retired", "toolu_r")
    assert_durability_error(results[1], "gone", "toolu_g")
    assert probe.calls == []
    # Neither is one of the agent's tools: both count under one label value, as a normal
    # call of a tool the model invented does.
    assert counted_tool_calls(metrics) == {("unknown", "durability_error"): 2}


async def test_a_failing_safe_retry_stores_its_error_as_the_result(
    registry: ToolRegistry, probe: Probe
) -> None:
    history = orphaned_step(call("toolu_a", "lookup"))  # no id: fails validation this time
    metrics = Metrics()
    results = await repair(registry, history, metrics=metrics)

    assert len(results) == 1
    assert results[0].is_error
    assert body(results[0])["error"].startswith("invalid arguments for tool 'lookup'")
    assert results[0].run_id == "run-0"
    assert probe.calls == []
    # It was invoked again (not given the durability error), whatever came of it.
    assert counted_tool_calls(metrics) == {("lookup", "reinvoked"): 1}


@pytest.mark.parametrize(
    "history",
    [
        pytest.param([], id="empty"),
        pytest.param(
            [Message.user("hi"), Message.assistant("hello")],
            id="no-tool-calls",
        ),
        pytest.param(
            [
                Message.user("hi"),
                Message.assistant("", tool_calls=[ToolCall("toolu_a", "charge", {})]),
                Message.tool(durability_error("charge", tool_call_id="toolu_a")),
            ],
            id="all-answered",
        ),
    ],
)
async def test_nothing_to_repair_gives_no_results(
    registry: ToolRegistry, probe: Probe, history: list[Message]
) -> None:
    # The unfinished runs are no longer the runner's business: the run service passes them
    # to record_start, which marks them interrupted (tests/integration/journal/test_resume.py).
    metrics = Metrics()
    assert await repair(registry, history, metrics=metrics) == []
    assert probe.calls == []
    assert counted_tool_calls(metrics) == {}


async def test_after_repair_the_model_sees_every_call_paired_with_one_result(
    registry: ToolRegistry, probe: Probe
) -> None:
    history = orphaned_step(
        call("toolu_a", "lookup", id="A-1"), call("toolu_b", "charge", amount=5)
    )
    history.extend(await repair(registry, history))  # as the run service does once stored
    model = Model(then="I will check the charge first.")
    outcome, _ = await run(registry, model, history=history, turn=new_turn("again"))

    seen = model.requests[0].messages
    assert [(m.role, m.tool_call_id, m.is_error) for m in seen] == [
        (Role.USER, None, False),
        (Role.ASSISTANT, None, False),
        (Role.TOOL, "toolu_a", False),
        (Role.TOOL, "toolu_b", True),
        (Role.USER, None, False),
    ]
    assert body(seen[3])["kind"] == "tool-durability-error"
    assert outcome.end.status is RunStatus.COMPLETE
    assert [name for name, _ in probe.calls] == ["lookup"]

"""The order of AgentRunner's journal writes around the model and the handlers."""

from __future__ import annotations

from app.domain import Message, Role, RunStatus, durability_error
from app.llm.scripted import ScriptedLLMClient
from app.metrics import Metrics
from app.services.journal import RunEnd, StatelessJournal
from app.services.runner import AgentRunner
from app.tools.registry import ToolRegistry
from tests.unit.runner.support import (
    SYSTEM,
    Model,
    Probe,
    Repeat,
    body,
    call,
    counted_tool_calls,
    new_turn,
    run,
    stored,
)


async def test_write_1_commits_before_any_handler_and_write_2_holds_every_result(
    registry: ToolRegistry, probe: Probe
) -> None:
    calls = [call("toolu_a", "note", text="a"), call("toolu_b", "note", text="b")]
    metrics = Metrics()
    outcome, journal = await run(registry, Model(calls, then="all done"), metrics=metrics)

    assert journal.kinds() == ["step", "results", "end"]  # the runner never writes the start
    assert probe.writes_seen == [1, 1]  # both handlers ran after write #1, before write #2
    # One ownership check before each dispatch, each one before its own handler.
    assert journal.checks == [0, 1]
    assert probe.checks_seen == [1, 2]
    step = journal.records[0][1]
    assert step.role is Role.ASSISTANT
    assert step.tool_calls == calls
    assert step.run_id == "run-1"
    results = journal.records[1][1]
    assert [(m.role, m.tool_call_id, m.tool_name) for m in results] == [
        (Role.TOOL, "toolu_a", "note"),
        (Role.TOOL, "toolu_b", "note"),
    ]
    assert [body(m) for m in results] == [{"echo": "a"}, {"echo": "b"}]
    final_message, end = journal.records[2][1]
    assert final_message.role is Role.ASSISTANT
    assert final_message.content == "all done"
    assert final_message.tool_calls == []
    assert end == RunEnd(RunStatus.COMPLETE, "all done")

    assert outcome.end == RunEnd(RunStatus.COMPLETE, "all done")
    turn = outcome.turn
    assert turn.iterations == 2
    assert turn.finished_at is not None
    assert [m.role for m in turn.messages] == [
        Role.USER,
        Role.ASSISTANT,
        Role.TOOL,
        Role.TOOL,
        Role.ASSISTANT,
    ]
    assert turn.messages[1] is step
    assert turn.messages[-1] is final_message

    assert counted_tool_calls(metrics) == {("note", "ok"): 2}
    samples = metrics.registry.get_sample_value
    model_labels = {"model": "scripted:main"}
    assert samples("agent_runner_model_call_seconds_count", model_labels) == 2
    for direction, tokens in [
        ("input", turn.usage.input_tokens),
        ("output", turn.usage.output_tokens),
    ]:
        assert tokens > 0
        assert samples(
            "agent_runner_model_tokens_total", model_labels | {"direction": direction}
        ) == (tokens)


async def test_each_step_is_written_before_the_next_model_call(registry: ToolRegistry) -> None:
    model = Model([call("toolu_1", "note", text="1")], [call("toolu_2", "note", text="2")])
    outcome, journal = await run(registry, model)

    assert journal.kinds() == ["step", "results", "step", "results", "end"]
    assert outcome.end.status is RunStatus.COMPLETE
    second = model.requests[1].messages
    assert [(m.role, m.tool_call_id) for m in second] == [
        (Role.USER, None),
        (Role.ASSISTANT, None),
        (Role.TOOL, "toolu_1"),
    ]
    assert second[1].tool_calls == [call("toolu_1", "note", text="1")]


async def test_a_turn_without_tools_writes_only_its_end(registry: ToolRegistry) -> None:
    history = [Message.user("earlier"), Message.assistant("earlier answer")]
    model = Model(then="hello")
    outcome, journal = await run(registry, model, history=history)

    assert journal.kinds() == ["end"]
    final_message, end = journal.records[0][1]
    assert final_message.content == "hello"
    assert end == RunEnd(RunStatus.COMPLETE, "hello")
    assert [m.content for m in model.requests[0].messages] == ["earlier", "earlier answer", "hi"]
    assert model.requests[0].system == SYSTEM
    assert [t.name for t in model.requests[0].tools] == [
        "note",
        "step",
        "fan",
        "boom",
        "lookup",
        "charge",
    ]
    assert outcome.turn.iterations == 1


async def test_the_stateless_journal_runs_the_same_loop(
    registry: ToolRegistry, probe: Probe
) -> None:
    metrics = Metrics()
    runner = AgentRunner(
        llm=ScriptedLLMClient(scripts={"main": Model([call("toolu_a", "note", text="a")])}),
        registry=registry,
        metrics=metrics,
    )
    outcome = await runner.run(
        new_turn(), journal=StatelessJournal(), history=[], agent=registry.agent("main")
    )
    assert outcome.end == RunEnd(RunStatus.COMPLETE, "done")
    assert [name for name, _ in probe.calls] == ["note"]
    assert outcome.turn.messages[1].run_id == "run-1"
    assert counted_tool_calls(metrics) == {("note", "ok"): 1}


async def test_a_continued_turn_does_not_append_its_stored_user_message(
    registry: ToolRegistry, probe: Probe
) -> None:
    # The same Idempotency-Key picks run-1 up after a crash: its user message and its first
    # step are stored (the step's orphaned call already repaired) and come in the history.
    history = [
        stored(Message.user("earlier"), seq=1, run_id="run-0"),
        stored(Message.assistant("earlier answer"), seq=2, run_id="run-0"),
        stored(Message.user("buy it"), seq=3, run_id="run-1"),
        stored(
            Message.assistant("on it", tool_calls=[call("toolu_a", "note", text="a")]),
            seq=4,
            run_id="run-1",
        ),
        stored(
            Message.tool(durability_error("note", tool_call_id="toolu_a")), seq=5, run_id="run-1"
        ),
    ]
    turn = new_turn("buy it")
    turn.user_stored = True
    turn.stored_status = RunStatus.INTERRUPTED.value
    turn.iterations = 1
    turn.messages = [m for m in history if m.run_id == "run-1"]  # as the run service does
    model = Model(then="bought")
    outcome, journal = await run(registry, model, history=history, turn=turn)

    assert [(m.role, m.content) for m in model.requests[0].messages] == [
        (m.role, m.content) for m in history
    ]
    assert journal.kinds() == ["end"]
    assert outcome.end == RunEnd(RunStatus.COMPLETE, "bought")
    assert [m.role for m in outcome.turn.messages] == [
        Role.USER,
        Role.ASSISTANT,
        Role.TOOL,
        Role.ASSISTANT,
    ]
    assert outcome.turn.iterations == 2  # the earlier model call still counts
    assert probe.calls == []


async def test_a_continued_turn_keeps_counting_its_iterations(registry: ToolRegistry) -> None:
    turn = new_turn()
    turn.user_stored = True
    turn.iterations = 2
    history = [stored(Message.user("hi"), seq=1, run_id="run-1")]
    model = Repeat("note", {"text": "again"})
    outcome, journal = await run(registry, model, history=history, turn=turn, max_iterations=3)

    assert outcome.end == RunEnd(RunStatus.MAX_ITERATIONS, "step 1")
    assert len(model.requests) == 1
    assert [m.content for m in model.requests[0].messages] == ["hi"]
    assert journal.kinds() == ["step", "results", "end"]


async def test_write_1_is_flushed_only_before_a_handler_that_is_not_safe_to_retry(
    registry: ToolRegistry, probe: Probe
) -> None:
    # A write #1 a power loss takes back would let the handler that ran after it run again
    # once the turn is resumed; for safe_to_retry tools, and calls no handler answers (an
    # unknown tool, one the agent does not have), that costs nothing, so no sync is paid.
    steps = [
        [call("toolu_a", "lookup", id="1")],
        [call("toolu_b", "lookup", id="2"), call("toolu_c", "charge")],
        [call("toolu_d", "nope"), call("toolu_e", "retired")],
        [call("toolu_f", "note", text="x")],
    ]
    _, journal = await run(registry, Model(*steps, then="done"))
    assert journal.effects == [False, True, False, True]

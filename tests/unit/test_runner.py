"""AgentRunner over a ScriptedLLMClient: write order, dispatch, stop conditions and repair.

The journal here is a recording test double: it shows which write the runner makes when and
every ownership check it asks for, and the in-process tools below record what they see
(including how many writes and checks came before them). The runner computes repairs and
hands them to `Journal.record_repairs` in one write; how that stores them is
tests/integration/test_journal.py's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from app.domain import Message, Role, RunStatus, ToolCall, ToolResult, Usage, durability_error
from app.errors import SessionConflict
from app.llm.base import LLMError, ModelRequest, ModelResponse
from app.llm.scripted import ScriptedLLMClient, ask, final
from app.metrics import Metrics
from app.services.journal import Journal, RunEnd, Turn
from app.services.runner import BUDGET_NOTE, AgentRunner, RunOutcome
from app.tools.agents_file import parse_registry
from app.tools.base import AgentConfig, ToolContext
from app.tools.registry import ToolRegistry

HERE = "tests.unit.test_runner"
SYSTEM = "You are a test agent."
GUARD_S = 5  # only a deadlock guard: no assertion below depends on timing

AGENTS_YAML = f"""
tools:
  note:
    python: "{HERE}:note"
    input_schema: {{type: object, properties: {{text: {{type: string}}}}, required: [text]}}
  step:
    python: "{HERE}:serial_step"
    input_schema: {{type: object, properties: {{label: {{type: string}}}}, required: [label]}}
  fan:
    python: "{HERE}:fan"
    parallel: true
    input_schema:
      type: object
      properties: {{label: {{type: string}}, after: {{type: string}}}}
      required: [label]
  boom:
    python: "{HERE}:boom"
  hidden:
    python: "{HERE}:note"
  lookup:
    python: "{HERE}:lookup"
    safe_to_retry: true
    input_schema: {{type: object, properties: {{id: {{type: string}}}}, required: [id]}}
  charge:
    python: "{HERE}:charge"
  retired:
    python: "{HERE}:lookup"
    safe_to_retry: true
agents:
  main:
    model: "scripted:main"
    system: {SYSTEM}
    tools: [note, step, fan, boom, lookup, charge]
"""


# --- what the tools record -----------------------------------------------------------------------


@dataclass
class Probe:
    journal: RecordingJournal | None = None
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    contexts: list[ToolContext] = field(default_factory=list)
    writes_seen: list[int] = field(default_factory=list)
    checks_seen: list[int] = field(default_factory=list)
    order: list[tuple[str, str]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    peak_target: int = 0
    peak: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    done: dict[str, asyncio.Event] = field(default_factory=dict)

    def record(self, name: str, arguments: dict[str, Any], ctx: ToolContext) -> None:
        self.calls.append((name, arguments))
        self.contexts.append(ctx)
        self.writes_seen.append(-1 if self.journal is None else len(self.journal.records))
        self.checks_seen.append(-1 if self.journal is None else len(self.journal.checks))

    def finished(self, label: str) -> asyncio.Event:
        return self.done.setdefault(label, asyncio.Event())


PROBE = Probe()


@pytest.fixture(autouse=True)
def probe() -> Iterator[Probe]:
    global PROBE
    PROBE = Probe()
    PROBE.release.set()
    yield PROBE
    PROBE = Probe()


async def note(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    """Echo the text."""
    PROBE.record("note", arguments, ctx)
    return {"echo": arguments["text"]}


async def serial_step(arguments: dict[str, Any], ctx: ToolContext) -> str:
    """A non-parallel tool that yields to the loop while it runs."""
    PROBE.record("step", arguments, ctx)
    label = arguments["label"]
    PROBE.order.append(("start", label))
    for _ in range(5):
        await asyncio.sleep(0)
    PROBE.order.append(("end", label))
    return str(label)


async def fan(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    """A parallel tool: waits for `release` and, if given, for call `after` to finish."""
    PROBE.record("fan", arguments, ctx)
    label = arguments["label"]
    PROBE.order.append(("start", label))
    PROBE.in_flight += 1
    PROBE.max_in_flight = max(PROBE.max_in_flight, PROBE.in_flight)
    if PROBE.peak_target and PROBE.in_flight >= PROBE.peak_target:
        PROBE.peak.set()
    try:
        await PROBE.release.wait()
        if "after" in arguments:
            await PROBE.finished(arguments["after"]).wait()
    finally:
        PROBE.in_flight -= 1
    PROBE.order.append(("end", label))
    PROBE.finished(label).set()
    return {"label": label}


async def boom(arguments: dict[str, Any], ctx: ToolContext) -> None:
    """Always raises."""
    PROBE.record("boom", arguments, ctx)
    raise RuntimeError("kaput")


async def lookup(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    """Safe to run twice."""
    PROBE.record("lookup", arguments, ctx)
    return {"id": arguments["id"], "found": True}


async def charge(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    """A side effect that must not run twice."""
    PROBE.record("charge", arguments, ctx)
    return {"charged": True}


# --- test doubles --------------------------------------------------------------------------------


class RecordingJournal(Journal):
    """Appends (kind, payload) per write, in the order the runner makes them.

    `checks` holds, per `check_owned` call, how many handlers had been invoked by then.
    """

    def __init__(self) -> None:
        self.records: list[tuple[str, Any]] = []
        self.checks: list[int] = []

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.records]

    async def record_start(self, turn: Turn, interrupted: Sequence[str]) -> None:
        self.records.append(("start", list(interrupted)))

    async def check_owned(self, turn: Turn) -> None:
        self.checks.append(len(PROBE.calls))

    async def record_step(self, turn: Turn, assistant: Message) -> None:
        await super().record_step(turn, assistant)
        self.records.append(("step", assistant))

    async def record_results(self, turn: Turn, results: Sequence[Message]) -> None:
        self.records.append(("results", list(results)))

    async def record_repairs(self, turn: Turn, repairs: Sequence[Message]) -> None:
        self.records.append(("repairs", list(repairs)))

    async def record_end(self, turn: Turn, final: Message | None, end: RunEnd) -> None:
        self.records.append(("end", (final, end)))


class LosingJournal(RecordingJournal):
    """Owns the session for the first `owned` checks; every later check finds it lost."""

    def __init__(self, *, owned: int = 0) -> None:
        super().__init__()
        self.owned = owned

    async def check_owned(self, turn: Turn) -> None:
        await super().check_owned(turn)
        if len(self.checks) > self.owned:
            assert turn.session_id is not None
            raise SessionConflict(turn.session_id)


Step = list[ToolCall] | ModelResponse | Exception


class Model:
    """A script: the n-th model call answers steps[n] (tool calls, a response or an error)."""

    def __init__(self, *steps: Step, then: str = "done") -> None:
        self.steps = list(steps)
        self.then = then
        self.requests: list[ModelRequest] = []

    def __call__(self, request: ModelRequest) -> ModelResponse:
        # The runner keeps appending to request.messages: keep what the model saw.
        self.requests.append(dataclasses.replace(request, messages=list(request.messages)))
        index = len(self.requests) - 1
        if index >= len(self.steps):
            return final(self.then)
        item = self.steps[index]
        if isinstance(item, Exception):
            raise item
        if isinstance(item, ModelResponse):
            return item
        return ask(f"step {index + 1}", item)


class Repeat(Model):
    """Asks for the same calls (with fresh ids) on every model call."""

    def __init__(self, name: str, arguments: dict[str, Any]) -> None:
        super().__init__()
        self.name = name
        self.arguments = arguments

    def __call__(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(dataclasses.replace(request, messages=list(request.messages)))
        n = len(self.requests)
        return ask(f"step {n}", [ToolCall(f"toolu_{n}", self.name, self.arguments)])


@pytest.fixture
def registry() -> ToolRegistry:
    return parse_registry(AGENTS_YAML, label="test_runner.yaml")


def agent_of(registry: ToolRegistry, **changes: Any) -> AgentConfig:
    return dataclasses.replace(registry.agent("main"), **changes)


def new_turn(text: str = "hi", *, run_id: str = "run-1") -> Turn:
    return Turn(run_id=run_id, agent="main", user_message=Message.user(text), session_id="sess-1")


def call(call_id: str, name: str, **arguments: Any) -> ToolCall:
    return ToolCall(call_id, name, arguments)


def tool_calls(metrics: Metrics, tool: str, outcome: str) -> float | None:
    """agent_runner_tool_calls_total for one tool and outcome (None: never counted)."""
    return metrics.registry.get_sample_value(
        "agent_runner_tool_calls_total", {"tool": tool, "outcome": outcome}
    )


def counted_tool_calls(metrics: Metrics) -> dict[tuple[str, str], float]:
    """Every (tool, outcome) the tool_calls counter has counted."""
    return {
        (sample.labels["tool"], sample.labels["outcome"]): sample.value
        for family in metrics.registry.collect()
        if family.name == "agent_runner_tool_calls"
        for sample in family.samples
        if sample.name == "agent_runner_tool_calls_total"
    }


async def run(
    registry: ToolRegistry,
    model: Model,
    *,
    history: list[Message] | None = None,
    turn: Turn | None = None,
    journal: RecordingJournal | None = None,
    metrics: Metrics | None = None,
    **agent_changes: Any,
) -> tuple[RunOutcome, RecordingJournal]:
    journal = journal or RecordingJournal()
    PROBE.journal = journal
    runner = AgentRunner(
        llm=ScriptedLLMClient(scripts={"main": model}),
        registry=registry,
        metrics=metrics or Metrics(),
    )
    outcome = await runner.run(
        turn or new_turn(), journal, list(history or []), agent_of(registry, **agent_changes)
    )
    return outcome, journal


def body(message: Message) -> Any:
    return json.loads(message.content)


# --- write order ---------------------------------------------------------------------------------


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
    outcome = await runner.run(new_turn(), Journal(), [], registry.agent("main"))
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
            Message.assistant("on it", [call("toolu_a", "note", text="a")]), seq=4, run_id="run-1"
        ),
        stored(Message.tool(durability_error("note", "toolu_a")), seq=5, run_id="run-1"),
    ]
    turn = new_turn("buy it")
    turn.user_stored = True
    turn.run_stored = True
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


# --- dispatch ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("concurrency", "peak"), [(1, 1), (2, 2), (5, 3)])
async def test_parallel_calls_overlap_up_to_max_tool_concurrency(
    registry: ToolRegistry, probe: Probe, concurrency: int, peak: int
) -> None:
    probe.release.clear()
    probe.peak_target = peak
    calls = [call(f"toolu_{x}", "fan", label=x) for x in "abc"]
    task = asyncio.create_task(run(registry, Model(calls), max_tool_concurrency=concurrency))

    await asyncio.wait_for(probe.peak.wait(), GUARD_S)  # `peak` handlers are in flight at once
    for _ in range(20):  # every chance for one more call to start, were the limit not kept
        await asyncio.sleep(0)
    assert probe.in_flight == peak
    assert [label for event, label in probe.order if event == "start"] == list("abc")[:peak]
    probe.release.set()
    outcome, journal = await asyncio.wait_for(task, GUARD_S)

    assert probe.max_in_flight == peak
    assert outcome.end.status is RunStatus.COMPLETE
    assert [body(m) for m in journal.records[1][1]] == [{"label": x} for x in "abc"]
    # Inside the limit too, each dispatch is preceded by its own ownership check.
    assert len(journal.checks) == 3
    assert probe.checks_seen == [1, 2, 3]


async def test_non_parallel_tools_run_one_at_a_time_in_call_order(
    registry: ToolRegistry, probe: Probe
) -> None:
    calls = [call(f"toolu_{x}", "step", label=x) for x in "abc"]
    outcome, journal = await run(registry, Model(calls))

    assert probe.order == [
        ("start", "a"),
        ("end", "a"),
        ("start", "b"),
        ("end", "b"),
        ("start", "c"),
        ("end", "c"),
    ]
    assert [body(m) for m in journal.records[1][1]] == ["a", "b", "c"]
    assert outcome.end.status is RunStatus.COMPLETE


async def test_a_non_parallel_call_waits_for_the_parallel_calls_before_it(
    registry: ToolRegistry, probe: Probe
) -> None:
    calls = [
        call("toolu_a", "fan", label="a"),
        call("toolu_b", "fan", label="b"),
        call("toolu_s", "step", label="s"),
        call("toolu_c", "fan", label="c"),
    ]
    await run(registry, Model(calls))

    order = probe.order
    assert order.index(("start", "s")) > max(order.index(("end", "a")), order.index(("end", "b")))
    assert order.index(("start", "c")) > order.index(("end", "s"))


async def test_results_keep_call_order_whatever_order_handlers_finish_in(
    registry: ToolRegistry, probe: Probe
) -> None:
    calls = [
        call("toolu_a", "fan", label="a", after="b"),  # finishes only after b has
        call("toolu_b", "fan", label="b"),
        call("toolu_s", "step", label="s"),
        call("toolu_n", "note", text="n"),
    ]
    outcome, journal = await run(registry, Model(calls))

    assert probe.order.index(("end", "a")) > probe.order.index(("end", "b"))
    results = journal.records[1][1]
    assert [m.tool_call_id for m in results] == ["toolu_a", "toolu_b", "toolu_s", "toolu_n"]
    assert [body(m) for m in results] == [{"label": "a"}, {"label": "b"}, "s", {"echo": "n"}]
    assert outcome.end.status is RunStatus.COMPLETE


async def test_unknown_tools_bad_input_and_handler_errors_become_error_results(
    registry: ToolRegistry, probe: Probe
) -> None:
    calls = [
        call("toolu_1", "nope"),
        call("toolu_2", "hidden", text="not for this agent"),
        call("toolu_3", "note"),
        call("toolu_4", "note", text=7),
        call("toolu_5", "boom"),
        call("toolu_6", "note", text="fine"),
    ]
    model = Model(calls, then="recovered")
    metrics = Metrics()
    outcome, journal = await run(registry, model, metrics=metrics)

    results = journal.records[1][1]
    assert [m.is_error for m in results] == [True, True, True, True, True, False]
    assert body(results[0]) == {"error": "unknown tool 'nope'"}
    assert body(results[1]) == {"error": "unknown tool 'hidden'"}
    assert body(results[2])["error"].startswith("invalid arguments for tool 'note'")
    assert "'text' is a required property" in body(results[2])["error"]
    assert body(results[3])["error"].startswith("invalid arguments for tool 'note'")
    assert body(results[4]) == {"error": "RuntimeError: kaput"}
    assert body(results[5]) == {"echo": "fine"}
    # Only valid calls to the agent's own tools reached a handler.
    assert probe.calls == [("boom", {}), ("note", {"text": "fine"})]
    # The model read the errors and the run went on.
    assert [m.is_error for m in model.requests[1].messages[-6:]] == [True] * 5 + [False]
    assert outcome.end == RunEnd(RunStatus.COMPLETE, "recovered")
    # Every call was checked for ownership, even those that reached no handler.
    assert journal.checks == [0, 0, 0, 0, 0, 1]
    # Names the agent does not have share one label, so a model cannot grow the series.
    assert counted_tool_calls(metrics) == {
        ("unknown", "error"): 2,
        ("note", "error"): 2,
        ("boom", "error"): 1,
        ("note", "ok"): 1,
    }
    assert tool_calls(metrics, "note", "ok") == 1


async def test_handlers_get_the_call_context(registry: ToolRegistry, probe: Probe) -> None:
    await run(registry, Model([call("toolu_a", "note", text="a")]))
    assert probe.contexts == [
        ToolContext(session_id="sess-1", run_id="run-1", tool_call_id="toolu_a")
    ]
    assert probe.contexts[0].idempotency_key == "sess-1:toolu_a"


@pytest.mark.parametrize(
    "calls",
    [
        pytest.param([call("toolu_a", "note", text="a")], id="one"),
        pytest.param([call(f"toolu_{x}", "step", label=x) for x in "ab"], id="serial"),
        pytest.param([call(f"toolu_{x}", "fan", label=x) for x in "abc"], id="parallel"),
        pytest.param(
            [call("toolu_a", "fan", label="a"), call("toolu_s", "step", label="s")], id="mixed"
        ),
    ],
)
async def test_a_runner_that_lost_the_session_dispatches_nothing(
    registry: ToolRegistry, probe: Probe, calls: list[ToolCall]
) -> None:
    journal = LosingJournal(owned=0)
    metrics = Metrics()
    with pytest.raises(SessionConflict):
        await run(registry, Model(calls), journal=journal, metrics=metrics)

    assert probe.calls == []
    assert journal.kinds() == ["step"]  # write #1 stood; no results, no end
    assert journal.checks and set(journal.checks) == {0}
    assert counted_tool_calls(metrics) == {}


async def test_losing_the_session_mid_step_stops_the_calls_not_yet_dispatched(
    registry: ToolRegistry, probe: Probe
) -> None:
    calls = [call(f"toolu_{x}", "step", label=x) for x in "abc"]
    journal = LosingJournal(owned=1)
    metrics = Metrics()
    with pytest.raises(SessionConflict):
        await run(registry, Model(calls), journal=journal, metrics=metrics)

    assert probe.calls == [("step", {"label": "a"})]
    assert journal.checks == [0, 1]  # the second check failed: b and c never ran
    assert journal.kinds() == ["step"]  # a's result is not written: the next run repairs it
    assert counted_tool_calls(metrics) == {("step", "ok"): 1}


# --- stop conditions -----------------------------------------------------------------------------


async def test_max_iterations_stops_the_run(registry: ToolRegistry, probe: Probe) -> None:
    model = Repeat("note", {"text": "again"})
    outcome, journal = await run(registry, model, max_iterations=3)

    assert outcome.end == RunEnd(RunStatus.MAX_ITERATIONS, "step 3")
    assert outcome.turn.iterations == 3
    assert len(model.requests) == 3
    assert journal.kinds() == ["step", "results"] * 3 + ["end"]
    assert journal.records[-1][1] == (None, RunEnd(RunStatus.MAX_ITERATIONS, "step 3"))
    assert len(probe.calls) == 3


async def test_three_steps_of_only_errors_is_stuck(registry: ToolRegistry) -> None:
    model = Repeat("boom", {})
    outcome, journal = await run(registry, model)

    assert outcome.end == RunEnd(RunStatus.STUCK, "step 3")
    assert outcome.turn.iterations == 3
    assert journal.kinds() == ["step", "results"] * 3 + ["end"]
    assert journal.records[-1][1] == (None, RunEnd(RunStatus.STUCK, "step 3"))


async def test_stuck_threshold_is_configurable(registry: ToolRegistry) -> None:
    outcome, _ = await run(registry, Repeat("nope", {}), stuck_threshold=1)
    assert outcome.end.status is RunStatus.STUCK
    assert outcome.turn.iterations == 1


async def test_a_step_with_a_success_resets_the_stuck_count(registry: ToolRegistry) -> None:
    failing = [call("toolu_x", "boom")]
    mixed = [call("toolu_y", "boom"), call("toolu_z", "note", text="ok")]
    model = Model(
        [call("toolu_1", "boom")],
        [call("toolu_2", "boom")],
        mixed,
        failing,
        [call("toolu_3", "boom")],
        then="finally",
    )
    outcome, _ = await run(registry, model)
    assert outcome.end == RunEnd(RunStatus.COMPLETE, "finally")
    assert outcome.turn.iterations == 6


def spend(tokens: int, n: int) -> ModelResponse:
    """A tool step that reports `tokens` of usage."""
    return ModelResponse(
        text=f"step {n}",
        tool_calls=[call(f"toolu_{n}", "note", text=str(n))],
        usage=Usage(input_tokens=tokens - 1, output_tokens=1),
        stop_reason="tool_use",
    )


async def test_token_budget_warns_once_at_80_percent_and_stops_at_90(
    registry: ToolRegistry,
) -> None:
    model = Model(spend(500, 1), spend(320, 2), spend(20, 3), spend(70, 4), spend(1, 5))
    outcome, journal = await run(registry, model, token_budget=1000)

    assert outcome.end == RunEnd(RunStatus.TOKEN_BUDGET_EXHAUSTED, "step 4")
    assert outcome.turn.iterations == 4
    assert outcome.turn.usage.total == 910
    assert journal.records[-1][1] == (None, RunEnd(RunStatus.TOKEN_BUDGET_EXHAUSTED, "step 4"))
    systems = [request.system for request in model.requests]
    # 50% and 82% before the second and third calls: the note arrives from the third on.
    assert systems == [SYSTEM, SYSTEM, f"{SYSTEM}\n\n{BUDGET_NOTE}", f"{SYSTEM}\n\n{BUDGET_NOTE}"]
    assert all((s or "").count(BUDGET_NOTE) <= 1 for s in systems)


async def test_the_budget_note_is_the_whole_system_prompt_when_there_was_none(
    registry: ToolRegistry,
) -> None:
    model = Model(spend(850, 1))
    outcome, _ = await run(registry, model, token_budget=1000, system=None)
    assert [request.system for request in model.requests] == [None, BUDGET_NOTE]
    assert outcome.end.status is RunStatus.COMPLETE


async def test_token_budget_warning_is_logged_once(
    registry: ToolRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="app.services.runner")
    model = Model(spend(810, 1), spend(10, 2), spend(10, 3))
    outcome, _ = await run(registry, model, token_budget=1000)

    assert outcome.end.status is RunStatus.COMPLETE
    warnings = [r for r in caplog.records if r.name == "app.services.runner"]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING
    assert getattr(warnings[0], "run_id", None) == "run-1"
    assert warnings[0].getMessage() == "run used 80% of its token budget"


# --- model failures ------------------------------------------------------------------------------


async def test_a_model_failure_before_any_write_ends_the_run_with_error(
    registry: ToolRegistry, probe: Probe
) -> None:
    model = Model(LLMError("overloaded, try later", type="overloaded_error", retryable=True))
    outcome, journal = await run(registry, model)

    assert journal.records == [
        (
            "end",
            (
                None,
                RunEnd(
                    RunStatus.ERROR,
                    None,
                    error_type="overloaded_error",
                    error_message="overloaded, try later",
                ),
            ),
        )
    ]
    assert outcome.end.status is RunStatus.ERROR
    assert outcome.end.error_type == "overloaded_error"
    assert outcome.end.error_message == "overloaded, try later"
    assert outcome.turn.iterations == 1
    assert outcome.turn.finished_at is not None
    assert probe.calls == []


async def test_a_model_failure_after_a_step_keeps_the_step(registry: ToolRegistry) -> None:
    model = Model([call("toolu_a", "note", text="a")], LLMError("gone", type="api_error"))
    outcome, journal = await run(registry, model)

    assert journal.kinds() == ["step", "results", "end"]
    assert journal.records[-1][1] == (
        None,
        RunEnd(RunStatus.ERROR, "step 1", error_type="api_error", error_message="gone"),
    )
    assert outcome.turn.iterations == 2


async def test_an_unexpected_model_exception_is_an_internal_error(registry: ToolRegistry) -> None:
    outcome, journal = await run(registry, Model(KeyError("content")))
    assert journal.kinds() == ["end"]
    assert outcome.end.status is RunStatus.ERROR
    assert outcome.end.error_type == "internal_error"


# --- repair --------------------------------------------------------------------------------------


def stored(message: Message, *, seq: int, run_id: str) -> Message:
    message.seq = seq
    message.run_id = run_id
    return message


def orphaned_step(*calls: ToolCall) -> list[Message]:
    return [
        stored(Message.user("buy it"), seq=1, run_id="run-0"),
        stored(Message.assistant("on it", list(calls)), seq=2, run_id="run-0"),
    ]


async def repair(
    registry: ToolRegistry, history: list[Message], *, metrics: Metrics | None = None
) -> list[Message]:
    """The results `AgentRunner.repair` stores, all in one write (none when nothing is
    orphaned); it leaves `history` as it was."""
    journal = PROBE.journal = RecordingJournal()  # a re-run tool sees nothing stored yet
    before = list(history)
    runner = AgentRunner(
        llm=ScriptedLLMClient(scripts={}), registry=registry, metrics=metrics or Metrics()
    )
    results = await runner.repair(new_turn(), journal, history, registry.agent("main"))
    assert history == before
    assert journal.records == ([("repairs", results)] if results else [])
    return results


class FailingRepairs(RecordingJournal):
    async def record_repairs(self, turn: Turn, repairs: Sequence[Message]) -> None:
        raise SessionConflict("sess-1")


async def test_a_repair_is_counted_and_logged_only_once_stored(
    registry: ToolRegistry, probe: Probe, caplog: pytest.LogCaptureFixture
) -> None:
    history = orphaned_step(call("toolu_a", "lookup", id="A-1"), call("toolu_b", "charge"))
    metrics = Metrics()
    runner = AgentRunner(llm=ScriptedLLMClient(scripts={}), registry=registry, metrics=metrics)
    caplog.set_level(logging.INFO, logger="app.services.runner")

    with pytest.raises(SessionConflict):
        await runner.repair(new_turn(), FailingRepairs(), history, registry.agent("main"))
    assert "repaired" not in caplog.text
    assert counted_tool_calls(metrics) == {}
    await runner.repair(new_turn(), RecordingJournal(), history, registry.agent("main"))
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
        await runner.repair(new_turn(), journal, history, registry.agent("main"))
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
    answered = Message.tool(ToolResult.ok(history[1].tool_calls[0], {"id": "A-1", "found": True}))
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
                Message.assistant("", [ToolCall("toolu_a", "charge", {})]),
                Message.tool(durability_error("charge", "toolu_a")),
            ],
            id="all-answered",
        ),
    ],
)
async def test_nothing_to_repair_gives_no_results(
    registry: ToolRegistry, probe: Probe, history: list[Message]
) -> None:
    # The unfinished runs are no longer the runner's business: the run service passes them
    # to record_start, which marks them interrupted (tests/integration/test_journal.py).
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

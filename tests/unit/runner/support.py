"""What the runner tests share: in-process tools that record what they see, a recording
journal, scripted models and a helper that runs one turn.

The journal here is a recording test double: it shows which write the runner makes when and
every ownership check it asks for, and the in-process tools below record what they see
(including how many writes and checks came before them). The runner computes repairs and
hands them to `Journal.record_repairs` in one write; how that stores them is
tests/integration/journal/'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from app.domain import Message, ToolCall
from app.errors import DatabaseUnavailable, SessionConflict
from app.llm.base import ModelRequest, ModelResponse
from app.llm.scripted import ScriptedLLMClient, ask, final
from app.metrics import Metrics
from app.services.journal import RunEnd, StatelessJournal, Turn
from app.services.runner import AgentRunner, RunOutcome
from app.tools.base import AgentConfig, ToolContext
from app.tools.registry import ToolRegistry

HERE = "tests.unit.runner.support"
SYSTEM = "You are a test agent."
GUARD_S = 5  # only a deadlock guard: no runner test's assertion depends on timing

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


class RecordingJournal(StatelessJournal):
    """Appends (kind, payload) per write, in the order the runner makes them.

    `checks` holds, per `check_owned` call, how many handlers had been invoked by then.
    """

    def __init__(self) -> None:
        self.records: list[tuple[str, Any]] = []
        self.checks: list[int] = []
        self.effects: list[bool] = []  # each write #1's: a handler not safe to retry follows

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.records]

    async def record_start(self, turn: Turn, *, interrupted: Sequence[str]) -> None:
        self.records.append(("start", list(interrupted)))

    async def check_owned(self, turn: Turn) -> None:
        self.checks.append(len(PROBE.calls))

    async def record_step(self, turn: Turn, *, assistant: Message, effects: bool = True) -> None:
        # A real write waits on the database: a dispatch started alongside it, not after
        # it, would run meanwhile, and the probe would see it ahead of write #1.
        for _ in range(5):
            await asyncio.sleep(0)
        await super().record_step(turn, assistant=assistant, effects=effects)
        self.records.append(("step", assistant))
        self.effects.append(effects)

    async def record_results(self, turn: Turn, *, results: Sequence[Message]) -> None:
        self.records.append(("results", list(results)))

    async def record_repairs(self, turn: Turn, *, repairs: Sequence[Message]) -> None:
        self.records.append(("repairs", list(repairs)))

    async def record_end(self, turn: Turn, *, final: Message | None, end: RunEnd) -> None:
        self.records.append(("end", (final, end)))


class LosingJournal(RecordingJournal):
    """Owns the session for the first `owned` checks; every later check finds it lost, or
    (`outage`) finds the database gone."""

    def __init__(self, *, owned: int = 0, outage: bool = False) -> None:
        super().__init__()
        self.owned = owned
        self.outage = outage

    async def check_owned(self, turn: Turn) -> None:
        await super().check_owned(turn)
        if len(self.checks) > self.owned:
            assert turn.session_id is not None
            if self.outage:
                raise DatabaseUnavailable("The database cannot be reached.")
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
        return ask(f"step {index + 1}", calls=item)


class Repeat(Model):
    """Asks for the same calls (with fresh ids) on every model call."""

    def __init__(self, name: str, arguments: dict[str, Any]) -> None:
        super().__init__()
        self.name = name
        self.arguments = arguments

    def __call__(self, request: ModelRequest) -> ModelResponse:
        self.requests.append(dataclasses.replace(request, messages=list(request.messages)))
        n = len(self.requests)
        return ask(f"step {n}", calls=[ToolCall(f"toolu_{n}", self.name, self.arguments)])


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
        turn or new_turn(),
        journal=journal,
        history=list(history or []),
        agent=agent_of(registry, **agent_changes),
    )
    return outcome, journal


def stored(message: Message, *, seq: int, run_id: str) -> Message:
    """The message as the journal returns it: numbered, and of its run."""
    message.seq = seq
    message.run_id = run_id
    return message


def body(message: Message) -> Any:
    return json.loads(message.content)

"""AgentRunner's dispatch of a step's calls: parallelism, order, errors, ownership."""

from __future__ import annotations

import asyncio

import pytest

from app.domain import RunStatus, ToolCall
from app.errors import DatabaseUnavailable, SessionConflict
from app.metrics import Metrics
from app.services.journal import RunEnd
from app.tools.base import ToolContext
from app.tools.registry import ToolRegistry
from tests.unit.runner.support import (
    GUARD_S,
    LosingJournal,
    Model,
    Probe,
    body,
    call,
    counted_tool_calls,
    run,
    tool_calls,
)


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
    assert body(results[4]) == {"error": "RuntimeError: kaput; it may or may not have taken effect"}
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


@pytest.mark.parametrize("parallel", [True, False])
async def test_an_outage_at_the_ownership_check_is_raised_as_itself(
    registry: ToolRegistry, probe: Probe, *, parallel: bool
) -> None:
    # Not wrapped in the parallel calls' ExceptionGroup, which the API would answer 500.
    calls = [call(f"toolu_{x}", "fan" if parallel else "step", label=x) for x in "ab"]
    journal = LosingJournal(owned=0, outage=True)
    with pytest.raises(DatabaseUnavailable):
        await run(registry, Model(calls), journal=journal, metrics=Metrics())

    assert probe.calls == []
    assert journal.kinds() == ["step"]


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


async def test_losing_the_session_mid_batch_lets_the_calls_under_way_finish(
    registry: ToolRegistry, probe: Probe
) -> None:
    # c's check finds the session lost while a's handler is under way. Cancelled there, a
    # handler is cut off mid-request (a side effect half done); it finishes instead, as a
    # serial call does, and only the calls not yet dispatched are not.
    calls = [
        call("toolu_a", "fan", label="a", after="x"),  # under way until the test says
        call("toolu_b", "fan", label="b"),
        call("toolu_c", "fan", label="c"),
    ]
    journal = LosingJournal(owned=2)
    metrics = Metrics()
    task = asyncio.create_task(
        run(registry, Model(calls), journal=journal, metrics=metrics, max_tool_concurrency=2)
    )
    await asyncio.wait_for(probe.finished("b").wait(), GUARD_S)
    for _ in range(20):  # c takes b's place and its check fails
        await asyncio.sleep(0)
    assert len(journal.checks) == 3
    assert not task.done()
    assert ("end", "a") not in probe.order  # still under way: not cancelled
    probe.finished("x").set()
    with pytest.raises(SessionConflict):
        await asyncio.wait_for(task, GUARD_S)

    assert probe.order.index(("end", "a")) > probe.order.index(("end", "b"))
    assert [label for event, label in probe.order if event == "start"] == ["a", "b"]
    assert journal.kinds() == ["step"]  # no results written: the next run repairs a and b
    assert counted_tool_calls(metrics) == {("fan", "ok"): 2}

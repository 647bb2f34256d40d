"""What ends an AgentRunner run: max_iterations, stuck, the budget, model failures."""

from __future__ import annotations

import logging

import pytest

from app.domain import RunStatus, Usage
from app.llm.base import LLMError, ModelResponse
from app.services.journal import RunEnd
from app.services.runner import BUDGET_NOTE
from app.tools.registry import ToolRegistry
from tests.unit.runner.support import (
    SYSTEM,
    Model,
    Probe,
    Repeat,
    call,
    run,
)


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


@pytest.mark.parametrize(
    ("stop_reason", "error_type"),
    [
        ("max_tokens", "max_tokens"),
        # Cut off at the context window: dispatched once, the call's input possibly cut short.
        ("model_context_window_exceeded", "model_context_window_exceeded"),
        ("refusal", "refusal"),
        ("pause_turn", "pause_turn"),
        ("a_reason_newer_than_the_runner", "api_error"),
    ],
)
async def test_a_tool_call_in_an_answer_that_stopped_other_than_to_call_it_is_never_made(
    registry: ToolRegistry, probe: Probe, stop_reason: str, error_type: str
) -> None:
    calls = [call("toolu_a", "note", text="a")]
    answer = ModelResponse("calling", calls, stop_reason=stop_reason)
    outcome, journal = await run(registry, Model([call("toolu_0", "note", text="0")], answer))

    assert probe.calls == [("note", {"text": "0"})]  # the first step's call only
    assert journal.kinds() == ["step", "results", "end"]  # nothing of the stopped answer
    end = outcome.end
    assert (end.status, end.response, end.error_type) == (RunStatus.ERROR, "step 1", error_type)
    assert end.error_message is not None
    named = "max_tokens (" if stop_reason == "max_tokens" else f"stopped ({stop_reason!r})"
    assert named in end.error_message
    assert "the call was not made" in end.error_message
    assert outcome.turn.stop_reason == stop_reason


@pytest.mark.parametrize("stop_reason", ["tool_use", "end_turn", "stop_sequence", None])
async def test_a_tool_call_is_made_whatever_the_usual_stop_reason(
    registry: ToolRegistry, probe: Probe, stop_reason: str | None
) -> None:
    answer = ModelResponse("calling", [call("toolu_a", "note", text="a")], stop_reason=stop_reason)
    outcome, journal = await run(registry, Model(answer))

    assert probe.calls == [("note", {"text": "a"})]
    assert journal.kinds() == ["step", "results", "end"]
    assert outcome.end.status is RunStatus.COMPLETE


# --- the turn's stop reason ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "stop_reason",
    ["max_tokens", "model_context_window_exceeded", "refusal", "pause_turn", "end_turn", None],
)
async def test_a_text_answer_completes_the_run_and_its_stop_reason_is_kept(
    registry: ToolRegistry, stop_reason: str | None
) -> None:
    # Cut off or not, a text-only answer completes the run with its text: only the stop
    # reason tells an answer cut off midway from a finished one.
    answer = ModelResponse("the answer is", stop_reason=stop_reason)
    outcome, journal = await run(registry, Model(answer))

    assert outcome.end == RunEnd(RunStatus.COMPLETE, "the answer is")
    assert journal.kinds() == ["end"]
    assert outcome.turn.stop_reason == stop_reason


async def test_the_stop_reason_is_the_last_answers(registry: ToolRegistry) -> None:
    final = ModelResponse("done", stop_reason="stop_sequence")
    outcome, _ = await run(registry, Model([call("toolu_a", "note", text="a")], final))

    assert outcome.end == RunEnd(RunStatus.COMPLETE, "done")
    assert outcome.turn.stop_reason == "stop_sequence"


async def test_a_model_failure_keeps_the_stop_reason_of_the_answer_before_it(
    registry: ToolRegistry,
) -> None:
    first, _ = await run(registry, Model(LLMError("gone", type="api_error")))
    assert first.turn.stop_reason is None  # no answer at all

    model = Model([call("toolu_a", "note", text="a")], LLMError("gone", type="api_error"))
    later, _ = await run(registry, model)
    assert later.end.status is RunStatus.ERROR
    assert later.turn.stop_reason == "tool_use"


async def test_a_stop_reason_is_kept_to_its_first_64_characters(registry: ToolRegistry) -> None:
    reason = "a_stop_reason_newer_than_the_runner_" * 3
    outcome, _ = await run(registry, Model(ModelResponse("hm", stop_reason=reason)))

    assert outcome.end.status is RunStatus.COMPLETE
    assert outcome.turn.stop_reason == reason[:64]

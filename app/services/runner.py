"""The tool-calling loop: model call, write #1, dispatch, write #2, until a final answer."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from app import logs
from app.db.base import utcnow
from app.domain import (
    Message,
    RunStatus,
    ToolCall,
    ToolResult,
    durability_error,
    is_durability_error,
    orphaned_calls,
)
from app.llm.base import LLMClient, LLMError, ModelRequest, ModelResponse, not_a_message
from app.metrics import Metrics
from app.services.journal import Journal, RunEnd, Turn
from app.tools.base import AgentConfig, Tool, ToolContext
from app.tools.registry import ToolRegistry

log = logging.getLogger(__name__)

BUDGET_WARN = 0.8
BUDGET_STOP = 0.9
BUDGET_NOTE = (
    f"Note from the runner: this run has used {BUDGET_WARN:.0%} of its token budget. "
    "Finish the task with as few further steps as you can."
)


@dataclass(frozen=True)
class RunOutcome:
    """What the runner hands back: how the run ended, and the turn as it left it."""

    end: RunEnd
    turn: Turn


# Stop reasons of an answer whose tool calls are made (no stop reason reads as end_turn).
_DISPATCHING = frozenset({"tool_use", "end_turn", "stop_sequence", None})
# Stop reasons that are the run's error type when they stop a tool call; any other stop
# reason (newer than this code) is an `api_error`.
_NAMED_STOPS = frozenset({"max_tokens", "model_context_window_exceeded", "refusal", "pause_turn"})
# How much of a stop reason the run keeps (the API's are far shorter; a newer one may not be).
STOP_REASON_MAX = 64


def _call_not_made(reason: str, *, agent: AgentConfig, last_text: str | None) -> RunEnd:
    """How a run ends when its model's answer asks for tools but stopped other than to call
    them (cut off at max_tokens or the context window, refused, paused): a call's input may
    be incomplete, or the call not meant, so none is made and nothing of the answer stored
    (as after a failed model call)."""
    if reason == "max_tokens":
        message = (
            f"The model's answer reached max_tokens ({agent.max_tokens}) while asking for a"
            " tool call, whose input may be incomplete; the call was not made. Raise the"
            " agent's max_tokens."
        )
    else:
        message = (
            f"The model's answer stopped ({reason[:STOP_REASON_MAX]!r}) while asking for a tool"
            " call, whose input may be incomplete; the call was not made."
        )
    error_type = reason if reason in _NAMED_STOPS else "api_error"
    return RunEnd(RunStatus.ERROR, last_text, error_type=error_type, error_message=message)


@dataclass
class _Limits:
    """The stop rules checked after each step: tools stuck failing, and the token budget
    (a note joins the system prompt at BUDGET_WARN, the run stops at BUDGET_STOP)."""

    agent: AgentConfig
    system: str | None
    failed_steps: int = 0
    warned: bool = False

    def after_step(self, turn: Turn, *, results: Sequence[Message]) -> RunStatus | None:
        """The status the run stops with after these results, or None to go on."""
        self.failed_steps = self.failed_steps + 1 if all(m.is_error for m in results) else 0
        if self.failed_steps >= self.agent.stuck_threshold:
            return RunStatus.STUCK
        if self.agent.token_budget is None:
            return None
        used = turn.usage.total / self.agent.token_budget
        if used >= BUDGET_STOP:
            return RunStatus.TOKEN_BUDGET_EXHAUSTED
        if used >= BUDGET_WARN and not self.warned:
            self.warned = True
            self.system = f"{self.system}\n\n{BUDGET_NOTE}" if self.system else BUDGET_NOTE
            log.warning(
                "run used %d%% of its token budget",
                round(BUDGET_WARN * 100),
                extra={"run_id": turn.run_id, "tokens": turn.usage.total},
            )
        return None


class AgentRunner:
    """Runs one turn of an agent over a history, writing through a Journal."""

    def __init__(self, *, llm: LLMClient, registry: ToolRegistry, metrics: Metrics) -> None:
        self._llm = llm
        self._registry = registry
        self._metrics = metrics
        self._steps: set[asyncio.Task[list[Message]]] = set()  # in flight (see `_step`)

    async def settle(self) -> None:
        """Wait for the steps in flight, which turns cut off by shutdown finish first: before
        the database and the tools' clients they use are closed."""
        while self._steps:
            await asyncio.wait(set(self._steps))

    async def cancel_steps(self) -> None:
        """Cancel the steps still in flight (a second signal stopped the wait for them) and
        let them end: their calls' results are lost, as at a crash. Left running while the
        tools' clients close, a call would fail of that, and on SQLite (no fence) its step
        could store that failure as the call's result."""
        steps = set(self._steps)
        for step in steps:
            step.cancel()
        if steps:
            await asyncio.wait(steps)

    async def repair(
        self, turn: Turn, *, journal: Journal, history: list[Message], agent: AgentConfig
    ) -> list[Message]:
        """Store one result for every orphaned call of `history` (CONTRACT §2), in one write,
        and return them.

        A `safe_to_retry` tool is invoked again and its real result kept; any other gets
        the durability error, so the model — not the runner — decides whether to repeat it.
        SessionConflict when this runner lost the session: it runs and writes nothing more.
        """
        index, orphans = orphaned_calls(history)
        results: list[Message] = []
        outcomes: list[str] = []
        for call in orphans:
            result = await self._reinvoke(turn, journal=journal, call=call, agent=agent)
            message = Message.tool(result)
            message.run_id = history[index].run_id
            results.append(message)
            outcomes.append(
                "durability_error" if is_durability_error(result.content) else "reinvoked"
            )
        if not results:
            return results
        await journal.record_repairs(turn, repairs=results)
        for call, outcome in zip(orphans, outcomes, strict=True):  # counted once stored
            self._metrics.tool_calls.labels(_tool_label(call, agent=agent), outcome).inc()
            log.info(
                "repaired orphaned tool call",
                extra={"tool_call_id": call.id, "tool_name": call.name, "outcome": outcome},
            )
        return results

    def _handler_of(self, call: ToolCall, *, agent: AgentConfig) -> Tool | None:
        """The tool whose handler the call runs: None for a tool unknown, or not the agent's
        (the call is answered with an error, and runs nothing)."""
        return self._registry.tool(call.name) if call.name in agent.tools else None

    def _has_effects(self, call: ToolCall, *, agent: AgentConfig) -> bool:
        """Whether the call runs a handler that is not safe to retry."""
        tool = self._handler_of(call, agent=agent)
        return tool is not None and not tool.safe_to_retry

    async def _reinvoke(
        self, turn: Turn, *, journal: Journal, call: ToolCall, agent: AgentConfig
    ) -> ToolResult:
        tool = self._handler_of(call, agent=agent)
        if tool is None or not tool.safe_to_retry:
            return durability_error(call.name, tool_call_id=call.id)
        # As before any dispatch: a runner that lost the session (paused, then taken over)
        # runs nothing more of it, even a tool that may run twice.
        await journal.check_owned(turn)
        return await self._invoke(turn, call=call, agent=agent)

    async def run(
        self, turn: Turn, *, journal: Journal, history: list[Message], agent: AgentConfig
    ) -> RunOutcome:
        """Run the turn to its end; journal writes raise, model failures end the run.

        `history` is everything stored before; when a turn is continued (same
        Idempotency-Key) its stored user message is already in it.
        """
        if turn.user_stored:
            messages = list(history)
        else:
            messages = [*history, turn.user_message]
            turn.messages.append(turn.user_message)
        tools = [t.spec for t in self._registry.tools_for(agent)]
        call_ids = {call.id for message in messages for call in message.tool_calls}
        limits = _Limits(agent, system=agent.system)
        last_text: str | None = None
        while True:
            if turn.iterations >= agent.max_iterations:
                end = RunEnd(RunStatus.MAX_ITERATIONS, last_text)
                break
            turn.iterations += 1
            request = ModelRequest(agent.model, limits.system, messages, tools, agent.max_tokens)
            response = await self._ask(
                turn, agent=agent, request=request, last_text=last_text, call_ids=call_ids
            )
            if isinstance(response, RunEnd):
                end = response
                break
            assistant = Message.assistant(response.text, tool_calls=response.tool_calls)
            last_text = response.text
            if not response.tool_calls:
                end = RunEnd(RunStatus.COMPLETE, last_text)
                await self._finish(turn, journal=journal, final=assistant, end=end)
                return RunOutcome(end, turn)
            await self._step(
                turn,
                journal=journal,
                agent=agent,
                assistant=assistant,
                response=response,
                messages=messages,
            )
            call_ids.update(call.id for call in response.tool_calls)
            stop = limits.after_step(turn, results=messages[-len(response.tool_calls) :])
            if stop is not None:
                end = RunEnd(stop, last_text)
                break
        await self._finish(turn, journal=journal, final=None, end=end)
        return RunOutcome(end, turn)

    async def _ask(
        self,
        turn: Turn,
        *,
        agent: AgentConfig,
        request: ModelRequest,
        last_text: str | None,
        call_ids: set[str],
    ) -> ModelResponse | RunEnd:
        """The model's answer, or how the run ends when there is none to act on.

        `call_ids` are the ids of the session's calls so far: a call that reuses one is
        never run, nor stored (results are paired with their calls by id, and the API
        refuses a history with two tool_use blocks of one id)."""
        try:
            response = await self._complete(request)
        except LLMError as exc:
            return _failed(last_text, error=exc)
        except Exception as exc:  # an adapter bug must end the run, not answer a 500
            log.exception("model call raised", extra={"run_id": turn.run_id})
            return RunEnd(
                RunStatus.ERROR, last_text, error_type="internal_error", error_message=str(exc)
            )
        turn.usage.add(response.usage)
        reason = response.stop_reason
        # Kept whatever follows (a text-only answer cut off at max_tokens still completes the
        # run: this is what tells it from a finished one).
        turn.stop_reason = None if reason is None else reason[:STOP_REASON_MAX]
        if response.tool_calls and reason not in _DISPATCHING:
            return _call_not_made(str(reason), agent=agent, last_text=last_text)
        reused = next((c.id for c in response.tool_calls if c.id in call_ids), None)
        if reused is not None:
            error = not_a_message(f"tool_use id {reused[:64]!r} was used by an earlier call")
            log.warning("model answer refused", extra={"error_type": error.type})
            return _failed(last_text, error=error)
        return response

    async def _complete(self, request: ModelRequest) -> ModelResponse:
        start = time.perf_counter()
        try:
            response = await self._llm.complete(request)
        finally:
            self._metrics.model_call.labels(request.model).observe(time.perf_counter() - start)
        tokens = self._metrics.model_tokens
        tokens.labels(request.model, "input").inc(response.usage.input_tokens)
        tokens.labels(request.model, "output").inc(response.usage.output_tokens)
        return response

    async def _step(
        self,
        turn: Turn,
        *,
        journal: Journal,
        agent: AgentConfig,
        assistant: Message,
        response: ModelResponse,
        messages: list[Message],
    ) -> None:
        """One tool-call step: write #1, every handler, write #2.

        Once begun, a step is finished even if its turn is cancelled (by shutdown, at the end
        of its grace), and the turn stops after it. Cut off, a call in flight would lose its
        result (§2's error on resume, though it may have taken effect), and after write #1
        the calls not yet made would too (they are told from made ones only by write #2)."""
        step = asyncio.create_task(
            self._step_writes(
                turn, journal=journal, agent=agent, assistant=assistant, response=response
            )
        )
        self._steps.add(step)
        step.add_done_callback(self._steps.discard)
        try:
            await asyncio.shield(step)
        except asyncio.CancelledError:
            if not step.done():
                log.info("turn cut off: waiting for its step", extra={"run_id": turn.run_id})
                await asyncio.wait({step})
            if not step.cancelled():
                step.exception()  # seen: the cancellation is what the turn ends with
            raise
        messages.extend(step.result())

    async def _step_writes(
        self,
        turn: Turn,
        *,
        journal: Journal,
        agent: AgentConfig,
        assistant: Message,
        response: ModelResponse,
    ) -> list[Message]:
        """The step's messages, stored: the assistant's, then its calls' results."""
        effects = any(self._has_effects(call, agent=agent) for call in response.tool_calls)
        await journal.record_step(turn, assistant=assistant, effects=effects)
        turn.messages.append(assistant)
        results = [
            Message.tool(r)
            for r in await self._dispatch(
                turn, journal=journal, agent=agent, calls=response.tool_calls
            )
        ]
        await journal.record_results(turn, results=results)
        turn.messages.extend(results)
        return [assistant, *results]

    async def _finish(
        self, turn: Turn, *, journal: Journal, final: Message | None, end: RunEnd
    ) -> None:
        turn.finished_at = utcnow()
        await journal.record_end(turn, final=final, end=end)
        if final is not None:
            turn.messages.append(final)
        elif not turn.user_stored and turn.messages and turn.messages[-1] is turn.user_message:
            # The model failed before the turn's first write: its user message was never
            # stored (CONTRACT §2, the history is as it was), so it is not the turn's either.
            turn.messages.pop()

    async def _dispatch(
        self, turn: Turn, *, journal: Journal, agent: AgentConfig, calls: Sequence[ToolCall]
    ) -> list[ToolResult]:
        """Run the step's calls in order; neighbouring `parallel` tools run concurrently."""
        limit = asyncio.Semaphore(agent.max_tool_concurrency)
        results: list[ToolResult] = []
        batch: list[ToolCall] = []
        refused: list[Exception] = []  # the first failed ownership check of the batch

        async def limited(call: ToolCall) -> ToolResult:
            async with limit:
                if refused:  # a sibling found the session lost: dispatch nothing more
                    raise refused[0]
                try:
                    await journal.check_owned(turn)  # a runner that lost it dispatches nothing
                except Exception as exc:
                    refused.append(exc)
                    raise
                return await self._execute(turn, call=call, agent=agent)

        async def flush() -> None:
            if batch:
                # Not a TaskGroup: when one call finds the session lost, the calls already
                # under way finish, as a serial call does (cancelled, a handler would be cut
                # off mid-request); those not yet dispatched are not.
                outcomes = await asyncio.gather(*map(limited, batch), return_exceptions=True)
                failed = [o for o in outcomes if isinstance(o, BaseException)]
                if failed:
                    # The ownership check's errors (handlers' become results): the first, as
                    # a serial call raises it (SessionConflict a 409, an outage 503).
                    raise (refused or failed)[0]
                results.extend(o for o in outcomes if not isinstance(o, BaseException))
                batch.clear()

        for call in calls:
            tool = self._registry.tool(call.name)
            if tool is not None and tool.parallel:
                batch.append(call)
                continue
            await flush()
            await journal.check_owned(turn)
            results.append(await self._execute(turn, call=call, agent=agent))
        await flush()
        return results

    async def _execute(self, turn: Turn, *, call: ToolCall, agent: AgentConfig) -> ToolResult:
        result = await self._invoke(turn, call=call, agent=agent)
        outcome = "error" if result.is_error else "ok"
        self._metrics.tool_calls.labels(_tool_label(call, agent=agent), outcome).inc()
        return result

    async def _invoke(self, turn: Turn, *, call: ToolCall, agent: AgentConfig) -> ToolResult:
        """Run the call's handler (the registry validates its input and turns failures into
        error results)."""
        with logs.bound(tool_call_id=call.id):
            return await self._registry.execute(
                call, ctx=self._context(turn, call=call), allowed=agent.tools
            )

    @staticmethod
    def _context(turn: Turn, *, call: ToolCall) -> ToolContext:
        return ToolContext(session_id=turn.session_id, run_id=turn.run_id, tool_call_id=call.id)


def _failed(last_text: str | None, *, error: LLMError) -> RunEnd:
    """How a run ends when its model call failed (CONTRACT §3: status `error`)."""
    return RunEnd(RunStatus.ERROR, last_text, error_type=error.type, error_message=error.message)


def _tool_label(call: ToolCall, *, agent: AgentConfig) -> str:
    """The call's tool as a metric label: names the model invents share one value."""
    return call.name if call.name in agent.tools else "unknown"

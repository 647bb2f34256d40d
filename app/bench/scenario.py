"""The standard bench scenario: one agent, two tools, a zero-latency scripted model.

It is the same work our comparisons with other frameworks use:

* `get_issue` is a pure read: it returns the fixed 196-byte JSON object `ISSUE` at once.
* `post_slack` is the side effect: it counts its call in `SLACK` and returns at once.
* The model's step is k = 1 + the number of assistant messages so far. For k = 1..steps it
  answers a 200-character text and two tool calls, `get_issue {"issue_id": "ISSUE-k"}` then
  `post_slack {"channel": "#triage", "text": "ISSUE-k triaged (step k)."}`; at k = steps + 1
  a 200-character final answer.
* The user message is 200 characters. A 10-step session ends with 32 messages: the user
  message, 10 x (assistant + 2 tool results), the final answer.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from app.domain import Message, Role, ToolCall, Usage
from app.llm.base import ModelRequest, ModelResponse
from app.llm.scripted import tool_call_id
from app.tools.base import ToolContext

TEXT_CHARS = 200
CHANNEL = "#triage"
AGENT = "bench"
LONG_AGENT = "bench-long"
HTTP_MODEL = "bench-model"
_FILLER = (
    " The reporter says it started after the last deploy; logs show the same stack trace on"
    " every attempt, so I will look it up, post a short note to the channel, and move on."
)

ISSUE: dict[str, Any] = {
    "id": "ISSUE-4711",
    "title": "Checkout returns HTTP 500 for big carts",
    "state": "open",
    "priority": "high",
    "labels": ["bug", "checkout"],
    "reporter": "dana@example.com",
    "created_at": "2026-01-12T09:30:00Z",
}
ISSUE_BYTES = 196  # len of ISSUE as compact JSON, as a tool result stores it


def sized(text: str, *, chars: int = TEXT_CHARS) -> str:
    """`text` padded with filler sentences (or cut) to exactly `chars` characters."""
    while len(text) < chars:
        text += _FILLER
    return text[:chars]


USER_MESSAGE = sized("Please triage today's incoming issues one by one and tell me when done.")
FINAL_TEXT = sized("All issues are triaged and each one was posted to #triage.")


def step_text(k: int) -> str:
    """The 200-character text of step k."""
    return sized(f"Step {k}: looking up ISSUE-{k} and posting it to {CHANNEL}.")


def step_calls(k: int) -> list[tuple[str, dict[str, Any]]]:
    """The two tool calls of step k, in order: (name, arguments)."""
    return [
        ("get_issue", {"issue_id": f"ISSUE-{k}"}),
        ("post_slack", {"channel": CHANNEL, "text": f"ISSUE-{k} triaged (step {k})."}),
    ]


def durable_writes(steps: int) -> int:
    """CONTRACT §2's transactions of a fresh session's turn: two per step and the answer."""
    return 2 * steps + 1


def messages_per_session(steps: int) -> int:
    """Messages a fresh session holds after one turn: user, steps x 3, final answer."""
    return 2 + 3 * steps


class SideEffects:
    """How often each `post_slack` call ran, by idempotency key; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: Counter[str] = Counter()
        self._total = 0  # kept, not summed: the tool's cost must not grow with the calls

    def record(self, key: str) -> int:
        """Count one run of the call `key`; the total so far."""
        with self._lock:
            self._calls[key] += 1
            self._total += 1
            return self._total

    def reset(self) -> None:
        """Forget every call."""
        with self._lock:
            self._calls.clear()
            self._total = 0

    @property
    def total(self) -> int:
        """Calls counted since the last reset."""
        with self._lock:
            return self._total

    @property
    def repeated(self) -> list[str]:
        """Keys of calls that ran more than once."""
        with self._lock:
            return [key for key, count in self._calls.items() if count > 1]


# The counter the python tool and the bench's HTTP tool server both increment.
SLACK = SideEffects()


# Positional: the tool handler interface (README).
async def get_issue(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:  # noqa: PLR0917
    """Fetch an issue by id (a pure read: the same fixed record, at once)."""
    return ISSUE


# Positional: the tool handler interface (README).
async def post_slack(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:  # noqa: PLR0917
    """Post a message to a channel (the side effect, counted)."""
    total = SLACK.record(ctx.idempotency_key)
    return {"ok": True, "ts": f"1700000000.{total:06d}"}


TOOLS_YAML = """\
tools:
  get_issue:
    description: Fetch an issue by id
    input_schema: {{type: object, properties: {{issue_id: {{type: string}}}}, required: [issue_id]}}
    safe_to_retry: true
    {get_issue}
  post_slack:
    description: Post a message to a channel
    input_schema:
      type: object
      properties: {{channel: {{type: string}}, text: {{type: string}}}}
      required: [channel, text]
    {post_slack}
agents:
"""
AGENT_YAML = """\
  {name}:
    model: "{model}"
    system: You triage incoming issues.
    tools: [get_issue, post_slack]
    max_iterations: {max_iterations}
"""


def agents_yaml(agents: dict[str, tuple[str, int]], *, tools_url: str | None = None) -> str:
    """An agents file: `agents` maps name to (model, steps); python tools, or HTTP ones."""
    names = ("get_issue", "post_slack")
    if tools_url is None:
        where = {name: f'python: "app.bench.scenario:{name}"' for name in names}
    else:
        where = {name: f'http: {{url: "{tools_url}/{name}"}}' for name in names}
    text = TOOLS_YAML.format(**where)
    for name, (model, steps) in agents.items():
        text += AGENT_YAML.format(name=name, model=model, max_iterations=steps + 1)
    return text


def assistant_count(messages: list[Message]) -> int:
    """How many assistant messages the history holds."""
    return sum(1 for m in messages if m.role is Role.ASSISTANT)


@dataclass
class BenchModel:
    """The scripted model of the scenario (`scripted:bench`); optionally records its calls.

    `calls` holds (start, end) perf_counter times of each call while `recording`, so the
    time between calls can be measured without the model's own work.
    """

    steps: int
    recording: bool = False

    def __post_init__(self) -> None:
        self.calls: list[tuple[float, float]] = []

    def __call__(self, request: ModelRequest) -> ModelResponse:
        """The scenario's answer to step k of the session in `request`."""
        start = time.perf_counter()
        k = 1 + assistant_count(request.messages)
        # Fixed token counts: the client's own estimate would re-read the whole history.
        usage = Usage(input_tokens=60 * len(request.messages), output_tokens=80)
        if k > self.steps:
            response = ModelResponse(FINAL_TEXT, usage=usage, stop_reason="end_turn")
        else:
            calls = [
                ToolCall(tool_call_id(request, step=k, tool_name=name), name, arguments)
                for name, arguments in step_calls(k)
            ]
            response = ModelResponse(step_text(k), calls, usage=usage, stop_reason="tool_use")
        if self.recording:
            self.calls.append((start, time.perf_counter()))
        return response


def api_reply(body: dict[str, Any], *, steps: int) -> dict[str, Any]:
    """The Messages API answer of the scenario to a request body (the HTTP bench's model)."""
    k = 1 + sum(1 for m in body["messages"] if m["role"] == "assistant")
    content: list[dict[str, Any]]
    if k > steps:
        content, stop = [{"type": "text", "text": FINAL_TEXT}], "end_turn"
    else:
        content = [{"type": "text", "text": step_text(k)}]
        for index, (name, arguments) in enumerate(step_calls(k)):
            call_id = f"toolu_bench_{k:05d}_{index}"
            content.append({"type": "tool_use", "id": call_id, "name": name, "input": arguments})
        stop = "tool_use"
    return {
        "id": f"msg_bench_{k:05d}",
        "type": "message",
        "role": "assistant",
        "model": body.get("model", HTTP_MODEL),
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": {"input_tokens": 60 * len(body["messages"]), "output_tokens": 80},
    }


def issue_json() -> str:
    """ISSUE as the compact JSON a tool result stores."""
    return json.dumps(ISSUE, separators=(",", ":"))


class BenchError(Exception):
    """The bench could not run, or a check of the scenario failed (a side effect ran twice)."""


@dataclass(frozen=True)
class BenchOptions:
    """What to run: the scenario's size and how many sessions to time."""

    database_url: str | None = None
    sessions: int = 30
    warmup: int = 5
    steps: int = 10
    long_steps: int = 200
    concurrency: int = 16
    http: bool = True

    @property
    def per_worker(self) -> int:
        """Timed sessions per concurrent worker (about a third of `sessions`)."""
        return max(1, self.sessions // 3)

"""The HTTP bench: a real `agent-runner serve`, the real anthropic SDK, HTTP tools.

The bench process serves, from one background thread, a zero-latency fake of the Messages API
that answers the scenario from each request's messages, and the scenario's two tools over
HTTP (`post_slack` counts into SLACK by Idempotency-Key). The server is a subprocess on the
same database, pointed at both with ANTHROPIC_BASE_URL and an agents file of HTTP tools.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from app.bench.report import HttpFigures
from app.bench.scenario import (
    AGENT,
    HTTP_MODEL,
    ISSUE,
    SLACK,
    USER_MESSAGE,
    BenchError,
    BenchOptions,
    agents_yaml,
    api_reply,
)
from app.bench.service import check_run, check_side_effects, sessions_of
from app.schemas.runs import RunRead
from app.serving import ServeProcess, ThreadedServer


def scenario_app(steps: int) -> Starlette:
    """The fake Messages API (`/v1/messages`) and the two tools (`/tools/<name>`)."""

    async def create_message(request: Request) -> JSONResponse:
        return JSONResponse(api_reply(await request.json(), steps=steps))

    async def get_issue(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse(ISSUE)

    async def post_slack(request: Request) -> JSONResponse:
        await request.body()
        total = SLACK.record(request.headers.get("idempotency-key", ""))
        return JSONResponse({"ok": True, "ts": f"1700000000.{total:06d}"})

    return Starlette(
        routes=[
            Route("/v1/messages", create_message, methods=["POST"]),
            Route("/tools/get_issue", get_issue, methods=["POST"]),
            Route("/tools/post_slack", post_slack, methods=["POST"]),
        ]
    )


BENCH_KEY = "bench-key"


def server_env(database_url: str, *, agents_file: Path, model_url: str) -> dict[str, str]:
    """The server's environment: ours, minus anything that would change what it does. What
    a `.env` where the bench runs could give back is set (the environment wins over it): no
    failpoints, and the bench's own key."""
    dropped = ("ANTHROPIC_", "API_KEYS", "FAILPOINTS", "DATABASE_", "AGENTS_FILE", "LOG_")
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(dropped)},
        "API_KEYS": f"{BENCH_KEY}:bench",
        "FAILPOINTS": "",
        "DATABASE_URL": database_url,
        "AGENTS_FILE": str(agents_file),
        "ANTHROPIC_BASE_URL": model_url,
        "ANTHROPIC_API_KEY": BENCH_KEY,
        "ANTHROPIC_MAX_RETRIES": "0",
        "LOG_LEVEL": "WARNING",
    }


def _stopped_answering(exc: httpx.TransportError) -> BenchError:
    """The bench's server went away mid-bench (it died, or was stopped): one line."""
    return BenchError(f"agent-runner serve stopped answering ({exc!r})")


def _session(client: httpx.Client, *, durable: bool, steps: int) -> float:
    body: dict[str, str] = {"agent": AGENT, "message": USER_MESSAGE}
    if durable:
        body["session_id"] = f"bench-http-{os.urandom(12).hex()}"
    start = time.perf_counter()
    try:
        response = client.post("/v1/runs", json=body)
    except httpx.TransportError as exc:
        raise _stopped_answering(exc) from exc
    elapsed = (time.perf_counter() - start) * 1000
    if response.status_code != 200:
        raise BenchError(f"POST /v1/runs answered {response.status_code}: {response.text[:500]}")
    check_run(RunRead.model_validate(response.json()), steps=steps)
    return elapsed


class ModelCalls:
    """Seconds and count of the server's model calls (its own metric, from /metrics), summed
    per kind of session: a model call touches no database, so a difference between the kinds
    is what the machine does to the server, not what durability costs."""

    def __init__(self, client: httpx.Client) -> None:
        self._client = client
        self._totals = {False: [0.0, 0.0], True: [0.0, 0.0]}

    def _read(self) -> tuple[float, float]:
        try:
            text = self._client.get("/metrics").text
        except httpx.TransportError as exc:
            raise _stopped_answering(exc) from exc
        seconds = count = 0.0
        for family in text_string_to_metric_families(text):
            if family.name == "agent_runner_model_call_seconds":
                for sample in family.samples:
                    if sample.name.endswith("_sum"):
                        seconds += sample.value
                    elif sample.name.endswith("_count"):
                        count += sample.value
        return seconds, count

    def session(self, *, durable: bool, steps: int) -> float:
        """Time one session (see `_session`) and add its model calls to its kind's."""
        seconds, count = self._read()
        elapsed = _session(self._client, durable=durable, steps=steps)
        after_seconds, after_count = self._read()
        totals = self._totals[durable]
        totals[0] += after_seconds - seconds
        totals[1] += after_count - count
        return elapsed

    def mean_ms(self, *, durable: bool) -> float:
        """The mean model call as the server timed it, in ms, for one kind of session."""
        seconds, count = self._totals[durable]
        return 1000 * seconds / count if count else 0.0


def measure_http(database_url: str, *, options: BenchOptions, workdir: Path) -> HttpFigures:
    """Stateless and durable sessions through HTTP, interleaved, after warm-up."""
    SLACK.reset()
    stateless: list[float] = []
    durable: list[float] = []
    with ThreadedServer(scenario_app(options.steps), name="bench-fake-model") as fake:
        agents_file = workdir / "bench-agents.yaml"
        tools = agents_yaml({AGENT: (HTTP_MODEL, options.steps)}, tools_url=f"{fake.url}/tools")
        agents_file.write_text(tools)
        env = server_env(database_url, agents_file=agents_file, model_url=fake.url)
        server = ServeProcess(env=env, log_path=workdir / "server.log")
        try:
            server.start()
        except RuntimeError as exc:
            raise BenchError(f"agent-runner serve did not start: {exc}") from exc
        try:
            auth = {"Authorization": f"Bearer {BENCH_KEY}"}
            with httpx.Client(base_url=server.url, headers=auth, timeout=120) as client:
                for _ in range(options.warmup):
                    _session(client, durable=False, steps=options.steps)
                    _session(client, durable=True, steps=options.steps)
                calls = ModelCalls(client)
                for _ in range(options.sessions):
                    stateless.append(calls.session(durable=False, steps=options.steps))
                    durable.append(calls.session(durable=True, steps=options.steps))
            rss = server.peak_rss_mb()
        finally:
            server.stop()
    expected = 2 * (options.warmup + options.sessions) * options.steps
    side_effects = check_side_effects(expected)
    return HttpFigures(
        sessions_of(stateless, durable=durable, steps=options.steps),
        rss,
        side_effects,
        model_call_ms_stateless=calls.mean_ms(durable=False),
        model_call_ms_durable=calls.mean_ms(durable=True),
    )

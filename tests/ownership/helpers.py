"""Requests, problem checks and history readers shared by the ownership tests."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from tests.crash import support as crash_support

Json = dict[str, Any]

PROBLEM_JSON = "application/problem+json"

# Overrides the `backend` fixture's parameters: the test runs on PostgreSQL only.
POSTGRES_ONLY = pytest.mark.parametrize(
    "backend", [pytest.param("postgres", id="postgres", marks=pytest.mark.postgres)]
)


def run_body(agent: str, message: str, session_id: str | None, **extra: Any) -> Json:
    """The body of POST /v1/runs (no `session_id` key when it is None)."""
    body: Json = {"agent": agent, "message": message, **extra}
    if session_id is not None:
        body["session_id"] = session_id
    return body


def ok(response: httpx.Response) -> Json:
    """The JSON body of a 200."""
    assert response.status_code == 200, response.text
    body: Json = response.json()
    return body


def assert_problem(response: httpx.Response, status: int, code: str) -> Json:
    """The problem+json body of an error response with this status and code."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith(PROBLEM_JSON), response.headers
    problem: Json = response.json()
    assert problem["code"] == code, problem
    assert problem["status"] == status, problem
    assert {"type", "title", "detail"} <= problem.keys(), problem
    return problem


def assert_busy(response: httpx.Response) -> Json:
    """A 409 session_busy with an `active_run_id` field and a Retry-After header."""
    problem = assert_problem(response, 409, "session_busy")
    assert "active_run_id" in problem, problem
    retry_after = response.headers.get("retry-after")
    assert retry_after is not None and retry_after.isdigit() and int(retry_after) > 0, retry_after
    return problem


def post_until_not_busy(
    client: httpx.Client,
    body: Json,
    *,
    deadline: float,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    """POST /v1/runs again while it answers 409 session_busy; fail at `deadline` (monotonic)."""
    while True:
        response = client.post("/v1/runs", json=body, headers=headers)
        if response.status_code != 409:
            return response
        assert_busy(response)
        if time.monotonic() > deadline:
            pytest.fail(f"still session_busy at the deadline: {response.text}")
        time.sleep(0.1)


def fire_together(requests: list[tuple[str, Json]], *, timeout: float = 30) -> list[httpx.Response]:
    """POST each (server url, body) to /v1/runs from its own thread, all released at once."""
    barrier = threading.Barrier(len(requests))
    responses: list[httpx.Response | None] = [None] * len(requests)
    errors: list[BaseException] = []

    def send(index: int, url: str, body: Json) -> None:
        try:
            with httpx.Client(base_url=url, timeout=timeout) as client:
                client.get("/healthz")  # connect first, so the barrier releases requests only
                barrier.wait(timeout=timeout)
                responses[index] = client.post("/v1/runs", json=body)
        except Exception as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=send, args=(i, url, body), daemon=True)
        for i, (url, body) in enumerate(requests)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 5)
    assert not errors, errors
    done = [r for r in responses if r is not None]
    assert len(done) == len(requests), "some requests never answered"
    return done


class Background:
    """One POST /v1/runs sent from a thread; `.result` is its response or its transport error."""

    def __init__(
        self, url: str, body: Json, *, headers: dict[str, str] | None = None, timeout: float = 60
    ) -> None:
        self.result: httpx.Response | httpx.TransportError | None = None
        self._thread = threading.Thread(
            target=self._send, args=(url, body, headers or {}, timeout), daemon=True
        )
        self._thread.start()

    def _send(self, url: str, body: Json, headers: dict[str, str], timeout: float) -> None:
        try:
            with httpx.Client(base_url=url, timeout=timeout) as client:
                self.result = client.post("/v1/runs", json=body, headers=headers)
        except httpx.TransportError as exc:
            self.result = exc

    def join(self, timeout: float) -> httpx.Response | httpx.TransportError:
        """Wait for the answer (or the transport error)."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"no answer within {timeout}s"
        assert self.result is not None
        return self.result


def _pages(client: httpx.Client, path: str, params: dict[str, str]) -> list[Json]:
    items: list[Json] = []
    after: str | None = None
    while True:
        query = {**params, "limit": "200", **({"after": after} if after else {})}
        page = ok(client.get(path, params=query))
        items.extend(page["data"])
        after = page["next_after"]
        if after is None:
            return items


def history(client: httpx.Client, session_id: str, **params: str) -> list[Json]:
    """The session's whole history, in order."""
    return _pages(client, f"/v1/sessions/{session_id}/messages", params)


def session_runs(client: httpx.Client, session_id: str, **params: str) -> list[Json]:
    """The session's runs, newest first."""
    return _pages(client, f"/v1/sessions/{session_id}/runs", params)


def session_status(client: httpx.Client, session_id: str) -> str:
    """`idle`, `running` or `needs_resume`."""
    status: str = ok(client.get(f"/v1/sessions/{session_id}"))["status"]
    return status


def run_status(client: httpx.Client, run_id: str) -> str:
    """The status GET /v1/runs/{run_id} reports."""
    status: str = ok(client.get(f"/v1/runs/{run_id}"))["status"]
    return status


def tool_calls(messages: list[Json]) -> list[Json]:
    """Every tool call the assistant messages ask for, in order."""
    return [call for m in messages if m["role"] == "assistant" for call in m["tool_calls"]]


def result_of(messages: list[Json], call_id: str) -> Json:
    """The one tool message answering `call_id`."""
    found = [m for m in messages if m["role"] == "tool" and m["tool_call_id"] == call_id]
    assert len(found) == 1, (call_id, found)
    return found[0]


def user_messages(messages: list[Json], text: str) -> list[Json]:
    """The user messages holding `text`."""
    return [m for m in messages if m["role"] == "user" and m["content"] == text]


def assert_durability_error(message: Json, *, tool: str, call_id: str) -> None:
    """`message` is the durability error of CONTRACT §2 for this call (tests/crash's check)."""
    crash_support.assert_durability_error(message, {"id": call_id, "name": tool})


# The crash tests' check of a whole history: one check for every test of it.
assert_history_consistent = crash_support.assert_history_consistent

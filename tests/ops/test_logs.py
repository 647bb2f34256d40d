"""Logs: JSON lines with the run's ids, one access line per request, no keys or contents.

The JSON checks read the logs of the scenario in scenario.py (a crashed server and the one
that resumed its run); the text and level check runs a server of its own.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.ops.helpers import json_lines
from tests.ops.scenario import SESSIONS, Scenario
from tests.support.fake_anthropic import FakeAnthropic
from tests.support.server import AgentsServer

LEVELS = {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}
TEXT_LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?P<level>[A-Z]+) (?P<logger>[\w.]+): (?P<rest>.*)$"
)


def _records(ops: Scenario) -> list[dict[str, Any]]:
    return json_lines(ops.crash_log) + json_lines(ops.serve_log)


def _orphaned_calls(ops: Scenario) -> dict[str, str]:
    """Call id -> tool name of the calls the crash left without results."""
    run_id = ops.answers["resume"][1]["run_id"]
    return {
        call["id"]: call["name"]
        for message in ops.messages[SESSIONS["resume"]]
        if message["role"] == "assistant" and message["run_id"] == run_id
        for call in message["tool_calls"]
    }


def _tool_results(ops: Scenario, *, errors: bool) -> list[str]:
    """The texts inside the stored tool results (ok ones, or the failed calls' error texts)."""
    texts: list[str] = []
    for messages in ops.messages.values():
        for message in messages:
            if message["role"] != "tool":
                continue
            result = json.loads(message["content"])
            failed = isinstance(result, dict) and "error" in result
            if failed and result.get("kind") == "tool-durability-error":
                failed = False  # the runner's own text, not something the tool answered
            if failed == errors:
                texts.extend(_strings(result))
    return [t for t in texts if len(t) >= 12]


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [
            s for k, v in value.items() if k not in ("toolName", "toolCallId") for s in _strings(v)
        ]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _info_lines_holding(ops: Scenario, texts: list[str]) -> list[str]:
    return [
        line
        for record in _records(ops)
        if record["level"] == "INFO"
        for line in [json.dumps(record)]
        if any(text in line or json.dumps(text)[1:-1] in line for text in texts)
    ]


def test_every_line_is_a_json_object_with_time_level_logger_and_message(ops: Scenario) -> None:
    records = _records(ops)
    assert len(records) > 20
    for record in records:
        assert {"time", "level", "logger", "message"} <= record.keys(), record
        assert record["level"] in LEVELS, record
        datetime.fromisoformat(record["time"])
        assert isinstance(record["logger"], str) and isinstance(record["message"], str)


def test_lines_written_while_serving_a_durable_run_carry_its_ids(ops: Scenario) -> None:
    records = _records(ops)
    for action in ("resume", "ok", "tool_error", "model_error", "busy_first"):
        answer = ops.answers[action][1]
        mine = [r for r in records if r.get("run_id") == answer["run_id"]]
        access = [r for r in mine if r["logger"] == "app.access" and r["path"] == "/v1/runs"]
        assert access, f"no access line carries run_id {answer['run_id']} ({action})"
        for record in mine:
            assert record.get("session_id") == answer["session_id"], record
            assert record.get("agent") == answer["agent"], record
    model_failed = [r for r in records if r["message"] == "model call failed"]
    assert [r.get("run_id") for r in model_failed] == [ops.answers["model_error"][1]["run_id"]]
    failpoint = [r for r in json_lines(ops.crash_log) if r["logger"] == "app.failpoints"]
    assert len(failpoint) == 1
    assert failpoint[0].get("run_id") == ops.answers["resume"][1]["run_id"]
    assert failpoint[0].get("session_id") == SESSIONS["resume"]
    assert failpoint[0].get("agent") == "triage"


def test_a_replayed_turn_is_logged_under_its_stored_run(ops: Scenario) -> None:
    resumed, replayed = ops.answers["resume"][1], ops.answers["replay"]
    assert replayed == (200, resumed)  # the finished keyed turn's stored answer
    access = [
        r
        for r in _records(ops)
        if r["logger"] == "app.access" and r["path"] == "/v1/runs" and r["method"] == "POST"
    ]
    # The resubmission that continued the crashed turn, then the replay: both under its id.
    assert [r.get("run_id") for r in access].count(resumed["run_id"]) == 2


def test_requests_outside_a_run_carry_no_run_ids(ops: Scenario) -> None:
    for record in json_lines(ops.serve_log):
        if record["logger"] == "app.access" and not record["path"].startswith("/v1/runs"):
            assert not {"run_id", "session_id", "agent", "tool_call_id"} & record.keys(), record


def test_tool_lines_carry_the_tool_call_id(ops: Scenario) -> None:
    records = json_lines(ops.serve_log)
    resumed = ops.answers["resume"][1]
    repaired = [r for r in records if r["message"] == "repaired orphaned tool call"]
    assert len(repaired) == len(_orphaned_calls(ops)) == 2  # the crashed step's two calls
    assert {r.get("tool_call_id") for r in repaired} == set(_orphaned_calls(ops))
    for record in repaired:
        assert record.get("run_id") == resumed["run_id"], record
        assert record.get("session_id") == resumed["session_id"], record
        assert record.get("agent") == "triage", record

    failed_calls = [
        m["tool_call_id"]
        for m in ops.messages[SESSIONS["tool_error"]]
        if m["role"] == "tool" and m["is_error"]
    ]
    failed = [r for r in records if r["logger"] == "app.tools.registry"]
    assert len(failed_calls) == 1, failed_calls
    assert [r.get("tool_call_id") for r in failed] == failed_calls
    assert all(r.get("run_id") == ops.answers["tool_error"][1]["run_id"] for r in failed)


def test_one_access_line_per_request(ops: Scenario) -> None:
    access = [r for r in json_lines(ops.serve_log) if r["logger"] == "app.access"]
    for record in access:
        assert record["level"] == "INFO"
        assert isinstance(record["duration_ms"], int | float) and record["duration_ms"] >= 0
    logged = Counter((r["method"], r["path"], r["status"]) for r in access)
    # ServerProcess.start() polls /healthz until the first 200 (the scenario never does).
    health = ("GET", "/healthz", 200)
    assert logged.pop(health, 0) >= 1
    assert logged == Counter(ops.requests)


def test_no_line_contains_an_api_key(ops: Scenario) -> None:
    assert ops.rejected[0] == 401
    for log in (ops.crash_log, ops.serve_log):
        assert ops.api_key not in log
        assert ops.wrong_key not in log


def test_info_lines_hold_no_user_message_text_and_no_tool_results(ops: Scenario) -> None:
    results = _tool_results(ops, errors=False)
    assert any("Printer on fire" in text for text in results), results
    assert _info_lines_holding(ops, [ops.marker]) == []
    assert _info_lines_holding(ops, results) == []


def test_info_lines_hold_no_tool_error_results(ops: Scenario) -> None:
    errors = _tool_results(ops, errors=True)
    assert errors, "the scenario has no failed tool call"
    assert _info_lines_holding(ops, errors) == []


def test_text_format_and_warning_level(tmp_path: Path, agents_server: AgentsServer) -> None:
    server = agents_server(
        database_url=f"sqlite:///{tmp_path / 'text.db'}",
        env={"LOG_FORMAT": "text", "LOG_LEVEL": "WARNING"},
    )
    with server, server.client() as client:
        answer = client.post(
            "/v1/runs", json={"agent": "broken-model", "message": "hi", "session_id": "t-1"}
        )
        assert answer.status_code == 200 and answer.json()["status"] == "error"
        assert client.get("/readyz").status_code == 200
    run_id = answer.json()["run_id"]

    lines = server.logs().splitlines()
    assert lines, "nothing was logged at WARNING"
    for line in lines:
        match = TEXT_LINE.match(line)
        assert match, f"not a plain text log line: {line!r}"
        assert match["level"] in ("WARNING", "ERROR", "CRITICAL"), line
        assert match["logger"] != "app.access", line
    failed = [line for line in lines if "model call failed" in line]
    assert len(failed) == 1
    assert f"run_id={run_id}" in failed[0]
    assert "session_id=t-1" in failed[0] and "agent=broken-model" in failed[0]


def test_text_lines_cannot_be_forged_by_what_a_client_sends(
    tmp_path: Path, agents_server: AgentsServer
) -> None:
    # A newline in a path or an agent name started a line of the client's choosing, and an
    # escape sequence reached the operator's terminal.
    server = agents_server(
        database_url=f"sqlite:///{tmp_path / 'forge.db'}", env={"LOG_FORMAT": "text"}
    )
    forged = "\n2026-01-01 00:00:00,000 CRITICAL app: FORGED \x1b[31m\u2028"
    with server, server.client() as client:
        answer = client.post("/v1/runs", json={"agent": f"echo{forged}", "message": "hi"})
        assert answer.status_code == 404, answer.text
        assert client.get("/v1/runs/x%0A2026-01-01%20CRITICAL%20FORGED%1B%5B31m").status_code == 404

    text = server.logs()
    lines = text.splitlines()
    levels = [match["level"] for match in map(TEXT_LINE.match, lines) if match]
    assert len(levels) == len(lines), text  # every line one of the server's
    assert "CRITICAL" not in levels
    assert "\x1b" not in text and "\u2028" not in text
    assert sum("FORGED" in line for line in lines) == 2, text
    assert "agent=echo\\n2026-01-01" in text


def test_a_line_stays_short_whatever_the_path_and_holds_no_colour_codes(
    tmp_path: Path, agents_server: AgentsServer
) -> None:
    # A 60,000-character path made a 120 KB line (any client, no key needed); uvicorn's own
    # lines carried their message again with terminal colour codes (`color_message`). The
    # paths here keep their heads under 16 KiB: a longer head is 431 if it comes in more
    # than one read, which depends on the machine's load.
    server = agents_server(database_url=f"sqlite:///{tmp_path / 'long.db'}")
    with server, server.client() as client:
        assert client.get("/v1/sessions/" + "s" * 12_000).status_code == 422
        assert client.get("/nothing-" + "n" * 12_000).status_code == 404

    records = json_lines(server.logs())
    access = [r for r in records if r["logger"] == "app.access" and r["path"] != "/healthz"]
    assert [r["status"] for r in access] == [422, 404], access
    for record in access:
        assert len(json.dumps(record, ensure_ascii=False)) < 2_000, record
    assert access[0]["path"] == "/v1/sessions/" + "s" * 499 + "…(+11501 characters)"
    assert access[1]["message"].startswith("GET /nothing-" + "n" * 503 + "…(+11497 characters) 404")
    assert all("color_message" not in r for r in records)
    assert any(r["logger"].startswith("uvicorn") for r in records)
    assert "\x1b" not in server.logs()


def test_debug_level_logs_no_message_text_and_no_key(
    tmp_path: Path, fake_model: FakeAnthropic, agents_server: AgentsServer
) -> None:
    key, marker = "sk-debug-key-5d1e", "debug-marker-c0ffee"
    server = agents_server(
        database_url=f"sqlite:///{tmp_path / 'debug.db'}",
        env={"LOG_LEVEL": "debug", "API_KEYS": f"{key}:acme"},  # any case
    )
    with server, server.client() as client:
        answer = client.post(
            "/v1/runs",
            json={"agent": "triage", "message": f"triage {marker}", "session_id": "d-1"},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert answer.status_code == 200 and answer.json()["status"] == "complete", answer.text
    text = server.logs()
    assert any(r["level"] == "DEBUG" for r in json_lines(text)), "nothing was logged at DEBUG"
    assert any(marker in json.dumps(request) for request in fake_model.requests)
    assert marker not in text
    assert key not in text


def test_a_client_gone_before_its_body_is_logged_499_not_500(
    tmp_path: Path, agents_server: AgentsServer
) -> None:
    server = agents_server(database_url=f"sqlite:///{tmp_path / 'gone.db'}")
    with server, server.client() as client:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(
                b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"ag'
            )
        deadline = time.monotonic() + 10
        while "/v1/runs" not in server.logs():
            assert time.monotonic() < deadline, server.logs()
            time.sleep(0.05)
        assert client.get("/healthz").status_code == 200  # still serving

    posts = [r for r in json_lines(server.logs()) if r.get("path") == "/v1/runs"]
    assert [(r["method"], r["status"], r["level"]) for r in posts] == [("POST", 499, "INFO")]

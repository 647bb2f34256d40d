"""Every error is application/problem+json with a stable code, and nothing answers 5xx."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.api.helpers import (
    PROBLEM_FIELDS,
    Json,
    assert_all,
    assert_no_server_errors,
    assert_problem,
    get_ok,
    outcome,
    post_raw,
    run,
)
from tests.support.fake_anthropic import FakeAnthropic

MIB = 1024 * 1024
VALID = {"agent": "echo", "message": "hi"}

MALFORMED_BODIES = [
    b"{",
    b"not json",
    b"",
    b"null",
    b"42",
    b'"a string"',
    b"[]",
    b'[{"agent": "echo", "message": "hi"}]',
    b'{"agent": "echo", "message": "hi",}',
    b"\xff\xfe\x00",
    b'{"agent": "echo", "message": "hi", "metadata": {"a": '
    + b"[" * 100_000
    + b"]" * 100_000
    + b"}}",
]
INVALID_BODIES: list[Json] = [
    {},
    {"agent": "echo"},
    {"message": "hi"},
    {**VALID, "message": 123},
    {**VALID, "message": None},
    {**VALID, "message": ["hi"]},
    {**VALID, "message": ""},
    {**VALID, "message": " \n\t\u3000"},  # white space only: the Messages API refuses it
    {**VALID, "agent": 5},
    {**VALID, "agent": ""},
    {**VALID, "agent": None},
    {**VALID, "metadata": "x"},
    {**VALID, "metadata": [1, 2]},
    {**VALID, "metadata": 3},
    {**VALID, "user_id": ""},
    {**VALID, "user_id": 5},
    {**VALID, "user_id": "u" * 129},
    {**VALID, "session_id": 5},
    {**VALID, "session_id": ["s"]},
    {**VALID, "unknown": 1},
    {**VALID, "Session_id": "s-1"},
    {**VALID, "background": "yes"},
]
INVALID_SESSION_IDS = ["", "s" * 129, "a b", "a/b", "é", "日本", "abc\n", "a\x00b", "tab\t", "a*b"]
# Ids that reach the session routes as one path segment (a slash is another route: 404).
INVALID_PATH_SESSION_IDS = ["s" * 129, "a%20b", "%C3%A9", "a*b", "a%00b", "abc%0A"]


async def test_malformed_json_bodies(client: httpx.AsyncClient) -> None:
    outcomes = {repr(c): outcome(await post_raw(client, c)) for c in MALFORMED_BODIES}
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        response = await post_raw(client, json.dumps(VALID).encode(), content_type=content_type)
        outcomes[content_type] = outcome(response)

    assert_all(outcomes, 422, "validation_error")


async def test_a_body_that_is_not_json_says_where_and_why(client: httpx.AsyncClient) -> None:
    # It said "body.9: JSON decode error".
    body = b'{"a": 1, }'
    with pytest.raises(json.JSONDecodeError) as parsed:  # its words vary with Python's version
        json.loads(body)
    problem = assert_problem(await post_raw(client, body), 422, "validation_error")
    where, why = parsed.value.pos, parsed.value.msg
    assert problem["detail"] == (
        f"body: Not valid JSON at character {where} (counting from 0): {why}"
    ), problem
    assert problem["errors"][0]["loc"] == ["body", where], problem


async def test_invalid_fields_are_validation_errors(client: httpx.AsyncClient) -> None:
    outcomes = {
        json.dumps(body): outcome(await client.post("/v1/runs", json=body))
        for body in INVALID_BODIES
    }

    assert_all(outcomes, 422, "validation_error")
    assert (await get_ok(client, "/v1/sessions"))["data"] == []


async def test_invalid_session_ids_are_validation_errors(client: httpx.AsyncClient) -> None:
    outcomes = {
        f"POST {session_id!r}": outcome(
            await client.post("/v1/runs", json={**VALID, "session_id": session_id})
        )
        for session_id in INVALID_SESSION_IDS
    }
    for session_id in INVALID_PATH_SESSION_IDS:
        for route in ("", "/messages", "/runs"):
            url = f"/v1/sessions/{session_id}{route}"
            outcomes[f"GET {url}"] = outcome(await client.get(url))
        url = f"/v1/sessions/{session_id}"
        outcomes[f"DELETE {url}"] = outcome(await client.delete(url))

    assert_all(outcomes, 422, "validation_error")
    longest = ("AZaz09._:-" * 13)[:128]  # every allowed character, at the length limit
    assert (await run(client, "echo", "hi", session_id=longest))["session_id"] == longest
    assert (await get_ok(client, f"/v1/sessions/{longest}"))["id"] == longest


async def test_unknown_agent(client: httpx.AsyncClient, fake_model: FakeAnthropic) -> None:
    for session_id in (None, "s-new"):
        response = await client.post(
            "/v1/runs", json={**VALID, "agent": "nobody", "session_id": session_id}
        )
        body = assert_problem(response, 404, "agent_not_found")
        assert set(body) == PROBLEM_FIELDS  # no other code's members, not even as null
    assert_problem(await client.get("/v1/sessions/s-new"), 404, "session_not_found")
    assert fake_model.requests == []


async def test_a_message_may_fill_the_whole_body(client: httpx.AsyncClient) -> None:
    # The only limit is the body's 1 MiB: a message that fills it is a message.
    overhead = len(json.dumps({**VALID, "message": ""}).encode())
    for char, size in (("x", 1), ("é", 2)):
        message = char * ((MIB - overhead) // size)
        content = json.dumps({**VALID, "message": message}, ensure_ascii=False).encode()
        assert MIB - size < len(content) <= MIB
        response = await post_raw(client, content)
        assert response.status_code == 200, response.text[:300]
        assert response.json()["messages"][0]["content"] == message


async def test_body_over_one_mib_is_payload_too_large(client: httpx.AsyncClient) -> None:
    small = json.dumps(VALID).encode()
    exactly_one_mib = small + b" " * (MIB - len(small))  # trailing whitespace is valid JSON
    assert (await post_raw(client, exactly_one_mib)).status_code == 200
    assert_problem(await post_raw(client, exactly_one_mib + b" "), 413, "payload_too_large")

    content = json.dumps({**VALID, "message": "x" * (MIB + 1)}).encode()
    assert_problem(await post_raw(client, content), 413, "payload_too_large")

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(content), 64 * 1024):
            yield content[start : start + 64 * 1024]

    # Without a Content-Length the limit is enforced on what actually arrives.
    streamed = await client.post(
        "/v1/runs", content=chunks(), headers={"content-type": "application/json"}
    )
    assert "content-length" not in streamed.request.headers
    assert_problem(streamed, 413, "payload_too_large")

    # Whatever the method: a route that reads no body still refuses one over the limit.
    for method, path in (("GET", "/v1/agents"), ("DELETE", "/v1/sessions/s-1")):
        too_big = await client.request(method, path, content=exactly_one_mib + b" ")
        assert_problem(too_big, 413, "payload_too_large")
        streamed = await client.request(method, path, content=chunks())
        assert_problem(streamed, 413, "payload_too_large")
    assert (await client.request("GET", "/v1/agents", content=exactly_one_mib)).status_code == 200


async def test_unknown_path_and_wrong_method(client: httpx.AsyncClient) -> None:
    not_found = {
        f"{method} {path}": outcome(await client.request(method, path))
        for method, path in [
            ("GET", "/nope"),
            ("GET", "/v1/nope"),
            ("POST", "/v1/nope"),
            ("GET", "/v2/runs"),
            ("GET", "/v1/sessions/a/b"),
            ("GET", "/v1/agents/echo/tools"),
            ("GET", "/v1/agents/"),
            ("POST", "/v1/runs/"),
            ("GET", "/v1/sessions/s-1/"),
        ]
    }
    assert_all(not_found, 404, "not_found")

    # Allow names every method the path answers (RFC 9110 §15.5.6), HEAD wherever GET is.
    allowed: dict[str, set[str]] = {}
    for method, path in [
        ("GET", "/v1/runs"),
        ("PUT", "/v1/runs"),
        ("DELETE", "/v1/runs/r-1"),
        ("POST", "/v1/sessions"),
        ("PATCH", "/v1/sessions/s-1"),
        ("PUT", "/v1/sessions/s-1"),
        ("POST", "/v1/sessions/s-1/messages"),
        ("POST", "/v1/agents"),
        ("PUT", "/v1/agents/echo"),
        ("POST", "/healthz"),
        ("POST", "/openapi.json"),
    ]:
        response = await client.request(method, path)
        assert_problem(response, 405, "method_not_allowed")
        allowed[f"{method} {path}"] = set(response.headers.get("allow", "").split(", "))
    get_only = {"GET", "HEAD"}
    assert allowed == {
        "GET /v1/runs": {"POST"},
        "PUT /v1/runs": {"POST"},
        "DELETE /v1/runs/r-1": get_only,
        "POST /v1/sessions": get_only,
        "PATCH /v1/sessions/s-1": {"DELETE", "GET", "HEAD"},
        "PUT /v1/sessions/s-1": {"DELETE", "GET", "HEAD"},
        "POST /v1/sessions/s-1/messages": get_only,
        "POST /v1/agents": get_only,
        "PUT /v1/agents/echo": get_only,
        "POST /healthz": get_only,
        "POST /openapi.json": get_only,
    }


async def test_two_idempotency_keys_are_refused_before_any_work(
    client: httpx.AsyncClient,
) -> None:
    headers = [("Idempotency-Key", "k-1"), ("Idempotency-Key", "k-2")]
    body = {**VALID, "session_id": "two-keys"}

    response = await client.post("/v1/runs", json=body, headers=headers)

    problem = assert_problem(response, 422, "validation_error")
    assert [e["loc"] for e in problem["errors"]] == [["header", "Idempotency-Key"]]
    assert_problem(await client.get("/v1/sessions/two-keys"), 404, "session_not_found")


# Python's json module takes NaN/Infinity and 1e400 (inf); JSON text, SQLite, PostgreSQL and
# UTF-8 each refuse some of these values. Each case must end as a 2xx or a 4xx problem.
HOSTILE_METADATA: dict[str, bytes] = {
    "nan": b'{"a": NaN}',
    "infinity": b'{"a": Infinity}',
    "minus-infinity": b'{"a": -Infinity}',
    "overflowing-float": b'{"a": 1e400}',
    "nul-in-value": b'{"a": "x\\u0000y"}',
    "nul-in-key": b'{"x\\u0000y": 1}',
    "lone-surrogate": b'{"a": "\\udfff"}',
    "huge-int": b'{"a": ' + b"9" * 4000 + b"}",
    "int-over-pythons-digit-limit": b'{"a": ' + b"9" * 5000 + b"}",
    # Deeper than the response can be serialised (255 levels), shallower than JSON parsing
    # gives up: refused up front, never run, stored and then unreadable.
    "objects-256-deep": b'{"a": ' * 256 + b"1" + b"}" * 256,
    "arrays-256-deep": b'{"a": ' + b"[" * 256 + b"]" * 256 + b"}",
}
TOO_DEEP = ("objects-256-deep", "arrays-256-deep")
HOSTILE_FIELDS: dict[str, Json] = {
    "nul-in-message": {"message": "x\x00y"},
    "nul-in-user-id": {"user_id": "u\x00"},
}


async def test_hostile_values_never_answer_5xx(client: httpx.AsyncClient) -> None:
    outcomes: dict[str, tuple[int, str]] = {}
    for name, metadata in HOSTILE_METADATA.items():
        for session_id, key in (("null", None), (f'"{name}"', None), (f'"{name}-k"', "k-1")):
            content = b'{"agent": "echo", "message": "hi", "session_id": %s, "metadata": %s}'
            response = await client.post(
                "/v1/runs",
                content=content % (session_id.encode(), metadata),
                headers={
                    "content-type": "application/json",
                    **({"Idempotency-Key": key} if key else {}),
                },
            )
            outcomes[f"POST {name} session_id={session_id}"] = outcome(response)
            if name in TOO_DEEP:
                assert_problem(response, 422, "validation_error")
    for name, fields in HOSTILE_FIELDS.items():
        for sid in (None, name):
            response = await client.post("/v1/runs", json={**VALID, "session_id": sid, **fields})
            outcomes[f"POST {name} session_id={sid}"] = outcome(response)
    # What was stored must not break reading it back, for this session or any other.
    for name in [*HOSTILE_METADATA, *(f"{m}-k" for m in HOSTILE_METADATA), *HOSTILE_FIELDS]:
        for route in ("", "/messages", "/runs"):
            url = f"/v1/sessions/{name}{route}"
            outcomes[f"GET {url}"] = outcome(await client.get(url))
    outcomes["GET /v1/sessions"] = outcome(await client.get("/v1/sessions"))

    assert_no_server_errors(outcomes)


async def test_a_body_without_a_json_content_type_says_so(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/v1/runs",
        content=b'{"agent": "echo", "message": "hi"}',
        headers={"content-type": "text/plain"},
    )
    body = assert_problem(response, 422, "validation_error")
    assert "Content-Type: application/json" in body["detail"]

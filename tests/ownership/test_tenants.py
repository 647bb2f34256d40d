"""API keys and tenants (CONTRACT §3, §5): who may see and use a session."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from tests.ownership.conftest import Servers
from tests.ownership.helpers import Background, assert_problem, ok, run_body
from tests.support.tool_server import ToolServer

API_KEYS = "key-acme:acme,key-globex:globex"
ACME = {"Authorization": "Bearer key-acme"}
GLOBEX = {"Authorization": "Bearer key-globex"}
SESSION = "s-acme"
JSON = {"Content-Type": "application/json"}

Call = Callable[[httpx.Client, dict[str, str]], httpx.Response]


def session_routes(user_id: str | None, run_id: str) -> dict[str, Call]:
    """Every route that reaches session SESSION, as `user_id` (query on GET, body on POST)."""
    query = {"user_id": user_id} if user_id is not None else {}
    body = run_body("echo", "Hello again", SESSION, **({"user_id": user_id} if user_id else {}))
    base = f"/v1/sessions/{SESSION}"
    return {
        "get session": lambda c, h: c.get(base, params=query, headers=h),
        "messages": lambda c, h: c.get(f"{base}/messages", params=query, headers=h),
        "runs": lambda c, h: c.get(f"{base}/runs", params=query, headers=h),
        "delete": lambda c, h: c.delete(base, params=query, headers=h),
        "post run": lambda c, h: c.post("/v1/runs", json=body, headers=h),
        "get run": lambda c, h: c.get(f"/v1/runs/{run_id}", params=query, headers=h),
    }


def test_api_keys_tenants_and_users(servers: Servers) -> None:
    """401 without a valid key; another tenant's session is 404, another user's is 403."""
    server = servers.start("server", env={"API_KEYS": API_KEYS})
    with server.client() as client:
        created = client.post(
            "/v1/runs", json=run_body("echo", "Hello", SESSION, user_id="u1"), headers=ACME
        )
        run_id = ok(created)["run_id"]
        every_v1: dict[str, Call] = {
            **session_routes("u1", run_id),
            "list sessions": lambda c, h: c.get("/v1/sessions", headers=h),
            "agents": lambda c, h: c.get("/v1/agents", headers=h),
            "agent": lambda c, h: c.get("/v1/agents/echo", headers=h),
            # The key is checked before anything else about the request.
            "bad json": lambda c, h: c.post("/v1/runs", content=b"{", headers={**h, **JSON}),
            "too large": lambda c, h: c.post("/v1/runs", content=b" " * 2**21, headers=h),
            "nul in path": lambda c, h: c.get("/v1/runs/%00", headers=h),
            "bad session id": lambda c, h: c.get("/v1/sessions/a%20b", headers=h),
            "bad limit": lambda c, h: c.get("/v1/sessions?limit=0", headers=h),
        }
        for name, call in every_v1.items():
            for headers in (
                {},
                {"Authorization": "Bearer key-wrong"},
                {"Authorization": "key-acme"},
            ):
                response = call(client, headers)
                assert_problem(response, 401, "unauthorized")
                assert response.headers.get("www-authenticate") == "Bearer", name
        # Two keys name no one tenant (the first one was taken; a proxy may read the last).
        for first, second in (("key-acme", "key-globex"), ("key-globex", "key-acme")):
            both = [("Authorization", f"Bearer {first}"), ("Authorization", f"Bearer {second}")]
            refused = assert_problem(client.get("/v1/sessions", headers=both), 401, "unauthorized")
            assert refused["detail"] == "Send one Authorization header, not several."
        for path in ("/healthz", "/readyz"):
            assert client.get(path).status_code == 200, path
        # What is no route is the router's answer, key or not (the routes are public).
        assert_problem(client.get("/v1/nothing-here"), 404, "not_found")
        assert_problem(client.put("/v1/runs"), 405, "method_not_allowed")

        for name, call in session_routes("u1", run_id).items():
            code = "run_not_found" if name == "get run" else "session_not_found"
            assert_problem(call(client, GLOBEX), 404, code)
        globex_sessions = ok(client.get("/v1/sessions", headers=GLOBEX))["data"]
        assert SESSION not in [s["id"] for s in globex_sessions]

        for name, call in session_routes("u2", run_id).items():
            response = call(client, ACME)
            assert response.status_code == 403, (name, response.text)
            assert_problem(response, 403, "session_access_denied")
        # Naming no user: a turn needs the session's user; reads act for the tenant.
        anonymous = session_routes(None, run_id)
        assert_problem(anonymous["post run"](client, ACME), 403, "session_access_denied")
        for name in ("get session", "messages", "runs", "get run"):
            assert anonymous[name](client, ACME).status_code == 200, name

        mine = session_routes("u1", run_id)
        session = ok(mine["get session"](client, ACME))
        assert (session["tenant_id"], session["user_id"]) == ("acme", "u1")
        assert [m["content"] for m in ok(mine["messages"](client, ACME))["data"]] == [
            "Hello",
            "echo: Hello",
        ]
        assert [r["run_id"] for r in ok(mine["runs"](client, ACME))["data"]] == [run_id]
        assert ok(mine["get run"](client, ACME))["run_id"] == run_id
        assert ok(mine["post run"](client, ACME))["status"] == "complete"
        acme_sessions = ok(client.get("/v1/sessions", headers=ACME))["data"]
        assert [s["id"] for s in acme_sessions] == [SESSION]
        assert mine["delete"](client, ACME).status_code == 204
        assert_problem(mine["get session"](client, ACME), 404, "session_not_found")

    logs = server.logs()
    assert "POST /v1/runs" in logs  # the log is the server's, and it is not empty
    for secret in ("key-acme", "key-globex", "key-wrong"):
        assert secret not in logs


def test_a_running_session_is_not_revealed_to_another_tenant_or_user(
    servers: Servers, tool_server: ToolServer
) -> None:
    """While acme's turn runs, globex still gets 404 and user u2 still 403, never a 409 that
    reveals the session and names acme's run."""
    server = servers.start("server", env={"API_KEYS": API_KEYS})
    body = run_body("slow", "Post the slow report", SESSION, user_id="u1")
    running = Background(server.url, body, headers=ACME)
    assert tool_server.in_flight.wait(15), server.logs()  # acme's turn waits on its handler
    with server.client() as client:
        mine = client.get(f"/v1/sessions/{SESSION}", params={"user_id": "u1"}, headers=ACME)
        assert ok(mine)["status"] == "running"
        answers = {
            "globex post": client.post("/v1/runs", json=body, headers=GLOBEX),
            "globex delete": client.delete(f"/v1/sessions/{SESSION}", headers=GLOBEX),
            "u2 post": client.post("/v1/runs", json={**body, "user_id": "u2"}, headers=ACME),
            "u2 delete": client.delete(
                f"/v1/sessions/{SESSION}", params={"user_id": "u2"}, headers=ACME
            ),
        }
    tool_server.release()
    done = running.join(15)
    assert isinstance(done, httpx.Response)
    assert ok(done)["status"] == "complete"
    found = {name: (r.status_code, r.json().get("code")) for name, r in answers.items()}
    assert found == {
        "globex post": (404, "session_not_found"),
        "globex delete": (404, "session_not_found"),
        "u2 post": (403, "session_access_denied"),
        "u2 delete": (403, "session_access_denied"),
    }, {name: r.text for name, r in answers.items()}

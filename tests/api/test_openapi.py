"""/openapi.json: a stable operationId per route, problem+json errors, a valid document."""

from __future__ import annotations

import json
import re
import unicodedata
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openapi_spec_validator
import pytest

from app.errors import AppError
from app.main import create_app
from app.schemas.runs import NOT_BLANK
from app.settings import Settings
from tests.api.helpers import PROBLEM_JSON, Json, listing

OPERATIONS = {
    ("post", "/v1/runs"): "create_run",
    ("get", "/v1/runs/{run_id}"): "get_run",
    ("get", "/v1/sessions"): "list_sessions",
    ("get", "/v1/sessions/{session_id}"): "get_session",
    ("get", "/v1/sessions/{session_id}/messages"): "list_messages",
    ("get", "/v1/sessions/{session_id}/runs"): "list_session_runs",
    ("delete", "/v1/sessions/{session_id}"): "delete_session",
    ("get", "/v1/agents"): "list_agents",
    ("get", "/v1/agents/{name}"): "get_agent",
    ("get", "/healthz"): "healthz",
    ("get", "/readyz"): "readyz",
    ("get", "/metrics"): "get_metrics",
}
PROBLEM_REF = "#/components/schemas/Problem"
HTTP_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


async def fetch_openapi(agents_file: Path, *, api_keys: str | None = None) -> Json:
    """GET /openapi.json of a freshly built app (the document needs no database)."""
    settings = Settings(database_url="memory://", agents_file=agents_file, api_keys=api_keys)
    app = create_app(settings)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        response = await http.get("/openapi.json")
    assert response.status_code == 200, response.text
    document: Json = response.json()
    return document


@pytest.fixture
async def openapi(agents_file: Path) -> Json:
    """The OpenAPI document."""
    return await fetch_openapi(agents_file)


def operations(document: Json) -> dict[tuple[str, str], Json]:
    """Every operation of the document by (method, path)."""
    return {
        (method, path): operation
        for path, item in document["paths"].items()
        for method, operation in item.items()
        if method in HTTP_METHODS
    }


async def test_every_route_has_its_stable_operation_id(openapi: Json, agents_file: Path) -> None:
    ids = {key: op.get("operationId") for key, op in operations(openapi).items()}

    assert ids == OPERATIONS
    assert len(set(ids.values())) == len(ids)
    rebuilt = await fetch_openapi(agents_file)
    assert json.dumps(rebuilt, sort_keys=True) == json.dumps(openapi, sort_keys=True)


def test_errors_are_documented_as_problems(openapi: Json) -> None:
    wrong: dict[str, Any] = {}
    for (method, path), operation in operations(openapi).items():
        for status, response in operation["responses"].items():
            if not status.startswith(("4", "5")):
                continue
            content = response.get("content", {})
            schema = content.get(PROBLEM_JSON, {}).get("schema", {})
            # Only problem+json: the service never sends a problem as anything else.
            if schema.get("$ref") != PROBLEM_REF or set(content) != {PROBLEM_JSON}:
                wrong[f"{method.upper()} {path} {status}"] = content

    assert not wrong, f"errors not documented as problem+json Problem:\n{listing(wrong)}"
    problem = openapi["components"]["schemas"]["Problem"]
    assert set(problem["required"]) >= {"type", "title", "status", "detail", "code"}


def test_problem_statuses_of_each_route(openapi: Json) -> None:
    ops = operations(openapi)

    def statuses(method: str, path: str) -> set[str]:
        return set(ops[(method, path)]["responses"])

    assert statuses("post", "/v1/runs") >= {"200", "403", "404", "409", "413", "422", "503"}
    assert statuses("get", "/v1/runs/{run_id}") >= {"200", "404"}
    for method, path in OPERATIONS:
        if "{session_id}" in path:
            assert statuses(method, path) >= {"404", "422"}, (method, path)
    assert statuses("delete", "/v1/sessions/{session_id}") >= {"204", "409"}
    assert statuses("get", "/v1/agents/{name}") >= {"200", "404"}
    for path in ("/v1/sessions", "/v1/agents"):
        assert "422" in statuses("get", path), path
    # Any route may answer these: a body over 1 MiB (any method), shutdown while its body
    # is still arriving, and the unforeseen.
    for method, path in ops:
        assert statuses(method, path) >= {"413", "431", "500", "503"}, (method, path)


def test_each_problem_response_names_the_codes_it_may_carry(openapi: Json) -> None:
    ops = operations(openapi)

    def codes(method: str, path: str, status: str) -> set[str]:
        description = ops[(method, path)]["responses"][status]["description"]
        return set(re.findall(r"`([a-z_]+)`", description))

    run = ("post", "/v1/runs")
    assert codes(*run, "404") == {"agent_not_found", "session_not_found"}
    assert codes(*run, "409") == {
        "session_busy",
        "session_agent_mismatch",
        "memory_store_not_durable",
    }
    assert codes(*run, "422") == {"validation_error", "idempotency_key_reused"}
    # A route on the database meets a schema changed under it as /readyz does.
    assert codes(*run, "503") == {"database_unavailable", "schema_out_of_date", "shutting_down"}
    assert codes("get", "/v1/runs/{run_id}", "404") == {"run_not_found"}
    assert codes("delete", "/v1/sessions/{session_id}", "409") == {"session_busy"}
    assert codes("get", "/readyz", "503") == {
        "database_unavailable",
        "schema_out_of_date",
        "shutting_down",
    }
    assert codes("get", "/healthz", "413") == {"payload_too_large"}
    assert codes("get", "/healthz", "431") == {"headers_too_large"}
    assert codes("get", "/healthz", "500") == {"internal_error"}
    assert codes("get", "/healthz", "503") == {"shutting_down"}
    assert codes("get", "/v1/sessions/{session_id}", "503") == {
        "database_unavailable",
        "schema_out_of_date",
        "shutting_down",
    }
    # Every code a route answers (CONTRACT §3's list and ours) is named somewhere; the
    # generic ones (unknown path, wrong method, HTTP-level errors) belong to no route.
    named = {
        code
        for (method, path), operation in ops.items()
        for status in operation["responses"]
        if status.startswith(("4", "5"))
        for code in codes(method, path, status)
    }
    generic = {"not_found", "method_not_allowed", "http_error"}
    assert named == {cls.code for cls in app_errors()} - generic


def app_errors() -> list[type[AppError]]:
    """Every error class of app/errors.py (not a test's own subclass)."""
    found, todo = [], [AppError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return [cls for cls in found if cls.__module__ == "app.errors"]


def test_the_members_and_headers_problems_carry_are_described(openapi: Json) -> None:
    problem = openapi["components"]["schemas"]["Problem"]
    # session_busy, session_agent_mismatch and validation_error add a member each.
    assert set(problem["properties"]) >= {"active_run_id", "bound_agent", "errors"}
    ops = operations(openapi)
    for method, path in (("post", "/v1/runs"), ("delete", "/v1/sessions/{session_id}")):
        assert "Retry-After" in ops[(method, path)]["responses"]["409"]["headers"], path
        assert "Retry-After" in ops[(method, path)]["responses"]["503"]["headers"], path


def test_bodies_are_described(openapi: Json) -> None:
    schemas = openapi["components"]["schemas"]
    create = openapi["paths"]["/v1/runs"]["post"]
    body_ref = create["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    run_ref = create["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    body = schemas[body_ref.rsplit("/", 1)[-1]]
    run = schemas[run_ref.rsplit("/", 1)[-1]]

    assert set(body["required"]) == {"agent", "message"}
    assert set(body["properties"]) == {"agent", "message", "session_id", "user_id", "metadata"}
    assert body.get("additionalProperties") is False
    assert set(run["properties"]) >= {
        "run_id",
        "session_id",
        "status",
        "response",
        "iterations",
        "messages",
        "usage",
        "error",
        "created_at",
        "finished_at",
    }


def test_every_run_documents_its_stop_reason(openapi: Json) -> None:
    # A client tells an answer cut off at max_tokens from a finished one by it: each route
    # that shows runs documents it, always present, null or a string.
    schemas = openapi["components"]["schemas"]
    ops = operations(openapi)

    def schema_of(ref: str) -> Json:
        found: Json = schemas[ref.rsplit("/", 1)[-1]]
        return found

    runs = [
        schema_of(ops[key]["responses"]["200"]["content"]["application/json"]["schema"]["$ref"])
        for key in (("post", "/v1/runs"), ("get", "/v1/runs/{run_id}"))
    ]
    page_ref = ops[("get", "/v1/sessions/{session_id}/runs")]["responses"]["200"]["content"]
    page = schema_of(page_ref["application/json"]["schema"]["$ref"])
    runs.append(schema_of(page["properties"]["data"]["items"]["$ref"]))
    for run in runs:
        assert "stop_reason" in run["required"], run
        field = run["properties"]["stop_reason"]
        assert {branch["type"] for branch in field["anyOf"]} == {"string", "null"}
        assert '`stop_reason == "max_tokens"`' in field["description"]


def test_every_json_answer_is_a_named_schema(openapi: Json) -> None:
    # A generated client names its models after components; an inline schema gets a name
    # made up from the path.
    inline = [
        (key, status)
        for key, operation in operations(openapi).items()
        for status, response in operation["responses"].items()
        for media, content in response.get("content", {}).items()
        if media.endswith("json") and "$ref" not in content["schema"]
    ]
    assert inline == []


def test_links_lead_from_a_run_to_its_run_and_session(openapi: Json) -> None:
    by_id = {op["operationId"]: op for op in operations(openapi).values()}
    schemas = openapi["components"]["schemas"]
    followed: dict[str, set[str]] = {}
    for (method, path), operation in operations(openapi).items():
        for status, response in operation["responses"].items():
            if not (links := response.get("links")):
                continue
            ref = response["content"]["application/json"]["schema"]["$ref"]
            fields = schemas[ref.rsplit("/", 1)[-1]]["properties"]
            for link in links.values():
                target = by_id[link["operationId"]]
                names = {p["name"] for p in target["parameters"] if p["in"] == "path"}
                assert set(link["parameters"]) == names, link
                # A stateless run's ids lead nowhere (nothing of it is stored): said so.
                assert "stateless" in link["description"], link
                for expression in link["parameters"].values():
                    assert expression.removeprefix("$response.body#/") in fields, expression
                followed.setdefault(f"{method} {path} {status}", set()).add(link["operationId"])
    leads = {"get_run", "get_session", "list_messages", "list_session_runs", "delete_session"}
    assert followed == {"post /v1/runs 200": leads, "get /v1/runs/{run_id} 200": leads}


def test_string_parameters_say_they_refuse_nul(openapi: Json) -> None:
    # The service answers 422 for a NUL in any path or query value; the document says so.
    lax = [
        (path, parameter["name"])
        for (_, path), operation in operations(openapi).items()
        for parameter in operation.get("parameters", [])
        if parameter["in"] in ("path", "query")
        for branch in parameter["schema"].get("anyOf", [parameter["schema"]])
        if branch.get("type") == "string"
        and ("pattern" not in branch or re.search(branch["pattern"], "1\x001"))
    ]
    assert lax == []


def test_document_is_valid_openapi(openapi: Json) -> None:
    openapi_spec_validator.validate(openapi)


async def test_the_document_is_the_same_with_and_without_api_keys(
    openapi: Json, agents_file: Path
) -> None:
    # A client generated from one deployment must work against another: every /v1 operation
    # takes a bearer key or none, whatever API_KEYS says.
    keyed = await fetch_openapi(agents_file, api_keys="k1:t1")
    assert keyed == openapi
    schemes = openapi["components"]["securitySchemes"]
    assert [(s["type"], s["scheme"]) for s in schemes.values()] == [("http", "bearer")]
    (name,) = schemes
    secured = {key: op["security"] for key, op in operations(openapi).items() if "security" in op}
    assert set(secured) == {key for key in OPERATIONS if key[1].startswith("/v1/")}
    assert all(security == [{}, {name: []}] for security in secured.values())


async def test_the_document_does_not_change_from_request_to_request(agents_file: Path) -> None:
    app = create_app(Settings(database_url="memory://", agents_file=agents_file))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        first = (await http.get("/openapi.json")).json()
        await http.put("/v1/runs")  # a 405 reads the document for its Allow header
        again = (await http.get("/openapi.json")).json()

    assert again == first
    (security,) = {
        json.dumps(op["security"]) for op in operations(first).values() if "security" in op
    }
    assert json.loads(security) == [{}, {"HTTPBearer": []}]


def test_types_a_generated_client_relies_on(openapi: Json) -> None:
    schemas = openapi["components"]["schemas"]
    post = operations(openapi)[("post", "/v1/runs")]
    (key,) = [p for p in post["parameters"] if p["name"] == "Idempotency-Key"]
    # An optional header is absent or a string, never null (a client would send "None").
    assert key["required"] is False
    assert key["schema"]["type"] == "string" and "anyOf" not in key["schema"]
    role = schemas["MessageRead"]["properties"]["role"]
    assert schemas[role["$ref"].rsplit("/", 1)[-1]]["enum"] == ["user", "assistant", "tool"]
    ready = operations(openapi)[("get", "/readyz")]["responses"]["200"]
    ready_ref = ready["content"]["application/json"]["schema"]["$ref"]
    assert set(schemas[ready_ref.rsplit("/", 1)[-1]]["required"]) == {"status", "schema"}


def _ecma_white_space(c: str) -> bool:
    """ECMA-262's WhiteSpace and LineTerminator, what `\\s` means to a client's validator."""
    return c in "\t\n\v\f\r\u2028\u2029\ufeff" or unicodedata.category(c) == "Zs"


def test_the_not_blank_pattern_means_the_same_in_python_and_in_ecma_262() -> None:
    # A client's JSON Schema validator reads patterns as ECMA-262 does; the service's check
    # goes by Python's str.isspace. They differ (\x1c-\x1f, \x85, \ufeff): `\S` told clients
    # that "\x1c" was a message (the service refused it) and "\ufeff" was not (it ran it).
    # The pattern is a character class of single characters, read alike by both.
    assert not re.search(r"\\[sSwWdDbB]", NOT_BLANK), NOT_BLANK
    pattern = re.compile(NOT_BLANK)
    mismatched = [
        hex(code)
        for code in range(0x110000)
        if not 0xD800 <= code <= 0xDFFF
        if (pattern.fullmatch(c := chr(code)) is None) != (c.isspace() or _ecma_white_space(c))
    ]
    assert mismatched == []


async def test_the_run_body_refuses_what_its_schema_refuses(
    memory_client: httpx.AsyncClient, openapi: Json
) -> None:
    # The body's documented patterns (white space, NUL) against what the service answers. A
    # message's NUL is in its description only: one pattern cannot say both, linearly.
    schema = {**openapi["components"]["schemas"]["RunCreate"], "components": openapi["components"]}
    validator = jsonschema.Draft202012Validator(schema)
    bodies = [
        {"agent": "echo", "message": message}
        for message in ["\x1c", "\x85", "\ufeff", " \u3000\t", "a", "\ufeffa", " a "]
    ]
    bodies += [
        {"agent": "echo\x00", "message": "hi"},
        {"agent": "echo", "message": "hi", "user_id": "u\x00"},
    ]
    outcomes = {}
    for body in bodies:
        response = await memory_client.post("/v1/runs", json=body)
        outcomes[json.dumps(body)] = (response.status_code, validator.is_valid(body))
    assert outcomes == {
        key: (200, True) if status == 200 else (422, False) for key, (status, _) in outcomes.items()
    }
    assert sorted(status for status, _ in outcomes.values()) == [200] * 3 + [422] * 6

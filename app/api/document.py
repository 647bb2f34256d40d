"""/openapi.json: FastAPI's document, amended to say what the service does."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute

from app.api.problems import PROBLEM_JSON

# What app.api.deps.plain_parameters lets through: any string without NUL.
NO_NUL = "^[^\\x00]*$"


def operation_id(route: APIRoute) -> str:
    """Handlers are named verb_noun; that name is the stable operationId clients generate from."""
    return route.name


def finish_document(app: FastAPI) -> None:
    """Amend the app's /openapi.json with each step below, once: FastAPI builds the document
    on first use and keeps it in `app.openapi_schema`."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            for item in generate()["paths"].values():
                for operation in item.values():
                    _auth_as_optional(operation)
                    _problems_as_problem_json(operation)
                    _no_nul_in_parameters(operation)
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's way to amend the document


def _auth_as_optional(operation: dict[str, Any]) -> None:
    """The document is the same whether API_KEYS is set or not: every /v1 operation takes a
    bearer key or none (`security: [{}, {scheme: []}]`), so a client generated from any
    deployment sends a key when given one and works against every other (CONTRACT §3). Where
    a key is needed and missing, the operation's documented 401 says so."""
    if operation.get("security"):
        operation["security"].insert(0, {})


def _problems_as_problem_json(operation: dict[str, Any]) -> None:
    """A problem is only ever sent as application/problem+json (FastAPI also lists the route's
    own media type, application/json or /metrics' text/plain, for every response with a
    model)."""
    for response in operation["responses"].values():
        content = response.get("content", {})
        if PROBLEM_JSON in content:
            response["content"] = {PROBLEM_JSON: content[PROBLEM_JSON]}


def _no_nul_in_parameters(operation: dict[str, Any]) -> None:
    """Path and query strings refuse NUL (app.api.deps.plain_parameters): say so where a string
    parameter has no pattern of its own."""
    for parameter in operation.get("parameters", []):
        if parameter["in"] not in ("path", "query"):
            continue
        schema = parameter["schema"]
        for branch in schema.get("anyOf", [schema]):
            if branch.get("type") == "string" and "pattern" not in branch:
                branch["pattern"] = NO_NUL

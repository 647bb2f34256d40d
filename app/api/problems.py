"""Every error as application/problem+json (RFC 9457) with a stable `code`."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path

from app.db.outages import DATABASE_ERRORS, is_outage, unavailable
from app.errors import (
    AppError,
    DatabaseUnavailable,
    HeadersTooLarge,
    HttpError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    SchemaOutOfDate,
    ShuttingDown,
    ValidationFailed,
)
from app.schemas.common import Problem

log = logging.getLogger(__name__)

PROBLEM_JSON = "application/problem+json"


def problem_response(exc: AppError) -> JSONResponse:
    """The problem+json response of an error."""
    body = Problem(
        type=f"urn:agent-runner:problem:{exc.code}",
        title=exc.title,
        status=exc.status,
        detail=exc.detail,
        code=exc.code,
    ).model_dump(exclude_none=True)
    body.update(exc.extra)  # the members this code adds, null ones included
    return JSONResponse(
        body, status_code=exc.status, headers=exc.headers(), media_type=PROBLEM_JSON
    )


async def _app_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, AppError)
    return problem_response(exc)


# Positional: Starlette calls exception handlers so.
async def _validation_error(request: Request, exc: Exception) -> JSONResponse:  # noqa: PLR0917
    assert isinstance(exc, RequestValidationError)
    found = exc.errors()
    errors = [
        {"loc": list(e.get("loc", ())), "msg": _message(e), "type": str(e.get("type"))}
        for e in found
    ]
    detail = "; ".join(f"{_place(e)}: {_message(e)}" for e in found)
    content_type = request.headers.get("content-type", "")
    if request.method == "POST" and "json" not in content_type.lower():
        # A body is read as JSON only when it says so (FastAPI's guard against cross-site
        # form posts); tell the client why its object was not seen.
        detail = f"Send the body as JSON with Content-Type: application/json. {detail}"
    return problem_response(ValidationFailed(detail, errors=errors))


def _message(error: Any) -> str:
    """An error's words; of a body that is not JSON, where and why (FastAPI's: "JSON decode
    error")."""
    if error.get("type") == "json_invalid":
        loc, why = error.get("loc", ()), error.get("ctx", {}).get("error", "")
        where = f" at character {loc[-1]} (counting from 0)" if len(loc) > 1 else ""
        return f"Not valid JSON{where}: {why}".rstrip(": ")
    return str(error.get("msg", ""))


def _place(error: Any) -> str:
    """Where an error is, as `detail` names it: `body.9` is a character, not a field."""
    if error.get("type") == "json_invalid":
        return "body"
    return ".".join(map(str, error.get("loc", ())))


_HTTP_METHODS = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})


def _allowed_methods(request: Request) -> str | None:
    """The methods /openapi.json lists for the request's path, and HEAD wherever GET is
    (Starlette's 405 names only the first route that matched, e.g. GET where DELETE is
    served too); None for a path the document does not describe."""
    methods: set[str] = set()
    for template, item in request.app.openapi()["paths"].items():
        if compile_path(template)[0].match(request.url.path):
            methods |= {method.upper() for method in item if method in _HTTP_METHODS}
    if "GET" in methods:
        methods.add("HEAD")
    return ", ".join(sorted(methods)) or None


# Positional: Starlette calls exception handlers so.
async def _http_error(request: Request, exc: Exception) -> JSONResponse:  # noqa: PLR0917
    assert isinstance(exc, StarletteHTTPException)
    detail = str(exc.detail)
    if exc.status_code == 400:
        # FastAPI's "error parsing the body" (bytes that are not UTF-8 JSON, nesting too deep):
        # to a client, just another invalid body.
        error: AppError = ValidationFailed(
            "The request body is not valid JSON, or nests too deeply to read."
        )
    elif exc.status_code == 404:
        error = NotFound(detail)
    elif exc.status_code == 413:
        error = PayloadTooLarge(detail)
    elif exc.status_code == 405:
        starlettes = (exc.headers or {}).get("Allow")  # names the first route's methods only
        error = MethodNotAllowed(detail, allow=_allowed_methods(request) or starlettes)
    else:
        error = HttpError(detail, status=exc.status_code, headers=dict(exc.headers or {}))
    return problem_response(error)


# Positional: Starlette calls exception handlers so.
async def _database_error(request: Request, exc: Exception) -> JSONResponse:  # noqa: PLR0917
    if not is_outage(exc):
        if (changed := await _schema_changed(request, exc=exc)) is not None:
            return problem_response(changed)
        log.error("unhandled database error", exc_info=exc)  # never raised again: log it now
        return _internal_error()
    return problem_response(unavailable(exc))


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    # Starlette raises the exception again once this answer is sent, for the server to log
    # with its traceback: one traceback per error, not two.
    log.error("unhandled error: %s", type(exc).__name__)
    return _internal_error()


async def _schema_changed(request: Request, *, exc: Exception) -> SchemaOutOfDate | None:
    """After a database error the code did not expect: the schema's state, if it is no longer
    the code's (changed under a running replica, as /readyz then says), which explains it."""
    try:
        await request.app.state.services.health.readiness()
    except SchemaOutOfDate as changed:
        log.warning("database error (%s): %s", type(exc).__name__, changed.detail)
        return changed
    except Exception:  # the error being answered is the one to report
        return None
    return None


def _internal_error() -> JSONResponse:
    return problem_response(AppError("An unexpected error."))


def install(app: FastAPI) -> None:
    """Register the handlers on the app."""
    app.add_exception_handler(AppError, _app_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    for error in DATABASE_ERRORS:  # OSError among them: ConnectionError, TimeoutError, …
        app.add_exception_handler(error, _database_error)
    app.add_exception_handler(Exception, _unexpected)


_RETRY_AFTER = {
    "description": "Seconds to wait before retrying (session_busy, and every 503).",
    "schema": {"type": "integer"},
}
# The headers a problem of this status may carry (AppError.headers).
_PROBLEM_HEADERS: dict[int, dict[str, Any]] = {
    401: {"WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}},
    409: {"Retry-After": _RETRY_AFTER},
    503: {"Retry-After": _RETRY_AFTER},
}


# What any route may answer: 413 for a body over the limit (on any method, before the route
# is reached), 431 for a request line and headers over theirs (`agent-runner serve`'s HTTP
# parser: app/request_head.py), 503 when shutdown begins while its body is still arriving,
# and 500 for what went wrong unforeseen.
EVERY_ROUTE: tuple[type[AppError], ...] = (
    PayloadTooLarge,
    HeadersTooLarge,
    ShuttingDown,
    AppError,
)


def responses(*errors: type[AppError]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` documenting problem+json for the statuses of the route's errors
    and of EVERY_ROUTE's, each response's description naming the `code`s it may carry. A
    route that reads or writes the database may also meet a schema changed under it."""
    if DatabaseUnavailable in errors:
        errors = (*errors, SchemaOutOfDate)
    codes: dict[int, list[str]] = {}
    for error in (*errors, *EVERY_ROUTE):
        named = codes.setdefault(error.status, [])
        if error.code not in named:
            named.append(error.code)
    return {
        status: {"model": Problem, **documented_problem(status, codes=named)}
        for status, named in sorted(codes.items())
    }


def documented_problem(status: int, *, codes: list[str]) -> dict[str, Any]:
    """The OpenAPI response of a problem of this status, naming the `codes` it may carry."""
    response: dict[str, Any] = {
        "content": {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}},
        "description": "A problem; code " + " or ".join(f"`{code}`" for code in codes),
    }
    if status in _PROBLEM_HEADERS:
        response["headers"] = _PROBLEM_HEADERS[status]
    return response

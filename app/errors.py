"""Domain errors; each has a stable `code` and an HTTP status for api/problems.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from typing_extensions import override


class AppError(Exception):
    """Base of every error the API renders as problem+json."""

    code = "internal_error"
    status = 500
    title = "Internal error"

    def __init__(self, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extra = extra

    def headers(self) -> dict[str, str]:
        """Extra response headers for this error."""
        return {}


class NotFound(AppError):
    code = "not_found"
    status = 404
    title = "Not found"


class AgentNotFound(NotFound):
    code = "agent_not_found"
    title = "Agent not found"

    def __init__(self, name: str) -> None:
        super().__init__(f"No agent named {name!r}.")


class RunNotFound(NotFound):
    code = "run_not_found"
    title = "Run not found"

    def __init__(self, run_id: str) -> None:
        super().__init__(f"No run with id {run_id!r}.")


class SessionNotFound(NotFound):
    code = "session_not_found"
    title = "Session not found"

    def __init__(self, session_id: str) -> None:
        super().__init__(f"No session with id {session_id!r}.")


class SessionDeleted(SessionNotFound):
    """The session was deleted under this turn (its runner paused, another replica took the
    session over and deleted it)."""

    def __init__(self, session_id: str) -> None:
        super().__init__(session_id)
        self.detail = (
            f"Session {session_id!r} was deleted while this turn ran; the turn stopped"
            " without writing or dispatching anything further (a tool call already under way"
            " may still finish)."
        )


class SessionAccessDenied(AppError):
    code = "session_access_denied"
    status = 403
    title = "Session access denied"

    def __init__(self, session_id: str) -> None:
        super().__init__(
            f"Session {session_id!r} serves only requests with the user_id it was created with."
        )


class SessionAgentMismatch(AppError):
    code = "session_agent_mismatch"
    status = 409
    title = "Session bound to another agent"

    def __init__(self, session_id: str, *, bound: str, requested: str) -> None:
        super().__init__(
            f"Session {session_id!r} is bound to agent {bound!r}, not {requested!r}.",
            bound_agent=bound,
        )


class SessionBusy(AppError):
    code = "session_busy"
    status = 409
    title = "Session busy"
    retry_after_s = 1

    def __init__(self, session_id: str, *, active_run_id: str | None) -> None:
        super().__init__(
            f"Session {session_id!r} has a run in progress; retry when it has finished.",
            active_run_id=active_run_id,
        )

    @override
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class SessionConflict(SessionBusy):
    """This runner may have lost the session (found at a durable write or before a
    dispatch); RunService answers SessionHoldLost instead when nobody else took it."""

    def __init__(self, session_id: str, *, active_run_id: str | None = None) -> None:
        super().__init__(session_id, active_run_id=active_run_id)
        self.detail = (
            f"This runner no longer owns session {session_id!r} (another runner took it over); "
            "it stopped without writing or dispatching anything further (a tool call already"
            " under way may still finish: the run that took over treats it as interrupted)."
        )


class MemoryStoreNotDurable(AppError):
    code = "memory_store_not_durable"
    status = 409
    title = "Memory store is not durable"

    def __init__(self) -> None:
        super().__init__(
            "DATABASE_URL=memory:// keeps nothing; a run with a session_id needs a durable store "
            "(a SQLite file or PostgreSQL). Omit session_id for a stateless run."
        )


class ValidationFailed(AppError):
    code = "validation_error"
    status = 422
    title = "Validation error"


class MethodNotAllowed(AppError):
    code = "method_not_allowed"
    status = 405
    title = "Method not allowed"

    def __init__(self, detail: str, *, allow: str | None) -> None:
        super().__init__(detail)
        self.allow = allow

    @override
    def headers(self) -> dict[str, str]:
        return {"Allow": self.allow} if self.allow is not None else {}


class PayloadTooLarge(AppError):
    code = "payload_too_large"
    status = 413
    title = "Payload too large"


class HeadersTooLarge(AppError):
    """A request's line and headers past their limit (app/request_head.py)."""

    code = "headers_too_large"
    status = 431
    title = "Request header fields too large"


class HttpError(AppError):
    """Any other HTTP error the framework raises, with its own status."""

    code = "http_error"
    title = "HTTP error"

    def __init__(self, detail: str, *, status: int, headers: dict[str, str]) -> None:
        super().__init__(detail)
        self.status = status
        self._headers = headers

    @override
    def headers(self) -> dict[str, str]:
        return self._headers


class Unavailable(AppError):
    """A 503: this replica cannot serve the request now; `Retry-After` says when to retry."""

    status = 503
    retry_after_s = 2

    @override
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class DatabaseUnavailable(Unavailable):
    code = "database_unavailable"
    title = "Database unavailable"


class SessionHoldLost(DatabaseUnavailable):
    """This runner's hold on the session ended with its connection to the database, and no
    other runner took the session (where one did: SessionConflict)."""

    def __init__(self, session_id: str) -> None:
        super().__init__(
            f"This replica's hold on session {session_id!r} ended with its connection to the"
            " database, so it stopped without writing or dispatching anything further (a tool"
            " call already under way may still finish). Resubmit the same session_id (and"
            " Idempotency-Key) to resume the turn."
        )


class SchemaOutOfDate(Unavailable):
    """/readyz: the database's schema is not the newest migration this code knows (it is
    behind, or a newer build's)."""

    code = "schema_out_of_date"
    title = "Schema out of date"
    retry_after_s = 5


class ConfigError(Exception):
    """The agents file or another configuration input is invalid (raised at start)."""


class SchemaAhead(ConfigError):
    """The database's schema is at a migration this build does not have: a newer build has
    upgraded it (a rolling upgrade), and this one must neither migrate nor serve it."""

    def __init__(self, revision: str) -> None:
        super().__init__(
            f"the database's schema is at {revision!r}, a migration this build does not have:"
            " a newer build has upgraded the database; run that build here"
        )


class SqliteFileBusy(ConfigError):
    """Another process holds the SQLite file's lock: it serves the file (or runs a turn on it)."""

    def __init__(self, lock_file: Path) -> None:
        super().__init__(
            f"another process is serving this SQLite database, or running a turn on it (it"
            f" holds {lock_file}); a SQLite file is served by one process: run replicas on"
            " PostgreSQL"
        )
        self.lock_file = lock_file


class IdempotencyKeyReused(AppError):
    code = "idempotency_key_reused"
    status = 422
    title = "Idempotency-Key reused with another body"

    def __init__(self, key: str) -> None:
        super().__init__(
            f"Idempotency-Key {key!r} was first used with a different request body on this "
            "session; use a new key for a new turn."
        )


class Unauthorized(AppError):
    code = "unauthorized"
    status = 401
    title = "Unauthorized"

    @override
    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class ShuttingDown(Unavailable):
    code = "shutting_down"
    title = "Shutting down"
    retry_after_s = 1

    def __init__(
        self, detail: str = "This replica is shutting down and takes no new runs; retry elsewhere."
    ) -> None:
        super().__init__(detail)

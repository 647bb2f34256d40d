"""What a database failure means to a client: which failures are outages (503
`database_unavailable`, not bugs), what the 503 says by cause, and what is logged of it."""

from __future__ import annotations

import errno
import functools
import logging
import sqlite3
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

import asyncpg
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from app.errors import DatabaseUnavailable

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

# PostgreSQL errors that mean the connection, not the statement, failed (class 57 is the
# server ending it: shutdown, terminated backend). When the server ends a connection between
# statements, asyncpg may instead find its protocol in a state it cannot leave and raise
# InternalClientError ("cannot switch to state …"); that connection is as dead.
PG_CONNECTION_ERRORS = (
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    OSError,
)

# What a failing database raises, up to the services' callers (the API's handlers, `run`):
# `is_outage` tells which of them are outages.
DATABASE_ERRORS = (DBAPIError, asyncpg.PostgresError, sqlite3.Error, PoolTimeoutError, OSError)

# What a 503 database_unavailable says, by cause.
UNREACHABLE_DETAIL = "The database cannot be reached; retry later."
READ_ONLY_DETAIL = "The database is read-only (a standby?): it cannot store runs now."
POOL_BUSY_DETAIL = "This replica's database connections are all in use; retry later."
EXHAUSTED_DETAIL = "The database is out of connections, memory or disk space; retry later."
UNWRITABLE_DETAIL = (
    "The database file cannot be opened or written now (disk full, I/O errors, or out of"
    " file descriptors); retry later."
)
REPLICA_EXHAUSTED_DETAIL = "This replica is out of file descriptors or memory; retry later."

# This process out of a resource, on its way to the database (errno).
_LOCAL_LIMITS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
# SQLite's names for a file it cannot write (sqlite3.Error.sqlite_errorname's primary code).
_SQLITE_UNWRITABLE = ("SQLITE_FULL", "SQLITE_IOERR", "SQLITE_CANTOPEN")


def read_again_if_disconnected(read: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """For a read, which changes nothing and so may run twice: once more if its connection
    had been ended by the server while it sat in the pool, unseen by the driver (the pool's
    check at checkout raced the server's goodbye; SQLAlchemy has then replaced the pool's
    connections). Otherwise such a read answered 503 though the database was up."""

    @functools.wraps(read)
    async def again(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await read(*args, **kwargs)
        except DBAPIError as exc:
            if not exc.connection_invalidated:
                raise
            log.info("a pooled database connection had been ended: reading again")
            return await read(*args, **kwargs)

    return again


def pg_read_only(exc: BaseException) -> bool:
    """The statement failed because the database takes no writes (SQLSTATE 25006: a standby,
    or default_transaction_read_only): an outage for this service, not a bug."""
    return _sqlstate(exc) == "25006"


def saturated(exc: BaseException) -> bool:
    """The database, or this process on its way to it, is out of a resource for now (SQLSTATE
    class 53: connections, memory, disk; or this process's file descriptors or memory): up,
    and worth waiting for, where an outage is not."""
    return _pg_exhausted(exc) or _local_limit(exc) is not None


def is_outage(exc: Exception) -> bool:
    """A database failure that is an outage (503 `database_unavailable`), not a bug (500)."""
    if sqlite_statement_error(exc):
        return False
    if isinstance(exc, DBAPIError):
        return (
            isinstance(exc, OperationalError | InterfaceError)
            or exc.connection_invalidated
            or pg_read_only(exc)
            or saturated(exc)
        )
    # The driver's own errors (the journal's writes use the drivers directly).
    if isinstance(exc, asyncpg.PostgresError):
        return isinstance(exc, PG_CONNECTION_ERRORS) or pg_read_only(exc) or saturated(exc)
    if isinstance(exc, sqlite3.Error):
        return isinstance(exc, sqlite3.OperationalError)
    if isinstance(exc, OSError) and not isinstance(exc, ConnectionError | TimeoutError):
        return saturated(exc)  # out of file descriptors or memory on the way to the database
    return True  # pool timeouts and socket errors on the way to the database


def unavailable(exc: BaseException) -> DatabaseUnavailable:
    """The 503 for a database failure that is an outage, saying which; logs its cause (the
    driver's error, its code and message: never a statement or its parameters)."""
    if isinstance(exc, PoolTimeoutError):  # not the database's state: this replica's pool
        log.warning("database connections all in use")
        return DatabaseUnavailable(POOL_BUSY_DETAIL)
    if pg_read_only(exc):
        detail = READ_ONLY_DETAIL
    elif _pg_exhausted(exc):
        detail = EXHAUSTED_DETAIL
    elif _local_limit(exc) is not None:
        detail = REPLICA_EXHAUSTED_DETAIL
    elif _sqlite_unwritable(exc):
        detail = UNWRITABLE_DETAIL
    else:
        detail = UNREACHABLE_DETAIL
    log.warning("database unavailable: %s", _cause(exc))
    return DatabaseUnavailable(detail)


def _driver_error(exc: BaseException) -> BaseException:
    """The driver's own error: SQLAlchemy wraps it (`orig`), and its asyncpg adapter wraps
    asyncpg's again (as the cause)."""
    error = getattr(exc, "orig", None) or exc
    cause = error.__cause__
    return cause if isinstance(cause, asyncpg.PostgresError | OSError) else error


def _sqlstate(exc: BaseException) -> str | None:
    for error in (getattr(exc, "orig", None), _driver_error(exc), exc):
        sqlstate = getattr(error, "sqlstate", None)
        if isinstance(sqlstate, str):
            return sqlstate
    return None


def _pg_exhausted(exc: BaseException) -> bool:
    """PostgreSQL is out of a resource (SQLSTATE class 53)."""
    sqlstate = _sqlstate(exc)
    return sqlstate is not None and sqlstate.startswith("53")


def _local_limit(exc: BaseException) -> int | None:
    error = _driver_error(exc)
    if isinstance(error, OSError) and error.errno in _LOCAL_LIMITS:
        return error.errno
    return None


def sqlite_statement_error(exc: BaseException) -> bool:
    """A statement SQLite could not run as written (SQLITE_ERROR: no such table or column, …),
    which its driver raises as an OperationalError, like an outage: a schema that is not the
    code's, or a bug, never the database's state."""
    return getattr(_driver_error(exc), "sqlite_errorname", None) == "SQLITE_ERROR"


def _sqlite_unwritable(exc: BaseException) -> bool:
    name = getattr(_driver_error(exc), "sqlite_errorname", None)  # SQLITE_IOERR_WRITE, …
    return isinstance(name, str) and name.startswith(_SQLITE_UNWRITABLE)


def _cause(exc: BaseException) -> str:
    error = _driver_error(exc)
    parts = [type(error).__name__]
    if (sqlstate := _sqlstate(exc)) is not None:
        parts.append(f"SQLSTATE {sqlstate}")
    if isinstance(error, OSError) and error.errno is not None:
        parts.append(errno.errorcode.get(error.errno, str(error.errno)))
    if isinstance(name := getattr(error, "sqlite_errorname", None), str):
        parts.append(name)
    if isinstance(error, OSError | sqlite3.Error | asyncpg.PostgresError) and str(error):
        parts.append(str(error).splitlines()[0][:200])
    return ": ".join(parts)

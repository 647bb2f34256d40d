"""DATABASE_URL: which URLs the service takes, and how each store's drivers read them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import asyncpg
from sqlalchemy.engine import make_url

from app.errors import ConfigError

MEMORY_URL = "memory://"


def sqlite_file(database_url: str) -> Path | None:
    """The file of a SQLite database URL (None for memory:// and PostgreSQL), symbolic links
    resolved: the locks beside it must be found by every spelling of its path."""
    if database_url == MEMORY_URL:
        return None
    url = make_url(database_url)
    if url.get_backend_name() != "sqlite" or not url.database:
        return None
    return Path(url.database).resolve()


# libpq options asyncpg does not read: sent on, the server would refuse each as an unknown
# setting, and some (channel_binding=require) ask for a protection asyncpg cannot give.
_LIBPQ_ONLY_OPTIONS = frozenset(
    {
        "channel_binding",
        "gssdelegation",
        "gssencmode",
        "hostaddr",
        "keepalives",
        "keepalives_count",
        "keepalives_idle",
        "keepalives_interval",
        "load_balance_hosts",
        "replication",
        "require_auth",
        "requirepeer",
        "sslcertmode",
        "sslcompression",
        "sslcrldir",
        "sslsni",
        "tcp_user_timeout",
    }
)


def check_database_url(database_url: str) -> str:
    """A DATABASE_URL this service can use (white space around it dropped), or ConfigError
    saying why not, without quoting it (it may hold a password)."""
    database_url = database_url.strip()
    if not database_url:
        raise ConfigError("it is empty: unset it for the default, or name a database")
    if database_url == MEMORY_URL:
        return database_url
    if database_url.lower().startswith("memory:"):
        raise ConfigError(f"write the store that keeps nothing as {MEMORY_URL}, with no path")
    try:
        url = make_url(database_url)
        port = url.port
    except Exception as exc:  # ArgumentError, or ValueError for a port that is not a number
        several = "; for several hosts write ?host=a,b&port=p1,p2" if "," in database_url else ""
        raise ConfigError(f"not a database URL ({exc}){several}") from None
    backend = url.get_backend_name()
    if backend == "sqlite":
        if not url.database or url.database == ":memory:" or url.query:
            raise ConfigError(
                "a SQLite URL names a file and nothing else (sqlite:///path.db);"
                f" {MEMORY_URL} is the store that keeps nothing"
            )
        if url.database.startswith("~"):  # the shell's, not a path: a folder named ~ here
            raise ConfigError("a SQLite path is not expanded: write the home folder for ~")
    elif backend in ("postgresql", "postgres"):
        if url.host is not None and "@" in url.host:
            raise ConfigError("write an @ in its user name or password as %40")
        if port is not None and not 0 < port < 65536:
            raise ConfigError(f"port {port} is not a TCP port")
        unread = sorted(_LIBPQ_ONLY_OPTIONS.intersection(url.query))
        if unread:
            raise ConfigError(
                f"asyncpg, the service's PostgreSQL driver, has no option {', '.join(unread)}"
                f" (libpq's): remove {'them' if len(unread) > 1 else 'it'}"
            )
        timeout = url.query.get("connect_timeout")
        if timeout is not None and not _positive_number(timeout):
            raise ConfigError("connect_timeout is a number of seconds above 0")
        _check_pg_files_and_attrs(url.query)
    else:
        raise ConfigError(
            f"scheme {url.drivername!r} is not supported;"
            f" use sqlite:///path.db, postgresql://user@host/db or {MEMORY_URL}"
        )
    return database_url


# The options naming a file the driver reads (asyncpg's error for a missing one names none).
_FILE_OPTIONS = ("sslrootcert", "sslcert", "sslkey", "sslcrl")
_SESSION_ATTRS = ("any", "primary", "standby", "prefer-standby", "read-write", "read-only")


def _check_pg_files_and_attrs(query: Mapping[str, str | tuple[str, ...]]) -> None:
    for option in _FILE_OPTIONS:
        path = query.get(option)
        if isinstance(path, str) and path and not Path(path).is_file():
            raise ConfigError(f"{option}: no file {path}")
    attrs = query.get("target_session_attrs")
    if attrs is not None and attrs not in _SESSION_ATTRS:
        raise ConfigError(f"target_session_attrs is one of {', '.join(_SESSION_ATTRS)}")


def _positive_number(text: str | tuple[str, ...]) -> bool:
    try:
        return isinstance(text, str) and float(text) > 0
    except ValueError:
        return False


def async_url(database_url: str) -> str:
    """Map a DATABASE_URL of CONTRACT §5 to the async SQLAlchemy URL that serves it."""
    if database_url == MEMORY_URL:
        raise ConfigError("memory:// has no database URL; Database.connect makes its store")
    url = make_url(check_database_url(database_url))
    if url.get_backend_name() == "sqlite":
        return url.set(drivername="sqlite+aiosqlite").render_as_string(hide_password=False)
    # Only names the dialect: every connection is made by `pg_connector`, from the URL, and
    # SQLAlchemy would read the query its own way (`?host=a,b` with one port: an error).
    url = url.set(drivername="postgresql+asyncpg", query={})
    return url.render_as_string(hide_password=False)


# Query options that carry a secret (libpq's names).
_SECRET_OPTIONS = frozenset({"password", "sslpassword"})


def shown_url(database_url: str) -> str:
    """The URL as logs and messages may show it: its password hidden, in the authority or
    in a query option."""
    url = make_url(database_url)
    query = {k: "***" if k.lower() in _SECRET_OPTIONS else v for k, v in url.query.items()}
    # The query is rendered percent-encoded; *** reads as the password's *** does.
    return url.set(query=query).render_as_string(hide_password=True).replace("%2A%2A%2A", "***")


def asyncpg_dsn(database_url: str) -> str:
    """The libpq-style URI asyncpg.connect reads, for a postgresql:// DATABASE_URL.

    asyncpg reads libpq's options (sslmode, sslrootcert, passfile, target_session_attrs, …)
    and sends any other query option as a server setting (application_name, options,
    search_path, …), as libpq does. `ssl`, asyncpg's own name for sslmode, is read as
    sslmode; libpq's fallback_application_name as application_name when that is not set;
    connect_timeout is pg_connector's."""
    url = make_url(database_url).set(drivername="postgresql")
    query = dict(url.query)
    if "ssl" in query:
        query.setdefault("sslmode", query.pop("ssl"))
    fallback = query.pop("fallback_application_name", None)
    if fallback is not None:
        query.setdefault("application_name", fallback)
    query.pop("connect_timeout", None)
    return url.set(query=query).render_as_string(hide_password=False)


def pg_connector(database_url: str, **options: Any) -> Callable[[], Awaitable[asyncpg.Connection]]:
    """Opens a connection to a postgresql:// DATABASE_URL: the engine's `async_creator`, so
    that the engine, the migrations and the ownership connection read the URL alike, as
    asyncpg does (SQLAlchemy would hand each query option to asyncpg.connect as a keyword,
    and a libpq option such as application_name would stop the start with a TypeError).
    A connection is given the URL's connect_timeout, 5 s without one."""
    dsn = asyncpg_dsn(database_url)
    timeout = float(str(make_url(database_url).query.get("connect_timeout", 5)))

    async def connect() -> asyncpg.Connection:
        connection: asyncpg.Connection = await asyncpg.connect(dsn, timeout=timeout, **options)
        return connection

    return connect

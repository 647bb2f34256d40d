"""Values read from the environment: API_KEYS, and DATABASE_URL's libpq options."""

from __future__ import annotations

import socket
import time

import pytest
from sqlalchemy.engine import make_url

from app.api.auth import ApiKeys
from app.db.urls import asyncpg_dsn, check_database_url, pg_connector, shown_url
from app.errors import ConfigError, Unauthorized


def test_api_keys_may_hold_what_a_header_carries() -> None:
    # A space inside, or a Latin-1 character (a header's bytes are read as Latin-1): such
    # keys are sent and matched, so they are kept, not refused.
    keys = ApiKeys.parse("k 2:acme,kë:globex")
    assert keys.tenant("k 2") == "acme"
    assert keys.tenant("k\xeb") == "globex"


def test_api_keys_ignore_spaces_around_key_and_tenant() -> None:
    keys = ApiKeys.parse(" k1 : acme , k2:globex ")
    assert keys.tenant("k1") == "acme"
    assert keys.tenant("k2") == "globex"
    with pytest.raises(Unauthorized):
        keys.tenant("k1 :")


NOT_A_TOKEN = (
    "has a key with a control character or one beyond Latin-1, which no Authorization"
    " header can send"
)


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("k1:a,k1:b", "API_KEYS: entry 2 repeats the key of an earlier one"),
        ("k1:a, k1 :b", "API_KEYS: entry 2 repeats the key of an earlier one"),
        ("k1", "API_KEYS: entry 1 is not key:tenant"),
        ("k1:a,:b", "API_KEYS: entry 2 is not key:tenant"),
        ("k1: ", "API_KEYS: entry 1 is not key:tenant"),
        ("", "API_KEYS is set but empty: name key:tenant entries, or unset it"),
        (" ", "API_KEYS is set but empty: name key:tenant entries, or unset it"),
        ("k1:a,", "API_KEYS: entry 2 is not key:tenant"),
        # A session's tenant_id holds 128: every durable run of the key was a 500 on PostgreSQL.
        (f"k1:a,k2:{'t' * 129}", "API_KEYS: entry 2 names a tenant of more than 128 characters"),
        # Accepted, such a key was never matched: a header's bytes are read as Latin-1, and
        # cannot hold a control character.
        *[
            (f"k1:a,{key}:b", f"API_KEYS: entry 2 {NOT_A_TOKEN}")
            for key in ("k\t2", "日本", "k\x7f", "k\u0100")
        ],
    ],
)
def test_api_keys_refused_with_the_entry_named_and_no_key_shown(spec: str, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ApiKeys.parse(spec)
    assert str(caught.value) == problem


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://u:s3cret@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u@h/db?password=s3cret", "postgresql://u@h/db?password=***"),
        ("postgresql://u@h/db?ssl=require&sslpassword=s3cret", "ssl=require&sslpassword=***"),
        ("postgresql://u@h/db?PASSWORD=s3cret", "postgresql://u@h/db?PASSWORD=***"),
        ("sqlite:////tmp/x.db", "sqlite:////tmp/x.db"),
    ],
)
def test_a_shown_database_url_hides_its_password_wherever_it_is(url: str, shown: str) -> None:
    assert shown in shown_url(url)
    assert "s3cret" not in shown_url(url)


@pytest.mark.parametrize("option", ["sslmode", "ssl"])
@pytest.mark.parametrize("mode", ["disable", "require", "verify-full"])
def test_the_ssl_mode_reaches_asyncpg_by_libpqs_name(option: str, mode: str) -> None:
    # asyncpg reads the URI as libpq does (sslmode); `ssl` is asyncpg's keyword for it, which
    # an earlier build passed to the engine's connections only.
    url = make_url(asyncpg_dsn(f"postgresql://u:p@h:5432/db?{option}={mode}&application_name=x"))
    assert url.drivername == "postgresql"
    assert dict(url.query) == {"sslmode": mode, "application_name": "x"}
    assert (url.username, url.password, url.host, url.database) == ("u", "p", "h", "db")


def test_libpqs_fallback_application_name_names_the_connections_when_nothing_else_does() -> None:
    dsn = make_url(asyncpg_dsn("postgresql://h/db?fallback_application_name=a"))
    assert dict(dsn.query) == {"application_name": "a"}
    dsn = make_url(asyncpg_dsn("postgresql://h/db?fallback_application_name=a&application_name=b"))
    assert dict(dsn.query) == {"application_name": "b"}
    # connect_timeout is the connector's, not a server setting.
    assert dict(make_url(asyncpg_dsn("postgresql://h/db?connect_timeout=2")).query) == {}


async def test_connect_timeout_is_how_long_a_connection_may_take() -> None:
    # A server that accepts and never answers: 5 s without the option.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        connect = pg_connector(f"postgresql://u@127.0.0.1:{port}/db?connect_timeout=0.5")
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            await connect()
        assert time.monotonic() - start < 3


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("", "it is empty"),
        ("  ", "it is empty"),
        ("garbage", "not a database URL"),
        ("memory:///", "write the store that keeps nothing as memory://"),
        ("sqlite://", "a SQLite URL names a file"),
        ("sqlite:///:memory:", "a SQLite URL names a file"),
        ("sqlite:///x.db?uri=true", "a SQLite URL names a file"),
        ("sqlite:///~/x.db", "a SQLite path is not expanded: write the home folder for ~"),
        ("postgresql://u:pw@h:abc/db", "not a database URL"),
        ("postgresql://u:pw@h:99999/db", "port 99999 is not a TCP port"),
        ("postgresql://u@h1:5432,h2:5433/db", "for several hosts write ?host=a,b&port=p1,p2"),
        ("postgresql://u:secret-1@secret-2@h/db", "write an @ in its user name or password"),
        ("postgresql://h/db?channel_binding=require", "has no option channel_binding"),
        ("postgresql://h/db?keepalives=1&gssencmode=disable", "gssencmode, keepalives"),
        ("postgresql://h/db?connect_timeout=0", "connect_timeout is a number of seconds"),
        ("mysql://h/db", "scheme 'mysql' is not supported"),
        ("postgresql://h/db?sslmode=verify-full&sslrootcert=/no/ca.pem", "sslrootcert: no file"),
        ("postgresql://h/db?sslcert=/no/c.pem&sslkey=/no/k.pem", "sslcert: no file /no/c.pem"),
        ("postgresql://h/db?sslkey=/no/k.pem", "sslkey: no file /no/k.pem"),
        ("postgresql://h/db?sslcrl=/no/crl.pem", "sslcrl: no file /no/crl.pem"),
        ("postgresql://h/db?target_session_attrs=bogus", "target_session_attrs is one of any,"),
    ],
)
def test_a_database_url_that_cannot_be_used_says_why_without_quoting_it(
    url: str, reason: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        check_database_url(url)
    assert reason in str(refused.value)
    assert "secret" not in str(refused.value)


@pytest.mark.parametrize(
    "url",
    [
        "memory://",
        "sqlite:///relative.db",
        "sqlite:////abs/x.db",
        "sqlite+aiosqlite:///x.db",
        "postgres://u@h/db",
        "postgresql+asyncpg://u:p%40ss@h:5432/db?sslmode=require&application_name=a",
        "postgresql://u@/db?host=/var/run/postgresql",
        "postgresql://u@/db?host=a,b&port=5432",
        "postgresql://u@h/db?connect_timeout=2.5&options=-c%20search_path%3Dx",
        f"postgresql://u@h/db?sslmode=verify-full&sslrootcert={__file__}",
        "postgresql://u@h/db?target_session_attrs=read-write",
    ],
)
def test_database_urls_a_user_writes_are_taken_as_written(url: str) -> None:
    assert check_database_url(f"  {url} ") == url

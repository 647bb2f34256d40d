"""What a client is told, and what is logged, of a database failure that is an outage."""

from __future__ import annotations

import errno
import logging
import sqlite3
from pathlib import Path

import pytest

from app.db.outages import (
    REPLICA_EXHAUSTED_DETAIL,
    UNREACHABLE_DETAIL,
    UNWRITABLE_DETAIL,
    saturated,
    unavailable,
)


def disk_full(path: Path) -> sqlite3.OperationalError:
    """A real SQLITE_FULL: a database allowed no more pages than it has."""
    connection = sqlite3.connect(path)
    try:
        connection.execute("CREATE TABLE t (x TEXT)")
        connection.commit()
        pages = connection.execute("PRAGMA page_count").fetchone()[0]
        connection.execute(f"PRAGMA max_page_count = {pages}")
        with pytest.raises(sqlite3.OperationalError) as full:
            connection.execute("INSERT INTO t VALUES (?)", ("secret prompt " * 1000,))
        return full.value
    finally:
        connection.close()


def test_a_full_sqlite_file_cannot_be_written_and_the_log_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    error = disk_full(tmp_path / "full.db")
    with caplog.at_level(logging.WARNING, logger="app.db.outages"):
        assert unavailable(error).detail == UNWRITABLE_DETAIL
    assert caplog.messages == [
        "database unavailable: OperationalError: SQLITE_FULL: database or disk is full"
    ]
    assert not saturated(error)  # not worth waiting for: it needs an operator


def test_a_replica_out_of_file_descriptors_says_so(caplog: pytest.LogCaptureFixture) -> None:
    error = OSError(errno.EMFILE, "Too many open files")
    with caplog.at_level(logging.WARNING, logger="app.db.outages"):
        assert unavailable(error).detail == REPLICA_EXHAUSTED_DETAIL
    assert caplog.messages == [
        "database unavailable: OSError: EMFILE: [Errno 24] Too many open files"
    ]
    assert saturated(error)


def test_a_refused_connection_is_an_unreachable_database() -> None:
    error = ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
    assert unavailable(error).detail == UNREACHABLE_DETAIL
    assert not saturated(error)

"""The integration tests' fixtures: the service's Database on a database of its own per test."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from app.db.session import Database


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    database = await Database.connect(database_url, pool_size=5)
    try:
        yield database
    finally:
        await database.dispose()

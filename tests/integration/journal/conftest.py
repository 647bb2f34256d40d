"""The journal tests' fixtures: a database per test, metrics, and the journal on them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from app.db.session import Database
from app.metrics import Metrics
from app.services.journal import DurableJournal
from tests.integration.journal.support import journal_on


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    database = await Database.connect(database_url, pool_size=5)
    try:
        yield database
    finally:
        await database.dispose()


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
def journal(db: Database, metrics: Metrics) -> DurableJournal:
    return journal_on(db, metrics)

"""The journal tests' fixtures: a database per test, metrics, and the journal on them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from app.db.journal import journal_store
from app.db.session import Database
from app.failpoints import Failpoints
from app.metrics import Metrics
from app.services.journal import DurableJournal
from app.services.ownership import LocalOwnership


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
    ownership = LocalOwnership()
    store = journal_store(db, ownership.fence_sql)
    return DurableJournal(store, Failpoints.parse(None), ownership, metrics)

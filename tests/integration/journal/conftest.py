"""The journal tests' fixtures: metrics, and the journal on the database (`db`, one per test)."""

from __future__ import annotations

import pytest

from app.db.session import Database
from app.metrics import Metrics
from app.services.journal import DurableJournal
from tests.integration.journal.support import journal_on


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
def journal(db: Database, metrics: Metrics) -> DurableJournal:
    return journal_on(db, metrics)

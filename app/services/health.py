"""Readiness: whether this replica can serve runs now."""

from __future__ import annotations

from dataclasses import dataclass

from app.db.migrate import database_state, from_a_newer_build
from app.db.outages import READ_ONLY_DETAIL
from app.db.session import Database
from app.errors import DatabaseUnavailable, SchemaOutOfDate
from app.services.ownership import Ownership


@dataclass
class HealthService:
    db: Database
    ownership: Ownership
    head_revision: str | None  # the newest migration's (None for memory://)

    async def readiness(self) -> str | None:
        """The schema's revision, once the database and the ownership connection answer and
        the schema is at the newest migration; else DatabaseUnavailable or SchemaOutOfDate."""
        try:
            state = await database_state(self.db)
            await self.ownership.ping()
        except Exception as exc:
            raise DatabaseUnavailable(
                f"The database cannot be reached ({type(exc).__name__})."
            ) from exc
        if state.read_only:
            raise DatabaseUnavailable(READ_ONLY_DETAIL)
        if state.revision != self.head_revision:
            if from_a_newer_build(state.revision):
                # A newer build has migrated the database (a rolling upgrade): this older
                # build cannot tell whether it can use that schema, and must not migrate it.
                raise SchemaOutOfDate(
                    f"The schema is at {state.revision!r}, a migration this build does not"
                    " have: a newer build has upgraded the database; run that build here."
                )
            raise SchemaOutOfDate(
                f"The schema is at {state.revision!r}, not {self.head_revision!r}; "
                "run `agent-runner migrate`."
            )
        return state.revision

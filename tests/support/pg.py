"""Reaching the test PostgreSQL past the service, from synchronous test code."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import asyncpg

from app.db.urls import asyncpg_dsn

T = TypeVar("T")


def on_postgres(database_url: str, work: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
    """`work` on a connection of its own to the database, closed after."""

    async def run() -> T:
        conn = await asyncpg.connect(asyncpg_dsn(database_url))
        try:
            return await work(conn)
        finally:
            await conn.close()

    return asyncio.run(run())

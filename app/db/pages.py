"""One page of a stored list, held to a budget of bytes as well as to `limit` rows.

A page is read in ONE statement, so that it is one snapshot on either store (PostgreSQL reads
in autocommit, each statement its own): the list's first `limit + 1` rows are read as their
keys and the bytes of their text, numbered and summed in the list's order by window
functions, and joined back to their whole rows only where the page holds them. A row past
the page is never sent whole. Sizing a text value reads only its length (on PostgreSQL,
`octet_length` reads a stored value's header). A JSON value the server reads whole to size
it, on PostgreSQL too (json has no cast to text but through its text form): at most
`limit + 1` values per page, on the database's side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from sqlalchemy import ColumnElement, Integer, Select, and_, bindparam, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import InstrumentedAttribute
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

T = TypeVar("T")


@dataclass(frozen=True)
class Paged(Generic[T]):
    """The rows of one page of a list, and whether more rows follow them."""

    rows: Sequence[T]
    more: bool


class text_bytes(FunctionElement[int]):  # SQL functions are lower case
    """The bytes of a text or JSON column's value as stored (UTF-8; NULL for NULL)."""

    type = Integer()
    inherit_cache = True


# Positional: SQLAlchemy's compiler calls them so.
@compiles(text_bytes, "postgresql")
def _postgres_bytes(element: text_bytes, compiler: SQLCompiler, **kw: Any) -> str:  # noqa: PLR0917
    return f"octet_length(CAST({compiler.process(element.clauses, **kw)} AS TEXT))"


@compiles(text_bytes, "sqlite")
def _sqlite_bytes(element: text_bytes, compiler: SQLCompiler, **kw: Any) -> str:  # noqa: PLR0917
    return f"length(CAST({compiler.process(element.clauses, **kw)} AS BLOB))"


def stored_bytes(*columns: InstrumentedAttribute[Any]) -> ColumnElement[int]:
    """The bytes the values of these text or JSON columns hold together (a NULL none)."""
    lengths: list[ColumnElement[int]] = [func.coalesce(text_bytes(c), 0) for c in columns]
    total = lengths[0]
    for length in lengths[1:]:
        total = total + length
    return total


def page_statement(
    query: Select[Any],
    *,
    entity: type[T],
    keys: Sequence[InstrumentedAttribute[Any]],
    descending: bool,
    size: ColumnElement[int],
) -> Select[Any]:
    """The statement of a page of the `entity` rows `query` selects (its filters, as bound
    parameters; no order or limit), in the order of `keys` (unique together; `descending`
    or not). Built once per list and run by `read_page`: building it costs more than
    reading a page of small rows."""
    primary_key = [getattr(entity, c.key) for c in entity.__mapper__.primary_key]  # type: ignore[attr-defined]
    columns = list({c.key: c for c in (*primary_key, *keys)}.values())
    order = [k.desc() if descending else k.asc() for k in keys]
    read = query.with_only_columns(*columns, size.label("size")).order_by(*order)
    sized = read.limit(bindparam("page_read", type_=Integer)).subquery()
    in_order = [sized.c[k.key].desc() if descending else sized.c[k.key].asc() for k in keys]
    placed = select(
        *(sized.c[c.key] for c in primary_key),
        func.row_number().over(order_by=in_order).label("place"),
        func.sum(sized.c.size).over(order_by=in_order, rows=(None, 0)).label("upto"),
        func.count().over().label("seen"),
    ).subquery()
    return (
        select(entity, placed.c.seen)
        .join(placed, and_(*(c == placed.c[c.key] for c in primary_key)))
        .where(
            placed.c.place <= bindparam("page_limit", type_=Integer),
            or_(placed.c.place == 1, placed.c.upto <= bindparam("page_budget", type_=Integer)),
        )
        .order_by(placed.c.place)
    )


async def read_page(
    session: AsyncSession,
    *,
    statement: Select[Any],
    params: dict[str, Any],
    limit: int,
    budget: int,
) -> Paged[Any]:
    """The page `statement` (`page_statement`) reads with these parameters of its filters:
    at most `limit` rows, and none that would take the bytes of their text past `budget`,
    but the first."""
    found = (
        await session.execute(
            statement,
            {**params, "page_read": limit + 1, "page_limit": limit, "page_budget": budget},
        )
    ).all()
    rows = [row[0] for row in found]
    return Paged(rows, more=bool(found) and found[0][1] > len(rows))

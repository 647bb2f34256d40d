"""The `lookup_order` example tool: a deterministic fake order store."""

from __future__ import annotations

import hashlib
from typing import Any

from app.tools.base import ToolContext, ToolFailed

_CATALOG = (
    ("WID-1", "Widget", 1250),
    ("GAD-2", "Gadget", 3999),
    ("GIZ-3", "Gizmo", 799),
    ("DOO-4", "Doohickey", 2450),
    ("SPR-5", "Sprocket", 325),
)
_STATUSES = ("processing", "shipped", "delivered", "delayed")


# Positional: the tool handler interface (README).
async def lookup_order(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:  # noqa: PLR0917
    """Look up an order by id: its status, items and total."""
    order_id = arguments.get("order_id")
    if not isinstance(order_id, str) or not order_id.strip():
        raise ToolFailed("order_id must be a non-empty string")
    return fake_order(order_id.strip())


def fake_order(order_id: str) -> dict[str, Any]:
    """The order for `order_id`; the same id always gives the same order."""
    # A hash, not random(): a resumed session must see the same order as before the crash.
    digest = hashlib.sha256(order_id.encode()).digest()
    count = 1 + digest[0] % 3
    items = []
    total_cents = 0
    for i in range(count):
        sku, name, price_cents = _CATALOG[digest[1 + i] % len(_CATALOG)]
        quantity = 1 + digest[4 + i] % 3
        total_cents += quantity * price_cents
        items.append(
            {"sku": sku, "name": name, "quantity": quantity, "unit_price": price_cents / 100}
        )
    return {
        "order_id": order_id,
        "status": _STATUSES[digest[7] % len(_STATUSES)],
        "items": items,
        "total": total_cents / 100,
        "currency": "EUR",
    }

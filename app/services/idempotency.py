"""An Idempotency-Key's request fingerprint: what tells a retry from a different request
(§4: the same key with a different body, compared as parsed JSON, is 422)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from app.schemas.runs import RunCreate


def fingerprint(body: RunCreate, *, floats_as_sent: bool = False) -> str:
    """A hash of the request body as parsed JSON, to tell a retry from a different request.

    `floats_as_sent`: as the builds before 2026-11-30 stored it, which hashed 12.0 as
    written (not as the 12 it equals); a key one of them stored must still replay (to the
    body as first sent: a retry that spells 12.0 as 12 differs from it there)."""
    parsed = body.model_dump(mode="json", exclude_unset=True)
    canonical = json.dumps(
        parsed if floats_as_sent else _integral_floats_as_ints(parsed),
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def _integral_floats_as_ints(value: Any) -> Any:
    """JSON has one kind of number: 12.0 and 12 are the same value."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _integral_floats_as_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral_floats_as_ints(v) for v in value]
    return value

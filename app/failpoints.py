"""Crash points for tests (CONTRACT §6): `FAILPOINTS=name[@n][,name[@n]...]`.

Reaching an armed point for the n-th time in this process ends it with `os._exit`: no cleanup,
no further writes, no transaction rollback sent — the same as `kill -9` at that instant.
"""

from __future__ import annotations

import logging
import os
from collections import Counter

from app.errors import ConfigError

log = logging.getLogger(__name__)

# In the order a turn reaches them (CONTRACT §6).
NAMES = (
    "before-write-1",
    "after-write-1",
    "after-handlers",
    "in-write-2",
    "after-write-2",
    "before-final-write",
)
EXIT_CODE = 137  # what a shell reports for a process killed by SIGKILL


class Failpoints:
    """Armed crash points and how often each was reached."""

    __slots__ = ("_armed", "_reached")

    def __init__(self, armed: dict[str, int]) -> None:
        self._armed = armed
        self._reached: Counter[str] = Counter()

    @classmethod
    def parse(cls, spec: str | None) -> Failpoints:
        """Parse the FAILPOINTS value (empty: none armed). An empty entry, an unknown or
        repeated name and a bad count are a ConfigError: a typo would otherwise leave a test
        running with a crash point it did not mean."""
        armed: dict[str, int] = {}
        text = (spec or "").strip()
        for item in text.split(",") if text else ():
            item = item.strip()
            if not item:
                raise ConfigError(f"FAILPOINTS: {text!r} has an empty entry; use name[@n],...")
            name, at, count = item.partition("@")
            if name in armed:
                raise ConfigError(f"FAILPOINTS: {name!r} is named twice")
            if name not in NAMES:
                raise ConfigError(f"FAILPOINTS: unknown failpoint {name!r}; known: {sorted(NAMES)}")
            valid = count.isascii() and count.isdigit() and int(count) >= 1
            if at and not valid:
                raise ConfigError(f"FAILPOINTS: {item!r}: the count after @ must be 1 or more")
            armed[name] = int(count) if at else 1
        return cls(armed)

    @property
    def armed(self) -> bool:
        """Whether any failpoint is set (unset, reaching one costs nothing)."""
        return bool(self._armed)

    def reach(self, name: str) -> None:
        """Die here if `name` is armed for this arrival; otherwise return at once."""
        if not self._armed or name not in self._armed:
            return
        self._reached[name] += 1
        if self._reached[name] == self._armed[name]:
            log.warning("failpoint reached, exiting", extra={"failpoint": name})
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(EXIT_CODE)

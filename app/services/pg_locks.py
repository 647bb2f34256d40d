"""The advisory locks PostgresOwnership holds (services/pg_ownership.py), as SQL and keys:
a session's lock key, a lock connection's token, the fence on the token, and the questions
whether a session's lock is held."""

from __future__ import annotations

import hashlib
import secrets

# A pg_locks row `l` that is a runner's session lock: a granted exclusive advisory lock on a
# bigint key, which pg_locks shows as (classid, objid) = (high, low 32 bits) and objsubid = 1
# (`key_parts`). A lock connection's token is a lock on two int4 keys: objsubid = 2; a shared
# lock on a session's key is a replica's question whether it is held (`HELD_AMONG_SQL`), over
# with its statement.
_SESSION_LOCK = (
    "l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 AND l.mode = 'ExclusiveLock'"
)

# True while the lock connection whose token is (token_hi, token_lo) is alive: its session
# lock on the token refuses the shared one asked for here. (Had it been granted, it lasts only
# to the end of the writing transaction, and no lock connection takes a token already used.)
# A write asks it once it has locked the session's row (`claim_sql`): the lock may have been
# lost while the write waited for the row.
PG_FENCE_SQL = (
    "NOT pg_try_advisory_xact_lock_shared(CAST(:token_hi AS integer), CAST(:token_lo AS integer))"
)

# A session lock held by any runner of this database. Advisory locks are per database: another
# database's on the same server with the same key are another deployment's sessions.
SESSION_LOCK_HELD = (
    f"{_SESSION_LOCK}"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)

# The session lock keys, of those given, that a runner holds: its lock refuses the shared one
# asked for here, which is granted otherwise and lasts to the statement's end. (One lookup in
# the lock table each; asking pg_locks would copy every lock of the server.) Asked on a
# connection that holds no session's lock (services/pg_questions.py); the lock connection
# would be granted its own sessions' keys.
HELD_AMONG_SQL = (
    "SELECT k FROM unnest($1::bigint[]) AS k WHERE NOT pg_try_advisory_xact_lock_shared(k)"
)


# Of the session locks (classid, objid) = ($1[i], $2[i]), those whose holder's connection has
# been idle (no heartbeat) for $3 seconds or more: a stalled runner's, which the next turn
# takes over (`HOLDER_SQL` asks the same of one). Reads pg_locks, which copies
# every lock of the server: asked only of sessions another runner holds.
STALLED_AMONG_SQL = f"""
    SELECT l.classid::bigint AS hi, l.objid::bigint AS lo
    FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
    WHERE {SESSION_LOCK_HELD}
      AND (l.classid::bigint, l.objid::bigint) IN (SELECT * FROM unnest($1::bigint[], $2::bigint[]))
      AND extract(epoch FROM clock_timestamp() - a.state_change) >= $3
"""


# The pid holding the session lock (classid, objid) = ($1, $2), and how long its connection has
# been idle (`PostgresOwnership._holder`): no row if no runner holds it.
HOLDER_SQL = f"""
    SELECT l.pid, extract(epoch FROM clock_timestamp() - a.state_change) AS idle_s
    FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
    WHERE {SESSION_LOCK_HELD}
      AND l.classid = $1::bigint::oid AND l.objid = $2::bigint::oid
"""


def lock_key(session_id: str) -> int:
    """A signed 64-bit advisory lock key for the session (collisions only cause a false busy)."""
    return int.from_bytes(hashlib.sha256(session_id.encode()).digest()[:8], "big", signed=True)


# A lock connection's token: two signed int4 advisory-lock keys.
Token = tuple[int, int]


def new_token() -> Token:
    """A random token, never one another lock connection holds or held (64 random bits)."""
    return secrets.randbits(32) - 2**31, secrets.randbits(32) - 2**31


def key_parts(key: int) -> tuple[int, int]:
    """A bigint lock key as pg_locks shows it: (classid, objid), its high and low 32 bits
    (with objsubid = 1)."""
    unsigned = key & 0xFFFFFFFFFFFFFFFF
    return unsigned >> 32, unsigned & 0xFFFFFFFF

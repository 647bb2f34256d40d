"""Property: whatever JSON a client posts to /v1/runs, the answer is never a 5xx."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.api.helpers import assert_no_server_errors, outcome, post_raw

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


SESSION_IDS = st.sampled_from(["s-1", "s-2", "fuzz:3"]) | st.from_regex(
    r"[A-Za-z0-9._:-]{1,128}", fullmatch=True
)
VALID_BODIES = st.fixed_dictionaries(
    {"agent": st.just("echo"), "message": st.text(min_size=1, max_size=40)},
    optional={
        "session_id": SESSION_IDS,
        "user_id": st.sampled_from(["u-1", "u-2"]) | st.text(min_size=1, max_size=12),
        "metadata": st.dictionaries(st.text(max_size=8), ANY_JSON, max_size=3),
    },
)
# A valid body with one field (or an unknown one) set to any JSON value.
ONE_FIELD_OFF = st.tuples(
    VALID_BODIES,
    st.sampled_from(["agent", "message", "session_id", "user_id", "metadata", "extra"]),
    ANY_JSON,
).map(lambda drawn: {**drawn[0], drawn[1]: drawn[2]})
RUN_BODIES = st.one_of(VALID_BODIES, ONE_FIELD_OFF, ANY_JSON)


@pytest.mark.parametrize("backend", ["sqlite"])
@settings(
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(body=RUN_BODIES)
async def test_any_json_body_never_answers_5xx(client: httpx.AsyncClient, body: Any) -> None:
    content = json.dumps(body).encode()

    status, code = outcome(await post_raw(client, content))

    # The spread of answers shows in `pytest --hypothesis-show-statistics`.
    event(str(status) if status < 400 else f"{status} {code}")
    assert_no_server_errors({content.decode(): (status, code)})

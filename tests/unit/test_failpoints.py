"""FAILPOINTS parsing, and that an armed point ends the process on the n-th arrival."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app.errors import ConfigError
from app.failpoints import EXIT_CODE, NAMES, Failpoints

REPO = Path(__file__).resolve().parents[2]


def test_every_contract_failpoint_is_known() -> None:
    assert NAMES == (  # CONTRACT §6, in the order a turn reaches them
        "before-write-1",
        "after-write-1",
        "after-handlers",
        "in-write-2",
        "after-write-2",
        "before-final-write",
    )


@pytest.mark.parametrize(
    ("spec", "armed"),
    [
        ("after-write-1", {"after-write-1": 1}),
        ("after-write-1@1", {"after-write-1": 1}),
        ("in-write-2@3", {"in-write-2": 3}),
        (
            "before-write-1,after-handlers@2, before-final-write@10 ",
            {"before-write-1": 1, "after-handlers": 2, "before-final-write": 10},
        ),
    ],
)
def test_parse_arms_the_named_points(spec: str, armed: dict[str, int]) -> None:
    failpoints = Failpoints.parse(spec)
    assert failpoints.armed
    assert failpoints._armed == armed


@pytest.mark.parametrize("spec", [None, "", " "])
def test_unset_arms_nothing_and_reach_returns(spec: str | None) -> None:
    failpoints = Failpoints.parse(spec)
    assert not failpoints.armed
    for name in sorted(NAMES):
        for _ in range(3):
            failpoints.reach(name)


def test_reach_of_a_point_that_is_not_armed_returns() -> None:
    failpoints = Failpoints.parse("after-write-2")
    for _ in range(3):
        failpoints.reach("after-write-1")
        failpoints.reach("before-write-1")


@pytest.mark.parametrize(
    "spec",
    [
        "after-write-3",
        "AFTER-WRITE-1",
        "after_write_1",
        "after-write-1,bogus@2",
        "@2",
    ],
)
def test_unknown_names_are_a_config_error(spec: str) -> None:
    with pytest.raises(ConfigError, match="unknown failpoint"):
        Failpoints.parse(spec)


@pytest.mark.parametrize(
    "spec",
    [
        "after-write-1@0",
        "after-write-1@-1",
        "after-write-1@x",
        "after-write-1@1.5",
        "after-write-1@+2",
        "after-write-1@2@3",
        "after-write-1@ 2",
        # str.isdigit() accepts "²" but int() rejects it: must still be a ConfigError.
        pytest.param("after-write-1@\u00b2", id="superscript-two"),
    ],
)
def test_bad_counts_are_a_config_error(spec: str) -> None:
    with pytest.raises(ConfigError):
        Failpoints.parse(spec)


def test_an_empty_count_after_the_at_sign_is_a_config_error() -> None:
    # `name@` (say, `after-write-1@$N` with N unset) must not silently arm the first arrival.
    with pytest.raises(ConfigError):
        Failpoints.parse("after-write-1@")


def test_the_process_ends_with_137_on_the_nth_arrival_only() -> None:
    code = textwrap.dedent(
        """
        from app.failpoints import Failpoints

        failpoints = Failpoints.parse("after-write-1@2")
        failpoints.reach("after-write-2")
        failpoints.reach("after-write-1")
        print("survived-first", flush=True)
        failpoints.reach("after-write-1")
        print("survived-second", flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == EXIT_CODE == 137, done.stderr
    assert done.stdout.splitlines() == ["survived-first"]


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("after-write-1,,after-write-2", "has an empty entry"),
        ("after-write-2,", "has an empty entry"),
        (",", "has an empty entry"),
        ("after-write-1@2,after-write-1@4", "'after-write-1' is named twice"),
    ],
)
def test_empty_entries_and_repeated_names_are_a_config_error(spec: str, says: str) -> None:
    # They were let through: the empty entry skipped, the repeated name's last count kept.
    with pytest.raises(ConfigError, match=says):
        Failpoints.parse(spec)

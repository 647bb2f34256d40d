"""The bench's SIGTERM is Ctrl-C, even when it lands in a garbage collector's callback."""

from __future__ import annotations

import subprocess
import sys

# SIGTERM arrives while a weakref callback runs (as during garbage collection), where a
# KeyboardInterrupt is printed ("Exception ignored in …") and dropped: the bench, stopped
# while its server started, went on to its end and exited 0.
SCRIPT = """
import signal, time, weakref

from app.cli import _stop_as_ctrl_c

_stop_as_ctrl_c()


class Thing:
    pass


thing = Thing()
ref = weakref.ref(thing, lambda _: signal.raise_signal(signal.SIGTERM))
del thing
time.sleep(10)
print("went on")
"""


def test_a_sigterm_inside_a_weakref_callback_still_stops_the_bench() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert "went on" not in done.stdout
    assert done.stderr.rstrip().endswith("KeyboardInterrupt"), done.stderr

"""The bench's SIGTERM is Ctrl-C, even when it lands in a garbage collector's callback or in
the middle of `subprocess.Popen.poll`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


# The interrupt lands in Popen.poll() between its lock's acquire and its `try` (a trace
# function raises it there), as a SIGTERM did while the bench waited for its server to start:
# the lock stayed held, the killed server was never seen to end, and the bench printed a
# TimeoutExpired traceback 10 s later instead of stopping.
POLL_INTERRUPTED = """
import inspect, os, subprocess, sys
from pathlib import Path

from app.serving import ServeProcess

source, first = inspect.getsourcelines(subprocess.Popen._internal_poll)
acquire = next(i for i, line in enumerate(source) if "_waitpid_lock.acquire(False)" in line)
after = first + next(i for i in range(acquire + 1, len(source)) if source[i].strip() == "try:")


def trace(frame, event, arg):
    if frame.f_code is not subprocess.Popen._internal_poll.__code__:
        return None

    def line(frame, event, arg):
        if event == "line" and frame.f_lineno == after:
            sys.settrace(None)
            raise KeyboardInterrupt
        return line

    return line


work = Path(sys.argv[1])
server = ServeProcess(
    env={**os.environ, "DATABASE_URL": f"sqlite:///{work}/bench.db"}, log_path=work / "log"
)
sys.settrace(trace)
try:
    server.start()
except KeyboardInterrupt:
    held = server.process._waitpid_lock.locked()  # what CPython left: the case, not another
    child = server.process
    print(f"interrupted; lock held {held}; server {child.pid} ended {child.returncode}")
"""


def test_an_interrupt_inside_popen_poll_still_kills_and_reaps_the_server(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", POLL_INTERRUPTED, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("interrupted; lock held True; server "), done.stdout
    assert done.stdout.rstrip().endswith(" ended -9"), done.stdout
    pid = int(done.stdout.split()[5])
    assert not Path(f"/proc/{pid}").exists()  # killed, and left no process behind

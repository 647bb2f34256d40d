"""The installed `agent-runner` command's entry point: the CLI, imported with Ctrl-C quiet.

Loading the CLI's modules takes a few hundred milliseconds. A Ctrl-C then would raise
KeyboardInterrupt in the middle of an import, and Python would print its traceback; with
SIGINT's default action instead, the command ends by SIGINT as a shell expects, saying
nothing. Python's own handler is put back once the CLI is loaded, so that everything after
(click, asyncio.run, the bench's clean-up) sees Ctrl-C as it always does.
"""

import signal


def main() -> None:
    """Load the CLI with Ctrl-C's default action, then run it."""
    quiet = signal.getsignal(signal.SIGINT) is signal.default_int_handler  # not ignored
    if quiet:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    from app.cli import main as cli  # here: once SIGINT is quiet

    if quiet:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    cli()

"""The `specjax` command: `generate` and its llama.cpp-style flags (`command`), `batch` jobs
(`batch`). The top of the house: imports `api` and `jobs`; nothing imports it.

`main` imports the command (and with it JAX) only once it runs, with its own Ctrl-C handler:
`import specjax` is cheap (its public names load on first use), so a Ctrl-C while JAX is still
being imported is one line and exit 130, like one at any later point, not a traceback."""

from __future__ import annotations

import signal
import sys
import threading

from specjax.cli.interrupt import EXIT_INTERRUPTED


def main(argv: list[str] | None = None) -> int:
    """Run the `specjax` command line (`argv` without the program name; None: `sys.argv`)."""
    # A KeyboardInterrupt raised inside an import can come out as another error (numpy turns
    # it into an ImportError), so a Ctrl-C while the command's modules load is only noted;
    # the load finishes (under a second) and the command then stops before it starts.
    hit: list[int] = []
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, lambda *_: hit.append(1)) if in_main_thread else None
    try:
        from specjax.cli import command
    finally:
        if in_main_thread:
            signal.signal(signal.SIGINT, previous)
    if hit:
        print("specjax: interrupted (Ctrl-C)", file=sys.stderr)
        return EXIT_INTERRUPTED
    return command.main(argv)


__all__ = ["main"]

"""Ctrl-C (SIGINT) while a `specjax` command runs, and the exit status it gives. The standard
library only: `specjax.cli.main` imports this before JAX, so a Ctrl-C at any point of the
command, JAX's own import included, ends in one line and exit 130."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any


class Interrupt:
    """Ctrl-C (SIGINT) while a command runs. Once the decode loop asks (`generate(interrupt=
    ...)`, a batch job's runner): a flag the loop reads between its segments, so it stops
    there and what was generated is kept. Before the loop first asks (loading, compiling,
    prefill) and at a second Ctrl-C: KeyboardInterrupt (`main`: exit 130, no traceback),
    and the flag too, so that one raised where Python drops exceptions (a garbage-collector
    callback, a finalizer: dropped here without a word) still stops the loop when it asks."""

    def __init__(self) -> None:
        self.asked = False
        self.hit = False

    def __call__(self) -> bool:
        self.asked = True
        return self.hit

    def _handle(self, signum: int, frame: Any) -> None:
        first = not self.hit
        self.hit = True
        if not (self.asked and first):
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self) -> Iterator[Interrupt]:
        """The handler for SIGINT while in the block (the main thread's only: signals are)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(signal.SIGINT, self._handle)
        unraisable = sys.unraisablehook

        def hook(args: Any) -> None:
            if args.exc_type is None or not issubclass(args.exc_type, KeyboardInterrupt):
                unraisable(args)

        sys.unraisablehook = hook
        _ACTIVE.append(self)
        try:
            yield self
        finally:
            _ACTIVE.pop()
            sys.unraisablehook = unraisable
            signal.signal(signal.SIGINT, previous)


#: The Interrupts installed (`main` installs one for the whole command).
_ACTIVE: list[Interrupt] = []


def current_interrupt() -> Interrupt:
    """The command's Interrupt (a new one outside `main`)."""
    return _ACTIVE[-1] if _ACTIVE else Interrupt()


#: The exit status of a command stopped by Ctrl-C (128 + SIGINT, as a shell reports it).
EXIT_INTERRUPTED = 130

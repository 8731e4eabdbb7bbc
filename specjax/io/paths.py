"""Output paths checked before any work: a run never ends with nowhere to put its result."""

from __future__ import annotations

import contextlib
import os


def check_writable(path: str, flag: str) -> None:
    """Raise ValueError (one line: the flag, the path, why) unless `path` can be opened for
    writing; checked before any work, so a run never ends with nowhere to put its result. A
    file this check creates is removed again."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a directory")
    existed = os.path.exists(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot write there ({err.strerror})") from None
    os.close(fd)
    if not existed:
        with contextlib.suppress(OSError):
            os.unlink(path)

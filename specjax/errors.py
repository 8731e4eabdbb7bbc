"""specjax's exception types. All derive from ValueError so callers can catch bad input uniformly.
`file_error` turns a ValueError met while reading a file into the file's ModelFileError."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class SpecjaxError(ValueError):
    """Base class for specjax errors about user input, files or configuration."""


class CacheOverflowError(SpecjaxError):
    """A sequence needed more KV cells than its cache row holds."""


class ModelFileError(SpecjaxError):
    """A model/tokenizer/cache file is missing, truncated, corrupted or unsupported."""


class VocabMismatchError(SpecjaxError):
    """Draft and target vocabularies are incompatible (llama.cpp's compatibility rules)."""


@contextlib.contextmanager
def file_error(source: str, what: str) -> Iterator[None]:
    """Re-raises a ValueError of the `with` body as a ModelFileError naming the file and what
    was invalid (`{source}: {what}: {error}`, e.g. what="invalid model hyper-parameters" around
    a config constructor); a ModelFileError already names its file and passes unchanged."""
    try:
        yield
    except ModelFileError:
        raise
    except ValueError as e:
        raise ModelFileError(f"{source}: {what}: {e}") from e

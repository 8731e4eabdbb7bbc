"""specjax's exception types. All derive from ValueError so callers can catch bad input uniformly."""


class SpecjaxError(ValueError):
    """Base class for specjax errors about user input, files or configuration."""


class CacheOverflowError(SpecjaxError):
    """A sequence needed more KV cells than its cache row holds."""


class ModelFileError(SpecjaxError):
    """A model/tokenizer/cache file is missing, truncated, corrupted or unsupported."""


class VocabMismatchError(SpecjaxError):
    """Draft and target vocabularies are incompatible (llama.cpp's compatibility rules)."""

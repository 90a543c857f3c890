"""DataError: the one error every data module raises for a source, cache or split that cannot be used."""

from __future__ import annotations


class DataError(RuntimeError):
    """A data source that cannot be loaded; message is one clear line."""

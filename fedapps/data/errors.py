"""The one exception type of the data layer."""

from __future__ import annotations


class DataError(ValueError):
    """A bad data setting or missing data files; the message names the key/value and the fix."""

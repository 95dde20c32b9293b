"""The one exception type of the data layer."""

from __future__ import annotations

from fedapps.config import ConfigError


class DataError(ConfigError):
    """A bad data setting or missing data files; the message names the key/value and the fix."""

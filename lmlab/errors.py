"""The error type for problems a user causes (bad name, missing file, out-of-range value)."""


class ConfigError(ValueError):
    """Raised before long work starts; the message says what was wrong and how to fix it."""

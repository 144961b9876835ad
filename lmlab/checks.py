"""Range checks for typed configs: a bad value fails with one ConfigError line naming its field."""

from __future__ import annotations

from lmlab.errors import ConfigError


def at_least(section: str, config: object, minimum: float, *fields: str) -> None:
    """Each of `fields` of `config` is a number >= `minimum` (None counts as unset and passes)."""
    for name in fields:
        value = getattr(config, name)
        if value is not None and not value >= minimum:
            raise ConfigError(f"{section}.{name} must be >= {minimum}, got {value}")


def in_open_interval(section: str, config: object, name: str, low: float, high: float) -> None:
    value = getattr(config, name)
    if not low < value < high:
        raise ConfigError(f"{section}.{name} must be in ({low}, {high}), got {value}")

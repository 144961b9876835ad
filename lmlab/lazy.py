"""Package attributes imported on first use (PEP 562), for re-exports whose modules are slow to import."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_attributes(package: str, where: dict[str, str]) -> Callable[[str], object]:
    """A module-level `__getattr__` for `package` that imports each name of `where` from the module it maps to."""

    def __getattr__(name: str) -> object:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(where[name]), name)

    return __getattr__

"""Reading JSON Lines files (prompt files, GSM8K) with one clear error for a line that is not JSON."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from lmlab.errors import ConfigError


def json_lines(text: str, where: str, expect: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of each non-blank line of `text`; a line that is not JSON raises one
    ConfigError naming `where` (the file) and the line, and saying what a line should hold (`expect`)."""
    for line_no, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            yield line_no, json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{where} line {line_no} is not JSON ({err.msg}); {expect}") from None

"""Atomic file writes: write under a temporary name in the same folder, then rename into place.

A reader sees the old file or the new one, never a half-written one, and a failed write leaves
the old file untouched. The file gets the usual mode (0666 minus the umask), as `open` would
give it: `tempfile.mkstemp` would make it private (0600), and so do writers that replace the
file they are given (safetensors' `save_file`), so the mode is set again after the write.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Call `write(tmp_path)`, then move the result to `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # the kernel applies the umask
    mode = tmp.stat().st_mode & 0o777
    try:
        write(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))

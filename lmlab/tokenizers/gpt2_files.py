"""The GPT-2 `vocab.json` + `merges.txt` format.

GPT-2 stores byte strings as text by mapping every byte to a printable character: printable
Latin-1 bytes stand for themselves, the rest (controls, space, ...) map to code points from 256
on, in byte order. `vocab.json` maps such strings to ids; `merges.txt` lists one merge per line
as the two strings separated by a space, after a `#version` header.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from lmlab.atomic import atomic_write_text
from lmlab.errors import ConfigError


@cache
def byte_to_char() -> dict[int, str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in mapping):
        mapping[b] = chr(256 + n)
    return mapping


@cache
def char_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_char().items()}


def to_text(token: bytes) -> str:
    table = byte_to_char()
    return "".join(table[b] for b in token)


def from_text(text: str, where: str) -> bytes:
    table = char_to_byte()
    try:
        return bytes(table[c] for c in text)
    except KeyError as err:
        raise ConfigError(f"{where}: {text!r} holds {err.args[0]!r}, which is not a GPT-2 byte character") from None


def write(directory: str | Path, vocab: dict[int, bytes], merges: list[tuple[bytes, bytes]],
          special_tokens: list[str]) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    specials = {tok.encode("utf-8"): tok for tok in special_tokens}
    entries = {specials.get(b) or to_text(b): i for i, b in sorted(vocab.items())}
    atomic_write_text(directory / "vocab.json", json.dumps(entries, ensure_ascii=False, indent=0))
    lines = [f"{to_text(a)} {to_text(b)}" for a, b in merges]
    atomic_write_text(directory / "merges.txt", "#version: 0.2\n" + "\n".join(lines) + "\n")


def read(vocab_path: str | Path, merges_path: str | Path,
         special_tokens: list[str]) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Vocab and merges from GPT-2 files; special tokens are read literally, the rest as byte characters."""
    entries = json.loads(Path(vocab_path).read_text(encoding="utf-8"))
    specials = set(special_tokens)
    vocab = {int(i): (tok.encode("utf-8") if tok in specials else from_text(tok, str(vocab_path)))
             for tok, i in entries.items()}
    merges = []
    with open(merges_path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line or (line_no == 1 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise ConfigError(f"{merges_path}:{line_no}: expected two tokens separated by one space, got {line!r}")
            where = f"{merges_path}:{line_no}"
            merges.append((from_text(parts[0], where), from_text(parts[1], where)))
    return vocab, merges

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


def to_entries(vocab: dict[int, bytes], merges: list[tuple[bytes, bytes]],
               special_tokens: list[str]) -> tuple[dict[str, int], list[str]]:
    """The contents of `vocab.json` (token text -> id) and the lines of `merges.txt` (without its header)."""
    specials = {tok.encode("utf-8"): tok for tok in special_tokens}
    entries = {specials.get(b) or to_text(b): i for i, b in sorted(vocab.items())}
    return entries, [f"{to_text(a)} {to_text(b)}" for a, b in merges]


def from_entries(entries: dict[str, int], merge_lines: list[str], special_tokens: list[str],
                 where: str) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Vocab and merges from `to_entries`' form; `where` names their origin in errors (e.g. a checkpoint)."""
    merges = [_merge(line, f"{where}: merge {n}") for n, line in enumerate(merge_lines, 1)]
    return _vocab(entries, special_tokens, where), merges


def write(directory: str | Path, vocab: dict[int, bytes], merges: list[tuple[bytes, bytes]],
          special_tokens: list[str]) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    entries, lines = to_entries(vocab, merges, special_tokens)
    atomic_write_text(directory / "vocab.json", json.dumps(entries, ensure_ascii=False, indent=0))
    atomic_write_text(directory / "merges.txt", "".join(f"{line}\n" for line in ["#version: 0.2", *lines]))


def read(vocab_path: str | Path, merges_path: str | Path,
         special_tokens: list[str]) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Vocab and merges from GPT-2 files."""
    vocab = _vocab(json.loads(Path(vocab_path).read_text(encoding="utf-8")), special_tokens, str(vocab_path))
    merges = []
    with open(merges_path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if line and not (line_no == 1 and line.startswith("#version")):
                merges.append(_merge(line, f"{merges_path}:{line_no}"))
    return vocab, merges


def _vocab(entries: dict[str, int], special_tokens: list[str], where: str) -> dict[int, bytes]:
    """Special tokens are read literally, the rest as GPT-2 byte characters."""
    specials = set(special_tokens)
    return {int(i): (tok.encode("utf-8") if tok in specials else from_text(tok, where)) for tok, i in entries.items()}


def _merge(line: str, where: str) -> tuple[bytes, bytes]:
    parts = line.split(" ")
    if len(parts) != 2:
        raise ConfigError(f"{where}: expected two tokens separated by one space, got {line!r}")
    return from_text(parts[0], where), from_text(parts[1], where)

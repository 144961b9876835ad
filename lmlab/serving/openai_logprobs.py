"""Log-probabilities in OpenAI's shapes: the `logprobs` object of /v1/completions choices (tokens, token_logprobs,
top_logprobs, text_offset) and the `logprobs.content` list of /v1/chat/completions choices.

A token's text is its bytes decoded as UTF-8. A byte-level token that is not valid UTF-8 alone (part of a character)
is written as OpenAI writes it, "bytes:\\xe2\\x80", so that no two tokens share a text (the keys of completions'
top_logprobs) and a client can rebuild the bytes; chat's `bytes` field holds the raw bytes either way.
"""

from __future__ import annotations

import codecs
from typing import Any

from lmlab.errors import ConfigError
from lmlab.serving.logprobs import TokenLogprobs

LOWEST = -9999.0  # JSON has no -inf: a log-probability below this is written as this, as OpenAI and vLLM do


class TokenPieces:
    """Each token id's bytes and its text, from the tokenizer's byte-level vocabulary, read once."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._vocab: dict[int, bytes] | None = None

    def bytes(self, token: int) -> bytes:
        if self._vocab is None:
            try:
                self._vocab = dict(self.tokenizer.to_bpe().vocab)
            except (AttributeError, ConfigError):  # no byte-level form: each id's text alone, as asked
                self._vocab = {}
        if not self._vocab:
            return self.tokenizer.decode([token]).encode("utf-8")
        return self._vocab.get(token, b"")  # an id past the tokenizer's (a padded vocabulary) stands for no text

    def text(self, token: int) -> str:
        piece = self.bytes(token)
        try:
            return piece.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


class TextOffsets:
    """Character offsets of tokens in the text their bytes decode to, fed token by token. A token that starts inside
    a character (its bytes finish one an earlier token began) gets that character's offset."""

    def __init__(self, start: int = 0):
        self.chars = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, piece: bytes) -> int:
        offset = self.chars
        self.chars += len(self._decoder.decode(piece))
        return offset


class CompletionLogprobs:
    """The `logprobs` objects of one /v1/completions choice, as its tokens come. With echo, the prompt's tokens come
    first (the first with no log-probability, as OpenAI gives it) and the offsets count the prompt's text."""

    def __init__(self, pieces: TokenPieces, prompt: list[int], prompt_text: str, echo: bool):
        self.pieces, self.prompt, self.echo = pieces, prompt, echo
        self.offsets = TextOffsets(len(prompt_text) if echo else 0)

    def next(self, entries: list[TokenLogprobs],
             prompt_entries: list[TokenLogprobs | None] | None = None) -> dict[str, list]:
        """The object for `entries` (and, with echo, for `prompt_entries` before them)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if self.echo and prompt_entries is not None:
            self._add(out, self.prompt, prompt_entries, TextOffsets())
        self._add(out, [e.token for e in entries], entries, self.offsets)
        return out

    def _add(self, out: dict[str, list], ids: list[int], entries: list[TokenLogprobs | None],
             offsets: TextOffsets) -> None:
        for token, entry in zip(ids, entries):
            out["tokens"].append(self.pieces.text(token))
            out["text_offset"].append(offsets.push(self.pieces.bytes(token)))
            out["token_logprobs"].append(None if entry is None else max(entry.logprob, LOWEST))
            out["top_logprobs"].append(None if entry is None else self._top(entry))

    def _top(self, entry: TokenLogprobs) -> dict[str, float]:
        """The most likely tokens and the chosen one (OpenAI's up to logprobs + 1), most likely first."""
        ranked = dict(entry.top)
        ranked.setdefault(entry.token, entry.logprob)
        return {self.pieces.text(t): max(lp, LOWEST) for t, lp in sorted(ranked.items(), key=lambda kv: -kv[1])}


def chat_logprobs(pieces: TokenPieces, entries: list[TokenLogprobs]) -> dict[str, list]:
    """A chat choice's (or chunk's) `logprobs`: each token with its top_logprobs most likely."""
    return {"content": [{**_chat_token(pieces, e.token, e.logprob),
                         "top_logprobs": [_chat_token(pieces, t, lp) for t, lp in e.top]} for e in entries]}


def _chat_token(pieces: TokenPieces, token: int, logprob: float) -> dict[str, Any]:
    return {"token": pieces.text(token), "logprob": max(logprob, LOWEST), "bytes": list(pieces.bytes(token))}

"""Text of a sequence as its tokens arrive, for streaming (a terminal, server-sent events).

Each push decodes the whole completion so far and hands out what is new, so a character whose UTF-8
bytes span tokens comes out whole. Held back: a trailing incomplete character (decoded as U+FFFD),
and text that may be the start of a stop string; text from a stop string on never comes out.
"""

from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.tokens: list[int] = []
        self.sent = ""

    def push(self, token: int) -> str:
        """The new text that `token` makes final ("" while it is held back)."""
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        ends = [text.find(s) for s in self.stops if s in text]
        text = text[:min(ends)] if ends else text.rstrip("\ufffd")
        held = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return self._advance(text[:len(text) - held])

    def finish(self, text: str) -> str:
        """What is left of the final `text` (the completion as the generation cut it) after what was sent."""
        return self._advance(text)

    def _advance(self, text: str) -> str:
        if len(text) > len(self.sent) and text.startswith(self.sent):
            delta, self.sent = text[len(self.sent):], text
            return delta
        return ""

"""Chat examples and chat templates (registry `chat_template`).

A template turns a conversation (turns of role and content) into text segments, each marked as
trained or not: SFT learns the assistant's words and the marker that ends its turn, never the
prompt, the role headers or the other speakers.

    template = CHAT_TEMPLATES.build("chatml")
    ids, trained = tokenize_chat([Turn("user", "Hi"), Turn("assistant", "Hello!")], tokenizer, template)
    template.render(turns, add_generation_prompt=True)   # the prompt for generation
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lmlab.alignment.tokens import encode
from lmlab.errors import ConfigError
from lmlab.registry import Registry
from lmlab.tokenizers import Tokenizer

CHAT_TEMPLATES = Registry("chat_template", group="chat_template", doc="chat formats: plain, ChatML, Llama 3")

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Turn:
    role: str  # system, user or assistant
    content: str


def check_turns(turns: Sequence[Turn], need_assistant: bool) -> None:
    if not turns:
        raise ConfigError("a chat example has no turns")
    for turn in turns:
        if turn.role not in ROLES:
            raise ConfigError(f"a chat turn has role {turn.role!r}; roles are {', '.join(ROLES)}")
    if need_assistant and not any(t.role == "assistant" for t in turns):
        raise ConfigError("a chat example has no assistant turn, so SFT has nothing to learn from it")


class ChatTemplate:
    """Base of the entries: `header(role)` opens a turn, `footer(role)` closes it; the assistant's
    content and footer are trained. `special_tokens` must each be one token of the tokenizer."""

    special_tokens: tuple[str, ...] = ()
    start = ""  # once, before the first turn

    def __init__(self, cfg=None):
        self.cfg = cfg

    def header(self, role: str) -> str:
        raise NotImplementedError

    def footer(self, role: str) -> str:
        raise NotImplementedError

    def between(self, role: str) -> str:
        """Untrained text after a turn's footer (a newline, for some formats)."""
        return ""

    def content(self, turn: Turn) -> str:
        return turn.content

    def segments(self, turns: Sequence[Turn], add_generation_prompt: bool = False) -> list[tuple[str, bool]]:
        """(text, trained) pieces whose concatenation is the rendered conversation."""
        check_turns(turns, need_assistant=not add_generation_prompt)
        pieces = [(self.start, False)] if self.start else []
        for turn in turns:
            trained = turn.role == "assistant"
            pieces += [(self.header(turn.role), False), (self.content(turn) + self.footer(turn.role), trained)]
            if self.between(turn.role):
                pieces.append((self.between(turn.role), False))
        if add_generation_prompt:
            pieces.append((self.header("assistant"), False))
        return [(text, trained) for text, trained in pieces if text]

    def render(self, turns: Sequence[Turn], add_generation_prompt: bool = False) -> str:
        return "".join(text for text, _ in self.segments(turns, add_generation_prompt))

    @property
    def stop(self) -> str:
        """What ends the assistant's turn: a stop string for generation."""
        return self.footer("assistant")


@CHAT_TEMPLATES.register("plain")
class Plain(ChatTemplate):
    """"User: ...\\nAssistant: ...\\n" with no special tokens: for lmlab's own tokenizers. A system turn is
    its text and a blank line."""

    def header(self, role: str) -> str:
        return {"system": "", "user": "User:", "assistant": "Assistant:"}[role]

    def footer(self, role: str) -> str:
        return "\n\n" if role == "system" else "\n"

    def content(self, turn: Turn) -> str:
        # The space after "User:"/"Assistant:" starts the content, as BPE joins a space to the next word.
        return turn.content if turn.role == "system" else " " + turn.content

    @property
    def stop(self) -> str:
        return "\nUser:"


@CHAT_TEMPLATES.register("chatml")
class ChatML(ChatTemplate):
    """ChatML (Qwen, OpenAI): "<|im_start|>role\\ncontent<|im_end|>\\n"."""

    special_tokens = ("<|im_start|>", "<|im_end|>")

    def header(self, role: str) -> str:
        return f"<|im_start|>{role}\n"

    def footer(self, role: str) -> str:
        return "<|im_end|>"

    def between(self, role: str) -> str:
        return "\n"


@CHAT_TEMPLATES.register("llama3")
class Llama3(ChatTemplate):
    """Llama 3: "<|begin_of_text|>" once, then "<|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|>"."""

    special_tokens = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    start = "<|begin_of_text|>"

    def header(self, role: str) -> str:
        return f"<|start_header_id|>{role}<|end_header_id|>\n\n"

    def footer(self, role: str) -> str:
        return "<|eot_id|>"


def _single_token(tokenizer, token: str) -> bool:
    if isinstance(tokenizer, Tokenizer):
        return token in tokenizer.special_tokens
    return len(tokenizer.encode(token, add_special_tokens=False)) == 1


def check_template_tokens(tokenizer, template: ChatTemplate) -> None:
    """One clear error where the template's special tokens are not single tokens of the tokenizer: its markers
    would be read as plain text, and its stop string would never come as a token."""
    missing = [t for t in template.special_tokens if not _single_token(tokenizer, t)]
    if missing:
        raise ConfigError(f"chat_template={type(template).__name__} needs the special tokens {', '.join(missing)}, "
                          "which the tokenizer does not have as single tokens; add them to the tokenizer's "
                          "special_tokens or use chat_template=plain")


def tokenize_chat(turns: Sequence[Turn], tokenizer, template: ChatTemplate,
                  add_generation_prompt: bool = False) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and, per id, whether SFT trains on it."""
    check_template_tokens(tokenizer, template)
    ids: list[int] = []
    trained: list[bool] = []
    for text, learn in template.segments(turns, add_generation_prompt):
        piece = encode(tokenizer, text, special_tokens=False)
        ids += piece
        trained += [learn] * len(piece)
    return ids, trained

"""SFT data: chat examples read from JSONL, tokenized by a chat template, laid out as (inputs, targets)
rows of the training context whose targets are -100 (ignored by the cross-entropy loss) everywhere but
the assistant's tokens, and the end-of-text token that follows a conversation ending with the assistant.

One line per example, either `{"turns": [{"role": ..., "content": ...}, ...]}` or the OpenAI/Hugging
Face form `{"messages": [...]}`. With `pack`, examples follow one another in a stream cut into rows (no
padding), with positions that restart at each example (and each row), which the model reads as document
boundaries: no token attends across examples. Without it each example has its own row, cut to the
context with a count of the cut ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from lmlab.alignment.chat import ChatTemplate, Turn, check_turns, tokenize_chat
from lmlab.alignment.tokens import eos_id
from lmlab.errors import ConfigError
from lmlab.jsonl import json_lines

IGNORE = -100  # the cross-entropy loss's ignore_index
EXPECT = 'a line is {"turns": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'


def read_chat_jsonl(path: str | Path) -> list[list[Turn]]:
    """The conversations of a JSONL file; a malformed line is one error naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"chat data {path} does not exist")
    examples = []
    for line_no, record in json_lines(path.read_text(encoding="utf-8"), str(path), EXPECT):
        turns = record.get("turns", record.get("messages")) if isinstance(record, dict) else None
        if not isinstance(turns, list) or not all(
                isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str)
                for t in turns):
            raise ConfigError(f"{path} line {line_no} holds no list of role/content turns; {EXPECT}")
        example = [Turn(t["role"], t["content"]) for t in turns]
        try:
            check_turns(example, need_assistant=True)
        except ConfigError as err:
            raise ConfigError(f"{path} line {line_no}: {err}") from None
        examples.append(example)
    if not examples:
        raise ConfigError(f"chat data {path} holds no examples")
    return examples


@dataclass
class SFTRows:
    inputs: torch.Tensor  # (rows, context) token ids
    targets: torch.Tensor  # (rows, context) the next token where it is trained, else -100
    truncated: int  # examples cut to fit a row (without packing)
    trained_tokens: int
    positions: torch.Tensor | None = None  # (rows, context) with packing: each example's own positions


def sft_rows(examples: Sequence[Sequence[Turn]], tokenizer, template: ChatTemplate, context_length: int,
             pack: bool = True, pad: int = 0) -> SFTRows:
    """Rows of `context_length` inputs and targets from the tokenized conversations."""
    if context_length < 1:
        raise ConfigError(f"context_length must be >= 1, got {context_length}")
    encoded = [tokenize_chat(turns, tokenizer, template) for turns in examples]
    eos = eos_id(tokenizer)
    if eos is not None:  # trained after a final assistant turn, so the model learns to end its answer (and stop)
        encoded = [(ids + [eos], trained + [trained[-1]]) for ids, trained in encoded]
    # targets[i] is token i + 1 where token i + 1 is trained: a sequence of n tokens gives n - 1 pairs.
    pairs = [(ids[:-1], [t if keep else IGNORE for t, keep in zip(ids[1:], trained[1:])]) for ids, trained in encoded]
    width, truncated = context_length, 0
    if pack:
        inputs = [t for x, _ in pairs for t in x]
        targets = [t for _, y in pairs for t in y]
        rows = -(-len(inputs) // width)
        x = torch.full((rows, width), pad, dtype=torch.long)
        y = torch.full((rows, width), IGNORE, dtype=torch.long)
        x.view(-1)[:len(inputs)] = torch.tensor(inputs)
        y.view(-1)[:len(targets)] = torch.tensor(targets)
        example = torch.full((rows * width,), len(pairs), dtype=torch.long)  # padding: one more "example"
        example[:len(inputs)] = torch.repeat_interleave(torch.arange(len(pairs)), torch.tensor([len(p) for p, _ in pairs]))
        positions = document_positions(example.view(rows, width))
    else:
        x = torch.full((len(pairs), width), pad, dtype=torch.long)
        y = torch.full((len(pairs), width), IGNORE, dtype=torch.long)
        for row, (inputs, targets) in enumerate(pairs):
            truncated += len(inputs) > width
            x[row, :min(len(inputs), width)] = torch.tensor(inputs[:width])
            y[row, :min(len(targets), width)] = torch.tensor(targets[:width])
    trained = int((y != IGNORE).sum())
    if trained == 0:
        raise ConfigError("no assistant token survives in the SFT rows; raise the context length")
    return SFTRows(x, y, truncated, trained, positions if pack else None)


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """(rows, seq) positions that count from 0 at each row's start and wherever the document id changes."""
    index = torch.arange(documents.shape[1]).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values

"""SFT data: chat JSONL (both key forms, one clear error per bad line), rows whose targets train only
the assistant's tokens, packed or one example per row."""

from __future__ import annotations

import json

import pytest
import torch

from lmlab.alignment.chat import CHAT_TEMPLATES, Turn, tokenize_chat
from lmlab.alignment.sft_data import IGNORE, read_chat_jsonl, sft_rows
from lmlab.errors import ConfigError
from lmlab.tokenizers import ByteTokenizer

EXAMPLES = [[Turn("user", "2+2?"), Turn("assistant", "4")], [Turn("user", "Hi"), Turn("assistant", "Hello")]]


def test_reads_turns_and_messages_and_names_the_bad_line(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"turns": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
                    + "\n\n" + json.dumps({"messages": [{"role": "user", "content": "c"},
                                                        {"role": "assistant", "content": "d"}]}) + "\n")
    assert read_chat_jsonl(path) == [[Turn("user", "a"), Turn("assistant", "b")],
                                     [Turn("user", "c"), Turn("assistant", "d")]]
    path.write_text(path.read_text() + json.dumps({"turns": [{"role": "user", "content": "e"}]}) + "\n")
    with pytest.raises(ConfigError, match="chat.jsonl line 4: a chat example has no assistant turn"):
        read_chat_jsonl(path)
    path.write_text('{"turns": "x"}\n')
    with pytest.raises(ConfigError, match="line 1 holds no list of role/content turns"):
        read_chat_jsonl(path)
    with pytest.raises(ConfigError, match="does not exist"):
        read_chat_jsonl(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("pack, context", [(True, 16), (False, 32)])
def test_rows_train_only_the_assistant_tokens(pack, context):
    tokenizer, template = ByteTokenizer(), CHAT_TEMPLATES.build("plain")
    rows = sft_rows(EXAMPLES, tokenizer, template, context_length=context, pack=pack)
    eot = tokenizer.eot_id
    trained = [t for t in rows.targets.flatten().tolist() if t != IGNORE]
    # The assistant's words, the newline that ends its turn, and end-of-text (so a model learns to stop).
    assert trained == [*b" 4\n", eot, *b" Hello\n", eot]
    assert rows.trained_tokens == len(trained) and rows.inputs.shape == rows.targets.shape
    stream = [t for turns in EXAMPLES for t in [*tokenize_chat(turns, tokenizer, template)[0], eot]]
    if pack:  # the stream of inputs, cut into rows, padding only at the very end
        assert rows.inputs.shape == (-(-(len(stream) - 2) // 16), 16)
    else:
        assert rows.inputs.shape == (2, 32) and rows.truncated == 0
        ids = [*tokenize_chat(EXAMPLES[0], tokenizer, template)[0], eot]  # each target is the next token, where trained
        assert rows.inputs[0, :len(ids) - 1].tolist() == ids[:-1]
        assert all(rows.targets[0, i] == ids[i + 1] for i in range(len(ids) - 1) if rows.targets[0, i] != IGNORE)


def test_examples_longer_than_the_context_are_cut_and_counted():
    full = sft_rows(EXAMPLES, ByteTokenizer(), CHAT_TEMPLATES.build("plain"), context_length=32, pack=False)
    cut = sft_rows(EXAMPLES, ByteTokenizer(), CHAT_TEMPLATES.build("plain"), context_length=24, pack=False)
    assert cut.truncated == 1 and cut.trained_tokens == full.trained_tokens - 2  # " Hello\n<eot>" loses "\n<eot>"


def test_a_context_too_short_for_any_answer_is_one_error():
    with pytest.raises(ConfigError, match="no assistant token survives"):
        sft_rows(EXAMPLES, ByteTokenizer(), CHAT_TEMPLATES.build("plain"), context_length=4, pack=False)


def test_packed_rows_restart_positions_at_each_example_and_row():
    tokenizer, template = ByteTokenizer(), CHAT_TEMPLATES.build("plain")
    rows = sft_rows(EXAMPLES, tokenizer, template, context_length=16, pack=True)
    # Inputs: 24 of the first example (its 25 ids with end-of-text, less the last), 26 of the second,
    # then 14 of padding; a row boundary restarts the count too, since rows are trained apart.
    r = torch.arange
    expected = torch.stack([r(16), torch.cat([r(8), r(8)]), r(16), torch.cat([r(2), r(14)])])
    assert torch.equal(rows.positions, expected)
    assert sft_rows(EXAMPLES, tokenizer, template, context_length=32, pack=False).positions is None

"""Tokenizers saved as plain data (in checkpoints) rebuild exactly; the byte tokenizer as a BPE."""

import pytest

from lmlab.errors import ConfigError
from lmlab.tokenizers import BPETokenizer, ByteTokenizer, pack_tokenizer, unpack_tokenizer


def test_saved_tokenizers_rebuild_with_the_same_ids(sample):
    byte = ByteTokenizer(ByteTokenizer.Config(special_tokens=["<|endoftext|>", "<|pad|>"]))
    bpe = BPETokenizer({**{i: bytes([i]) for i in range(256)}, 256: b"th", 257: b"the"},
                       [(b"t", b"h"), (b"th", b"e")], ["<|endoftext|>"])
    text = sample(0, 300) + "<|endoftext|>the<|pad|>"
    for tokenizer in (byte, bpe):
        packed = pack_tokenizer(tokenizer)
        rebuilt = unpack_tokenizer(packed, "ckpt")
        assert type(rebuilt) is type(tokenizer) and rebuilt.encode(text) == tokenizer.encode(text)
        assert rebuilt.fingerprint() == packed["fingerprint"] == tokenizer.fingerprint()
    assert byte.to_bpe().encode(text) == byte.encode(text)
    with pytest.raises(ConfigError, match="a MyTokenizer tokenizer, a class lmlab does not know"):
        unpack_tokenizer({**packed, "class": "MyTokenizer"}, "ckpt")
    with pytest.raises(ConfigError, match="ckpt: its BPETokenizer tokenizer rebuilds with fingerprint"):
        unpack_tokenizer({**packed, "fingerprint": "0" * 16}, "ckpt")


def test_the_vocabulary_of_a_saved_tokenizer_is_known_from_its_folder(tmp_path):
    from lmlab.tokenizers.base import expected_vocab_size

    bpe = BPETokenizer({**{i: bytes([i]) for i in range(256)}, 256: b"th"}, [(b"t", b"h")], ["<|endoftext|>"])
    bpe.save(tmp_path)
    # the config asks for 1024, but the trained tokenizer in `path` has 258 ids (with its end-of-text)
    config = {"vocab_size": 1024, "path": str(tmp_path), "special_tokens": ["<|endoftext|>"]}
    assert expected_vocab_size(config) == bpe.vocab_size == 258
    assert expected_vocab_size({**config, "special_tokens": ["<|endoftext|>", "<|pad|>"]}) == 259
    assert expected_vocab_size({"vocab_size": 1024, "path": None}) == 1024

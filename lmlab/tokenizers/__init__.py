"""Tokenizers: the registry, its interface and the built-in entries (byte, bpe)."""

from lmlab.tokenizers.base import EOT, TOKENIZERS, Tokenizer, pack_tokenizer, unpack_tokenizer
from lmlab.tokenizers.bpe import BPETokenizer
from lmlab.tokenizers.bpe_entry import BPEConfig, train_on_source
from lmlab.tokenizers.bpe_train import train_bpe
from lmlab.tokenizers.byte import ByteTokenizer

__all__ = ["EOT", "TOKENIZERS", "BPEConfig", "BPETokenizer", "ByteTokenizer", "Tokenizer", "pack_tokenizer",
           "train_bpe", "train_on_source", "unpack_tokenizer"]

"""Tokenizers: the registry, its interface and the built-in entries."""

from lmlab.tokenizers.base import EOT, TOKENIZERS, Tokenizer
from lmlab.tokenizers.byte import ByteTokenizer

__all__ = ["EOT", "TOKENIZERS", "Tokenizer", "ByteTokenizer"]

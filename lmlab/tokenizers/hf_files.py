"""A tokenizer as files Hugging Face `transformers` loads with `AutoTokenizer.from_pretrained(DIR)`.

lmlab's BPE is GPT-2's byte-level BPE, and the byte tokenizer is one with no merges, so the
folder is GPT-2's: `vocab.json` and `merges.txt`, plus a `tokenizer_config.json` naming
`GPT2Tokenizer`, without a prefix space or BOS token (lmlab adds neither), and marking lmlab's
special tokens as special, with their ids (so they are matched whole and skipped by
`decode(..., skip_special_tokens=True)`). The end-of-text token, if there is one, is the EOS token.
"""

from __future__ import annotations

import json
from pathlib import Path

from lmlab.atomic import atomic_write_text
from lmlab.tokenizers.base import EOT, Tokenizer


def save_hf_tokenizer(tokenizer: Tokenizer, directory: str | Path, model_max_length: int) -> Path:
    """Write the tokenizer's Hugging Face files into `directory`; returns it."""
    bpe = tokenizer.to_bpe()  # first: a tokenizer with no BPE form fails before anything is written
    directory = Path(directory)
    bpe.save(directory)
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "add_prefix_space": False,
        "add_bos_token": False,
        "bos_token": None,
        "eos_token": EOT if EOT in bpe.special_tokens else None,
        "unk_token": None,  # byte-level: every text has ids, nothing is unknown
        "pad_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,  # decode gives the text back exactly, as lmlab's does
        "added_tokens_decoder": {
            str(bpe.special_id(token)): {"content": token, "special": True, "normalized": False, "lstrip": False,
                                         "rstrip": False, "single_word": False}
            for token in bpe.special_tokens},
    }
    atomic_write_text(directory / "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return directory

"""Prompt + response sequences as training tensors: input ids, next-token labels and the mask of the
labels that are response tokens (the only ones SFT and RL losses read)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmlab.tokenizers import Tokenizer


def encode(tokenizer, text: str, special_tokens: bool) -> list[int]:
    """Token ids of `text` from an lmlab tokenizer or a Hugging Face one. With `special_tokens`, a Hugging
    Face tokenizer adds what its model expects at the start of a sequence (Llama's BOS); a response,
    which continues a prompt, gets none."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.encode(text)
    return list(tokenizer.encode(text, add_special_tokens=special_tokens))


def pad_id(tokenizer) -> int:
    """The id padding positions hold (never read through the response mask): the tokenizer's pad token,
    else its end-of-text token, else 0."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.eot_id or 0
    for name in ("pad_token_id", "eos_token_id"):
        if getattr(tokenizer, name, None) is not None:
            return getattr(tokenizer, name)
    return 0


def tokenize_prompt_and_output(prompt_strs: Sequence[str], output_strs: Sequence[str],
                               tokenizer) -> dict[str, torch.Tensor]:
    """Each prompt followed by its output, right-padded to the longest: `input_ids` and `labels` (the
    same sequences shifted by one, both (batch, longest - 1)) and `response_mask`, True where the label
    is an output token."""
    if len(prompt_strs) != len(output_strs):
        raise ValueError(f"{len(prompt_strs)} prompts but {len(output_strs)} outputs")
    prompts = [encode(tokenizer, p, special_tokens=True) for p in prompt_strs]
    outputs = [encode(tokenizer, o, special_tokens=False) for o in output_strs]
    longest = max(len(p) + len(o) for p, o in zip(prompts, outputs))
    full = torch.full((len(prompts), longest), pad_id(tokenizer), dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.bool)
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        full[i, :len(p) + len(o)] = torch.tensor(p + o, dtype=torch.long)
        mask[i, len(p):len(p) + len(o)] = True
    return {"input_ids": full[:, :-1], "labels": full[:, 1:], "response_mask": mask[:, 1:]}

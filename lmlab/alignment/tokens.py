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


def eos_id(tokenizer) -> int | None:
    """The end-of-text id of an lmlab tokenizer or a Hugging Face one (None when it has none)."""
    return tokenizer.eot_id if isinstance(tokenizer, Tokenizer) else getattr(tokenizer, "eos_token_id", None)


def pad_id(tokenizer) -> int:
    """The id padding positions hold (never read through the response mask): the tokenizer's pad token,
    else its end-of-text token, else 0."""
    pad = None if isinstance(tokenizer, Tokenizer) else getattr(tokenizer, "pad_token_id", None)
    for candidate in (pad, eos_id(tokenizer)):
        if candidate is not None:
            return candidate
    return 0


def sequences_to_tensors(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                         pad: int = 0) -> dict[str, torch.Tensor]:
    """Token ids of each prompt followed by its response, right-padded with `pad` to the longest:
    `input_ids` and `labels` (the same sequences shifted by one, both (batch, longest - 1)) and
    `response_mask`, True where the label is a response token."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    longest = max(len(p) + len(r) for p, r in zip(prompts, responses))
    if longest < 2:
        raise ValueError("every prompt + response is shorter than 2 tokens: there is no next token to predict")
    full = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        full[i, :len(p) + len(r)] = torch.tensor([*p, *r], dtype=torch.long)
        mask[i, len(p):len(p) + len(r)] = True
    return {"input_ids": full[:, :-1], "labels": full[:, 1:], "response_mask": mask[:, 1:]}


def tokenize_prompt_and_output(prompt_strs: Sequence[str], output_strs: Sequence[str],
                               tokenizer) -> dict[str, torch.Tensor]:
    """Each prompt followed by its output, tokenized by `tokenizer` (lmlab's or Hugging Face's), as
    `sequences_to_tensors` lays them out."""
    if len(prompt_strs) != len(output_strs):
        raise ValueError(f"{len(prompt_strs)} prompts but {len(output_strs)} outputs")
    prompts = [encode(tokenizer, p, special_tokens=True) for p in prompt_strs]
    outputs = [encode(tokenizer, o, special_tokens=False) for o in output_strs]
    return sequences_to_tensors(prompts, outputs, pad_id(tokenizer))


def full_sequences(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole sequences `sequences_to_tensors` split into inputs and labels (batch, longest), and each
    one's length up to its last response token (batch,): what a reward model scores at its last token."""
    mask = tensors["response_mask"]
    if not mask.any(-1).all():
        raise ValueError("a sequence has no response token, so it has no last response token to score")
    last_label = mask.shape[1] - 1 - mask.flip(1).int().argmax(1)
    return torch.cat([tensors["input_ids"][:, :1], tensors["labels"]], dim=1), last_label + 2

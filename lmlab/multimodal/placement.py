"""Image features in a token sequence, LLaVA-style: each image marker token of a prompt expands to the N
positions of that image's patches, whose embeddings are the projected patch features.

    ids = expand_markers(prompt, marker_id, n_patches)       # the marker id, repeated N times, per image
    batch = layout(prompts, answers, marker_id, n_patches)    # padded inputs, targets (IGNORE on prompt/image)
    embeds = place_image_features(lm.embed_tokens(batch.input_ids), batch.input_ids, marker_id, features)

The expanded ids keep the marker id at every image position, so the positions are found again from the ids
alone (by the engine's prefill, after its own left padding). Images go in the order of their markers, prompt
by prompt: `features` (M, N, d_model) holds the M images of the whole batch in that order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100  # targets the loss skips (loss=cross_entropy's ignore_index)


class MarkerError(ValueError):
    """The image markers of the prompts do not match the images given."""


def check_markers(prompts: Sequence[Sequence[int]], marker_id: int, n_images: int) -> None:
    """Every prompt holds at least one image marker, and the batch exactly one per image; else one clear error."""
    counts = [sum(1 for t in p if t == marker_id) for p in prompts]
    missing = [i for i, c in enumerate(counts) if c == 0]
    if missing:
        raise MarkerError(f"prompt(s) {missing} hold no image marker (id {marker_id}); put one marker where each "
                          "image goes, e.g. at the start of the prompt")
    if sum(counts) != n_images:
        raise MarkerError(f"the prompts hold {sum(counts)} image marker(s) (per prompt: {counts}) but {n_images} "
                          "image(s) were given; give one image per marker, in the markers' order")


def expand_markers(prompt: Sequence[int], marker_id: int, n_patches: int) -> list[int]:
    """The prompt with each marker repeated `n_patches` times: one position per patch."""
    out: list[int] = []
    for t in prompt:
        out.extend([t] * n_patches if t == marker_id else [t])
    return out


@dataclass
class ImageTextBatch:
    """Prompt (+ answer) rows with their image markers expanded, padded to one length."""

    input_ids: torch.Tensor  # (B, S) long: the marker id at each image position, `pad_id` on padding
    targets: torch.Tensor  # (B, S) long: the next token where it is an answer token, IGNORE_INDEX elsewhere
    start: torch.Tensor  # (B,) long: each row's first real position (> 0 only with left padding)
    lengths: torch.Tensor  # (B,) long: each row's real positions


def layout(prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]] | None, marker_id: int,
           n_patches: int, n_images: int | None = None, pad_id: int = 0, left_pad: bool = False) -> ImageTextBatch:
    """Each prompt, its markers expanded, followed by its answer, as next-token inputs and targets: row b is
    prompt_b + answer_b less its last token, and its targets that sequence shifted by one with IGNORE_INDEX
    wherever the predicted token is not an answer token (prompt, image, padding). Without answers the rows
    are the prompts themselves and no target is kept (a prefill). Padding goes on the right (training: a
    causal model's real positions never see it), or with `left_pad` on the left, as the engine prefills.
    n_images: images given (default: one per prompt)."""
    if answers is not None and (len(answers) != len(prompts) or not all(answers)):
        raise ValueError(f"{len(prompts)} prompts need as many non-empty answers, got {[len(a) for a in answers]} tokens")
    check_markers(prompts, marker_id, len(prompts) if n_images is None else n_images)
    shift = 0 if answers is None else 1  # inputs lose their last token only when something is predicted
    answers = [[] for _ in prompts] if answers is None else answers
    rows = [(expand_markers(p, marker_id, n_patches), list(a)) for p, a in zip(prompts, answers)]
    width = max(len(p) + len(a) for p, a in rows) - shift
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    start, lengths = [], []
    for b, (prompt, answer) in enumerate(rows):
        full = prompt + answer
        n = len(full) - shift
        first = width - n if left_pad else 0
        input_ids[b, first:first + n] = torch.tensor(full[:n], dtype=torch.long)
        if answer:  # input position i predicts full[i + 1]; the answer's tokens are full[len(prompt):]
            targets[b, first + len(prompt) - 1:first + n] = torch.tensor(answer, dtype=torch.long)
        start.append(first)
        lengths.append(n)
    return ImageTextBatch(input_ids, targets, torch.tensor(start), torch.tensor(lengths))


def place_image_features(token_embeds: torch.Tensor, input_ids: torch.Tensor, marker_id: int,
                         features: torch.Tensor) -> torch.Tensor:
    """`token_embeds` (B, S, D) with the positions holding `marker_id` replaced by `features` (M, N, D), the
    M images' projected patches in marker order (row by row, left to right); gradients reach both."""
    mask = input_ids == marker_id
    if features.dim() != 3 or features.shape[-1] != token_embeds.shape[-1]:
        raise ValueError(f"features {tuple(features.shape)} must be (images, patches, {token_embeds.shape[-1]})")
    found, given = int(mask.sum()), features.shape[0] * features.shape[1]
    if found != given:
        raise MarkerError(f"{found} image position(s) in the ids but {features.shape[0]} image(s) of "
                          f"{features.shape[1]} patches = {given} feature rows; expand each marker to one "
                          "position per patch (expand_markers) and give one image per marker")
    out = token_embeds.clone()
    out[mask] = features.reshape(given, -1).to(out.dtype)
    return out

"""The `reward_model` entry of the `reward` registry: a trained Bradley-Terry reward model's score.

Unlike the verifiers it reads the prompt too, and scores a whole batch in one forward, so it offers
`score_batch(prompts, responses)`, which `rollout` calls instead of `reward(response, ground_truth)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from omegaconf import MISSING

from lmlab.alignment.preference import ended_sequences
from lmlab.alignment.reward_model import ScalarHead, last_token_scores
from lmlab.alignment.tokens import encode, full_sequences
from lmlab.alignment.verifiers import REWARDS, Reward
from lmlab.errors import ConfigError

HEAD_PREFIX = "reward.score."  # where task=reward_model's checkpoint keeps the score head


@REWARDS.register("reward_model")
class RewardModelScore(Reward):
    """The score of a reward model trained by `lmlab-train task=reward_model` on prompt + response."""

    @dataclass
    class Config:
        path: str = MISSING  # the reward model's checkpoint
        batch_size: int = 64  # sequences per forward

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        from lmlab.training.checkpoints import load, read_checkpoint  # the trainer's package: loaded when used

        state = read_checkpoint(cfg.path, "reward.path")["state_dict"]
        head = {k.removeprefix(HEAD_PREFIX): v for k, v in state.items() if k.startswith(HEAD_PREFIX)}
        if not head:
            raise ConfigError(f"reward.path={cfg.path} has no reward head: train one with lmlab-train task=reward_model")
        backbone, self.tokenizer, _ = load(cfg.path)
        self.model = ScalarHead(backbone).eval()
        self.model.score.load_state_dict(head)

    def __call__(self, response: str, ground_truth: str) -> dict[str, float]:
        raise ConfigError("reward=reward_model scores a prompt with its response: call score_batch (rollout does)")

    @torch.no_grad()
    def score_batch(self, prompts: Sequence[str], responses: Sequence[str],
                    device: torch.device | str = "cpu") -> list[dict[str, float]]:
        """{"reward": score} of each prompt + response (+ end-of-text, as the model was trained)."""
        self.model.to(device)
        scores = []
        for start in range(0, len(prompts), self.cfg.batch_size):
            rows = slice(start, start + self.cfg.batch_size)
            tensors = ended_sequences([encode(self.tokenizer, p, special_tokens=True) for p in prompts[rows]],
                                      responses[rows], self.tokenizer)
            ids, lengths = full_sequences(tensors)
            scores += last_token_scores(self.model(ids.to(device)), lengths.to(device)).tolist()
        return [{"reward": s} for s in scores]

"""Scalar heads on a Transformer: a reward model (Bradley-Terry, trained on preference pairs) reads the
score at each sequence's last token; a PPO critic reads one value per token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.nn.transformer import Transformer


class ScalarHead(nn.Module):
    """The backbone's final hidden states through one Linear to a score per position. The head starts at
    zero, so a fresh reward model scores every sequence 0 and a fresh critic predicts 0."""

    def __init__(self, backbone: Transformer):
        super().__init__()
        self.backbone = backbone
        self.score = nn.Linear(backbone.embed_tokens.embedding_dim, 1)
        nn.init.zeros_(self.score.weight)
        nn.init.zeros_(self.score.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Scores (batch, seq), in float32."""
        return self.score(self.backbone.hidden_states(input_ids)).squeeze(-1).float()


def last_token_scores(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each row's score at its last real token: (batch, seq) and lengths (batch,) -> (batch,)."""
    if (lengths < 1).any() or (lengths > scores.shape[1]).any():
        raise ValueError(f"sequence lengths must be in 1..{scores.shape[1]}, got {lengths.tolist()}")
    return scores.gather(1, (lengths - 1).long()[:, None]).squeeze(1)


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """-log sigmoid(r_chosen - r_rejected) per pair: the likelihood that the chosen response wins."""
    return -F.logsigmoid(chosen - rejected)

"""VQ-VAE codebooks (config group `codebook`): vector quantisation of encoder outputs with a
straight-through gradient (van den Oord et al. 2017, "Neural Discrete Representation Learning").

Each encoder vector z is replaced by its nearest code e_k (squared Euclidean distance). The forward
value is e_k; the backward pass copies the decoder's gradient to z unchanged (`z + (e - z).detach()`),
so the encoder trains through the non-differentiable argmin. The entries differ in how the codes learn:

    straight_through   gradient descent on the codebook loss ||sg[z] - e||^2, plus beta * ||z - sg[e]||^2
                       (the commitment loss, which keeps the encoder near its codes)
    ema                codes are exponential moving averages of the vectors assigned to them (no gradient),
                       with Laplace smoothing of the counts and optional restarts of unused codes; only the
                       commitment loss trains the encoder

`CodeUsage` counts how often each code is picked: the perplexity of that distribution (K when all codes are
equally used, 1 when one code takes everything) and the fraction of codes used at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.checks import at_least
from lmlab.errors import ConfigError
from lmlab.registry import Registry

CODEBOOKS = Registry("codebook", group="codebook",
                     doc="VQ-VAE codebooks: nearest-code quantisation, straight-through gradient")


@dataclass
class CodebookConfig:
    size: int = 512  # number of codes K: the image vocabulary an early-fusion LM adds to its text tokens
    dim: int = 64  # width of each code vector (the encoder's output channels)
    beta: float = 0.25  # weight of the commitment loss ||z - sg[e]||^2

    def __post_init__(self) -> None:
        if not self.size >= 1:
            raise ConfigError(f"codebook.size={self.size}: a codebook needs at least one code; use a positive size "
                              "such as codebook.size=512")
        at_least("codebook", self, 1, "dim")
        at_least("codebook", self, 0, "beta")


@dataclass
class Quantized:
    z_q: torch.Tensor  # (B, D, H, W): the codes' vectors forward, the identity to z backward
    codes: torch.Tensor  # (B, H, W) long: the index of each position's code
    loss: torch.Tensor  # the codebook's weighted training terms (added to the reconstruction loss)
    terms: dict[str, torch.Tensor] = field(default_factory=dict)  # unweighted: commitment (and codebook)


class Codebook(nn.Module):
    """Base of the entries: nearest-code search, lookup and the straight-through estimator."""

    def __init__(self, cfg: CodebookConfig):
        super().__init__()
        self.cfg = cfg
        self.size, self.dim = cfg.size, cfg.dim

    @property
    def vectors(self) -> torch.Tensor:
        """The codes (K, D)."""
        raise NotImplementedError

    def nearest(self, flat: torch.Tensor) -> torch.Tensor:
        """Index of the nearest code of each row of `flat` (N, D), in float32 (a bf16 argmin picks wrong codes)."""
        with torch.autocast(flat.device.type, enabled=False):
            z, e = flat.float(), self.vectors.float()
            distances = z.pow(2).sum(1, keepdim=True) - 2 * z @ e.t() + e.pow(2).sum(1)[None, :]
            return distances.argmin(1)

    def lookup(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes (B, H, W) -> their vectors (B, D, H, W)."""
        return F.embedding(codes, self.vectors).permute(0, 3, 1, 2)

    def forward(self, z: torch.Tensor) -> Quantized:
        """Quantise encoder outputs z (B, D, H, W)."""
        if z.shape[1] != self.dim:
            raise ValueError(f"the codebook holds {self.dim}-wide codes but got {z.shape[1]} channels")
        b, d, h, w = z.shape
        flat = z.permute(0, 2, 3, 1).reshape(-1, d)
        codes = self.nearest(flat)
        quantized = self.lookup(codes.view(b, h, w)).to(z.dtype)
        loss, terms = self.losses(z, quantized)
        if self.training:
            self.update(flat.detach(), codes)
        z_q = z + (quantized - z).detach()  # straight-through: forward = codes, backward = identity
        return Quantized(z_q, codes.view(b, h, w), loss, terms)

    def losses(self, z: torch.Tensor, quantized: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError

    def update(self, flat: torch.Tensor, codes: torch.Tensor) -> None:
        """Learning the codes outside the gradient (the EMA entry); nothing for gradient-trained codes."""


@CODEBOOKS.register("straight_through")
class StraightThroughCodebook(Codebook):
    """Codes learned by gradient descent: codebook loss ||sg[z] - e||^2 + beta * commitment ||z - sg[e]||^2."""

    @dataclass
    class Config(CodebookConfig):
        pass

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.embedding = nn.Parameter(torch.empty(cfg.size, cfg.dim).uniform_(-1 / cfg.size, 1 / cfg.size))

    @property
    def vectors(self) -> torch.Tensor:
        return self.embedding

    def losses(self, z: torch.Tensor, quantized: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        codebook = F.mse_loss(quantized, z.detach())  # moves the codes toward the encoder outputs
        commitment = F.mse_loss(z, quantized.detach())  # keeps the encoder near its codes
        return codebook + self.cfg.beta * commitment, {"codebook": codebook, "commitment": commitment}


@CODEBOOKS.register("ema")
class EMACodebook(Codebook):
    """Codes as exponential moving averages of their assigned vectors (Laplace-smoothed counts), dead-code restarts."""

    @dataclass
    class Config(CodebookConfig):
        decay: float = 0.99  # of the running counts and sums
        epsilon: float = 1e-5  # Laplace smoothing of the counts, so a code with no assignments never divides by 0
        # The first step restarts every code it leaves unused: a start from the data.
        restart_threshold: float = 1.0  # codes used less per step (running count) restart at batch vectors; 0: off

        def __post_init__(self) -> None:
            super().__post_init__()
            if not 0 < self.decay < 1:
                raise ConfigError(f"codebook.decay must be in (0, 1), got {self.decay}")
            if not self.epsilon > 0:
                raise ConfigError(f"codebook.epsilon must be > 0, got {self.epsilon}")
            at_least("codebook", self, 0, "restart_threshold")

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        embedding = torch.randn(cfg.size, cfg.dim)
        self.register_buffer("embedding", embedding)
        # Each code starts as if it had been assigned once, at its own value: with zero counts, the smoothed
        # count of an unused code would be ~epsilon and its first update would blow its vector up.
        self.register_buffer("cluster_size", torch.ones(cfg.size))
        self.register_buffer("embed_sum", embedding.clone())
        self.restarts = 0  # codes restarted so far (logged)

    @property
    def vectors(self) -> torch.Tensor:
        return self.embedding

    def losses(self, z: torch.Tensor, quantized: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        commitment = F.mse_loss(z, quantized.detach())
        return self.cfg.beta * commitment, {"commitment": commitment}

    @torch.no_grad()
    def update(self, flat: torch.Tensor, codes: torch.Tensor) -> None:
        """N_k <- decay N_k + (1 - decay) n_k;  m_k <- decay m_k + (1 - decay) sum of the vectors assigned to k;
        e_k <- m_k / N'_k with the Laplace-smoothed N'_k = (N_k + eps) / (N + K eps) * N, N = sum_k N_k."""
        cfg = self.cfg
        flat = flat.float()
        onehot = F.one_hot(codes, self.size).to(flat.dtype)
        self.cluster_size.mul_(cfg.decay).add_(onehot.sum(0), alpha=1 - cfg.decay)
        self.embed_sum.mul_(cfg.decay).add_(onehot.t() @ flat, alpha=1 - cfg.decay)
        total = self.cluster_size.sum()
        smoothed = (self.cluster_size + cfg.epsilon) / (total + self.size * cfg.epsilon) * total
        self.embedding.copy_(self.embed_sum / smoothed[:, None])
        if cfg.restart_threshold > 0:
            self.restart_dead(flat)

    def restart_dead(self, flat: torch.Tensor) -> None:
        """Codes used less than `restart_threshold` times per step (running count) become random vectors of the
        batch, counted as assigned once, so that they sit where the encoder's outputs are (Jukebox)."""
        dead = (self.cluster_size < self.cfg.restart_threshold).nonzero().flatten()
        if len(dead) == 0:
            return
        picks = flat[torch.randint(len(flat), (len(dead),), device=flat.device)]
        self.embedding[dead] = picks
        self.embed_sum[dead] = picks
        self.cluster_size[dead] = 1.0
        self.restarts += len(dead)


class CodeUsage:
    """Counts of the codes picked (over any number of batches) and what they say about the codebook."""

    def __init__(self, size: int, device: torch.device | str = "cpu"):
        self.counts = torch.zeros(size, dtype=torch.float64, device=device)

    def update(self, codes: torch.Tensor) -> None:
        self.counts += torch.bincount(codes.flatten(), minlength=len(self.counts)).to(self.counts)

    def perplexity(self) -> float:
        """exp(entropy) of the code frequencies: the number of equally used codes with the same entropy."""
        return usage_perplexity(self.counts)

    def fraction_used(self) -> float:
        """Share of the codebook picked at least once."""
        return float((self.counts > 0).double().mean())


def usage_perplexity(counts: torch.Tensor) -> float:
    """exp(-sum p log p) of the distribution `counts` (K,) describes (0 log 0 = 0); nan with no counts."""
    total = counts.sum()
    if total <= 0:
        return math.nan
    p = counts[counts > 0].double() / total
    return float(torch.exp(-(p * p.log()).sum()))

"""Vision encoders (config group `vision_encoder`): images (B, 3, H, W) in [0, 1] -> patch features.

An encoder has `.width` (feature size), `.n_patches`, `forward(images) -> (B, n_patches, width)` and
`encode(images) -> (patches, pooled (B, width))`. The ViT is lmlab's own Transformer blocks (the
`model/block`, `model/norm`, `model/ffn` entries) run bidirectionally (`mha` with causal=false) over
patch embeddings with 2-D positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lmlab.checks import at_least
from lmlab.errors import ConfigError
from lmlab.nn.blocks import BLOCKS
from lmlab.nn.init import INITS
from lmlab.nn.norms import NORMS
from lmlab.nn.positions import POSITIONS
from lmlab.nn.transformer import ModelConfig
from lmlab.registry import Registry

VISION_ENCODERS = Registry("vision_encoder", group="vision_encoder", doc="image encoders: images -> patch features")


def sincos_2d(grid: int, width: int) -> torch.Tensor:
    """Fixed 2-D sine-cosine positions (grid * grid, width): half the channels encode the row, half the column."""
    if width % 4:
        raise ConfigError(f"vision_encoder.position=sincos needs a width divisible by 4, got {width}")
    quarter = width // 4
    freq = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    rows, cols = torch.meshgrid(torch.arange(grid, dtype=torch.float64), torch.arange(grid, dtype=torch.float64),
                                indexing="ij")
    angles = [torch.outer(axis.flatten(), freq) for axis in (rows, cols)]
    return torch.cat([f(a) for a in angles for f in (torch.sin, torch.cos)], dim=1).float()


class SinCos2D(nn.Module):
    """Fixed 2-D sin-cos positions (MAE, SigLIP)."""

    def __init__(self, grid: int, width: int):
        super().__init__()
        self.register_buffer("table", sincos_2d(grid, width), persistent=False)

    def forward(self) -> torch.Tensor:
        return self.table


class Learned2D(nn.Module):
    """Learned positions factorised by axis: row embedding + column embedding (2 * grid vectors)."""

    def __init__(self, grid: int, width: int):
        super().__init__()
        self.grid = grid
        self.rows = nn.Parameter(torch.randn(grid, width) * 0.02)
        self.cols = nn.Parameter(torch.randn(grid, width) * 0.02)

    def forward(self) -> torch.Tensor:
        return (self.rows[:, None] + self.cols[None, :]).flatten(0, 1)


POSITIONS_2D = {"sincos": SinCos2D, "learned": Learned2D}


@VISION_ENCODERS.register("vit")
class ViT(nn.Module):
    """Vision Transformer: patch embedding, 2-D positions, lmlab's blocks with bidirectional attention."""

    @dataclass
    class Config:
        image_size: int = 32  # images must be image_size x image_size (data sources resize to it)
        patch_size: int = 4  # patches of patch_size x patch_size pixels: (image_size / patch_size)^2 tokens
        width: int = 128
        n_layers: int = 4
        n_heads: int = 4
        position: str = "sincos"  # 2-D positions: sincos (fixed) or learned (row + column embeddings)
        cls_token: bool = False  # prepend a learned [CLS] token
        pool: str = "mean"  # the pooled feature: mean of the patch features, or cls (needs cls_token)
        block: Any = "prenorm"  # an entry of model/block
        norm: Any = "layernorm"  # an entry of model/norm
        ffn: Any = "gelu"  # an entry of model/ffn

        def __post_init__(self) -> None:
            at_least("vision_encoder", self, 1, "image_size", "patch_size", "width", "n_layers", "n_heads")
            if self.image_size % self.patch_size:
                raise ConfigError(f"vision_encoder.image_size={self.image_size} is not divisible by "
                                  f"vision_encoder.patch_size={self.patch_size}")
            if self.width % self.n_heads:
                raise ConfigError(f"vision_encoder.width={self.width} is not divisible by n_heads={self.n_heads}")
            if self.position not in POSITIONS_2D:
                raise ConfigError(f"vision_encoder.position={self.position!r}; choose one of {sorted(POSITIONS_2D)}")
            if self.position == "sincos" and self.width % 4:
                raise ConfigError(f"vision_encoder.position=sincos needs a width divisible by 4, got {self.width}")
            if self.pool not in ("mean", "cls"):
                raise ConfigError(f"vision_encoder.pool={self.pool!r}; choose mean or cls")
            if self.pool == "cls" and not self.cls_token:
                raise ConfigError("vision_encoder.pool=cls needs vision_encoder.cls_token=true")

    def __init__(self, cfg: Config):
        super().__init__()
        self.image_size, self.patch_size, self.width = cfg.image_size, cfg.patch_size, cfg.width
        grid = cfg.image_size // cfg.patch_size
        self.n_patches = grid * grid
        self.pool = cfg.pool
        self.patch_embed = nn.Conv2d(3, cfg.width, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.position_2d = POSITIONS_2D[cfg.position](grid, cfg.width)
        self.cls = nn.Parameter(torch.randn(1, 1, cfg.width) * 0.02) if cfg.cls_token else None
        n_tokens = self.n_patches + int(cfg.cls_token)
        # The blocks read their sizes and parts from a ModelConfig, as in the language model.
        blocks_cfg = ModelConfig(d_model=cfg.width, n_layers=cfg.n_layers, max_seq_len=n_tokens, norm=cfg.norm,
                                 ffn=cfg.ffn, position="nope", block=cfg.block,
                                 attention={"name": "mha", "n_heads": cfg.n_heads, "causal": False})
        self.layers = nn.ModuleList(BLOCKS.build(cfg.block, blocks_cfg, layer_idx=i) for i in range(cfg.n_layers))
        self.no_position = POSITIONS.build("nope", n_tokens, cfg.width, cfg.width // cfg.n_heads, cfg.n_heads)
        self.norm = NORMS.build(cfg.norm, cfg.width) if self.layers[0].final_norm else nn.Identity()
        self.effective_depth = cfg.n_layers  # gpt2 init scales the residual outputs by depth
        INITS.build("gpt2").apply(self)

    def encode(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(patch features (B, n_patches, width), pooled feature (B, width))."""
        expected = (3, self.image_size, self.image_size)
        if images.dim() != 4 or tuple(images.shape[1:]) != expected:
            raise ValueError(f"images {tuple(images.shape)} must be (batch, {', '.join(map(str, expected))}): RGB of "
                             f"vision_encoder.image_size={self.image_size}")
        x = self.patch_embed(images * 2.0 - 1.0).flatten(2).transpose(1, 2)  # [0, 1] -> [-1, 1]; (B, N, width)
        x = x + self.position_2d().to(x.dtype)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(len(x), -1, -1).to(x.dtype), x], dim=1)
        positions = torch.arange(x.shape[1], device=x.device)
        for layer in self.layers:
            x = layer(x, self.no_position, positions)
        x = self.norm(x)
        patches = x[:, 1:] if self.cls is not None else x
        return patches, x[:, 0] if self.pool == "cls" else patches.mean(1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.encode(images)[0]

    def extra_repr(self) -> str:
        return f"image_size={self.image_size}, patch_size={self.patch_size}, n_patches={self.n_patches}"


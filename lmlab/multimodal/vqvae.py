"""The VQ-VAE image tokenizer: a conv encoder that downsamples images by `downsample` to a grid of vectors,
a codebook (`codebook` group) that replaces each by its nearest code, and a conv decoder back to pixels.

    vq = VQVAE(VQVAEConfig(image_size=32, downsample=4), CODEBOOKS.build("ema"))
    out = vq(images)                      # images (B, 3, 32, 32) in [0, 1]
    loss = out.loss                       # reconstruction MSE + the codebook's terms
    tokens = vq.tokenize(images)          # (B, 64) code ids, row-major over the 8 x 8 grid
    pictures = vq.detokenize(tokens)      # (B, 3, 32, 32), clamped to [0, 1]

`load_vqvae(path)` rebuilds a trained one from a `task=vqvae` checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from lmlab.checks import at_least
from lmlab.errors import ConfigError
from lmlab.multimodal.codebook import CODEBOOKS, Codebook, Quantized

VQVAE_PREFIX = "vqvae."  # the LightningModule attribute (and state-dict prefix) that holds the VQ-VAE
VQVAE_CONFIG_KEY = "lmlab_vqvae"  # where a checkpoint keeps what rebuilds its VQ-VAE (`vqvae_config`)


@dataclass
class VQVAEConfig:
    image_size: int = 32  # images are image_size x image_size RGB
    downsample: int = 4  # a power of 2: each code stands for a downsample x downsample patch (32 -> 8 x 8 codes)
    hidden: int = 64  # channels of the conv layers
    res_blocks: int = 2  # residual blocks at the code resolution, in the encoder and in the decoder

    def __post_init__(self) -> None:
        at_least("task", self, 1, "image_size", "downsample", "hidden")
        at_least("task", self, 0, "res_blocks")
        if self.downsample & (self.downsample - 1):
            raise ConfigError(f"task.downsample={self.downsample} must be a power of 2 (each halving is one "
                              "stride-2 convolution), e.g. 4 or 8")
        if self.image_size % self.downsample:
            raise ConfigError(f"task.downsample={self.downsample} does not divide task.image_size={self.image_size}")


@dataclass
class VQOutput:
    reconstruction: torch.Tensor  # (B, 3, H, W), unclamped
    quantized: Quantized
    loss: torch.Tensor  # reconstruction MSE + the codebook's weighted terms
    terms: dict[str, torch.Tensor] = field(default_factory=dict)  # recon_mse and the codebook's unweighted terms


class ResBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.body = nn.Sequential(nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(channels, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def encoder(cfg: VQVAEConfig, code_dim: int) -> nn.Sequential:
    """log2(downsample) stride-2 4x4 convolutions, residual blocks, then a 1x1 convolution to the code width."""
    halvings = int(math.log2(cfg.downsample))
    layers: list[nn.Module] = [nn.Conv2d(3, cfg.hidden, 3, padding=1)]
    for _ in range(halvings):
        layers += [nn.ReLU(), nn.Conv2d(cfg.hidden, cfg.hidden, 4, stride=2, padding=1)]
    layers += [ResBlock(cfg.hidden) for _ in range(cfg.res_blocks)]
    layers += [nn.ReLU(), nn.Conv2d(cfg.hidden, code_dim, 1)]
    return nn.Sequential(*layers)


def decoder(cfg: VQVAEConfig, code_dim: int) -> nn.Sequential:
    """The encoder's mirror: 1x1 convolution from the code width, residual blocks, stride-2 transposed convolutions."""
    halvings = int(math.log2(cfg.downsample))
    layers: list[nn.Module] = [nn.Conv2d(code_dim, cfg.hidden, 3, padding=1)]
    layers += [ResBlock(cfg.hidden) for _ in range(cfg.res_blocks)]
    for _ in range(halvings):
        layers += [nn.ReLU(), nn.ConvTranspose2d(cfg.hidden, cfg.hidden, 4, stride=2, padding=1)]
    layers += [nn.ReLU(), nn.Conv2d(cfg.hidden, 3, 3, padding=1)]
    return nn.Sequential(*layers)


class VQVAE(nn.Module):
    """Images (B, 3, S, S) in [0, 1] <-> a (S / downsample)^2 grid of code ids; see the module's doc."""

    def __init__(self, cfg: VQVAEConfig, codebook: Codebook):
        super().__init__()
        self.cfg = cfg
        self.codebook = codebook
        self.encoder = encoder(cfg, codebook.dim)
        self.decoder = decoder(cfg, codebook.dim)
        self.grid = cfg.image_size // cfg.downsample

    @property
    def n_codes(self) -> int:
        """Codes per image: the image's tokens in an early-fusion sequence."""
        return self.grid * self.grid

    def check_images(self, images: torch.Tensor) -> None:
        size = self.cfg.image_size
        if images.dim() != 4 or images.shape[1:] != (3, size, size):
            raise ValueError(f"the VQ-VAE takes RGB images (B, 3, {size}, {size}) in [0, 1], got "
                             f"{tuple(images.shape)}; "
                             "convert with PIL's .convert('RGB') and resize, or train with task.image_size to match")

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Encoder outputs (B, D, grid, grid) before quantisation."""
        self.check_images(images)
        return self.encoder(images * 2 - 1)  # centred inputs

    def decode(self, z_q: torch.Tensor) -> torch.Tensor:
        return self.decoder(z_q)

    def forward(self, images: torch.Tensor) -> VQOutput:
        quantized = self.codebook(self.encode(images))
        reconstruction = self.decode(quantized.z_q)
        recon_mse = F.mse_loss(reconstruction.float(), images.float())
        terms = {"recon_mse": recon_mse, **quantized.terms}
        return VQOutput(reconstruction, quantized, recon_mse + quantized.loss, terms)

    @torch.no_grad()
    def tokenize(self, images: torch.Tensor) -> torch.Tensor:
        """Code ids (B, grid * grid), row-major."""
        z = self.encode(images)
        flat = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
        return self.codebook.nearest(flat).view(len(images), -1)

    @torch.no_grad()
    def detokenize(self, codes: torch.Tensor) -> torch.Tensor:
        """Code ids (B, grid * grid) -> images (B, 3, S, S) clamped to [0, 1]."""
        if codes.dim() != 2 or codes.shape[1] != self.n_codes:
            raise ValueError(f"detokenize takes (B, {self.n_codes}) code ids, got {tuple(codes.shape)}")
        if codes.numel() and (codes.min() < 0 or codes.max() >= self.codebook.size):
            raise ValueError(f"code ids must be in [0, {self.codebook.size}), got "
                             f"{int(codes.min())}..{int(codes.max())}")
        z_q = self.codebook.lookup(codes.view(-1, self.grid, self.grid))
        return self.decode(z_q).clamp(0, 1)


def build_vqvae(net: VQVAEConfig, codebook_cfg) -> VQVAE:
    """A VQ-VAE of the `net` sizes with the codebook entry `codebook_cfg` selects."""
    return VQVAE(net, CODEBOOKS.build(codebook_cfg))


def net_config(task_cfg) -> VQVAEConfig:
    """The VQVAEConfig fields of a config that extends VQVAEConfig (task=vqvae's)."""
    values = OmegaConf.to_container(task_cfg, resolve=True) if OmegaConf.is_config(task_cfg) else vars(task_cfg)
    return VQVAEConfig(**{k: values[k] for k in VQVAEConfig.__dataclass_fields__})


def vqvae_config(vqvae: VQVAE) -> dict:
    """What rebuilds `vqvae` (its sizes and codebook entry), as plain data for a checkpoint's VQVAE_CONFIG_KEY."""
    entry, codebook = CODEBOOKS.resolve(vqvae.codebook.cfg)
    return {"net": dataclasses.asdict(vqvae.cfg), "codebook": {"name": entry.name, **dataclasses.asdict(codebook)}}


def load_vqvae(path: str | Path, device: str | torch.device = "cpu") -> VQVAE:
    """The trained VQ-VAE (eval mode) of a task=vqvae checkpoint, or the frozen one a task=early_fusion
    checkpoint holds."""
    from lmlab.training.checkpoints import read_checkpoint

    checkpoint = read_checkpoint(path, "task.vqvae")
    saved = checkpoint.get(VQVAE_CONFIG_KEY)
    if saved is None:
        raise ConfigError(f"{path} holds no VQ-VAE; pass the checkpoints/last.ckpt of an lmlab-train task=vqvae run")
    model = build_vqvae(VQVAEConfig(**saved["net"]), saved["codebook"])
    model.load_state_dict({k.removeprefix(VQVAE_PREFIX): v for k, v in checkpoint["state_dict"].items()
                           if k.startswith(VQVAE_PREFIX)})
    return model.to(device).eval()

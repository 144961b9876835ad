"""The VQ-VAE: shapes at each downsampling, the encoder trained through the quantiser by the decoder's
gradient, a few seeded steps on synthetic images lower the loss, tokenize/detokenize, bad input."""

from __future__ import annotations

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.multimodal.synthetic import SyntheticImageText
from lmlab.multimodal.vqvae import VQVAEConfig, build_vqvae


def _vq(codebook: str = "ema", **net) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_vqvae(VQVAEConfig(**{"hidden": 16, "res_blocks": 1, **net}), {"name": codebook, "size": 32, "dim": 8})


@pytest.mark.parametrize("downsample, grid", [(1, 16), (2, 8), (4, 4), (8, 2)])
def test_shapes(downsample, grid):
    vq = _vq(image_size=16, downsample=downsample).eval()
    images = torch.rand(3, 3, 16, 16)
    out = vq(images)
    assert out.reconstruction.shape == images.shape
    assert out.quantized.codes.shape == (3, grid, grid)
    tokens = vq.tokenize(images)
    assert tokens.shape == (3, grid * grid) and vq.n_codes == grid * grid
    assert torch.equal(tokens, out.quantized.codes.flatten(1))
    pictures = vq.detokenize(tokens)
    assert pictures.shape == images.shape and pictures.min() >= 0 and pictures.max() <= 1
    assert torch.allclose(pictures, out.reconstruction.clamp(0, 1), atol=1e-6)


def test_the_encoder_gets_the_decoders_gradient():
    vq = _vq().eval()
    images = torch.rand(2, 3, 32, 32)
    out = vq(images)
    z_q = out.quantized.z_q
    z_q.retain_grad()
    out.terms["recon_mse"].backward()  # the reconstruction alone: no commitment term reaches the encoder
    last_encoder_conv = vq.encoder[-1]
    assert z_q.grad.abs().sum() > 0
    assert last_encoder_conv.weight.grad is not None and last_encoder_conv.weight.grad.abs().sum() > 0
    # d(recon)/dz equals d(recon)/dz_q: the encoder's output gradient is the decoder's input gradient
    z = vq.encode(images).detach().requires_grad_()
    recon = torch.nn.functional.mse_loss(vq.decode(vq.codebook(z).z_q), images)
    (grad_z,) = torch.autograd.grad(recon, z)
    assert torch.allclose(grad_z, z_q.grad, atol=1e-7)


@pytest.mark.parametrize("codebook", [{"name": "straight_through"}, {"name": "ema", "restart_threshold": 1.0}])
def test_a_few_seeded_steps_lower_the_loss_below_the_mean_images(codebook):
    data = SyntheticImageText(32, size=16, seed=0)
    images = torch.stack([data[i]["image"] for i in range(len(data))])
    mean_image_mse = images.var(0, unbiased=False).mean().item()  # what a decoder ignoring its codes reaches
    torch.manual_seed(0)
    vq = build_vqvae(VQVAEConfig(image_size=16, downsample=2, hidden=16, res_blocks=1),
                     {**codebook, "size": 32, "dim": 8}).train()
    optimizer = torch.optim.Adam(vq.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        out = vq(images)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        losses.append(out.terms["recon_mse"].item())
    assert losses[-1] < 0.75 * mean_image_mse < losses[0]


def test_bad_images_and_codes_say_what_is_expected():
    vq = _vq()
    with pytest.raises(ValueError, match=r"RGB images \(B, 3, 32, 32\)"):
        vq.tokenize(torch.rand(2, 1, 32, 32))
    with pytest.raises(ValueError, match=r"\(B, 3, 32, 32\).*got \(2, 3, 16, 16\)"):
        vq(torch.rand(2, 3, 16, 16))
    with pytest.raises(ValueError, match=r"code ids must be in \[0, 32\)"):
        vq.detokenize(torch.full((1, 64), 32))
    with pytest.raises(ValueError, match=r"\(B, 64\) code ids"):
        vq.detokenize(torch.zeros(1, 10, dtype=torch.long))


def test_bad_sizes_fail_with_the_field_named():
    with pytest.raises(ConfigError, match="task.downsample=3 must be a power of 2"):
        VQVAEConfig(downsample=3)
    with pytest.raises(ConfigError, match="does not divide task.image_size=20"):
        VQVAEConfig(image_size=20, downsample=8)


def test_image_grid_png(tmp_path):
    from PIL import Image

    from lmlab.multimodal.grid import save_image_grid

    top, bottom = torch.zeros(3, 3, 4, 4), torch.ones(3, 3, 4, 4)
    top[1, 0] = 1.0  # the second image of the first row is red
    path = save_image_grid([top, bottom], tmp_path / "grid.png", scale=2, gap=1)
    image = Image.open(path)
    assert image.size == (3 * (4 * 2 + 1) + 1, 2 * (4 * 2 + 1) + 1)
    assert image.getpixel((1 + 9 + 3, 1 + 3)) == (255, 0, 0)
    assert image.getpixel((1, 1)) == (0, 0, 0) and image.getpixel((1, 10)) == (255, 255, 255)
    with pytest.raises(ValueError, match="rows of equal"):
        save_image_grid([top, bottom[:2]], tmp_path / "bad.png")

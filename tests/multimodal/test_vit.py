"""The ViT entry: shapes, bidirectional attention over patches, 2-D positions, config errors."""

import pytest
import torch
from lmlab.errors import ConfigError
from lmlab.multimodal.vit import VISION_ENCODERS, sincos_2d

SMALL = {"name": "vit", "image_size": 16, "patch_size": 4, "width": 32, "n_layers": 2, "n_heads": 2}


def test_default_vit_shapes():
    vit = VISION_ENCODERS.build("vit")
    patches, pooled = vit.encode(torch.rand(2, 3, 32, 32))
    assert vit.n_patches == 64 and patches.shape == (2, 64, vit.width) and pooled.shape == (2, vit.width)
    torch.testing.assert_close(pooled, patches.mean(1))
    assert torch.equal(vit(torch.zeros(1, 3, 32, 32)), vit.encode(torch.zeros(1, 3, 32, 32))[0])


@pytest.mark.parametrize("fields", [
    {"cls_token": True, "pool": "cls", "position": "learned"},
    {"block": "postnorm", "norm": "rmsnorm", "ffn": "swiglu"},
    {"block": "sandwich", "patch_size": 8},
])
def test_variants_build_from_lmlab_parts(fields):
    vit = VISION_ENCODERS.build({**SMALL, **fields})
    patches, pooled = vit.encode(torch.rand(3, 3, 16, 16))
    assert patches.shape == (3, vit.n_patches, 32) and pooled.shape == (3, 32)
    assert all(not layer.self_attn.causal for layer in vit.layers)


def test_every_patch_sees_every_other_and_gradients_reach_the_patch_embedding():
    torch.manual_seed(0)
    vit = VISION_ENCODERS.build(SMALL)
    images = torch.rand(1, 3, 16, 16)
    changed = images.clone()
    changed[..., -4:, -4:] = 0.0  # only the last patch
    first, moved = vit(images)[0, 0], vit(changed)[0, 0]
    assert not torch.allclose(first, moved)  # the first patch's feature depends on the last patch
    vit.encode(images)[1].sum().backward()
    assert vit.patch_embed.weight.grad.abs().sum() > 0


def test_sincos_positions_tell_rows_and_columns_apart():
    table = sincos_2d(4, 16)
    assert table.shape == (16, 16)
    assert len({tuple(row.tolist()) for row in table}) == 16  # every grid cell distinct
    # the first half encodes the row only: cells of one row share it
    torch.testing.assert_close(table[0, :8], table[3, :8])
    assert not torch.allclose(table[0, 8:], table[3, 8:])


@pytest.mark.parametrize("fields, match", [
    ({"image_size": 30}, "not divisible by vision_encoder.patch_size"),
    ({"width": 30, "n_heads": 4}, "not divisible by n_heads"),
    ({"width": 30, "n_heads": 3}, "sincos needs a width divisible by 4"),
    ({"pool": "cls"}, "needs vision_encoder.cls_token"),
    ({"position": "rope"}, "position='rope'"),
])
def test_bad_configs_fail_with_the_field_named(fields, match):
    with pytest.raises(ConfigError, match=match):
        VISION_ENCODERS.build({**SMALL, **fields})


def test_images_of_the_wrong_size_say_what_is_expected():
    vit = VISION_ENCODERS.build(SMALL)
    with pytest.raises(ValueError, match=r"must be \(batch, 3, 16, 16\).*image_size=16"):
        vit(torch.rand(2, 3, 32, 32))

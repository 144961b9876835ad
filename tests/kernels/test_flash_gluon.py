"""flash_triton's Hopper path (`flash_gluon`'s Gluon kernels) against the reference and the portable Triton kernels.

The parity tests need an sm_90 GPU; the layout test needs only a Triton with Gluon.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

from lmlab.kernels import flash_gluon, flash_triton  # noqa: E402
from lmlab.kernels.flash_triton import FlashAttentionTriton, flash_attention_triton_forward  # noqa: E402
from lmlab.kernels.flash_reference import FlashAttentionReference  # noqa: E402
from tests.kernels.test_flash_triton import assert_near, check_against_reference, inputs  # noqa: E402

hopper = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                            reason="needs an sm_90 (Hopper) GPU")


def assert_takes_gluon_path(q: torch.Tensor, k: torch.Tensor) -> None:
    q4, k4 = (t[:, None] if t.dim() == 3 else t for t in (q, k))
    assert flash_triton._hopper_path(q4, k4, True) is flash_gluon


def _projection_views(b: int, s: int, h: int, kv_h: int, d: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """q, k, v as "b s (h d) -> b h s d" views of one fused projection (read in place by the kernels)."""
    x = torch.randn(b, s, (h + 2 * kv_h) * d, device="cuda", dtype=dtype)
    return [t.unflatten(-1, (-1, d)).transpose(1, 2).requires_grad_() for t in x.split([h * d, kv_h * d, kv_h * d], -1)]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("shape_q, shape_kv, dtype", [
    ((2, 4, 256, 64), (2, 4, 256, 64), torch.bfloat16),      # MHA
    ((1, 8, 384, 128), (1, 2, 384, 128), torch.bfloat16),    # GQA 8:2
    ((2, 4, 256, 128), (2, 1, 256, 128), torch.float16),     # MQA, float16
    ((3, 128, 64), (3, 128, 64), torch.bfloat16),            # 3-D: one head
])
def test_matches_reference(shape_q, shape_kv, dtype: torch.dtype) -> None:
    q, k, v = inputs(shape_q, shape_kv, dtype)
    assert_takes_gluon_path(q, k)
    check_against_reference(q, k, v, True)


@pytest.mark.gpu
@hopper
def test_projection_views_and_strided_grad() -> None:
    """q, k, v as "b s (h d) -> b h s d" views of one fused projection and a strided dO: read in place."""
    b, s, h, d = 2, 256, 4, 64
    q, k, v = _projection_views(b, s, h, h, d, torch.bfloat16)
    assert flash_gluon._Rows.of(q).view.data_ptr() == q.data_ptr()  # no copy
    d_out = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    assert_takes_gluon_path(q, k)
    check_against_reference(q, k, v, True, d_out)


@pytest.mark.gpu
@hopper
def test_custom_scale_matches_the_portable_kernels() -> None:
    q, k, v = inputs((2, 4, 256, 128), (2, 2, 256, 128), torch.bfloat16, seed=3)
    out = FlashAttentionTriton.apply(q, k, v, True, 0.3)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    lse = flash_attention_triton_forward(q.detach(), k.detach(), v.detach(), True, 0.3)[1]
    flash_triton.GLUON = False
    try:
        ref = FlashAttentionTriton.apply(q, k, v, True, 0.3)
        ref_grads = torch.autograd.grad(ref, (q, k, v), d_out)
        ref_lse = flash_attention_triton_forward(q.detach(), k.detach(), v.detach(), True, 0.3)[1]
    finally:
        flash_triton.GLUON = True
    assert_near(out, ref, torch.bfloat16, "out")
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=1e-4)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert_near(g, r, torch.bfloat16, f"d{name}")


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_out: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """Causal attention in float32 by the reference twin: its output, and its (dq, dk, dv) for d_out if given."""
    inputs32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out = FlashAttentionReference.apply(*inputs32, True)
    return out, None if d_out is None else torch.autograd.grad(out, inputs32, d_out.float())


def _setting_cases() -> list[tuple[str, int, tuple]]:
    """(kernel, head_dim, setting) for each setting `flash_gluon` picks from, the warp-specialized kernels' too."""
    return [(kernel, d, s) for d in flash_gluon.HEAD_DIMS
            for kernel, settings in (("forward", flash_gluon.FWD_SETTINGS), ("dq", flash_gluon.DQ_SETTINGS),
                                     ("dkdv", flash_gluon.DKDV_SETTINGS[d]))
            for s in settings] + [(kernel, d, s) for d in flash_gluon.HEAD_DIMS
                                  for kernel, settings in (("forward", flash_gluon.FWD_WS_SETTINGS[d]),
                                                           ("dq", flash_gluon.DQ_WS_SETTINGS[d]),
                                                           ("dkdv", flash_gluon.DKDV_WS_SETTINGS[d]))
                                  for s in settings]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("kernel, d, setting", _setting_cases())
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_every_setting_matches_reference(kernel: str, d: int, setting, kv_heads: int) -> None:
    """Each tile setting of each kernel, not only the one timing picks, gives the float32 reference's output or
    gradients, without GQA and with 8:2 (where the dK/dV kernels walk four query heads)."""
    q, k, v = inputs((2, 8, 384, d), (2, kv_heads, 384, d), torch.bfloat16, seed=7)
    scale = d ** -0.5
    out, lse = flash_gluon.forward(q.detach(), k.detach(), v.detach(), scale,
                                   setting if kernel == "forward" else None)
    if kernel == "forward":
        assert_near(out, _reference(q, k, v)[0], torch.bfloat16, "out")
        return
    d_out = torch.randn_like(q)
    pinned = {"dq_setting": setting} if kernel == "dq" else {"dkdv_setting": setting}
    grads = flash_gluon.backward(q.detach(), k.detach(), v.detach(), out, lse, d_out, scale, **pinned)
    ref_grads = _reference(q, k, v, d_out)[1]
    for name, g, r in zip("qkv", grads, ref_grads):
        assert_near(g, r, torch.bfloat16, f"d{name}")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d, setting", [(d, s) for table in (flash_gluon.FUSED_SETTINGS, flash_gluon.FUSED_WS_SETTINGS)
                                        for d, settings in table.items() for s in settings])
@pytest.mark.parametrize("heads, kv_heads, dtype, layout", [
    (4, 4, torch.bfloat16, "contiguous"),   # MHA
    (8, 2, torch.float16, "contiguous"),    # GQA 8:2
    (4, 1, torch.bfloat16, "projection"),   # MQA, views of a fused projection, strided dO
])
def test_fused_backward_matches_reference(d: int, setting, heads: int, kv_heads: int, dtype: torch.dtype,
                                          layout: str) -> None:
    """The fused backward (dQ reduced from the dK/dV pass), one-warpgroup and warp-specialized, at each of its
    settings gives the float32 reference's gradients, and the two-kernel backward's."""
    b, s = 2, 384
    if layout == "contiguous":
        q, k, v = inputs((b, heads, s, d), (b, kv_heads, s, d), dtype, seed=5)
        d_out = torch.randn_like(q)
    else:
        q, k, v = _projection_views(b, s, heads, kv_heads, d, dtype)
        d_out = torch.randn(b, s, heads, d, device="cuda", dtype=dtype).transpose(1, 2)
    scale = d ** -0.5
    out, lse = flash_gluon.forward(q.detach(), k.detach(), v.detach(), scale)
    grads = flash_gluon.backward(q.detach(), k.detach(), v.detach(), out, lse, d_out, scale, fused_setting=setting)
    two_kernels = flash_gluon.backward(q.detach(), k.detach(), v.detach(), out, lse, d_out, scale,
                                       dq_setting=flash_gluon.DQ_SETTINGS[0],
                                       dkdv_setting=flash_gluon.DKDV_SETTINGS[d][0])
    ref_grads = _reference(q, k, v, d_out)[1]
    for name, g, r, pair in zip("qkv", grads, ref_grads, two_kernels):
        assert g.dtype == dtype and g.is_contiguous()
        assert_near(g, r, dtype, f"d{name}")
        assert_near(g, pair, dtype, f"d{name} against the two kernels")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("causal, seq, dtype", [(False, 256, torch.bfloat16), (True, 200, torch.bfloat16),
                                                (True, 256, torch.float32)])
def test_other_calls_keep_the_portable_kernels(causal: bool, seq: int, dtype: torch.dtype) -> None:
    q = torch.zeros(1, 2, seq, 64, device="cuda", dtype=dtype)
    assert flash_triton._hopper_path(q, q, causal) is None


@pytest.mark.parametrize("layout", ["contiguous", "projection", "expanded heads"])
def test_rows_view_addresses_every_head(layout: str) -> None:
    """Head h of batch b starts at row b * rb + h * rh, column h * ch of the 2-D view, wherever the tensor lies."""
    b, h, s, d = 2, 3, 16, 64
    if layout == "contiguous":
        t = torch.randn(b, h, s, d, dtype=torch.bfloat16)
    elif layout == "projection":  # the keys of a fused q/k/v projection
        t = torch.randn(b, s, 3 * h * d, dtype=torch.bfloat16)[..., h * d:2 * h * d].unflatten(-1, (h, d))
        t = t.transpose(1, 2)
    else:
        t = torch.randn(b, 1, s, d, dtype=torch.bfloat16).expand(b, h, s, d)
    rows = flash_gluon._Rows.of(t)
    assert rows.view.data_ptr() == t.data_ptr()  # read in place, not copied
    for i in range(b):
        for j in range(h):
            row, col = i * rows.rb + j * rows.rh, j * rows.ch
            torch.testing.assert_close(rows.view[row:row + s, col:col + d], t[i, j], rtol=0, atol=0)


@pytest.mark.parametrize("misaligned", ["rows", "start"])
def test_misaligned_tensors_are_copied(misaligned: str) -> None:
    """TMA needs 16-byte aligned rows and start: a row stride of 100 elements (200 bytes), or a contiguous tensor
    that starts 2 bytes into its storage, is read from an aligned contiguous copy."""
    if misaligned == "rows":
        t = torch.randn(2, 16, 100, dtype=torch.bfloat16)[..., :64].unsqueeze(1)
    else:
        t = torch.randn(2 * 16 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 1, 16, 64)
        assert t.is_contiguous() and t.data_ptr() % 16
    rows = flash_gluon._Rows.of(t)
    assert rows.view.data_ptr() != t.data_ptr() and rows.view.data_ptr() % 16 == 0 and rows.view.stride() == (64, 1)
    torch.testing.assert_close(rows.view[16:32], t[1, 0], rtol=0, atol=0)

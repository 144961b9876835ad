"""`kernels=triton` in a whole model on a GPU: same loss and gradients as the reference path,
eager and under torch.compile."""

import copy

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")

from lmlab.kernels.registry import KERNELS, install_kernels  # noqa: E402
from lmlab.nn.transformer import Transformer  # noqa: E402
from lmlab.training.compile import compile_for_training  # noqa: E402
from lmlab.training.losses import LOSSES  # noqa: E402


def loss_and_grads(model, loss_fn, tokens):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", torch.bfloat16):
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])["loss"]
    loss.backward()
    return loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("extra", [[], ["model.attention.n_kv_heads=2", "loss.z_loss=1e-3"]])
@pytest.mark.parametrize("compiled", [False, True])
def test_triton_path_matches_the_reference_path(make_cfg, tiny_overrides, extra, compiled):
    cfg = make_cfg([*tiny_overrides, "model.d_model=256", "model.attention.n_heads=4", "model.max_seq_len=256",
                    "data.context_length=256", *extra])
    torch.manual_seed(0)
    reference = Transformer(cfg.model, 320).cuda()
    kernel = copy.deepcopy(reference)
    ref_loss, kernel_loss = LOSSES.build(cfg.loss), LOSSES.build(cfg.loss)
    assert install_kernels(KERNELS.build("triton"), kernel, kernel_loss) == []
    assert kernel.layers[0].self_attn.kernel is not None
    if compiled:
        compile_for_training(kernel, kernel_loss)
    tokens = torch.randint(0, 320, (4, 257), device="cuda")
    expected, expected_grads = loss_and_grads(reference, ref_loss, tokens)
    got, grads = loss_and_grads(kernel, kernel_loss, tokens)
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
    for name, g in expected_grads.items():
        scale = g.abs().max().clamp_min(1e-6)
        assert (grads[name] - g).abs().max() / scale < 5e-2, name

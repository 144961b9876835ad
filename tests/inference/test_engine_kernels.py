"""Cached decoding with the engine's Triton decode-attention kernel, which rotates and stores this step's keys
itself, equals a full forward for each position scheme (ALiBi's bias makes the kernel step aside), with GQA, MQA,
QK-norm, a window and left padding. Runs on CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1),
where the kernel is set on the engine by hand."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from lmlab.inference.engine import Engine
from lmlab.nn import ModelConfig, Transformer

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRETED),
                                reason="needs CUDA, or Triton's CPU interpreter (TRITON_INTERPRET=1)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _engine(model: Transformer) -> Engine:
    if DEVICE == "cuda":
        return Engine(model, attention_kernel=True)
    from lmlab.kernels.decode_attention_triton import decode_attention

    engine = Engine(model)
    engine.attention_kernel = decode_attention  # what CUDA would choose
    return engine


@pytest.mark.parametrize("position, attention", [
    ({"name": "rope"}, {"n_heads": 4, "n_kv_heads": 2}),
    ({"name": "rope", "layout": "interleaved"}, {"n_heads": 4}),
    ({"name": "rope"}, {"n_heads": 4, "qk_norm": True}),
    ({"name": "nope"}, {"n_heads": 4, "n_kv_heads": 1}),
    ({"name": "learned"}, {"n_heads": 4, "window": 5}),
    ({"name": "alibi"}, {"n_heads": 4}),
])
def test_cached_decoding_with_the_kernel_equals_a_full_forward(position, attention):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(d_model=64, n_layers=2, max_seq_len=32, norm="rmsnorm", ffn="swiglu",
                                    position=position, attention={"name": "mha", **attention}, block="prenorm"),
                        vocab_size=96).to(DEVICE).eval()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        full = model(ids)
        unpadded = model(ids[1:, 2:])[0]  # sequence 1 starts at slot 2
    engine = _engine(model)
    engine.begin(2, 12, start=torch.tensor([0, 2]))
    got = [engine.extend(ids[:, :7], all_logits=True)]
    got = torch.cat(got + [engine.decode(ids[:, t]).clone()[:, None] for t in range(7, 12)], dim=1)
    torch.testing.assert_close(got[0], full[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1, 2:], unpadded, atol=1e-5, rtol=1e-5)

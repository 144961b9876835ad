"""Batch-invariant decoding: a token's logits are the same bits whether a one-token step, a (k+1)-token
verification or a larger batch computes them, so greedy speculative decoding gives exactly the target's tokens.
Runs on CUDA (bf16, the case that needs it), or on the CPU under Triton's interpreter (TRITON_INTERPRET=1) in
float16. The interpreter's tl.dot is one BLAS call, whose result for a row depends on where the row sits in the
tile; a GPU's tensor-core instructions treat every row alike. So under the interpreter these tests multiply row by
row, which checks what lmlab controls: which products each row sums, in which order."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.inference.engine import Engine
from lmlab.inference.speculative import speculative_generate
from lmlab.nn import ModelConfig, Transformer

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available()
needs_kernels = pytest.mark.skipif(not (CUDA or INTERPRETED),
                                   reason="needs CUDA, or Triton's CPU interpreter (TRITON_INTERPRET=1)")
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float16
VOCAB = 96


@pytest.fixture(autouse=True)
def _dot_row_by_row(monkeypatch):
    if CUDA or not INTERPRETED:
        return
    import numpy as np
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        rows = [np.matmul(row[None], b.data, dtype=d.data.dtype) for row in a.data]
        return interpreter.TensorHandle(np.concatenate(rows) + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def _model(seed: int = 0, d_model: int = 64, n_layers: int = 2, **attention) -> Transformer:
    torch.manual_seed(seed)
    config = ModelConfig(d_model=d_model, n_layers=n_layers, max_seq_len=64, norm="rmsnorm", ffn="swiglu",
                         position={"name": "rope"}, attention={"name": "mha", "n_heads": 4, **attention},
                         block="prenorm")
    return Transformer(config, vocab_size=VOCAB).to(DEVICE, DTYPE).eval()


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@needs_kernels
def test_invariant_linear_gives_each_row_the_same_bits_alone_and_in_a_batch():
    from lmlab.kernels.invariant_matmul_triton import invariant_linear

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 1024, generator=g).to(DEVICE, DTYPE)
    bias = torch.randn(96, generator=g).to(DEVICE, DTYPE)
    x = torch.randn(20, 1024, generator=g).to(DEVICE, DTYPE)
    batch = invariant_linear(x, weight, bias)
    for row in (0, 7, 19):
        assert torch.equal(invariant_linear(x[row:row + 1], weight, bias)[0], batch[row])
    reference = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(batch.float(), reference, atol=0.05, rtol=0.01)  # float32 sums, rounded once


@needs_kernels
@pytest.mark.parametrize("attention", [{}, {"n_kv_heads": 2}])
def test_one_token_steps_and_a_verification_step_give_the_same_bits(attention):
    model, ids = _model(**attention), _ids(2, 14)
    engine = Engine(model, batch_invariant=True, cuda_graphs=False)
    engine.begin(2, 24, lookahead=4)
    engine.extend(ids[:, :9])
    one_by_one = torch.stack([engine.decode(ids[:, t]).clone() for t in range(9, 14)], dim=1)
    engine.rewind(9)
    verified = engine.decode(ids[:, 9:14])
    assert torch.equal(one_by_one, verified)
    engine.begin(1, 24, lookahead=4)  # the second sequence alone: the same bits as in the batch
    engine.extend(ids[1:, :9])
    assert torch.equal(engine.decode(ids[1:, 9:14]), verified[1:])
    reference = model(ids.to(DEVICE)).float()[:, 9:14]
    torch.testing.assert_close(verified, reference, atol=0.1, rtol=0.05)  # the same model, in another order


@needs_kernels
def test_a_prompt_gives_the_same_bits_however_it_is_cut():
    model, ids = _model(n_kv_heads=2, n_layers=1), _ids(1, 40)  # GQA: prompts go 32 tokens at a time
    engine = Engine(model, batch_invariant=True)  # on CUDA, whole chunks replay a CUDA graph and the rest is eager
    assert engine.invariant.chunk == 32
    engine.begin(1, 40)
    whole = engine.extend(ids, all_logits=True).clone()  # 32 + 8
    engine.begin(1, 40)
    cut = torch.cat([engine.extend(ids[:, :5], all_logits=True), engine.extend(ids[:, 5:], all_logits=True)], dim=1)
    assert torch.equal(whole, cut)  # 5, then 32 + 3


@needs_kernels
def test_greedy_speculative_output_is_exactly_the_targets_in_half_precision():
    target, draft = _model(0, n_layers=3), _model(5, n_layers=1)  # an unrelated draft: many rejections
    prompt = _ids(1, 8, seed=3)[0].tolist()
    alone = Engine(target, batch_invariant=True, cuda_graphs=False).generate([prompt], max_new_tokens=30)
    engine = Engine(target, batch_invariant=True, cuda_graphs=False)
    out = speculative_generate(engine, Engine(draft), prompt, k=4, max_new_tokens=30)
    assert out.tokens[0] == alone.tokens[0]


def test_batch_invariant_refuses_what_it_cannot_cover():
    with pytest.raises(ConfigError, match="excludes compile"):
        Engine(_model(), compile=True, batch_invariant=True)
    if not (CUDA or INTERPRETED):
        with pytest.raises(ConfigError, match="decode-attention kernel"):
            Engine(_model(), batch_invariant=True)
    moe = Transformer(ModelConfig(d_model=32, n_layers=1, max_seq_len=16, norm="rmsnorm", ffn="swiglu",
                                  position={"name": "rope"}, attention={"name": "mha", "n_heads": 2}, block="prenorm",
                                  moe={"name": "topk", "n_experts": 2, "k": 1}), vocab_size=VOCAB)
    with pytest.raises(ConfigError, match="MoE"):
        Engine(moe, batch_invariant=True)

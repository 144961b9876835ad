"""Gated DeltaNet: the chunked form equals the recurrence (forward and backward, several chunk sizes, ragged
lengths, an initial state), a hand-computed delta-rule case, causality, training, left-padded generation
and the refusal of bad fields."""

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.inference.engine import Engine
from lmlab.nn import ATTENTION, POSITIONS, ModelConfig, Transformer
from lmlab.nn.gated_deltanet import chunk_gated_delta_rule, l2_normalize, recurrent_gated_delta_rule
from tests.conftest import next_token_losses

D, H = 32, 4


def build(**fields):
    return ATTENTION.build({"name": "gated_deltanet", "n_heads": H, **fields}, D)


def model(**attn) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=D, n_layers=2, max_seq_len=48, norm="rmsnorm", ffn="swiglu", position="rope",
                      attention={"name": "gated_deltanet", **attn}, block="prenorm")
    return Transformer(cfg, vocab_size=64)


def rule_inputs(length: int, d_k: int = 8, d_v: int = 6):
    """Random q, k (unit norm), v, g < 0, beta in (0, 1) and an initial state, all requiring gradients."""
    gen = torch.Generator().manual_seed(length)
    rows = (2, 3, length)  # batch, heads, tokens
    tensors = [torch.randn(*rows, d_k, generator=gen), l2_normalize(torch.randn(*rows, d_k, generator=gen)),
               torch.randn(*rows, d_v, generator=gen), -torch.rand(*rows, generator=gen),
               torch.rand(*rows, generator=gen), torch.randn(2, 3, d_k, d_v, generator=gen)]
    return [t.requires_grad_() for t in tensors]


def grads(outputs, inputs):
    """Gradients of a fixed random projection of the outputs (every output element gets its own weight)."""
    gen = torch.Generator().manual_seed(0)
    loss = sum((out * torch.randn(out.shape, generator=gen)).sum() for out in outputs)
    return torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("chunk_size", [4, 8, 16])
@pytest.mark.parametrize("length", [13, 21])
def test_chunked_rule_equals_recurrence_forward_and_backward(chunk_size, length):
    q, k, v, g, beta, s0 = inputs = rule_inputs(length)
    want = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    got = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size, initial_state=s0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads(got, inputs), grads(want, inputs)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk_size", [4, 8, 16])
def test_layer_chunked_equals_recurrent_in_input_and_parameter_gradients(chunk_size):
    torch.manual_seed(0)
    attn = build(chunk_size=chunk_size)
    x = torch.randn(2, 11, D, requires_grad=True)
    pos = POSITIONS.build("nope", 64, D, 8, H)
    chunked = attn(x, pos, torch.arange(11))
    inputs, _ = attn.heads(x)
    recurrent = attn.output(recurrent_gated_delta_rule(*inputs)[0], x)
    torch.testing.assert_close(chunked, recurrent, atol=1e-5, rtol=1e-5)
    wrt = [x, *attn.parameters()]
    for a, b in zip(grads([chunked], wrt), grads([recurrent], wrt)):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# Two steps from S_0 = 0 with k_1 = (1, 0), v_1 = (1, 2), k_2 = (0.6, 0.8), v_2 = (3, -1), beta = 1:
# S_1 = k_1 v_1^T = [[1, 2], [0, 0]]; S_2 = alpha S_1 + k_2 (v_2 - alpha S_1^T k_2)^T, where S_1^T k_2 = (0.6, 1.2).
# alpha = 1 (the plain delta rule): S_2 = S_1 + k_2 (2.4, -2.2)^T; alpha = 0.5: S_2 = S_1 / 2 + k_2 (2.7, -1.6)^T.
@pytest.mark.parametrize("alpha,s_2", [(1.0, [[2.44, 0.68], [1.92, -1.76]]), (0.5, [[2.12, 0.04], [2.16, -1.28]])])
@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_two_steps_by_hand(form, alpha, s_2):
    q = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    k = torch.tensor([[1.0, 0.0], [0.6, 0.8]])
    v = torch.tensor([[1.0, 2.0], [3.0, -1.0]])
    g = torch.log(torch.tensor([1.0, alpha]))  # alpha_1 is irrelevant: S_0 = 0
    beta = torch.ones(2)
    args = [t[None, None] for t in (q, k, v, g, beta)]
    o, state = chunk_gated_delta_rule(*args, chunk_size=4) if form == "chunked" else recurrent_gated_delta_rule(*args)
    s_2 = torch.tensor(s_2)
    torch.testing.assert_close(state[0, 0], s_2)
    torch.testing.assert_close(o[0, 0], torch.stack([torch.tensor([1.0, 2.0]), s_2[0]]))  # S_1^T q_1, S_2^T q_2


def test_future_tokens_do_not_change_the_past():
    torch.manual_seed(0)
    attn, pos = build(chunk_size=4), POSITIONS.build("nope", 64, D, 8, H)
    x = torch.randn(2, 14, D)
    x2 = x.clone()
    x2[:, 9:] = torch.randn(2, 5, D)
    with torch.no_grad():
        a, b = attn(x, pos, torch.arange(14)), attn(x2, pos, torch.arange(14))
    torch.testing.assert_close(a[:, :9], b[:, :9])
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_default_layer_in_a_model_names_and_sizes():
    m = model()
    attn = m.layers[0].self_attn
    names = {n for n, _ in attn.named_parameters()}
    assert {"q_proj.weight", "a_proj.weight", "b_proj.weight", "g_proj.weight", "o_proj.weight", "A_log", "dt_bias",
            "o_norm.weight", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"} <= names
    # S: 4 heads of 8 x 8; convolution states: 3 inputs of 32 channels (q, k, v)
    assert attn.state_elements() == 4 * 8 * 8 + 3 * 3 * 32
    assert m.kv_cache_bytes_per_token() == 0
    assert build(expand_v=2.0, head_dim=4, use_gate=False).v_proj.out_features == 32


def test_a_tiny_model_trains():
    m = model(chunk_size=8)
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    losses = next_token_losses(m, ids, steps=8, lr=1e-2)
    assert losses[-1] < 0.6 * losses[0]


def test_left_padded_batch_generates_as_each_prompt_alone():
    engine = Engine(model(chunk_size=4).eval())
    prompts = [[5, 9, 2], [7, 1, 3, 3, 8, 20, 11, 4, 6], [4]]
    batched = engine.generate(prompts, max_new_tokens=8).tokens
    assert batched == [engine.generate([p], max_new_tokens=8).tokens[0] for p in prompts]
    assert not engine.rewindable


@pytest.mark.parametrize("fields,match", [
    ({"chunk_size": 12}, "attention.chunk_size=12; must be a power of two"),
    ({"chunk_size": 0}, "attention.chunk_size=0"),
    ({"n_heads": 5}, "model.d_model=32 is not divisible by attention.n_heads=5"),
    ({"expand_v": 0.3}, "attention.expand_v=0.3"),
    ({"d_conv": 0}, "attention.d_conv=0"),
])
def test_bad_fields_are_refused_when_built(fields, match):
    with pytest.raises(ConfigError, match=match):
        build(**fields)

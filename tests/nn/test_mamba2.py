"""Mamba-2: the chunked scan equals the token-by-token recurrence (forward and backward), the layer is
causal and trains in a model, bad settings are refused, and left padding leaves the generation state alone."""

import pytest
import torch
import torch.nn.functional as F

from lmlab.errors import ConfigError
from lmlab.inference.engine import Engine
from lmlab.nn import ATTENTION, ModelConfig, Transformer
from lmlab.nn.mamba2 import Mamba2, scan_recurrent, ssd_chunked
from tests.conftest import next_token_losses

D, VOCAB = 32, 64


def build(**fields) -> Mamba2:
    return ATTENTION.build({"name": "mamba2", **fields}, D)


def model(**attn) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=D, n_layers=2, max_seq_len=32, norm="rmsnorm", ffn="swiglu", position="nope",
                      attention={"name": "mamba2", **attn}, block="prenorm")
    return Transformer(cfg, vocab_size=VOCAB)


def scan_inputs(batch=2, length=13, heads=4, head_dim=4, groups=2, d_state=3, initial=True):
    g = torch.Generator().manual_seed(length)
    shapes = [(batch, length, heads, head_dim), (batch, length, heads), (heads,), (batch, length, groups, d_state),
              (batch, length, groups, d_state), (batch, heads, head_dim, d_state)]
    x, dt, a, b, c, h0 = (torch.randn(s, generator=g) for s in shapes)
    dt, A = F.softplus(dt), -a.exp()  # as the layer makes them: dt > 0, A < 0
    return [t.requires_grad_() for t in (x, dt, A, b, c, h0 if initial else None) if t is not None]


@pytest.mark.parametrize("initial", [False, True])
@pytest.mark.parametrize("chunk_size,length", [(4, 13), (8, 13), (16, 7), (4, 16)])
def test_chunked_scan_equals_recurrence_forward_and_backward(chunk_size, length, initial):
    inputs = scan_inputs(length=length, initial=initial)
    y, state = ssd_chunked(*inputs[:5], chunk_size, *inputs[5:])
    y_ref, state_ref = scan_recurrent(*inputs)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, state_ref, atol=1e-5, rtol=1e-5)
    probe = torch.randn_like(y), torch.randn_like(state)  # weights every output and the final state
    grads = torch.autograd.grad((y * probe[0]).sum() + (state * probe[1]).sum(), inputs)
    grads_ref = torch.autograd.grad((y_ref * probe[0]).sum() + (state_ref * probe[1]).sum(), inputs)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk_size", [4, 8])
def test_layer_forward_equals_one_token_at_a_time(chunk_size):
    """The conv state and the SSM step together give the chunked forward's outputs and gradients."""
    torch.manual_seed(0)
    layer = build(chunk_size=chunk_size, n_groups=2, d_state=8)
    x = torch.randn(2, 11, D, requires_grad=True)
    parallel = layer(x)
    state, steps = layer.init_state(2), []
    for t in range(x.shape[1]):
        y, state = layer.forward_with_state(x[:, t:t + 1], state)
        steps.append(y)
    recurrent = torch.cat(steps, dim=1)
    torch.testing.assert_close(recurrent, parallel, atol=1e-5, rtol=1e-5)
    params = [x, *layer.parameters()]
    probe = torch.randn_like(parallel)
    for got, want in zip(torch.autograd.grad((parallel * probe).sum(), params),
                         torch.autograd.grad((recurrent * probe).sum(), params)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_changing_a_token_changes_no_earlier_output():
    torch.manual_seed(0)
    layer = build(chunk_size=4)
    x = torch.randn(2, 12, D)
    x2 = x.clone()
    x2[:, 6] += 1.0
    with torch.no_grad():
        y, y2 = layer(x), layer(x2)
    torch.testing.assert_close(y[:, :6], y2[:, :6], atol=0, rtol=0)
    assert (y[:, 6:] - y2[:, 6:]).abs().amax(dim=-1).gt(1e-4).all()  # the change reaches every later token


def test_trains_in_a_transformer():
    net = model()
    assert {"in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight",
            "out_proj.weight"} == {n for n, _ in net.layers[0].self_attn.named_parameters()}
    ids = torch.randint(0, VOCAB, (4, 24), generator=torch.Generator().manual_seed(0))
    losses = next_token_losses(net, ids, steps=8, lr=3e-3)
    assert losses[-1] < losses[0] - 0.2, losses


@pytest.mark.parametrize("fields,message", [
    ({"chunk_size": 12}, "attention.chunk_size=12 must be a power of two"),
    ({"chunk_size": 0}, "attention.chunk_size must be >= 1"),
    ({"n_heads": 3}, "attention.expand \\* model.d_model = 64 is not divisible by attention.n_heads=3"),
    ({"n_groups": 3}, "attention.n_heads=4 is not divisible by attention.n_groups=3"),
    ({"dt_min": 0.2}, "attention.dt_min=0.2 and dt_max=0.1"),
])
def test_bad_settings_are_refused_when_built(fields, message):
    with pytest.raises(ConfigError, match=message):
        build(**fields)


def test_state_size_is_the_ssm_state_and_the_conv_inputs():
    net = model().eval()
    layer = net.layers[0].self_attn
    # 4 heads of 2 * 32 / 4 = 16 dims, d_state 16; conv over x, B, C = 64 + 2 * 16 channels, d_conv - 1 = 3 inputs
    assert layer.state_elements() == 4 * 16 * 16 + 96 * 3
    assert net.kv_cache_bytes_per_token() == 0
    engine = Engine(net)
    engine.begin(3, 200)
    assert engine.kv_cache_bytes() == 2 * 3 * layer.state_elements() * 4  # 2 layers, 3 sequences, float32
    assert not engine.rewindable


def test_left_padding_leaves_the_state_as_if_absent():
    net = model(chunk_size=4).eval()
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    padded = torch.cat([torch.randint(1, VOCAB, (1, 5)), prompt], dim=1)  # padding tokens that would change a state
    with torch.no_grad():
        alone = net(torch.cat([prompt, prompt[:, :1]], dim=1))
    engine = Engine(net)
    engine.begin(2, 12, start=torch.tensor([5, 0]))
    logits = engine.extend(torch.cat([padded, padded]), all_logits=True)
    torch.testing.assert_close(logits[0, 5:], alone[0, :6], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(engine.decode(prompt[:, 0].repeat(2))[0], alone[0, 6], atol=1e-5, rtol=1e-5)

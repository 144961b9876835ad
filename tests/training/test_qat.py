"""Quantization-aware training: off is the plain model; the fake-quantised forward is the forward of the
post-training quantized weights; gradients pass straight through; checkpoints stay plain; `qat=int4` trains."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lmlab.errors import ConfigError
from lmlab.inference.quant import quantize
from lmlab.inference.quant.qat import QATS, FakeQuantLinear, fake_quantize
from lmlab.nn import ModelConfig, Transformer
from lmlab.optim.groups import parameter_roles
from lmlab.tokenizers.byte import ByteTokenizer
from lmlab.training import LanguageModelTask, train
from lmlab.training.checkpoints import load
from tests.conftest import train_tiny

VOCAB = 101
INT4_32 = {"name": "int4", "group_size": 32}


def tiny_model(**fields) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=64, n_layers=2, max_seq_len=32, vocab_size=VOCAB, norm="rmsnorm", position="rope",
                      ffn={"name": "swiglu", "d_ff": 96}, attention={"name": "mha", "n_heads": 4, "n_kv_heads": 2},
                      block="prenorm", **fields)
    return Transformer(cfg, VOCAB)


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))


def fake_quantized(model: nn.Module) -> dict[str, FakeQuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, FakeQuantLinear)}


def test_qat_none_leaves_the_plain_model():
    plain, model = tiny_model(), tiny_model()
    assert QATS.build("none").install(model) == 0
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert torch.equal(model(tokens()), plain(tokens()))


@pytest.mark.parametrize("qat, ptq, n_quantized", [
    ("int8", "int8", 15),  # 2 layers x (q, k, v, o, gate, up, down) + lm_head
    (INT4_32, {**INT4_32, "method": "rtn"}, 14),  # int4 leaves the head alone
])
def test_fake_quantised_forward_is_the_ptq_models_forward(qat, ptq, n_quantized):
    model = tiny_model()
    ptq_model = copy.deepcopy(model)
    assert QATS.build(qat).install(model) == n_quantized
    assert quantize(ptq_model, ptq)["layers"] == n_quantized
    for name, linear in fake_quantized(model).items():  # the same grid: equal weights, bit for bit
        assert torch.equal(fake_quantize(linear.weight, linear.grid, linear.group_size),
                           ptq_model.get_submodule(name).dequantize()), name
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), ptq_model(tokens()), rtol=1e-5, atol=1e-5)


def test_qat_from_a_start_step_is_the_plain_model_before_it_and_fake_quantised_from_it():
    plain, model = tiny_model(), tiny_model()
    qat = QATS.build({**INT4_32, "start_step": 3})
    qat.install(model)
    quantized = tiny_model()
    QATS.build(INT4_32).install(quantized)
    with torch.no_grad():
        for step, reference in ((0, plain), (2, plain), (3, quantized), (7, quantized)):
            qat.at_step(model, step)
            assert torch.equal(model(tokens()), reference(tokens())), step
    with pytest.raises(ConfigError, match="qat.start_step must be >= 0"):
        QATS.build({**INT4_32, "start_step": -1}).install(tiny_model())


def test_weight_gradient_is_the_plain_models_gradient_at_the_quantized_weights():
    model = tiny_model()
    QATS.build(INT4_32).install(model)
    at_quantized = tiny_model()
    with torch.no_grad():
        for name, linear in fake_quantized(model).items():
            at_quantized.get_submodule(name).weight.copy_(fake_quantize(linear.weight, linear.grid, 32))
    x, y = tokens(1), tokens(2)
    for m in (model, at_quantized):
        F.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
    grads = dict(at_quantized.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad.abs().sum() > 0, name
        torch.testing.assert_close(p.grad, grads[name].grad, msg=name)


def test_qat_state_dict_is_the_plain_models_and_loads_into_a_plain_model_and_into_ptq():
    model = tiny_model(tie_embeddings=True)
    plain = tiny_model(tie_embeddings=True)
    roles = {name: role for name, (role, _) in parameter_roles(plain).items()}
    QATS.build("int8").install(model)  # quantize_head: the tied head too
    assert model.lm_head.weight is model.embed_tokens.weight
    assert {name: role for name, (role, _) in parameter_roles(model).items()} == roles  # optimizer groups unchanged
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # "trained" float weights, off the grid
    state = model.state_dict()
    assert list(state) == list(plain.state_dict())
    head = model.lm_head
    assert not torch.equal(state["lm_head.weight"], fake_quantize(head.weight, head.grid, head.group_size))  # float
    plain.load_state_dict(state)
    quantize(plain, "int8")
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens()), model(tokens()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("extra, match", [
    (["qat.group_size=64"], r"layers.0.self_attn.q_proj has in_features=32, not a multiple of qat.group_size=64; "
                            r"use qat.group_size=32"),
    (["qat.group_size=0"], r"qat.group_size must be one of 32, 64, 128 \(the group sizes quant=int4 runs\), got 0"),
    (["qat.group_size=48"], r"qat.group_size must be one of 32, 64, 128"),
])
def test_bad_group_size_fails_before_training(make_cfg, tiny_overrides, tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        train(make_cfg([*tiny_overrides, "qat=int4", *extra]), tmp_path / "run")
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()  # nothing tokenized


def test_qat_int4_trains_and_its_checkpoint_loads_as_a_plain_model(make_cfg, tiny_overrides, tmp_path):
    task = LanguageModelTask(make_cfg([*tiny_overrides, "qat=int4", "qat.group_size=32"]), ByteTokenizer())
    assert len(fake_quantized(task.model)) == 14  # 2 layers x 7 Linears
    ckpt = train_tiny(tmp_path, 2, "qat=int4", "qat.group_size=32")
    model, _, config = load(ckpt)
    assert config.qat == {"name": "int4", "group_size": 32, "quantize_head": False, "start_step": 0}
    assert not fake_quantized(model) and type(model.layers[0].mlp.down_proj) is nn.Linear

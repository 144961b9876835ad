"""trainer.cuda_graphs: the step's forward + loss compiled whole, its forward and backward replayed from CUDA graphs."""

import pytest
import torch

from lmlab.errors import ConfigError
from lmlab.nn.transformer import ModelConfig, Transformer
from lmlab.training import train
from lmlab.training.compile import graphed_model_terms
from lmlab.training.losses import LOSSES
from lmlab.training.objective import model_terms

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def tiny_model(device: str = "cpu") -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_layers=2, max_seq_len=16, norm="rmsnorm", ffn="swiglu", position="rope",
                      attention={"name": "mha", "n_heads": 2}, block="prenorm")
    return Transformer(cfg, vocab_size=64).to(device)


def adamw_losses(terms_of, model: Transformer, batches) -> list[float]:
    """One AdamW step per batch with the step's terms from `terms_of(inputs, targets)`; the loss before each."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for inputs, targets in batches:
        loss = terms_of(inputs, targets)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def batches(device: str, steps: int):
    generator = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 64, (4, 13), generator=generator).to(device) for _ in range(steps)]
    return [(x[:, :-1], x[:, 1:]) for x in ids]


@pytest.mark.slow
def test_whole_step_compile_trains_as_the_eager_step_on_cpu():
    """On a CPU nothing is replayed: the whole-model compile alone, against eager, over AdamW steps."""
    loss_fn = LOSSES.build({"name": "cross_entropy"})
    eager, compiled = tiny_model(), tiny_model()
    want = adamw_losses(lambda x, y: model_terms(eager, loss_fn, x, y), eager, batches("cpu", 3))
    got = adamw_losses(graphed_model_terms(compiled, loss_fn), compiled, batches("cpu", 3))
    assert got == pytest.approx(want, rel=1e-4)


@pytest.mark.gpu
@cuda
def test_replayed_steps_train_as_the_eager_steps():
    """Steps 3 on are graph replays (the first ones warm up and record): losses follow the eager run's."""
    loss_fn = LOSSES.build({"name": "cross_entropy", "z_loss": 1e-3})
    eager, graphed = tiny_model("cuda"), tiny_model("cuda")
    steps = batches("cuda", 8)
    want = adamw_losses(lambda x, y: model_terms(eager, loss_fn, x, y), eager, steps)
    terms_of = graphed_model_terms(graphed, loss_fn)
    got = adamw_losses(terms_of, graphed, steps)
    assert got == pytest.approx(want, rel=1e-3)
    # The logged terms are copies: a later replay does not change what an earlier step returned.
    first = terms_of(*steps[0])
    kept = {name: value.detach().clone() for name, value in first.items()}
    first["loss"].backward()
    terms_of(*steps[1])["loss"].backward()
    for name, value in kept.items():
        assert torch.equal(first[name].detach(), value), name


@pytest.mark.gpu
@cuda
def test_lmlab_train_with_cuda_graphs_reaches_the_compiled_runs_loss(make_cfg, tiny_overrides, tmp_path):
    common = [*tiny_overrides, "trainer.max_steps=15", "trainer.val_every=15", "sched.warmup_steps=1",
              "trainer.compile=true"]
    plain = train(make_cfg(common), tmp_path / "compiled")
    graphed = train(make_cfg([*common, "trainer.cuda_graphs=true"]), tmp_path / "graphed")
    assert graphed["val_loss"] < graphed["initial_val_loss"] - 0.5
    assert graphed["val_loss"] == pytest.approx(plain["val_loss"], rel=2e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_graphs_without_a_gpu_is_refused_before_training(make_cfg, tiny_overrides, tmp_path):
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        train(make_cfg([*tiny_overrides, "trainer.compile=true", "trainer.cuda_graphs=true"]), tmp_path / "run")
    assert not (tmp_path / "run").exists()

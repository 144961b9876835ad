"""Gradient accumulation keeps the global batch: the same steps as one full batch at a time."""

import torch

from lmlab.data.batches import RandomWindows
from lmlab.training import train
from tests.training.test_optim_training import scalars


def test_micro_batches_split_each_step_of_the_same_stream():
    tokens = torch.arange(1000).numpy()
    whole = iter(RandomWindows(tokens, batch_size=8, context_length=16, seed=3))
    parts = iter(RandomWindows(tokens, batch_size=8, context_length=16, seed=3, micro_batches=4))
    for _ in range(3):
        x, y = next(whole)
        micro = [next(parts) for _ in range(4)]
        assert all(m[0].shape == (2, 16) for m in micro)
        assert torch.equal(torch.cat([m[0] for m in micro]), x) and torch.equal(torch.cat([m[1] for m in micro]), y)


def test_rank_and_micro_batch_shares_tile_the_global_batch():
    tokens = torch.arange(1000).numpy()
    x, _ = next(iter(RandomWindows(tokens, 8, 16, seed=1)))
    pieces = []
    for rank in range(2):
        stream = iter(RandomWindows(tokens, 8, 16, seed=1, rank=rank, world_size=2, micro_batches=2))
        pieces += [next(stream)[0] for _ in range(2)]
    assert [p.shape[0] for p in pieces] == [2, 2, 2, 2] and torch.equal(torch.cat(pieces), x)


def test_accumulating_two_micro_batches_trains_like_the_whole_batch(make_cfg, tiny_overrides, tmp_path):
    steps = ["trainer.max_steps=12", "trainer.val_every=6", "trainer.log_every=1", "trainer.checkpoint_every=100"]
    whole = train(make_cfg([*tiny_overrides, *steps]), tmp_path / "whole")
    accumulated = train(make_cfg([*tiny_overrides, *steps, "trainer.accumulate_grad_batches=2"]), tmp_path / "acc")
    a = torch.load(tmp_path / "whole" / "checkpoints" / "last.ckpt", weights_only=False)
    b = torch.load(tmp_path / "acc" / "checkpoints" / "last.ckpt", weights_only=False)
    assert a["global_step"] == b["global_step"] == 12
    for key, value in a["state_dict"].items():
        torch.testing.assert_close(b["state_dict"][key], value, rtol=1e-4, atol=1e-5, msg=key)
    # train/loss is the whole batch's, logged once per optimizer step
    loss_a, loss_b = scalars(tmp_path / "whole", "train/loss"), scalars(tmp_path / "acc", "train/loss")
    assert loss_a.keys() == loss_b.keys()
    for step in loss_a:
        assert abs(loss_a[step] - loss_b[step]) < 1e-4, step
    assert abs(whole["val_loss"] - accumulated["val_loss"]) < 1e-4

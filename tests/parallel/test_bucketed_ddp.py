"""BucketedDDP in 2 and 4 gloo processes ends where one process on the whole batches ends, whatever
the bucket size; buckets start during backward; gradient accumulation goes through no_sync()."""

import pytest
import torch

from lmlab.parallel import BucketedDDP, run_processes
from lmlab.parallel.bucketed_ddp import make_buckets
from tests.parallel.common import (MODELS, RECIPES, assert_same_weights, batches, build, reference, shard, train,
                                   weights)

# (model, optimizer, bucket_size_mb): ~0.5 KB puts about one tensor in each bucket, 2 KB several, 100 MB all in one.
CASES = [("toy", "sgd", 0.0005), ("toy", "sgd", 0.002), ("toy", "sgd", 100.0), ("transformer", "adamw", 0.01)]


def _train_with_micro_batches(model: BucketedDDP, optimizer: torch.optim.Optimizer, rank: int, world_size: int) -> None:
    """The toy run with each rank's shard split in two micro-batches: the first backward inside no_sync()."""
    loss_fn = MODELS["toy"][2]
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    for x, y in batches("toy"):
        optimizer.zero_grad()
        halves = list(zip(shard(x, rank, world_size).chunk(2), shard(y, rank, world_size).chunk(2)))
        with model.no_sync():
            loss_fn(model(halves[0][0]), halves[0][1]).div(2).backward()
        loss_fn(model(halves[1][0]), halves[1][1]).div(2).backward()
        model.finish_gradient_synchronization()
        optimizer.step()
        schedule.step()


def _rank(rank: int, world_size: int, cases: list) -> dict:
    results = {}
    for model_name, recipe, bucket_mb in cases:
        model = BucketedDDP(build(model_name, rank), bucket_size_mb=bucket_mb)
        train(model, RECIPES[recipe](model.module), model_name, rank, world_size,
              sync=model.finish_gradient_synchronization)
        results[model_name, bucket_mb] = (weights(model.module), len(model.buckets), model.overlapped_buckets)

    model = BucketedDDP(build("toy", rank), bucket_size_mb=0.002)
    _train_with_micro_batches(model, RECIPES["sgd"](model.module), rank, world_size)
    results["no_sync"] = weights(model.module)

    # A second backward without finish_gradient_synchronization() (or no_sync) is an error that says so.
    x, y = batches("toy")[-1]
    loss = MODELS["toy"][2](model(shard(x, rank, world_size)), shard(y, rank, world_size))
    loss.backward(retain_graph=True)
    try:
        loss.backward()
    except RuntimeError as err:
        results["second_backward"] = str(err)
    model.finish_gradient_synchronization()  # what the first backward started must still complete
    return results


def _check(ranks: list[dict], cases: list, world_size: int) -> None:
    for model_name, recipe, bucket_mb in cases:
        want, _ = reference(model_name, recipe)
        for rank, result in enumerate(ranks):
            got, n_buckets, overlapped = result[model_name, bucket_mb]
            assert_same_weights(got, want, f"{model_name}, buckets of {bucket_mb} MB, rank {rank} of {world_size}")
            assert (n_buckets == 1) == (bucket_mb == 100.0)
            if model_name == "toy":  # its last step gives every parameter a gradient on every rank
                assert overlapped == n_buckets, "every bucket should start during backward"


def test_bucketed_ddp_matches_one_process_for_any_bucket_size():
    ranks = run_processes(_rank, 2, args=(CASES,), timeout=120)
    _check(ranks, CASES, 2)
    want, _ = reference("toy", "sgd")
    for rank, result in enumerate(ranks):
        assert_same_weights(result["no_sync"], want, f"no_sync accumulation, rank {rank}")
        assert "got a second gradient" in result["second_backward"] and "no_sync()" in result["second_backward"]


def test_bucketed_ddp_in_four_processes():
    cases = [("toy", "sgd", 0.002)]
    _check(run_processes(_rank, 4, args=(cases,), timeout=120), cases, 4)


def test_buckets_follow_backward_order_and_respect_the_size():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 100, 300, 50)]  # 400, 400, 1200, 200 bytes
    buckets = make_buckets(reversed(params), bucket_bytes=800)
    assert [[p.numel() for p in b.params] for b in buckets] == [[50], [300], [100, 100]]
    assert [b.buffer.numel() for b in buckets] == [50 + 1, 300 + 1, 200 + 2]  # gradients, then one counter each
    assert buckets[2].grad_slot(1).data_ptr() == buckets[2].buffer[100:].data_ptr()


def test_bucket_size_must_be_positive():
    with pytest.raises(ValueError, match="bucket_size_mb"):
        BucketedDDP(torch.nn.Linear(2, 2), bucket_size_mb=0)

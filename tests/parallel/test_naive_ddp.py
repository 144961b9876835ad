"""NaiveDDP in 2 and 4 gloo processes ends where one process on the whole batches ends."""

import pytest

from lmlab.parallel import NaiveDDP, run_processes
from tests.parallel.common import RECIPES, build, reference, train, weights, assert_same_weights

CASES = [("toy", "sgd"), ("transformer", "adamw")]


def _rank(rank: int, world_size: int) -> dict:
    results = {}
    for model_name, recipe in CASES:
        model = NaiveDDP(build(model_name, rank))
        assert model.module is not None and model.world_size == world_size
        train(model, RECIPES[recipe](model.module), model_name, rank, world_size,
              sync=model.finish_gradient_synchronization)
        results[model_name] = weights(model.module)
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_naive_ddp_matches_one_process_on_the_whole_batch(world_size):
    ranks = run_processes(_rank, world_size, timeout=120)
    for model_name, recipe in CASES:
        want, _ = reference(model_name, recipe)
        for rank, got in enumerate(ranks):
            # the toy model covers a frozen layer, a random buffer, a shared weight and a branch some
            # ranks (or all) leave without a gradient; the Transformer, tied embeddings
            assert_same_weights(got[model_name], want, f"{model_name}, rank {rank} of {world_size}")

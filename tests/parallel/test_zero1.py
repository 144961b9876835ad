"""ZeRO1 in 2 and 4 gloo processes: the weights of one process on the whole batches, about
1/world_size of the optimizer state on each rank, and state dicts in the unsharded format."""

import pytest
import torch
import torch.distributed as dist

from lmlab.parallel import NaiveDDP, ZeRO1, assign_owners, optimizer_state_numel, run_processes
from tests.parallel.common import RECIPES, assert_same_weights, build, reference, train, weights

# (model, sharded recipe, its unsharded twin): lmlab's AdamW with two param groups, torch's SGD,
# and lmlab's `muon` registry entry (a CompositeOptimizer of Muon and AdamW).
CASES = [("transformer", "zero1_adamw", "adamw"), ("toy", "zero1_sgd", "sgd"), ("transformer", "zero1_muon", "muon")]


def _check_state_dicts(optimizer: ZeRO1, model: torch.nn.Module, recipe: str) -> dict:
    """Reload this rank's shard, and the consolidated state, into fresh ZeRO1s; return rank 0's consolidated dict."""
    shard = optimizer.state_dict()
    optimizer.consolidate_state_dict(to=0)
    consolidated = [optimizer.state_dict()]
    dist.broadcast_object_list(consolidated, src=0)
    for saved in (shard, consolidated[0]):
        fresh = RECIPES[recipe](model)
        fresh.load_state_dict(saved)
        assert fresh.state.keys() == optimizer.state.keys()  # only the owned parameters' state is kept
        for p, state in optimizer.state.items():
            for key, value in state.items():
                torch.testing.assert_close(fresh.state[p][key], value, rtol=0, atol=0)
        # settings reach the local optimizer (a scheduler had lowered lr; a fresh one has the initial lr)
        assert [g["lr"] for g in fresh.optimizer.param_groups] == [g["lr"] for g in optimizer.param_groups]
    return consolidated[0]


def _rank(rank: int, world_size: int, cases: list, saved: dict | None = None) -> dict:
    results = {}
    if saved is not None:  # a consolidated state dict from another world size: keep the owned part
        optimizer = RECIPES["zero1_adamw"](build("transformer", rank))
        optimizer.load_state_dict(saved)
        results["reloaded"] = optimizer.state_dict()["state"]
    for model_name, recipe, _ in cases:
        model = NaiveDDP(build(model_name, rank))  # ZeRO1 needs the gradients averaged over ranks
        optimizer = RECIPES[recipe](model.module)
        assert isinstance(optimizer, ZeRO1)
        train(model, optimizer, model_name, rank, world_size, sync=model.finish_gradient_synchronization)
        consolidated = _check_state_dicts(optimizer, model.module, recipe)
        results[recipe] = (weights(model.module), optimizer_state_numel(optimizer), consolidated)
    # Adagrad fills its state in the constructor: ZeRO1 must drop what other ranks own.
    results["adagrad"] = optimizer_state_numel(ZeRO1(build("toy", rank).parameters(), torch.optim.Adagrad))
    return results


def _check(ranks: list[dict], cases: list, world_size: int) -> None:
    for model_name, recipe, unsharded in cases:
        want, reference_optimizer = reference(model_name, unsharded)
        total = optimizer_state_numel(reference_optimizer)
        for rank, result in enumerate(ranks):
            assert_same_weights(result[recipe][0], want, f"{recipe}, rank {rank} of {world_size}")
        shares = [result[recipe][1] for result in ranks]
        assert sum(shares) == total, "every parameter's state lives on exactly one rank"
        if model_name == "transformer":  # many similar tensors: the balance is close
            assert max(shares) <= 1.15 * total / world_size, f"{recipe}: per-rank state {shares} of {total}"
        # Rank 0's consolidated state dict is the unsharded optimizer's, in format and values.
        consolidated, full = ranks[0][recipe][2], reference_optimizer.state_dict()
        assert consolidated["param_groups"] == full["param_groups"]
        torch.testing.assert_close(consolidated["state"], full["state"])
    adagrad = [result["adagrad"] for result in ranks]
    assert sum(adagrad) == optimizer_state_numel(torch.optim.Adagrad(build("toy").parameters()))
    assert max(adagrad) < sum(adagrad)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_processes(_rank, 2, args=(CASES,), timeout=120)


def test_zero1_matches_one_process_and_shards_the_state(two_ranks):
    _check(two_ranks, CASES, 2)


def test_zero1_in_four_processes_and_a_checkpoint_from_two(two_ranks):
    cases = [("transformer", "zero1_adamw", "adamw")]
    saved = two_ranks[0]["zero1_adamw"][2]  # consolidated on rank 0 of the 2-process run
    ranks = run_processes(_rank, 4, args=(cases, saved), timeout=120)
    _check(ranks, cases, 4)
    shards = [result["reloaded"] for result in ranks]
    assert sum(len(shard) for shard in shards) == len(saved["state"])  # each parameter's state on one rank
    torch.testing.assert_close({i: s for shard in shards for i, s in shard.items()}, saved["state"])


def test_owners_balance_elements_largest_first():
    assert assign_owners([10, 1, 7, 3, 3], 2) == [0, 1, 1, 1, 0]  # 10, 3 | 7, 3, 1: loads 13 and 11
    assert assign_owners([5, 5, 5, 5], 4) == [0, 1, 2, 3]
    assert assign_owners([4, 4], 3) == [0, 1]  # a rank may own nothing
    assert assign_owners([], 2) == []

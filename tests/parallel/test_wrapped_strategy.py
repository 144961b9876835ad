"""WrappedDDPStrategy under Lightning's gradient accumulation: a wrapper with no_sync synchronizes once per step."""

from contextlib import contextmanager

import torch

from lmlab.parallel.strategies import WrappedDDPStrategy


class CountingWrapper:
    """Stands in for NaiveDDP/BucketedDDP: counts synchronizations and no_sync blocks."""

    def __init__(self, with_no_sync: bool):
        self.synced = self.blocked = 0
        if with_no_sync:
            self.no_sync = self._no_sync

    @contextmanager
    def _no_sync(self):
        self.blocked += 1
        yield

    def finish_gradient_synchronization(self):
        self.synced += 1


def _accumulate(wrapper, micro_batches: int) -> None:
    strategy = WrappedDDPStrategy(lambda model: model, shard_optimizer=False)
    strategy.model = wrapper
    loss = torch.zeros(())
    for _ in range(micro_batches - 1):  # as Lightning runs the micro-batches before the step's last
        with strategy.block_backward_sync():
            strategy.post_backward(loss)
    strategy.post_backward(loss)


def test_a_wrapper_with_no_sync_synchronizes_once_per_step():
    wrapper = CountingWrapper(with_no_sync=True)
    _accumulate(wrapper, micro_batches=4)
    assert (wrapper.blocked, wrapper.synced) == (3, 1)


def test_a_wrapper_without_no_sync_synchronizes_every_micro_batch():
    wrapper = CountingWrapper(with_no_sync=False)
    _accumulate(wrapper, micro_batches=4)
    assert wrapper.synced == 4

"""The Lightning strategy of `parallel=nd parallel.pp=N`: pipeline parallelism (lmlab.parallel.pipeline_parallel)
composed with data parallelism, through Lightning's DDP plumbing (processes, ranks, checkpoints).

A pipeline schedule runs every micro-batch's forward AND backward in one call, which Lightning's training step
does not expect: its closure runs training_step, then zero_grad, then backward. So the LightningModule asks the
strategy for `pipeline_step(inputs, targets, loss_terms)` in training_step (the schedule runs there, its loss is
logged as usual, its gradients are held aside), and this strategy's `backward` adds them into .grad where
autograd's backward would have run, between Lightning's on_before_backward and on_after_backward hooks, scaled by
1 / trainer.accumulate_grad_batches as Lightning scales a loss. Validation asks for `pipeline_eval(inputs,
targets)`, a forward-only pass through the pipeline.
"""

from __future__ import annotations

import torch
from lightning.pytorch.strategies import Strategy
from torch import nn

from lmlab.parallel.pipeline_parallel import PipelineParallel
from lmlab.parallel.strategies import ShardedWrapperStrategy


class PipelineStrategy(ShardedWrapperStrategy):
    """Each rank holds its stages (`parallelize_model`, from LanguageModelTask.configure_model) and trains on its
    replica's share of every batch; checkpoints, loading and gradient clipping go through the PipelineParallel as
    through any ShardedWrapperStrategy's wrapper (whole tensors, the whole model's norm)."""

    def __init__(self, pp: int, schedule: str, n_microbatches: int, stages_per_rank: int, **kwargs):
        super().__init__(shard=None, **kwargs)  # no wrapper module: the pipeline is built by parallelize_model
        self.pp, self.schedule, self.n_microbatches, self.stages_per_rank = pp, schedule, n_microbatches, stages_per_rank

    @property
    def distributed_sampler_kwargs(self) -> dict:
        """The ranks of one pipeline take the same rows: replica d (rank % dp) the d-th share of each batch."""
        dp = self.world_size // self.pp
        return {"num_replicas": dp, "rank": self.global_rank % dp}

    def parallelize_model(self, model: nn.Module) -> None:
        self.sharded = PipelineParallel(model, self.pp, self.n_microbatches, self.schedule, self.stages_per_rank,
                                        device=self.root_device)

    def pipeline_step(self, inputs: torch.Tensor, targets: torch.Tensor, loss_terms) -> dict[str, torch.Tensor]:
        """Run the schedule on a batch (see the module docstring); each loss term's batch mean, on every rank."""
        return self.sharded.train_step(inputs, targets, loss_terms)

    def pipeline_eval(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The batch's mean next-token cross-entropy, forward only, on every rank."""
        return self.sharded.eval_loss(inputs, targets)

    def backward(self, closure_loss: torch.Tensor, optimizer, *args, **kwargs) -> torch.Tensor:
        """Strategy.backward with the schedule's gradients in place of autograd's backward (already run)."""
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)  # on_before_backward
        self.sharded.accumulate_gradients(1 / module.trainer.accumulate_grad_batches)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)  # on_after_backward
        self.post_backward(closure_loss)
        return closure_loss

    def synchronizer(self) -> PipelineParallel:
        return self.sharded  # no wrapper module: the pipeline averages each stage's gradients over its replicas

    def _setup_model(self, model: nn.Module) -> nn.Module:
        return model  # the schedule runs the stages; nothing wraps the LightningModule

    def setup(self, trainer) -> None:
        # Not DDPStrategy.setup: outside fit it broadcasts rank 0's weights to every rank, which holds other stages.
        Strategy.setup(self, trainer)

    def model_to_device(self) -> None:
        if self.sharded is not None:  # the held tensors; placeholders made there stay one element under module.to
            self.sharded.place(self.root_device)
        super().model_to_device()

    def teardown(self) -> None:
        if self.sharded is not None:  # before Lightning moves the module to the CPU, which would expand them
            self.sharded.place(torch.device("cpu"))
        super().teardown()

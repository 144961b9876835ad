"""Evaluation tasks inside a training run: `lmlab-train eval=[mmlu,gsm8k] eval.mmlu.path=... trainer.eval_every=N`.

The tasks (lmlab.eval) are built and checked before training starts. Every `trainer.eval_every` steps,
and after the last step, rank 0 runs them on its replica of the model in eval mode, without gradients,
and logs each headline number as `eval/<task>/<metric>`; the other ranks wait at a barrier. A strategy
that shards the parameters (fsdp) leaves no rank with the whole model, so it is refused up front.
"""

from __future__ import annotations

import logging

import lightning as L
import torch
from omegaconf import DictConfig

from lmlab.errors import ConfigError
from lmlab.eval.registry import EvalTask, build_tasks, check_tasks, selected
from lmlab.eval.scoring import Scorer

log = logging.getLogger(__name__)


def check_eval(cfg: DictConfig, parallel) -> None:
    """The run's evaluation settings against the model and the parallel strategy, no task built (no data read):
    cheap enough for every job of a sweep before the first starts."""
    if selected(cfg.eval) and parallel.shards_parameters:
        raise ConfigError(f"eval during training runs the whole model on rank 0, and parallel={cfg.parallel.name} "
                          "shards its parameters; evaluate the saved checkpoint with `lmlab eval` instead")
    check_tasks(cfg.eval, cfg.model.max_seq_len)


def eval_tasks(cfg: DictConfig, parallel) -> tuple[list[EvalTask], int | None]:
    """The run's evaluation tasks, checked and built (their data read), and their limit."""
    check_eval(cfg, parallel)
    return build_tasks(cfg.eval)


class EvalDuringTraining(L.Callback):
    """Runs the tasks every `every` optimizer steps (None: after the last step only); see the module docstring."""

    def __init__(self, tasks: list[EvalTask], limit: int | None, every: int | None, max_steps: int):
        self.tasks, self.limit, self.every, self.max_steps = tasks, limit, every, max_steps
        self.last_step = -1

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        due = step >= self.max_steps or (self.every is not None and step % self.every == 0)
        if step == self.last_step or step == 0 or not due:  # mid-accumulation, or not yet
            return
        self.last_step = step
        if trainer.is_global_zero:
            metrics = self.evaluate(pl_module, trainer.datamodule)
            for logger in trainer.loggers:  # straight to the loggers: Lightning's self.log keeps only logging steps
                logger.log_metrics(metrics, step=step)
            log.info("step %d: %s", step, ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        trainer.strategy.barrier()

    def evaluate(self, pl_module, datamodule) -> dict[str, float]:
        model = pl_module.model
        scorer = Scorer(model, pl_module.tokenizer, model.max_seq_len, [pl_module.tokenizer.eot_id]
                        if pl_module.tokenizer.eot_id is not None else [],
                        validation=lambda: datamodule.val_tokens)
        try:
            with torch.no_grad():
                results = [task.run(scorer, self.limit) for task in self.tasks]
        finally:
            model.train()  # the engine put it in eval mode
        return {f"eval/{r.task}/{name}": float(value) for r in results for name, value in r.metrics.items()}

"""The LightningModule: composes model, loss, optimizer and schedule from their registries.

It never knows which norm, loss or optimizer it got; it only calls what the config selects.
"""

from __future__ import annotations

import logging
import math

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchmetrics
from omegaconf import DictConfig, OmegaConf
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from lmlab.errors import ConfigError
from lmlab.inference.quant.qat import QATS
from lmlab.kernels.registry import KERNELS, install_kernels
from lmlab.nn.moe.routers import sum_router_load_over
from lmlab.nn.transformer import Transformer
from lmlab.optim import OPTIMIZERS, SCHEDULERS, describe_groups
from lmlab.optim.schedules import warmup_steps
from lmlab.optim.stochastic_rounding import nearest_rounded_parameters
from lmlab.parallel.strategies import data_parallel_rank
from lmlab.tokenizers.base import Tokenizer, pack_tokenizer
from lmlab.training.checkpoints import CONFIG_KEY, TOKENIZER_KEY
from lmlab.training.compile import compile_for_training, graphed_model_terms
from lmlab.training.compute_dtype import CastParameters, compute_dtype, on_copies
from lmlab.training.config import TrainerConfig
from lmlab.training.fp8 import FP8
from lmlab.training.loggers import final_scalars
from lmlab.training.losses import LOSSES
from lmlab.training.noise_scale import NoiseScale
from lmlab.training.objective import model_terms, takes_hidden
from lmlab.training.progress import is_log_step
from lmlab.training.recompute import RECOMPUTE
from lmlab.training.step_guard import StepGuard

log = logging.getLogger(__name__)

GUARD_KEY = "lmlab_step_guard"  # the skipped-step counter and its running medians
METRICS_KEY = "lmlab_metrics"  # the last logged scalars (train/loss, val/loss, ...)


def step_guard_for(cfg: DictConfig) -> StepGuard:
    """The run's step guard; spikes are not judged during the learning-rate warmup."""
    t = cfg.trainer
    return StepGuard(t.skip_nonfinite, t.spike_factor, t.spike_window, warmup_steps(cfg.sched, t.max_steps),
                     t.max_consecutive_skips)


def optimizer_and_schedule(module: L.LightningModule, cfg: DictConfig, model: torch.nn.Module, kernel_ops=None) -> dict:
    """configure_optimizers' answer for `model`'s parameters: the `optim` entry (built by a strategy that
    shards optimizer state, zero1, when there is one) and the `sched` entry stepped every step."""
    build = getattr(module.trainer.strategy, "build_optimizer", OPTIMIZERS.build)
    optimizer = build(cfg.optim, model)
    if kernel_ops is not None:
        install_kernels(kernel_ops, optimizer)
    if n := nearest_rounded_parameters(optimizer):  # trainer.precision=bf16-true or 16-true
        log.warning("optim=%s writes %.3gM 16-bit weights rounded to nearest: an update under half a step of the "
                    "weight's precision (2^-9 to 2^-8 of it in bf16) is lost, every step. adam and adamw round bf16 "
                    "weights stochastically (optim.stochastic_rounding=true)", cfg.optim.name, n / 1e6)
    max_lr = cfg.optim.lr
    lr_at = SCHEDULERS.build(cfg.sched, max_lr, cfg.trainer.max_steps)
    scheduler = LambdaLR(optimizer, lambda step: lr_at(step) / max_lr)
    log.info("optimizer parameter groups (peak learning rates):\n%s", describe_groups(optimizer))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _whole(norm: torch.Tensor) -> torch.Tensor:
    """A gradient norm over all shards: of sharded gradients (fsdp) it comes back a DTensor."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


class LanguageModelTask(L.LightningModule):
    def __init__(self, cfg: DictConfig, tokenizer: Tokenizer):
        super().__init__()
        self.cfg = cfg
        # Read at every step, where each OmegaConf lookup costs host time a small model's step cannot spare
        self.trainer_cfg = TrainerConfig(**OmegaConf.to_container(cfg.trainer, resolve=True))
        self.tokenizer = tokenizer  # saved in every checkpoint: the weights mean nothing without its ids
        self.model = Transformer(cfg.model, tokenizer.vocab_size)
        self.qat = QATS.build(cfg.qat)
        self.fp8 = FP8.build(cfg.fp8)
        if self.qat.install(self.model) and cfg.fp8.name != "none":  # qat=int8/int4: Linears train fake-quantised
            raise ConfigError(f"qat={cfg.qat.name} and fp8={cfg.fp8.name} both replace the model's Linears; pick one")
        if n := self.fp8.install(self.model):  # fp8=tensorwise/rowwise: the blocks' matmuls in float8
            log.info("fp8=%s: %d block Linears train with float8 matmuls", cfg.fp8.name, n)
        if n := RECOMPUTE.build(cfg.recompute).install(self.model):
            log.info("recompute=%s: %d blocks recompute their activations in the backward", cfg.recompute.name, n)
        self.loss_fn = LOSSES.build(cfg.loss)
        if takes_hidden(self.loss_fn):
            self.model.output_head()  # loss.fused_head: fails now, not at the first step, where the head cannot fuse
        self.kernel_ops = KERNELS.build(cfg.kernels)
        for note in install_kernels(self.kernel_ops, self.model, self.loss_fn):
            log.info("kernels: %s", note)
        # Validation always reports plain next-token cross-entropy, whatever the training loss adds.
        self.val_loss = torchmetrics.MeanMetric()
        self.token_cross_entropy = lambda logits, targets: F.cross_entropy(logits.float(), targets)  # validation's
        self.last_val_step: int | None = None
        self.guard = step_guard_for(cfg)
        self._micro_terms: list[dict[str, torch.Tensor]] = []  # this optimizer step's micro-batches so far
        self._loss: torch.Tensor | None = None  # this step's loss over all micro-batches and ranks, for the guard
        self._noise: NoiseScale | None = None  # trainer.grad_noise_scale's estimator, made once the world is known
        self._small_sq_norm = math.nan  # the step's first micro-batch's squared gradient norm
        self._graphed_terms = None  # trainer.cuda_graphs: the step's forward and loss, compiled whole
        dtype = compute_dtype(self.trainer_cfg.compute_dtype)
        self._cast = None if dtype is None else CastParameters(self.model, dtype)
        self._configured = False

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def _slice(self, batch: tuple[torch.Tensor, torch.Tensor]):
        """(inputs, targets, positions): under context parallelism this rank's slice of every sequence."""
        context_slice = getattr(self.trainer.strategy, "context_slice", None)
        return (*batch, None) if context_slice is None else context_slice(*batch)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.qat.at_step(self.model, self.global_step)  # qat.start_step: full precision before it
        inputs, targets, positions = self._slice(batch)
        pipeline_step = getattr(self.trainer.strategy, "pipeline_step", None)
        if pipeline_step is not None:  # pipeline parallelism: its schedule runs the forward and the backward
            terms = pipeline_step(inputs, targets, self.loss_fn)
        elif self._graphed_terms is not None:
            terms = self._graphed_terms(inputs, targets, positions)
        else:
            terms = on_copies(self._cast, model_terms)(self.model, self.loss_fn, inputs, targets, positions)
        self._micro_terms.append({name: value.detach() for name, value in terms.items()})
        if len(self._micro_terms) == self.trainer_cfg.accumulate_grad_batches:  # the optimizer steps after this one
            self._log_step_terms()
            self._log_learning_rates()
            self._log_moe_stats()
        return terms["loss"]

    def _log_step_terms(self) -> None:
        """Log each loss term of the optimizer step: the mean over its micro-batches and over all
        ranks (one all-reduce), i.e. the loss of the global batch, whatever the device count."""
        names = list(self._micro_terms[0])
        means = torch.stack([torch.stack([t[n] for t in self._micro_terms]).float().mean() for n in names])
        self._micro_terms.clear()
        if self.trainer.world_size > 1:
            means = self.trainer.strategy.reduce(means, reduce_op="mean")
        step_terms = dict(zip(names, means))
        self._loss = step_terms["loss"]
        if self._logs_this_step():
            self.log("train/loss", step_terms.pop("loss"), prog_bar=True)
            self.log_dict({f"train/{name}": value for name, value in step_terms.items()})

    def _logs_this_step(self) -> bool:
        """Whether this optimizer step's scalars reach the logger: Lightning writes every log_every_n_steps-th
        step's, and the run's results read the last step's. Other steps skip `self.log`, whose bookkeeping
        costs a small model's step as much host time as the step itself (trainer.cuda_graphs)."""
        return is_log_step(self.global_step + 1, self.trainer.log_every_n_steps, self.trainer_cfg.max_steps)

    def _log_learning_rates(self) -> None:
        """`lr` is the first group's; with several optimizers (Muon + AdamW) also `lr/<optimizer>`."""
        if not self._logs_this_step():
            return
        groups = self.optimizers().param_groups
        self.log("lr", groups[0]["lr"])
        first_of = {}
        for group in groups:
            first_of.setdefault(group.get("optimizer"), group["lr"])
        if len(first_of) > 1:
            self.log_dict({f"lr/{name}": lr for name, lr in first_of.items()})

    def on_after_backward(self) -> None:
        """With trainer.grad_noise_scale: the squared gradient norm of the step's first micro-batch, taken before
        the others accumulate and before ranks reduce (Lightning syncs only the last micro-batch's backward)."""
        t = self.trainer_cfg
        if t.grad_noise_scale and len(self._micro_terms) == 1:
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            # Lightning scales each micro-batch's loss by 1/K: the micro-batch's own mean gradient is K times this
            norm = float(_whole(torch.nn.utils.get_total_norm(grads)))
            self._small_sq_norm = norm ** 2 * t.accumulate_grad_batches ** 2

    def _log_noise_scale(self, step_norm: float) -> None:
        t = self.trainer_cfg
        if self._noise is None:
            from lmlab.data import SOURCES

            _, data = SOURCES.resolve(self.cfg.data)
            tokens = data.batch_size * data.context_length  # the global batch
            self._noise = NoiseScale(tokens / (t.accumulate_grad_batches * data_parallel_rank(self.trainer)[1]), tokens)
        if math.isfinite(self._small_sq_norm) and math.isfinite(step_norm):
            scale = self._noise.update(self._small_sq_norm, step_norm ** 2)  # every step: moving averages
            if self._logs_this_step():
                self.log("train/grad_noise_scale", scale)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip to trainer.grad_clip by global norm, log the norm before clipping, and empty the
        gradients of a step the guard rejects, so that the optimizer step changes nothing."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        clip = getattr(self.trainer.strategy, "clip_grad_norm", torch.nn.utils.clip_grad_norm_)  # zero3: global
        norm = _whole(clip(params, self.trainer_cfg.grad_clip or math.inf))
        logs = self._logs_this_step()
        if logs:
            self.log("train/grad_norm", norm)
        if self.trainer_cfg.grad_noise_scale:
            self._log_noise_scale(float(norm))
        if not self.guard.active:
            return
        loss, norm = float(self._loss), float(norm)
        skip, why = self.guard.judge(loss, norm)
        if skip:
            optimizer.zero_grad(set_to_none=True)
            log.warning("step %d skipped (%s): loss %.4g, gradient norm %.4g; %d skipped so far",
                        self.global_step, why, loss, norm, self.guard.skipped)
        elif why:
            log.warning("step %d: %s (loss %.4g, gradient norm %.4g)", self.global_step, why, loss, norm)
        if logs:
            self.log("train/skipped_steps", float(self.guard.skipped))

    def _log_moe_stats(self) -> None:
        """Expert loads and router statistics, straight to the logger on the steps whose scalars it
        writes (`_logs_this_step`) only: a deep MoE has hundreds of them, and reading them costs a device sync."""
        if self.logger is None or not self._logs_this_step():
            return
        stats = self.model.moe_stats()
        if stats:
            self.logger.log_metrics({name: float(value) for name, value in stats.items()}, step=self.global_step)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        inputs, targets, positions = self._slice(batch)
        pipeline_eval = getattr(self.trainer.strategy, "pipeline_eval", None)
        if pipeline_eval is not None:  # pipeline parallelism: no rank holds the whole model
            loss = pipeline_eval(inputs, targets)
        else:
            logits = on_copies(self._cast, self.model)(inputs, positions)
            loss = self.token_cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.val_loss.update(loss, weight=targets.numel())

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        bytes_per_token = self.trainer.datamodule.val_bytes_per_token
        self.log_dict({
            "val/loss": loss,
            "val/ppl": loss.exp(),  # of the same mean over tokens
            # Bits per byte of text: comparable across tokenizers, unlike loss per token.
            "val/bpb": loss / math.log(2) / bytes_per_token,
        }, prog_bar=True)
        self.val_loss.reset()
        self.last_val_step = self.global_step

    def configure_model(self) -> None:
        """Let a sharding strategy (fsdp) shard the model, then compile it if asked (in that order,
        so the compiled graphs see the sharded parameters)."""
        if self._configured:
            return
        parallelize = getattr(self.trainer.strategy, "parallelize_model", None)
        if parallelize is not None:
            parallelize(self.model)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Ranks train on different rows (or slices of them): routers balance on the whole batch's load. Ranks
            # that share rows (tensor parallelism) only scale the sum, which the sign-only bias step ignores.
            sum_router_load_over(self.model, dist.group.WORLD)
        group = getattr(self.model, "vocab_parallel_group", None)
        if group is not None:  # tensor parallelism left each rank a slice of the vocabulary's logits
            self._use_vocab_parallel_loss(group)
        if self.trainer_cfg.cuda_graphs:  # validation runs the model eager
            self._graphed_terms = graphed_model_terms(self.model, self.loss_fn, self._cast)
        elif self.trainer_cfg.compile:
            compile_for_training(self.model, self.loss_fn)
        self._configured = True

    def _use_vocab_parallel_loss(self, group) -> None:
        from lmlab.parallel.vocab_parallel import vocab_parallel_cross_entropy

        if not hasattr(self.loss_fn, "use_vocab_parallel"):
            raise ConfigError(f"the loss {type(self.loss_fn).__name__} cannot take logits split by vocabulary "
                              "(parallel.tp > 1); cross_entropy can")
        self.loss_fn.use_vocab_parallel(group)
        self.token_cross_entropy = lambda logits, targets: vocab_parallel_cross_entropy(
            logits, targets, -100, 0.0, False, group=group)[0]

    def configure_optimizers(self):
        return optimizer_and_schedule(self, self.cfg, self.model, self.kernel_ops)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint[CONFIG_KEY] = OmegaConf.to_container(self.cfg, resolve=True)
        checkpoint[TOKENIZER_KEY] = pack_tokenizer(self.tokenizer)
        checkpoint[GUARD_KEY] = self.guard.state_dict()
        # The run's latest numbers, so a finished run asked to resume can report them without training.
        checkpoint[METRICS_KEY] = final_scalars(self.trainer)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if GUARD_KEY in checkpoint:
            self.guard.load_state_dict(checkpoint[GUARD_KEY])

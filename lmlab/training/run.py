"""`train(cfg, output_dir)`: everything `lmlab-train` does for one job.

All checks a user can fail (names, fields, paths, sizes, checkpoint compatibility) run before
the corpus is tokenized or a step is taken.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from lmlab.data import SOURCES, LMDataModule
from lmlab.errors import ConfigError
from lmlab.inference.quant.qat import QATS
from lmlab.kernels.registry import KERNELS, install_kernels
from lmlab.nn.transformer import Transformer
from lmlab.optim import OPTIMIZERS, SCHEDULERS
from lmlab.parallel.strategies import PARALLEL, Parallel
from lmlab.tokenizers import TOKENIZERS
from lmlab.tokenizers.base import expected_vocab_size
from lmlab.training.checkpoints import CONFIG_KEY, checkpoint_tokenizer, model_weights, read_checkpoint
from lmlab.training.compute_dtype import check_compute_dtype
from lmlab.training.evaluation import EvalDuringTraining, eval_tasks
from lmlab.training.loggers import ValidationStep, build_logger, final_scalars
from lmlab.training.losses import LOSSES
from lmlab.training.module import LanguageModelTask, step_guard_for
from lmlab.training.precision import Float32Metrics, resolve_precision
from lmlab.training.interrupt import GracefulStop
from lmlab.training.profile import StepProfiler
from lmlab.training.progress import StepProgress, quiet_library_noise
from lmlab.training.resume import ScheduleFromResumedStep, finished_run, resolve_auto_resume
from lmlab.training.throughput import Throughput

log = logging.getLogger(__name__)


def check_checkpoint(cfg: DictConfig, key: str) -> None:
    """The checkpoint at `cfg[key]` exists and was written by a run of the same model and tokenizer
    settings (the tokenizer itself then comes from the checkpoint: see `load_data`)."""
    path = Path(cfg[key])
    saved = read_checkpoint(path, key)[CONFIG_KEY]
    keep_settings = {"model": "the checkpoint's model settings",  # what to run with instead, per group
                     "tokenizer": "the checkpoint's tokenizer settings (it brings its tokenizer, whatever data= is)"}
    for group, keep in keep_settings.items():
        now = OmegaConf.to_container(cfg[group], resolve=True)
        diffs = _differences(_without_speed_only(saved[group]), _without_speed_only(now), group)
        if diffs:
            raise ConfigError(
                f"checkpoint {path} was trained with a different {group} config:\n  " + "\n  ".join(diffs)
                + f"\nrun with {keep}, or start without {key}")


def _without_speed_only(settings):
    """A registry entry's settings minus those its Config lists as `speed_only` (e.g. the BPE's
    num_workers): a checkpoint's tokenizer does not conflict with them."""
    if not isinstance(settings, dict) or "name" not in settings or settings["name"] not in TOKENIZERS:
        return settings
    speed_only = getattr(TOKENIZERS.get(settings["name"]).config, "speed_only", ())
    return {k: v for k, v in settings.items() if k not in speed_only}


def _differences(old, new, prefix: str) -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        if old.get("name") != new.get("name"):  # two registry entries: the entry differs, not its fields
            return [f"{prefix}: checkpoint {old.get('name')!r}, now {new.get('name')!r}"]
        return [d for k in sorted(old.keys() | new.keys())
                for d in _differences(old.get(k), new.get(k), f"{prefix}.{k}")]
    return [] if old == new else [f"{prefix}: checkpoint {old!r}, now {new!r}"]


def preflight(cfg: DictConfig):
    """Every check a user can fail that needs no data: returns the data source and its config."""
    OmegaConf.to_object(cfg.trainer)  # TrainerConfig's range checks
    source = SOURCES.build(cfg.data)
    _, data_cfg = SOURCES.resolve(cfg.data)
    if data_cfg.context_length > cfg.model.max_seq_len:
        raise ConfigError(
            f"data.context_length={data_cfg.context_length} is larger than model.max_seq_len={cfg.model.max_seq_len}; "
            "raise model.max_seq_len or shorten the context")
    if cfg.ckpt_path and cfg.init_from:
        raise ConfigError("set ckpt_path (resume a run) or init_from (new run from saved weights), not both")
    for key in ("ckpt_path", "init_from"):
        if cfg[key]:
            check_checkpoint(cfg, key)
    with torch.device("meta"):  # shapes and head counts, without allocating the model
        model = Transformer(cfg.model, vocab_size=cfg.model.vocab_size or expected_vocab_size(cfg.tokenizer))
    for module in model.modules():  # parts whose settings depend on the context (e.g. a sliding window)
        if hasattr(module, "check_context"):
            module.check_context(data_cfg.context_length)
    install_kernels(KERNELS.build(cfg.kernels), model, LOSSES.build(cfg.loss))  # e.g. an unsupported head dim
    QATS.build(cfg.qat).install(model)  # e.g. a qat.group_size that does not divide a Linear's inputs
    step_guard_for(cfg)
    try:  # optimizer arguments and group rules on the (meta) model itself, and the schedule
        OPTIMIZERS.build(cfg.optim, model)
        SCHEDULERS.build(cfg.sched, cfg.optim.lr, cfg.trainer.max_steps)
    except ConfigError:
        raise
    except ValueError as err:  # torch-style optimizers reject bad arguments with ValueError
        raise ConfigError(f"optim: {err}") from None
    return source, data_cfg


def check_parallel(cfg: DictConfig, batch_size: int) -> Parallel:
    """The parallel entry, after the checks that must pass before any process group exists."""
    parallel = PARALLEL.build(cfg.parallel)
    t = cfg.trainer
    if not isinstance(t.devices, int) or t.devices < 1 or t.num_nodes < 1:
        raise ConfigError(f"trainer.devices and trainer.num_nodes must be positive integers, got {t.devices} and {t.num_nodes}")
    world = t.devices * t.num_nodes
    if not parallel.distributed and world > 1:
        raise ConfigError(f"parallel=single runs one process, but trainer.devices={t.devices} and trainer.num_nodes="
                          f"{t.num_nodes}; pick a data-parallel strategy, e.g. parallel=ddp")
    if t.grad_noise_scale and parallel.shards_parameters and world > 1:
        raise ConfigError(f"trainer.grad_noise_scale measures one rank's gradient of its first micro-batch, before the "
                          f"ranks combine theirs; parallel={cfg.parallel.name} shards or reduces the gradients during "
                          "backward (or splits the model or the sequences), so no rank holds that gradient. Use ddp, "
                          "naive_ddp, bucketed_ddp or zero1, or set trainer.grad_noise_scale=false")
    if cfg.loss.get("fused_head") and parallel.shards_parameters and world > 1:
        raise ConfigError(f"loss.fused_head projects with the whole head's weight after the model's forward; "
                          f"parallel={cfg.parallel.name} shards the weights (or splits the model or the sequences). "
                          "Use ddp, naive_ddp, bucketed_ddp or zero1, or set loss.fused_head=false")
    if t.compile and not parallel.supports_compile:
        raise ConfigError(f"trainer.compile=true does not work with parallel={cfg.parallel.name}; set "
                          "trainer.compile=false")
    check_compute_dtype(t.compute_dtype, cfg.recompute.name, cfg.parallel.name, parallel.shards_parameters,
                        t.precision)
    cuda = uses_cuda(t.accelerator)
    if t.accelerator in ("gpu", "cuda") and not cuda:
        raise ConfigError(f"trainer.accelerator={t.accelerator} needs CUDA GPUs; this machine has none")
    if t.cuda_graphs and not cuda:
        raise ConfigError("trainer.cuda_graphs=true needs a CUDA GPU; this run has none (set trainer.cuda_graphs=false)")
    if t.cuda_graphs and parallel.distributed:  # parallel=single with several processes is refused above
        raise ConfigError(f"trainer.cuda_graphs=true runs on one GPU; parallel={cfg.parallel.name} with {world} "
                          "process(es) communicates inside the step. Use parallel=single or trainer.cuda_graphs=false")
    available = torch.cuda.device_count() if cuda else os.cpu_count() or 1
    if t.devices > available:
        what = "GPUs" if cuda else "CPU cores (one per process)"
        raise ConfigError(f"trainer.devices={t.devices} is more than the {available} {what} of this machine")
    parallel.check(cfg, world)
    data_ranks = parallel.data_parallel_size(world)
    parts = data_ranks * t.accumulate_grad_batches
    if batch_size % parts:
        raise ConfigError(f"data.batch_size={batch_size} is not divisible by {parts} ({data_ranks} data-parallel "
                          f"ranks of world size {world} = trainer.devices x trainer.num_nodes, times "
                          f"trainer.accumulate_grad_batches={t.accumulate_grad_batches}); every micro-batch of every "
                          "rank gets an equal slice")
    return parallel


def uses_cuda(accelerator: str) -> bool:
    return torch.cuda.is_available() and accelerator in ("auto", "gpu", "cuda")


def load_data(cfg: DictConfig, source, data_cfg) -> tuple:
    """The tokenizer and the data module (tokenized corpus, from cache when there). A run that
    resumes (ckpt_path) or starts from a checkpoint (init_from) uses the checkpoint's tokenizer,
    whatever `data=` is, so the weights keep their token ids; otherwise it is trained or loaded."""
    key = next((k for k in ("ckpt_path", "init_from") if cfg[k]), None)
    tokenizer = checkpoint_tokenizer(read_checkpoint(cfg[key], key), cfg[key]) if key else None
    if tokenizer is None:
        tokenizer = TOKENIZERS.build(cfg.tokenizer, source, cfg.cache_dir, cfg.trainer.progress_bar)
    else:
        log.info("tokenizer from %s: %s, %d tokens", cfg[key], type(tokenizer).__name__, tokenizer.vocab_size)
    datamodule = LMDataModule(source, tokenizer, data_cfg, cfg.cache_dir, cfg.seed, cfg.trainer.val_batches,
                              progress=cfg.trainer.progress_bar, micro_batches=cfg.trainer.accumulate_grad_batches)
    return tokenizer, datamodule


def train(cfg: DictConfig, output_dir: str | Path) -> dict[str, float]:
    """One process's training run: the whole job, or one rank of a distributed one."""
    output_dir = Path(output_dir)
    quiet_library_noise()
    cfg = resolve_auto_resume(cfg, output_dir)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    source, data_cfg = preflight(cfg)
    parallel = check_parallel(cfg, data_cfg.batch_size)
    tasks, eval_limit = eval_tasks(cfg, parallel)
    if cfg.ckpt_path and (saved := finished_run(cfg.ckpt_path, cfg.trainer.max_steps)) is not None:
        return saved

    tokenizer, datamodule = load_data(cfg, source, data_cfg)
    task = LanguageModelTask(cfg, tokenizer)
    if cfg.init_from:
        task.model.load_state_dict(model_weights(read_checkpoint(cfg.init_from, "init_from")))
        log.info("model weights from %s", cfg.init_from)
    flops_per_token = task.model.flops_per_token(data_cfg.context_length)
    log.info("model: %.2fM parameters (%.2fM without embeddings), %.2f MFLOP per token trained",
             task.model.num_parameters() / 1e6, task.model.num_parameters(exclude_embeddings=True) / 1e6,
             flops_per_token / 1e6)

    log.info("corpus: %d training tokens, %d validation tokens, %.2f bytes/token (%.2f in the validation windows, "
             "val/bpb's)", len(datamodule.train_tokens), len(datamodule.val_tokens), datamodule.bytes_per_token,
             datamodule.val_bytes_per_token)

    t = cfg.trainer
    throughput = Throughput(t.log_every, flops_per_token)
    logger = build_logger(cfg.logger, output_dir)
    strategy = parallel.lightning_strategy(t.devices * t.num_nodes, uses_cuda(t.accelerator))
    trainer = build_trainer(cfg, output_dir, logger, strategy, before=[throughput], after=[
        *([StepProfiler(output_dir, t.max_steps)] if cfg.profile else []),
        *([EvalDuringTraining(tasks, eval_limit, t.eval_every, t.max_steps)] if tasks else []),
    ])
    if trainer.is_global_zero:
        tokenizer.save(output_dir)

    initial = None
    if not cfg.ckpt_path:
        initial = trainer.validate(task, datamodule=datamodule, verbose=False)[0]["val/loss"]
    trainer.fit(task, datamodule=datamodule, ckpt_path=cfg.ckpt_path)  # its last step validates
    trainer.save_checkpoint(output_dir / "checkpoints" / "last.ckpt", weights_only=False)

    metrics = final_scalars(trainer)
    results = {
        "initial_val_loss": math.nan if initial is None else float(initial),
        "val_loss": metrics["val/loss"],
        "val_bpb": metrics["val/bpb"],
        "train_loss": metrics.get("train/loss", math.nan),  # what was minimised, with any MoE/MTP terms
        "train_lm_loss": metrics.get("train/lm_loss", metrics.get("train/loss", math.nan)),  # next-token loss alone
        "tokens_per_s": throughput.last_tokens_per_s or math.nan,
        "skipped_steps": task.guard.skipped,
    }
    # The whole config with these final numbers, one row per run (TensorBoard's HParams tab).
    logger.finish(OmegaConf.to_container(cfg, resolve=True),
                  {f"hp/{k}": v for k, v in results.items() if k != "initial_val_loss"}, trainer.global_step)
    log.info(summary(results, output_dir))
    if task.guard.skipped:
        log.warning("%d of %d steps were skipped by the step guard (see train/skipped_steps)", task.guard.skipped,
                    trainer.global_step)
    return results


class StopAtLastStep(L.Callback):
    """Stop at the last optimizer step through `should_stop`, before Lightning's own max_steps check ends the loop:
    Lightning then validates after that step (once, when val_every also lands there) and writes its scalars to the
    loggers even when log_every does not land on it, so every task's final numbers come from a validation inside fit
    (and show on the progress bar). Mid-accumulation global_step is still below max_steps."""

    def __init__(self, max_steps: int):
        self.max_steps = max_steps

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step >= self.max_steps:
            trainer.should_stop = True


def build_trainer(cfg: DictConfig, output_dir: Path, logger, strategy, before: list = (), after: list = ()) -> L.Trainer:
    """The Lightning Trainer of every task: step-counted validation, checkpoints every
    trainer.checkpoint_every steps and on Ctrl-C/SIGTERM, lmlab's step progress; callbacks `before` run
    ahead of those (what the progress lines print must be logged first), `after` behind them."""
    t = cfg.trainer
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")
    return L.Trainer(
        max_steps=t.max_steps,
        accumulate_grad_batches=t.accumulate_grad_batches,
        val_check_interval=min(t.val_every, t.max_steps) * t.accumulate_grad_batches,  # counted in micro-batches
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=t.log_every,
        precision=resolve_precision(t.precision),
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=strategy,
        logger=logger,
        callbacks=[
            *before,
            ModelCheckpoint(dirpath=output_dir / "checkpoints", filename="step{step:06d}", auto_insert_metric_name=False,
                            every_n_train_steps=t.checkpoint_every, save_top_k=-1),
            StepProgress(t.max_steps, t.log_every, bar=t.progress_bar),
            GracefulStop(output_dir / "checkpoints" / "last.ckpt", t.max_steps),
            StopAtLastStep(t.max_steps),
            ScheduleFromResumedStep(),
            Float32Metrics(),
            ValidationStep(),
            *after,
        ],
        enable_progress_bar=False,  # StepProgress counts steps; Lightning's bar counts epochs and batches
        enable_model_summary=False,  # the parameter count is logged above; its FLOPs column reads 0
        default_root_dir=str(output_dir),
        # no_grad rather than inference_mode: metric states made in the first, standalone
        # validation must stay updatable in the validations inside fit.
        inference_mode=False,
    )


def summary(results: dict[str, float], output_dir: Path) -> str:
    before = "" if math.isnan(results["initial_val_loss"]) else f"{results['initial_val_loss']:.3f} -> "
    train_loss = f"train/loss {results['train_lm_loss']:.3f}"
    if results["train_loss"] != results["train_lm_loss"]:
        train_loss += f" (LM only; {results['train_loss']:.3f} with the MoE/MTP terms)"
    return (f"val/loss {before}{results['val_loss']:.3f}, val/bpb {results['val_bpb']:.3f}, {train_loss}, "
            f"{results['tokens_per_s']:.0f} tokens/s; outputs in {output_dir}")

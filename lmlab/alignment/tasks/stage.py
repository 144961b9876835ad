"""What every post-training `task` shares: the policy loaded from `init_from` (weights, tokenizer and the
config it was trained with), held-out examples split off the stage's JSONL data, lmlab-train's Trainer,
and checkpoints that `lmlab eval`, `lmlab generate` and the next stage's `init_from` read as they read a
pre-training checkpoint."""

from __future__ import annotations

import copy
import logging
import math
import random
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
import torchmetrics
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import MISSING, DictConfig, OmegaConf
from torch import nn
from torch.utils.data import DataLoader

from lmlab.alignment.chat import CHAT_TEMPLATES, ChatTemplate
from lmlab.checks import in_open_interval
from lmlab.errors import ConfigError
from lmlab.tokenizers.base import Tokenizer, pack_tokenizer
from lmlab.training.checkpoints import CONFIG_KEY, TOKENIZER_KEY, load, read_checkpoint
from lmlab.training.loggers import build_logger, final_scalars
from lmlab.training.module import METRICS_KEY, optimizer_and_schedule
from lmlab.training.progress import quiet_library_noise
from lmlab.training.recompute import RECOMPUTE
from lmlab.training.resume import resolve_auto_resume
from lmlab.training.run import build_trainer
from lmlab.training.tasks import Task, check_single_process

log = logging.getLogger(__name__)

# The groups a stage takes from its own command line; every other one (model, tokenizer, data) is the
# policy's, so a stage's checkpoint loads like the one it started from.
STAGE_GROUPS = ("task", "optim", "sched", "loss", "rl_loss", "pref_loss", "reward", "trainer", "logger", "seed",
                "init_from", "recompute")
POLICY_GROUPS = ("model", "tokenizer", "data")  # init_from's; a stage reads its examples from task.data


def check_policy_overrides(name: str) -> None:
    """Refuse command-line overrides of the policy's groups, which the stage would ignore (lmlab-train's
    own overrides, under Hydra; a config passed in Python is the caller's)."""
    if not HydraConfig.initialized():
        return
    overrides = OverridesParser.create().parse_overrides(list(HydraConfig.get().overrides.task))
    ignored = [o.key_or_group for o in overrides if re.split(r"[./]", o.key_or_group)[0] in POLICY_GROUPS]
    if ignored:
        raise ConfigError(f"task={name} trains init_from's model with its tokenizer, so {', '.join(ignored)} would be "
                          "ignored; drop the override (the stage's examples come from task.data)")


@dataclass
class StageConfig:
    data: str = MISSING  # a JSONL file of the stage's examples
    template: str = "plain"  # the chat_template entry that formats prompts (lmlab list chat_template)
    val_fraction: float = 0.05  # examples held out for validation

    def __post_init__(self) -> None:
        in_open_interval("task", self, "val_fraction", 0.0, 1.0)


class PostTraining(Task):
    """Base of the post-training entries: checks, loads the policy, builds the stage's module and data
    (`build`), fits them and saves `checkpoints/last.ckpt`."""

    recomputes = True

    def build(self, cfg: DictConfig, policy: nn.Module, tokenizer: Tokenizer,
              template: ChatTemplate) -> tuple[StageModule, L.LightningDataModule]:
        raise NotImplementedError

    def check(self, cfg: DictConfig) -> None:
        """Checks of the entry's own that need no weights (`check_config` runs the common ones first)."""

    def check_config(self, cfg: DictConfig) -> None:
        """init_from, one process and task.data, then the entry's own `check`."""
        if not cfg.init_from:
            raise ConfigError(f"task={cfg.task.name} starts from a trained model: set init_from=PATH/TO/last.ckpt")
        read_checkpoint(cfg.init_from, "init_from")  # a missing or foreign file, named by its setting
        check_single_process(cfg)
        if not Path(self.cfg.data).is_file():
            raise ConfigError(f"task.data={self.cfg.data} is not a file")
        self.check(cfg)

    def run(self, cfg: DictConfig, output_dir: str | Path) -> dict[str, float]:
        output_dir = Path(output_dir)
        quiet_library_noise()
        # A frozen reference (or a critic's initial copy) is in eval mode on purpose.
        warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode", category=UserWarning)
        cfg = resolve_auto_resume(cfg, output_dir)
        name = cfg.task.name
        check_policy_overrides(name)  # not in check_config: it reads the running job's command line
        self.check_config(cfg)
        L.seed_everything(cfg.seed, workers=True, verbose=False)
        policy, tokenizer, base = load(cfg.init_from)
        policy.train()
        RECOMPUTE.build(cfg.recompute).install(policy)  # before build, which may copy the policy as a frozen reference
        module, datamodule = self.build(cfg, policy, tokenizer, CHAT_TEMPLATES.build(self.cfg.template))
        module.base_config = OmegaConf.to_container(base, resolve=True)
        logger = build_logger(cfg.logger, output_dir)
        trainer = build_trainer(cfg, output_dir, logger, "auto")
        tokenizer.save(output_dir)
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
        trainer.save_checkpoint(output_dir / "checkpoints" / "last.ckpt", weights_only=False)
        results = final_scalars(trainer)
        # lmlab-train's number for a sweep: the held-out loss (RL stages have none; they report val/accuracy).
        results["val_loss"] = results.get("val/loss", math.nan)
        logger.finish(OmegaConf.to_container(cfg, resolve=True), {f"hp/{k}": v for k, v in results.items()},
                      trainer.global_step)
        log.info("task=%s: %s; outputs in %s", name, ", ".join(
            f"{k} {v:.4g}" for k, v in sorted(results.items()) if k.startswith("val/")), output_dir)
        return results


class StageModule(L.LightningModule):
    """The LightningModule base of the stages: `model` is the policy (the Transformer that checkpoints
    save under `model.`), optimised by the `optim` and `sched` entries."""

    def __init__(self, cfg: DictConfig, policy: nn.Module, tokenizer: Tokenizer):
        super().__init__()
        self.cfg = cfg
        self.model = policy
        self.tokenizer = tokenizer
        self.base_config: dict = {}
        self.val_metrics = torchmetrics.MetricCollection({}, prefix="val/")

    def trainable(self) -> nn.Module:
        """The parameters the optimizer steps (a reward model's or critic's head included)."""
        return self.model

    def configure_optimizers(self):
        return optimizer_and_schedule(self, self.cfg, self.trainable())

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.log("train/grad_norm", torch.nn.utils.clip_grad_norm_(params, self.cfg.trainer.grad_clip or math.inf))

    def update_val(self, values: dict[str, torch.Tensor | float], weight: float = 1.0) -> None:
        """Add one validation batch's values to their running (weighted) means."""
        for key, value in values.items():
            if key not in self.val_metrics:
                self.val_metrics.add_metrics({key: torchmetrics.MeanMetric().to(self.device)})
            self.val_metrics[key].update(torch.as_tensor(value, dtype=torch.float32, device=self.device), weight)

    def on_validation_epoch_end(self) -> None:
        self.log_dict(self.val_metrics.compute(), prog_bar=True)
        self.val_metrics.reset()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        stage = OmegaConf.to_container(self.cfg, resolve=True)
        checkpoint[CONFIG_KEY] = {**self.base_config, **{k: stage[k] for k in STAGE_GROUPS if k in stage}}
        checkpoint[TOKENIZER_KEY] = pack_tokenizer(self.tokenizer)
        checkpoint[METRICS_KEY] = final_scalars(self.trainer)


def frozen_copy(model: nn.Module) -> nn.Module:
    """A reference model: the policy as it starts, out of the optimizer and the gradients."""
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference


def held_out(items: Sequence, fraction: float, seed: int) -> tuple[list, list]:
    """(training, validation) items: a seeded shuffle, at least one in each part."""
    if len(items) < 2:
        raise ConfigError(f"task.data holds {len(items)} example(s); a stage needs at least 2 (one held out)")
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    n_val = min(max(1, round(len(items) * fraction)), len(items) - 1)
    return [items[i] for i in order[n_val:]], [items[i] for i in order[:n_val]]


class ItemsData(L.LightningDataModule):
    """Training items in seeded random batches (reshuffled each pass), validation items in order;
    `collate` turns a list of items into a batch."""

    def __init__(self, train: Sequence, val: Sequence, batch_size: int, collate: Callable, seed: int,
                 val_batch_size: int | None = None):
        super().__init__()
        self.train, self.val, self.batch_size, self.collate, self.seed = train, val, batch_size, collate, seed
        self.val_batch_size = val_batch_size or batch_size

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, drop_last=len(self.train) >= self.batch_size,
                          collate_fn=self.collate, generator=generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.val_batch_size, collate_fn=self.collate)


"""What a person watching a run sees: optimizer steps out of `trainer.max_steps`, not Lightning's epochs.

On a terminal a tqdm bar counts steps (`120/300`, starting at the resumed step) with the latest
train/loss, lr and val/loss beside it. When stderr is not a terminal (output redirected to a file,
a batch job) or `trainer.progress_bar=false`, a plain log line is printed every `log_every` steps
and after every validation instead, so a log file shows the run's progress too.
"""

from __future__ import annotations

import logging
import sys
import warnings

import lightning as L
from tqdm import tqdm

log = logging.getLogger(__name__)

LIGHTNING_RANK_ZERO_LOGGER = "lightning.pytorch.utilities.rank_zero"


def is_log_step(step: int, log_every: int, max_steps: int) -> bool:
    """Whether optimizer step `step` (counted from 1) is one whose scalars the loggers write and the plain progress
    lines show: every `log_every`-th, and the last (StopAtLastStep stops the run there, so Lightning writes it too)."""
    return step % log_every == 0 or step >= max_steps


def _not_an_advert(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("💡 Tip")


def quiet_library_noise() -> None:
    """Drop what a user cannot act on: Lightning's advert for its cloud logger, torch's deprecation
    of a class Lightning still uses internally, and Lightning's notes on resuming into another run folder (its
    checkpoint callback's folder is named after the run, so the resumed run's never matches the checkpoint's)."""
    rank_zero = logging.getLogger(LIGHTNING_RANK_ZERO_LOGGER)
    if _not_an_advert not in rank_zero.filters:
        rank_zero.addFilter(_not_an_advert)
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"Be aware that when using `ckpt_path`, callbacks used to create")
    warnings.filterwarnings("ignore", message=r"The dirpath has changed from")


# Post-training adds its own: the rollouts' mean reward, held-out accuracy, the preference accuracy.
SHOWN = ("train/loss", "train/reward", "lr", "val/loss", "val/bpb", "val/accuracy", "val/reward_accuracy",
         "val/answer_acc", "val/recon_mse", "val/codebook_usage", "val/caption_accuracy", "perf/tokens_per_s")


def _metrics(trainer: L.Trainer) -> dict[str, float]:
    return {name: float(trainer.callback_metrics[name]) for name in SHOWN if name in trainer.callback_metrics}


def _fmt(name: str, value: float) -> str:
    if name == "perf/tokens_per_s":
        return f"{value:,.0f} tok/s"
    return f"{name} {value:.3g}" if name == "lr" else f"{name} {value:.4f}"


class StepProgress(L.Callback):
    """A step-counting progress bar, or plain progress lines (see the module's doc)."""

    def __init__(self, max_steps: int, log_every: int, bar: bool):
        self.max_steps = max_steps
        self.log_every = log_every
        self.bar_wanted = bar
        self._bar: tqdm | None = None
        self._shown_step = 0

    @staticmethod
    def live_bar_possible() -> bool:
        return sys.stderr.isatty()

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._shown_step = trainer.global_step
        if trainer.is_global_zero and self.bar_wanted and self.live_bar_possible():
            self._bar = tqdm(total=self.max_steps, initial=trainer.global_step, desc="train", unit="step",
                             dynamic_ncols=True, file=sys.stderr)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._shown_step or not trainer.is_global_zero:  # mid-accumulation: no optimizer step yet
            return
        if self._bar is not None:
            self._bar.update(step - self._shown_step)
            self._bar.set_postfix_str(self._postfix(trainer), refresh=False)
        elif is_log_step(step, self.log_every, self.max_steps):
            line = ", ".join(_fmt(k, v) for k, v in _metrics(trainer).items() if not k.startswith("val/"))
            log.info("step %d/%d: %s", step, self.max_steps, line)
        self._shown_step = step

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(trainer))
        else:
            val = {k: v for k, v in _metrics(trainer).items() if k.startswith("val/")}
            log.info("step %d/%d: %s", trainer.global_step, self.max_steps, ", ".join(_fmt(k, v) for k, v in val.items()))

    def _postfix(self, trainer: L.Trainer) -> str:
        return ", ".join(_fmt(k, v) for k, v in _metrics(trainer).items() if k != "val/bpb")

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._close()

    def on_exception(self, trainer: L.Trainer, module: L.LightningModule, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

"""`task=sft`: supervised fine-tuning on chat examples, the loss on the assistant's tokens only."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from lmlab.alignment.chat import ChatTemplate
from lmlab.alignment.sft_data import read_chat_jsonl, sft_rows
from lmlab.alignment.tasks.stage import ItemsData, PostTraining, StageConfig, StageModule, held_out
from lmlab.alignment.tokens import pad_id
from lmlab.checks import at_least
from lmlab.errors import ConfigError
from lmlab.training.losses import LOSSES
from lmlab.training.tasks import TASKS

log = logging.getLogger(__name__)


class SFTModule(StageModule):
    def __init__(self, cfg: DictConfig, policy, tokenizer):
        super().__init__(cfg, policy, tokenizer)
        self.loss_fn = LOSSES.build(cfg.loss)  # cross_entropy's ignore_index (-100) skips all but the assistant

    def _loss(self, batch) -> torch.Tensor:
        inputs, targets, positions = batch  # positions: packed examples' own (None: one example per row)
        return self.loss_fn(self.model(inputs, positions), targets)["loss"]

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        trained = int((batch[1] != self.loss_fn.cfg.ignore_index).sum())
        if trained:
            self.update_val({"loss": self._loss(batch)}, weight=trained)


@TASKS.register("sft")
class SFT(PostTraining):
    """Supervised fine-tuning on chat JSONL ({"turns"|"messages": [...]}); only assistant tokens are trained."""

    @dataclass
    class Config(StageConfig):
        batch_size: int = 16  # rows per optimizer step
        context_length: int | None = None  # row length; None: the model's max_seq_len
        pack: bool = False  # examples back to back in full rows (each attending only to itself), not one row each

        def __post_init__(self) -> None:
            super().__post_init__()
            at_least("task", self, 1, "batch_size", "context_length")

    def check(self, cfg: DictConfig) -> None:
        if cfg.loss.name != "cross_entropy":
            raise ConfigError(f"task=sft trains with loss=cross_entropy (its ignore_index masks the prompt), "
                              f"not loss={cfg.loss.name}")

    def build(self, cfg: DictConfig, policy, tokenizer, template: ChatTemplate):
        t = self.cfg
        context = t.context_length or policy.max_seq_len
        if context > policy.max_seq_len:
            raise ConfigError(f"task.context_length={context} is longer than the model's context ({policy.max_seq_len})")
        train, val = held_out(read_chat_jsonl(t.data), t.val_fraction, cfg.seed)
        parts = [sft_rows(examples, tokenizer, template, context, t.pack, pad_id(tokenizer)) for examples in (train, val)]
        for part, rows in zip(("training", "validation"), parts):
            log.info("sft %s: %d examples in %d rows, %d trained tokens%s", part, len(train if part == "training" else val),
                     len(rows.inputs), rows.trained_tokens, f", {rows.truncated} cut to {context} tokens" * bool(rows.truncated))
        items = [list(zip(rows.inputs, rows.targets, *([] if rows.positions is None else [rows.positions])))
                 for rows in parts]
        data = ItemsData(items[0], items[1], t.batch_size, collate=_stack, seed=cfg.seed)
        return SFTModule(cfg, policy, tokenizer), data


def _stack(rows: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(inputs, targets, positions) of a batch of rows; positions None for rows of one example each."""
    columns = [torch.stack(column) for column in zip(*rows)]
    return columns[0], columns[1], columns[2] if len(columns) == 3 else None

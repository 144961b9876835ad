"""`task=dpo` (a `pref_loss` entry against a frozen reference) and `task=reward_model` (a Bradley-Terry
scalar head) on preference JSONL: {"prompt": text or [turns], "chosen": text, "rejected": text}."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from lmlab.alignment.chat import ChatTemplate, Turn
from lmlab.alignment.preference import PREFERENCE_LOSSES, PreferencePair, preference_loss, preference_tensors
from lmlab.alignment.reward_model import ScalarHead, bradley_terry_loss, last_token_scores
from lmlab.alignment.tasks.stage import ItemsData, PostTraining, StageConfig, StageModule, frozen_copy, held_out
from lmlab.alignment.tokens import full_sequences
from lmlab.checks import at_least
from lmlab.errors import ConfigError
from lmlab.jsonl import json_lines
from lmlab.tokenizers.base import pack_tokenizer
from lmlab.training.checkpoints import CONFIG_KEY, load, read_checkpoint
from lmlab.training.tasks import TASKS

log = logging.getLogger(__name__)

EXPECT = 'a line is {"prompt": "..." or [{"role": "user", "content": "..."}, ...], "chosen": "...", "rejected": "..."}'


def read_preference_jsonl(path: str | Path, template: ChatTemplate) -> tuple[list[PreferencePair], int]:
    """The file's pairs, each prompt rendered by `template` up to the assistant's header, and how many
    pairs were skipped because both responses were the same (they carry no preference)."""
    pairs, skipped = [], 0
    for line_no, record in json_lines(Path(path).read_text(encoding="utf-8"), str(path), EXPECT):
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        ok = (isinstance(prompt, list) and all(isinstance(t, dict) and {"role", "content"} <= t.keys() for t in prompt)
              and isinstance(record.get("chosen"), str) and isinstance(record.get("rejected"), str))
        if not ok:
            raise ConfigError(f"{path} line {line_no} is not a preference pair; {EXPECT}")
        if record["chosen"] == record["rejected"]:
            skipped += 1
            continue
        text = template.render([Turn(t["role"], t["content"]) for t in prompt], add_generation_prompt=True)
        # Each response as the template writes an assistant's content; preference_tensors ends it with end-of-text.
        chosen, rejected = (template.content(Turn("assistant", record[k])) for k in ("chosen", "rejected"))
        pairs.append(PreferencePair(text, chosen, rejected))
    if skipped:
        log.warning("%s: skipped %d pair(s) whose chosen and rejected responses are the same", path, skipped)
    if not pairs:
        raise ConfigError(f"{path} holds no preference pair with two different responses")
    return pairs, skipped


@dataclass
class PreferenceConfig(StageConfig):
    batch_size: int = 16  # pairs per optimizer step

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least("task", self, 1, "batch_size")


class PreferenceStage(PostTraining):
    def data(self, cfg: DictConfig, tokenizer, template: ChatTemplate) -> ItemsData:
        pairs, _ = read_preference_jsonl(self.cfg.data, template)
        train, val = held_out(pairs, self.cfg.val_fraction, cfg.seed)
        return ItemsData(train, val, self.cfg.batch_size, collate=lambda batch: preference_tensors(batch, tokenizer)[:2],
                         seed=cfg.seed)


class DPOModule(StageModule):
    def __init__(self, cfg: DictConfig, policy, tokenizer, reference):
        super().__init__(cfg, policy, tokenizer)
        self.reference = reference  # frozen: moved with the module, never in the optimizer
        self.loss = PREFERENCE_LOSSES.build(cfg.pref_loss)

    def _step(self, batch) -> tuple[torch.Tensor, dict[str, float]]:
        chosen, rejected = batch
        return preference_loss(self.model, self.reference, chosen, rejected, self.loss)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss, metrics = self._step(batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log_dict({f"train/{k}": v for k, v in metrics.items() if k != "loss"})
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        _, metrics = self._step(batch)
        self.update_val(metrics, weight=len(batch[0]["input_ids"]))


@TASKS.register("dpo")
class DPO(PreferenceStage):
    """Direct preference optimisation (or IPO, SimPO, length-normalised DPO: pref_loss=) from init_from."""

    @dataclass
    class Config(PreferenceConfig):
        reference: str | None = None  # the reference checkpoint; None: init_from, frozen

    def check(self, cfg: DictConfig) -> None:
        PREFERENCE_LOSSES.build(cfg.pref_loss)
        if self.cfg.reference is not None:  # a missing or foreign file, named by its setting, before any weights load
            read_checkpoint(self.cfg.reference, "task.reference")

    def build(self, cfg: DictConfig, policy, tokenizer, template: ChatTemplate):
        reference = frozen_copy(policy) if self.cfg.reference is None else _reference(cfg, tokenizer)
        return DPOModule(cfg, policy, tokenizer, reference), self.data(cfg, tokenizer, template)


def _reference(cfg: DictConfig, tokenizer) -> torch.nn.Module:
    """The reference checkpoint, refused unless it has the policy's architecture and tokenizer."""
    reference, ref_tokenizer, ref_cfg = load(cfg.task.reference)
    policy_model = read_checkpoint(cfg.init_from, "init_from")[CONFIG_KEY]["model"]  # its config, not its weights again
    if OmegaConf.to_container(ref_cfg.model, resolve=True) != policy_model:
        raise ConfigError(f"task.reference={cfg.task.reference} has another architecture than init_from={cfg.init_from}")
    if pack_tokenizer(ref_tokenizer) != pack_tokenizer(tokenizer):
        raise ConfigError(f"task.reference={cfg.task.reference} has another tokenizer than init_from={cfg.init_from}")
    return frozen_copy(reference)


class RewardModelModule(StageModule):
    def __init__(self, cfg: DictConfig, policy, tokenizer):
        super().__init__(cfg, policy, tokenizer)
        self.reward = ScalarHead(policy)  # the backbone stays `model`, so the checkpoint loads as a policy too

    def trainable(self):
        return self.reward

    def _step(self, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        scores = []
        for side in batch:
            ids, lengths = full_sequences(side)
            scores.append(last_token_scores(self.reward(ids), lengths))
        chosen, rejected = scores
        loss = bradley_terry_loss(chosen, rejected).mean()
        return loss, {"loss": loss.detach(), "accuracy": (chosen > rejected).float().mean(),
                      "margin": (chosen - rejected).mean().detach()}

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss, metrics = self._step(batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log_dict({"train/accuracy": metrics["accuracy"], "train/margin": metrics["margin"]})
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        self.update_val(self._step(batch)[1], weight=len(batch[0]["input_ids"]))


@TASKS.register("reward_model")
class RewardModel(PreferenceStage):
    """A Bradley-Terry reward model: init_from's backbone plus a scalar head read at the last token."""

    Config = PreferenceConfig

    def build(self, cfg: DictConfig, policy, tokenizer, template: ChatTemplate):
        return RewardModelModule(cfg, policy, tokenizer), self.data(cfg, tokenizer, template)

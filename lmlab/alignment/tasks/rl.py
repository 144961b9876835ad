"""`task=grpo` and `task=ppo`: on-policy RL from init_from on prompt/answer JSONL. Each training step
samples `rollout_batch_size` responses (`group_size` per prompt) on lmlab's engine, scores them with a
`reward` entry, and takes `epochs` optimizer steps on them with an `rl_loss` entry (the clipped ratio
against the rollout-time log-probs), micro-batched. Validation answers the held-out prompts greedily."""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig
from torch import nn

from lmlab.alignment.chat import ChatTemplate, Turn
from lmlab.alignment.grpo import RolloutBatch, policy_update, rollout
from lmlab.alignment.logprobs import get_response_log_probs
from lmlab.alignment.pg_losses import PPO, RL_LOSSES
from lmlab.alignment.reward_model import ScalarHead
from lmlab.alignment.rewards import generalized_advantage_estimation
from lmlab.alignment.masked import masked_mean
from lmlab.alignment.tasks.stage import ItemsData, PostTraining, StageConfig, StageModule, frozen_copy, held_out
from lmlab.alignment.tokens import encode
from lmlab.alignment.verifiers import REWARDS
from lmlab.checks import at_least
from lmlab.errors import ConfigError
from lmlab.inference.engine import Engine
from lmlab.inference.samplers import SAMPLERS
from lmlab.jsonl import json_lines
from lmlab.training.checkpoints import CONFIG_KEY, read_checkpoint
from lmlab.training.tasks import TASKS

FINAL_ANSWER = "####"  # GSM8K's marker before the final answer


def read_prompts_jsonl(path: str | Path, prompt_field: str, answer_field: str) -> list[tuple[str, str]]:
    """(prompt, ground truth) of each line; an answer holding GSM8K's "#### N" keeps N alone."""
    expect = f'a line is {{"{prompt_field}": "...", "{answer_field}": "..."}} (task.prompt_field, task.answer_field)'
    items = []
    for line_no, record in json_lines(Path(path).read_text(encoding="utf-8"), str(path), expect):
        if not isinstance(record, dict) or not isinstance(record.get(prompt_field), str) or answer_field not in record:
            raise ConfigError(f"{path} line {line_no}: no {prompt_field!r} text and {answer_field!r}; {expect}")
        answer = str(record[answer_field])
        if FINAL_ANSWER in answer:
            answer = answer.rsplit(FINAL_ANSWER, 1)[1].strip().replace(",", "")
        items.append((record[prompt_field], answer))
    return items


@dataclass
class RLConfig(StageConfig):
    prompt_field: str = "prompt"
    answer_field: str = "answer"  # GSM8K's "... #### 72" gives 72
    rollout_batch_size: int = 64  # responses per step: rollout_batch_size / group_size prompts
    group_size: int = 8  # responses per prompt, normalised against each other
    epochs: int = 1  # optimizer steps on each rollout batch (after the first, off-policy: the ratio clips)
    micro_batch_size: int | None = None  # rows per forward/backward; None: the whole rollout batch
    max_new_tokens: int = 256
    temperature: float = 1.0  # of the rollouts; validation is greedy
    stop: list[str] = field(default_factory=list)  # stop strings besides the template's end of turn
    val_batch_size: int = 64
    # Rollouts replay the decode step from a CUDA graph (on CUDA): a small policy's step is otherwise all
    # kernel launches. The optimizer updates the weights in place, so one capture per shape serves the run.
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least("task", self, 1, "rollout_batch_size", "group_size", "epochs", "micro_batch_size", "max_new_tokens",
                 "val_batch_size")
        at_least("task", self, 0, "temperature")
        if self.rollout_batch_size % self.group_size:
            raise ConfigError(f"task.group_size={self.group_size} does not divide task.rollout_batch_size="
                              f"{self.rollout_batch_size}")
        if self.micro_batch_size is not None and self.rollout_batch_size % self.micro_batch_size:
            raise ConfigError(f"task.micro_batch_size={self.micro_batch_size} does not divide task.rollout_batch_size="
                              f"{self.rollout_batch_size}")


class RLModule(StageModule):
    def __init__(self, cfg: DictConfig, policy, tokenizer, template: ChatTemplate):
        super().__init__(cfg, policy, tokenizer)
        self.automatic_optimization = False  # several optimizer steps per rollout batch
        t = cfg.task
        self.loss = RL_LOSSES.build(cfg.rl_loss)
        self.reward_fn = REWARDS.build(cfg.reward)
        self.sampler = SAMPLERS.build({"name": "temperature", "temperature": t.temperature} if t.temperature > 0
                                      else "greedy")
        self.greedy = SAMPLERS.build("greedy")
        self.stop = [template.stop, *t.stop]
        self.reference = frozen_copy(policy) if self.loss.cfg.kl else None  # KL to init_from
        self._engine: Engine | None = None

    def engine(self) -> Engine:
        """One engine for the run, so its caches (and graphs) are reused from step to step."""
        if self._engine is None:
            self._engine = Engine(self.model, cuda_graphs=self.cfg.task.cuda_graphs)
        return self._engine

    def _rollout(self, batch, group_size: int, sampler) -> RolloutBatch:
        prompts, truths = batch
        return rollout(self.model, self.tokenizer, prompts, truths, self.reward_fn, group_size, sampler,
                       self.cfg.task.max_new_tokens, self.stop, self.loss.normalize_by_std and group_size > 1,
                       engine=self.engine())

    def training_step(self, batch, batch_idx: int) -> None:
        t = self.cfg.task
        start = time.perf_counter()
        rb = self._rollout(batch, t.group_size, self.sampler)
        seconds = time.perf_counter() - start
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = get_response_log_probs(self.reference, rb.tensors["input_ids"], rb.tensors["labels"],
                                             temperature=rb.temperature)["log_probs"]
        extra = self.prepare(rb)
        # trainer.max_steps counts optimizer steps (the schedule's length): the last batch takes only those left.
        epochs = min(t.epochs, self.cfg.trainer.max_steps - self.global_step)
        update = policy_update(self.model, self.optimizers(), rb, self.loss, epochs, t.micro_batch_size,
                               self.cfg.trainer.grad_clip, ref, extra_loss=extra, backward=self.manual_backward,
                               parameters=list(self.trainable().parameters()))
        for _ in range(epochs):
            self.lr_schedulers().step()
        tokens = float(rb.tensors["response_mask"].sum())
        logged = {**rb.metrics, **update, "rollout_tokens_per_s": tokens / seconds}
        self.log("train/reward", rb.metrics["reward_mean"], prog_bar=True)
        self.log("lr", self.optimizers().param_groups[0]["lr"])
        self.log_dict({f"train/{k}": v for k, v in logged.items() if not math.isnan(v)})

    def prepare(self, rb: RolloutBatch):
        """Hook before the update (PPO: values and GAE); returns the update's extra loss, or None."""
        return None

    def validation_step(self, batch, batch_idx: int) -> None:
        rb = self._rollout(batch, 1, self.greedy)
        m = rb.metrics
        self.update_val({"reward": m["reward_mean"], "accuracy": m["accuracy"], "response_length": m["response_length"]},
                        weight=len(batch[0]))


class PPOModule(RLModule):
    """Adds a critic: a copy of the policy's backbone with a zero-initialised value head."""

    def __init__(self, cfg: DictConfig, policy, tokenizer, template: ChatTemplate):
        super().__init__(cfg, policy, tokenizer, template)
        self.critic = ScalarHead(copy.deepcopy(policy))  # trained alongside the policy, from the same weights

    def trainable(self) -> nn.Module:
        return nn.ModuleDict({"policy": self.model, "critic": self.critic})

    def prepare(self, rb: RolloutBatch):
        """Per-token advantages by GAE from the terminal reward and the critic's values, whitened over the
        batch's response tokens; the value loss clips against these rollout-time values."""
        t, ids, mask = self.cfg.task, rb.tensors["input_ids"], rb.tensors["response_mask"]
        with torch.no_grad():
            values = self.critic(ids) * mask
        last = mask.shape[1] - 1 - mask.flip(1).int().argmax(1)
        rewards = torch.zeros_like(values)
        rewards[torch.arange(len(last), device=ids.device), last] = rb.raw_rewards.to(values.dtype)
        advantages, returns = generalized_advantage_estimation(rewards, values, mask, t.gamma, t.lam)
        mean = masked_mean(advantages, mask)
        std = masked_mean((advantages - mean) ** 2, mask).sqrt()
        rb.advantages = (advantages - mean) / (std + 1e-8) * mask
        return lambda rows: self.loss.value_loss(self.critic(ids[rows]), values[rows], returns[rows], mask[rows])


class RLStage(PostTraining):
    module = RLModule

    def check(self, cfg: DictConfig) -> None:
        if cfg.trainer.accumulate_grad_batches != 1:
            raise ConfigError(f"task={cfg.task.name} accumulates with task.micro_batch_size, not "
                              "trainer.accumulate_grad_batches")
        loss = RL_LOSSES.build(cfg.rl_loss)
        if isinstance(loss, PPO) != (self.module is PPOModule):
            raise ConfigError(f"rl_loss={cfg.rl_loss.name} with task={cfg.task.name}: task=ppo takes rl_loss=ppo (it "
                              "needs the critic), task=grpo any other rl_loss entry")
        REWARDS.resolve(cfg.reward)  # the name and fields; the module builds it (a reward model loads once)
        context = read_checkpoint(cfg.init_from, "init_from")[CONFIG_KEY]["model"]["max_seq_len"]
        if self.cfg.max_new_tokens >= context:  # no room left for a prompt of even one token
            raise ConfigError(f"task.max_new_tokens={self.cfg.max_new_tokens} must be below the model's context, "
                              f"model.max_seq_len={context} (init_from's), to leave room for the prompt")

    def build(self, cfg: DictConfig, policy, tokenizer, template: ChatTemplate):
        t = self.cfg
        items = [(template.render([Turn("user", prompt)], add_generation_prompt=True), truth)
                 for prompt, truth in read_prompts_jsonl(t.data, t.prompt_field, t.answer_field)]
        if not items:
            raise ConfigError(f"task.data={t.data} holds no prompts")
        room = policy.max_seq_len - t.max_new_tokens
        too_long = sum(len(encode(tokenizer, p, special_tokens=True)) > room for p, _ in items)
        if too_long:
            raise ConfigError(f"{too_long} of {len(items)} prompts are longer than {room} tokens, the model's context "
                              f"({policy.max_seq_len}) less task.max_new_tokens={t.max_new_tokens}")
        train, val = held_out(items, t.val_fraction, cfg.seed)
        data = ItemsData(train, val, t.rollout_batch_size // t.group_size, collate=_columns, seed=cfg.seed,
                         val_batch_size=t.val_batch_size)
        return self.module(cfg, policy, tokenizer, template), data


def _columns(items: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    return [p for p, _ in items], [a for _, a in items]


@TASKS.register("grpo")
class GRPO(RLStage):
    """GRPO-style RL (rl_loss=grpo_clip, dr_grpo, reinforce, reinforce_baseline) on prompt/answer JSONL."""

    Config = RLConfig


@TASKS.register("ppo")
class PPOStage(RLStage):
    """PPO (with rl_loss=ppo): a critic (a copy of the policy with a value head), GAE and value clipping."""

    module = PPOModule

    @dataclass
    class Config(RLConfig):
        gamma: float = 1.0
        lam: float = 0.95

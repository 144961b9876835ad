"""`task=vlm`: a LLaVA-style VLM (vision_encoder + projector + lmlab Transformer) trained to answer questions
about synthetic scenes (lmlab.multimodal.questions), scored by exact-match answer accuracy (val/answer_acc,
and val/answer_acc/<type> per question type).

    lmlab-train task=vlm task.stage=1 init_from=LM.ckpt      # stage 1: the projector alone (encoder, LM frozen)
    lmlab-train task=vlm task.stage=2 init_from=STAGE1.ckpt  # stage 2: projector + LM, from stage 1's VLM

init_from is an LM checkpoint (its Transformer and tokenizer; the marker takes the first id past the
tokenizer's), a task=vlm checkpoint (all its parts and settings: stage 2 after stage 1), or unset: a new LM
(`model` settings) with a byte tokenizer. The encoder is the `vision_encoder` entry, randomly initialised,
or a task=contrastive checkpoint's (task.encoder_from); it stays frozen unless task.train_encoder (stage 2).
"""

from __future__ import annotations

import logging
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from lmlab.alignment.tasks.stage import ItemsData, StageModule
from lmlab.alignment.tokens import eos_id
from lmlab.catalog import load_catalog
from lmlab.checks import at_least
from lmlab.errors import ConfigError
from lmlab.inference.engine import Engine
from lmlab.multimodal.dual_encoder import load_dual_encoder
from lmlab.multimodal.image_task import fit
from lmlab.multimodal.placement import IGNORE_INDEX
from lmlab.multimodal.questions import QUESTIONS, SceneQA, check_question_types, qa_items
from lmlab.multimodal.vlm import VLM, check_stage
from lmlab.nn.transformer import Transformer
from lmlab.tokenizers import ByteTokenizer
from lmlab.tokenizers.base import unpack_tokenizer
from lmlab.training.checkpoints import CONFIG_KEY, TOKENIZER_KEY, load, read_checkpoint
from lmlab.training.losses import LOSSES
from lmlab.training.progress import quiet_library_noise
from lmlab.training.resume import resolve_auto_resume
from lmlab.training.tasks import TASKS, Task, check_single_process

log = logging.getLogger(__name__)

VLM_PREFIX = "model."  # the LightningModule's attribute holding the VLM


class VLMModule(StageModule):
    """Teacher-forced cross-entropy on the answer tokens; validation also answers greedily (exact match)."""

    def __init__(self, cfg: DictConfig, vlm: VLM, tokenizer):
        super().__init__(cfg, vlm, tokenizer)
        self.loss_fn = LOSSES.build(cfg.loss)
        self.eot = eos_id(tokenizer)
        self._engine: Engine | None = None

    def engine(self) -> Engine:
        """One engine for the run, so its caches are reused from one validation to the next."""
        if self._engine is None:
            self._engine = Engine(self.model.lm)
        return self._engine

    def _loss(self, batch: dict) -> torch.Tensor:
        return self.loss_fn(self.model(batch["input_ids"], batch["images"]), batch["targets"])["loss"]

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log("lr", self.optimizers().param_groups[0]["lr"])
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        n = len(batch["answers"])
        self.update_val({"loss": self._loss(batch)}, weight=n)
        answers = self.model.generate(batch["prompts"], batch["images"], engine=self.engine(), tokenizer=self.tokenizer,
                                      max_new_tokens=self.cfg.task.max_answer_tokens, stop_token_ids=[self.eot]).texts
        right = [got.strip() == truth for got, truth in zip(answers, batch["answers"])]
        self.update_val({"answer_acc": sum(right) / n}, weight=n)
        by_kind = defaultdict(list)
        for kind, ok in zip(batch["kinds"], right):
            by_kind[kind].append(ok)
        for kind, oks in by_kind.items():
            self.update_val({f"answer_acc/{kind}": sum(oks) / len(oks)}, weight=len(oks))


class Collate:
    """A list of SceneQA items -> images, padded ids and targets (answer + end-of-text), and what validation reads."""

    def __init__(self, vlm: VLM, tokenizer, eot: int):
        self.vlm, self.tokenizer, self.eot = vlm, tokenizer, eot

    def prompt(self, question: str) -> list[int]:
        return [self.vlm.marker_id, *self.tokenizer.encode(question + "\n")]

    def answer(self, answer: str) -> list[int]:
        return [*self.tokenizer.encode(answer), self.eot]

    def __call__(self, items: list[dict]) -> dict:
        prompts = [self.prompt(item["question"]) for item in items]
        batch = self.vlm.inputs(prompts, [self.answer(item["answer"]) for item in items], pad_id=self.eot)
        return {"images": torch.stack([item["image"] for item in items]), "input_ids": batch.input_ids,
                "targets": batch.targets, "prompts": prompts, "answers": [item["answer"] for item in items],
                "kinds": [item["kind"] for item in items]}


@TASKS.register("vlm")
class VLMTask(Task):
    """A LLaVA-style VLM on synthetic scene questions: stage 1 trains the projector, stage 2 projector + LM."""

    @dataclass
    class Config:
        stage: int = 2  # 1: the projector alone (encoder and LM frozen); 2: projector + LM
        train_encoder: bool = False  # stage 2: train the vision encoder too (else it stays as initialised)
        encoder_from: str | None = None  # a task=contrastive checkpoint: its vision encoder, weights and settings
        questions: list[str] = field(default_factory=lambda: list(QUESTIONS))  # of: colour, shape, count, position
        train_size: int = 4000  # training items (a scene and one question each)
        val_size: int = 128  # held-out items (other seeds), answered greedily at each validation
        batch_size: int = 32
        val_batch_size: int = 64
        max_answer_tokens: int = 16  # generation stops at end-of-text or after this many tokens

        def __post_init__(self) -> None:
            check_stage(self.stage, self.train_encoder)
            at_least("task", self, 1, "train_size", "val_size", "batch_size", "val_batch_size", "max_answer_tokens")
            check_question_types(self.questions)

    def check_config(self, cfg: DictConfig) -> None:
        check_single_process(cfg)
        loss = LOSSES.resolve(cfg.loss)[1]
        if cfg.loss.name != "cross_entropy" or loss.ignore_index != IGNORE_INDEX:
            raise ConfigError(f"task=vlm trains with loss=cross_entropy and its ignore_index={IGNORE_INDEX} (which masks "
                              f"the prompt and image), not loss={cfg.loss.name}")
        if self.cfg.encoder_from and not any(k.startswith("model.image_encoder.") for k in
                                             read_checkpoint(self.cfg.encoder_from, "task.encoder_from")["state_dict"]):
            raise ConfigError(f"task.encoder_from={self.cfg.encoder_from} holds no image encoder; give a checkpoint "
                              "written by task=contrastive")

    def build_vlm(self, cfg: DictConfig) -> tuple[VLM, object, dict]:
        """The VLM, its tokenizer and the settings its checkpoints save (the LM's, then this run's VLM groups)."""
        run = OmegaConf.to_container(cfg, resolve=True)
        if cfg.init_from and is_vlm_checkpoint(read_checkpoint(cfg.init_from, "init_from")):
            if self.cfg.encoder_from:
                raise ConfigError(f"init_from={cfg.init_from} is a task=vlm checkpoint, which brings its own encoder; "
                                  "leave task.encoder_from unset")
            vlm, tokenizer, saved = load_vlm(cfg.init_from)
            log.info("init_from=%s is a task=vlm checkpoint: its encoder, projector and LM (and their settings)",
                     cfg.init_from)
            return vlm, tokenizer, saved
        if cfg.init_from:
            lm, tokenizer, base = load(cfg.init_from)
            base = OmegaConf.to_container(base, resolve=True)
        else:
            tokenizer = ByteTokenizer()
            lm = Transformer(cfg.model, tokenizer.vocab_size)
            base = {**run, "tokenizer": {"name": "byte", "special_tokens": tokenizer.special_tokens}}
        encoder_cfg, encoder_weights = run["vision_encoder"], None
        if self.cfg.encoder_from:  # a contrastive run's image tower, with the settings it was built with
            dual, _, dual_cfg = load_dual_encoder(self.cfg.encoder_from)
            encoder_cfg, encoder_weights = OmegaConf.to_container(dual_cfg.vision_encoder), dual.image_encoder.state_dict()
        vlm = VLM.build(encoder_cfg, run["projector"], lm, tokenizer)
        if encoder_weights is not None:
            vlm.encoder.load_state_dict(encoder_weights)
        # What the checkpoints save: the LM's settings and this VLM's, so that load_vlm rebuilds it.
        return vlm, tokenizer, {**base, "vision_encoder": encoder_cfg, "projector": run["projector"]}

    def data(self, cfg: DictConfig, vlm: VLM, tokenizer) -> ItemsData:
        t, size = self.cfg, vlm.encoder.image_size
        eot = eos_id(tokenizer)
        if eot is None:
            raise ConfigError("the tokenizer has no end-of-text token to end answers with")
        collate = Collate(vlm, tokenizer, eot)
        train = qa_items(t.train_size, cfg.seed, t.questions)
        val = qa_items(t.val_size, cfg.seed + 1, t.questions)
        answer = max(len(collate.answer(i.answer)) for i in train + val)
        if answer > t.max_answer_tokens:
            raise ConfigError(f"answers take up to {answer} tokens (with end-of-text), more than task.max_answer_tokens="
                              f"{t.max_answer_tokens}; raise it")
        prompt = max(len(collate.prompt(i.question)) for i in train + val) - 1 + vlm.n_patches  # the marker expanded
        if prompt + t.max_answer_tokens > vlm.lm.max_seq_len:
            raise ConfigError(f"a prompt of {prompt} positions ({vlm.n_patches} image patches) plus task.max_answer_tokens"
                              f"={t.max_answer_tokens} exceeds the LM's context (model.max_seq_len={vlm.lm.max_seq_len})")
        return ItemsData(SceneQA(train, size, cfg.seed), SceneQA(val, size, cfg.seed + 1), t.batch_size, collate=collate,
                         seed=cfg.seed, val_batch_size=t.val_batch_size)

    def run(self, cfg: DictConfig, output_dir: str | Path) -> dict[str, float]:
        output_dir = Path(output_dir)
        quiet_library_noise()
        warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode", category=UserWarning)
        cfg = resolve_auto_resume(cfg, output_dir)
        self.check_config(cfg)
        L.seed_everything(cfg.seed, workers=True, verbose=False)
        vlm, tokenizer, saved = self.build_vlm(cfg)
        if self.cfg.stage == 1 and not cfg.init_from:
            log.warning("task.stage=1 without init_from: the LM is new and stays frozen, so only the projector learns "
                        "(a soft prompt into a random LM); give init_from=LM.ckpt for a real stage 1")
        vlm.freeze(self.cfg.stage, self.cfg.train_encoder)
        datamodule = self.data(cfg, vlm, tokenizer)
        module = VLMModule(cfg, vlm, tokenizer)
        module.base_config = saved
        trainable = sum(p.numel() for p in vlm.parameters() if p.requires_grad)
        log.info("task=vlm stage %d: %s of %s parameters train (encoder %s, %d patches per image)", self.cfg.stage,
                 f"{trainable:,}", f"{sum(p.numel() for p in vlm.parameters()):,}",
                 "trained" if self.cfg.train_encoder else "frozen", vlm.n_patches)
        tokenizer.save(output_dir)
        _, results = fit(cfg, output_dir, module, datamodule)
        log.info("task=vlm: %s; outputs in %s", ", ".join(
            f"{k} {v:.4g}" for k, v in sorted(results.items()) if k.startswith("val/")), output_dir)
        return results


def is_vlm_checkpoint(checkpoint: dict) -> bool:
    return any(k.startswith(VLM_PREFIX + "projector.") for k in checkpoint["state_dict"])


def load_vlm(path: str | Path, device: str | torch.device = "cpu") -> tuple[VLM, object, dict]:
    """The VLM (weights loaded, eval mode, on `device`), its tokenizer and its saved settings from a task=vlm
    checkpoint."""
    checkpoint = read_checkpoint(path, "vlm checkpoint")
    if not is_vlm_checkpoint(checkpoint):
        raise ConfigError(f"{path} holds no VLM (no projector weights); it was not written by task=vlm")
    config = checkpoint[CONFIG_KEY]
    load_catalog(config.get("plugins") or [])  # the run's plugin parts (a norm, a projector) register
    tokenizer = unpack_tokenizer(checkpoint[TOKENIZER_KEY], str(path))
    weights = {k.removeprefix(VLM_PREFIX): v for k, v in checkpoint["state_dict"].items() if k.startswith(VLM_PREFIX)}
    lm = Transformer(OmegaConf.create(config["model"]), weights["lm.embed_tokens.weight"].shape[0])
    vlm = VLM.build(config["vision_encoder"], config["projector"], lm, tokenizer)
    vlm.load_state_dict(weights)
    return vlm.to(device).eval(), tokenizer, config

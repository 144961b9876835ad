"""The typed schema of `conf/train.yaml`.

Registry groups (model parts, data, tokenizer, optim, sched, loss) are `Any` here because the
chosen entry brings its own typed node; everything else is checked by this schema.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, get_args

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from lmlab.checks import at_least
from lmlab.errors import ConfigError
from lmlab.nn.transformer import ModelConfig
from lmlab.training.compute_dtype import compute_dtype


def check_lightning_names(precision: str, accelerator: str) -> None:
    """trainer.precision and trainer.accelerator against Lightning's own lists, so that a typo fails before the data
    is tokenized and the model built (Lightning checks them only as its Trainer starts)."""
    if precision == "auto" and accelerator == "auto":
        return
    from lightning.fabric.connector import _PRECISION_INPUT_STR, _PRECISION_INPUT_STR_ALIAS
    from lightning.pytorch.accelerators import AcceleratorRegistry

    for key, value, known in (
            ("precision", precision, ["auto", *get_args(_PRECISION_INPUT_STR), *get_args(_PRECISION_INPUT_STR_ALIAS)]),
            ("accelerator", accelerator, ["auto", "gpu", *AcceleratorRegistry.keys()])):
        if value not in known:
            hint = difflib.get_close_matches(value, known, n=1)
            raise ConfigError(f"trainer.{key}={value} is not one of Lightning's: {', '.join(known)}"
                              + (f". Did you mean '{hint[0]}'?" if hint else ""))


@dataclass
class TrainerConfig:
    max_steps: int = 300  # optimizer steps
    val_every: int = 50  # steps between validations (the last step always validates)
    val_batches: int = 8
    log_every: int = 10  # steps between logged scalars (and progress lines without a progress bar)
    accumulate_grad_batches: int = 1  # micro-batches per optimizer step; data.batch_size stays the global batch
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping (the pre-clip norm is logged either way)
    skip_nonfinite: bool = True  # skip optimizer steps whose loss or gradient norm is inf or nan
    spike_factor: float | None = None  # also skip steps whose loss or gradient norm exceeds this x the running median
    spike_window: int = 50  # steps in that running median
    max_consecutive_skips: int = 10  # then a spike is taken as the new level, and non-finite steps stop the run
    precision: str = "auto"  # auto: bf16-mixed on GPU, 32-true on CPU; or any Lightning precision
    accelerator: str = "auto"
    devices: Any = 1  # processes per node for a data-parallel `parallel` strategy
    num_nodes: int = 1
    checkpoint_every: int = 500  # steps; a checkpoint is also written at the end and on Ctrl-C/SIGTERM
    progress_bar: bool = True  # a live bar on a terminal; plain lines every log_every steps otherwise
    compile: bool = False  # torch.compile each block and the loss (see lmlab.training.compile)
    # with compile: the whole forward + loss and its backward compiled as one graph each and replayed from CUDA graphs,
    # for launch-bound (small) models; one GPU, static shapes, no gradient accumulation
    cuda_graphs: bool = False
    # bfloat16/float16: forward and backward on copies of the float32 parameters in this dtype, which keep the
    # updates; activations are then bf16 throughout (lmlab.training.compute_dtype). None: the parameters as they are
    compute_dtype: str | None = None
    eval_every: int | None = None  # steps between runs of the `eval` tasks (None: after the last step only)
    # log train/grad_noise_scale, B_simple in tokens (lmlab.training.noise_scale), from a micro-batch's and the
    # step's gradient norms: needs accumulate_grad_batches >= 2
    grad_noise_scale: bool = False

    def __post_init__(self) -> None:
        at_least("trainer", self, 1, "max_steps", "val_every", "val_batches", "log_every", "accumulate_grad_batches",
                 "num_nodes", "checkpoint_every", "max_consecutive_skips")
        at_least("trainer", self, 0, "grad_clip")
        if self.eval_every is not None:
            at_least("trainer", self, 1, "eval_every")
        if self.cuda_graphs and not self.compile:
            raise ConfigError("trainer.cuda_graphs replays the graphs that torch.compile makes: set trainer.compile=true "
                              "too")
        if self.cuda_graphs and self.accumulate_grad_batches > 1:
            raise ConfigError("trainer.cuda_graphs replays one forward per backward: each replay reuses the memory that "
                              "holds the last one's gradients, so micro-batches cannot accumulate. Set "
                              "trainer.accumulate_grad_batches=1 or trainer.cuda_graphs=false")
        check_lightning_names(self.precision, self.accelerator)
        compute_dtype(self.compute_dtype)
        if self.grad_noise_scale and self.accumulate_grad_batches < 2:
            raise ConfigError("trainer.grad_noise_scale compares one micro-batch's gradient with the step's: set "
                              "trainer.accumulate_grad_batches to 2 or more")


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: Any = MISSING
    tokenizer: Any = MISSING
    optim: Any = MISSING
    sched: Any = MISSING
    loss: Any = MISSING
    parallel: Any = MISSING
    kernels: Any = MISSING
    qat: Any = MISSING  # quantization-aware training: none, int8, int4
    fp8: Any = MISSING  # float8 training of the block matmuls: none, tensorwise, rowwise (torchao)
    recompute: Any = MISSING  # activation recomputation in the blocks' backward: none, full, selective
    logger: Any = MISSING
    task: Any = MISSING  # pretrain, or a post-training stage from init_from (sft, dpo, reward_model, grpo, ppo)
    rl_loss: Any = MISSING  # the policy-gradient loss of task=grpo/ppo
    pref_loss: Any = MISSING  # the preference loss of task=dpo
    reward: Any = MISSING  # the verifier that scores task=grpo/ppo rollouts
    vision_encoder: Any = MISSING  # the image encoder of task=contrastive and task=vlm
    contrastive_loss: Any = MISSING  # task=contrastive: clip, siglip
    image_data: Any = MISSING  # task=contrastive: image-text pairs (synthetic, folder, tar)
    projector: Any = MISSING  # task=vlm: vision features -> LM embeddings
    codebook: Any = MISSING  # the VQ-VAE codebook of task=vqvae: ema, straight_through
    eval: Any = field(default_factory=dict)  # evaluation tasks run during training (eval=[mmlu,gsm8k]) and eval.limit
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    seed: int = 0
    ckpt_path: str | None = None  # resume from this checkpoint (weights, optimizer, step)
    init_from: str | None = None  # start from this checkpoint's weights only (e.g. from `lmlab upcycle`)
    cache_dir: str = "${oc.env:LMLAB_CACHE,'~/.cache/lmlab'}"  # tokenized corpora, shared by runs
    plugins: list[str] = field(default_factory=list)  # modules imported before the config is composed
    profile: bool = False  # write a torch.profiler table and Chrome trace of a few steps into the run folder


ConfigStore.instance().store(name="train_schema", node=TrainConfig)

"""lmlab: a research framework for language models from scratch."""

__version__ = "0.1.0"


def load(ckpt_path, device="cpu"):
    """`(model, tokenizer, config)` from a checkpoint lmlab-train wrote: the Transformer (weights
    loaded, eval mode, on `device`), its tokenizer and the run's resolved config (an OmegaConf
    DictConfig). See `lmlab.training.checkpoints.load`."""
    from lmlab.training import checkpoints  # here, so that `import lmlab` stays light

    return checkpoints.load(ckpt_path, device)

"""Loading every registry: lmlab's built-in parts, then plugins.

Registration happens when the module that defines an entry is imported; this module names
those modules explicitly, so a registry never depends on some unrelated import having run.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from lmlab.registry import REGISTRIES, Registry, load_plugins

BUILTIN_MODULES = (
    "lmlab.tokenizers",
    "lmlab.nn",
    "lmlab.kernels.registry",
    "lmlab.data",
    "lmlab.optim",
    "lmlab.parallel.strategies",
    "lmlab.training",
    "lmlab.training.tasks",
    "lmlab.training.fp8",
    "lmlab.training.recompute",
    "lmlab.training.loggers",
    "lmlab.inference.quant",
    "lmlab.inference.samplers",
    "lmlab.serving.scheduler",
    "lmlab.eval.tasks",
    "lmlab.alignment",
    "lmlab.alignment.tasks",
    "lmlab.curation.filters",
    "lmlab.curation.corpus_filters",
    "lmlab.curation.readers",
    "lmlab.curation.executors",
    "lmlab.multimodal.codebook",
    "lmlab.multimodal.vqvae_task",
    "lmlab.multimodal.early_fusion_task",
    "lmlab.multimodal.vit",
    "lmlab.multimodal.contrastive",
    "lmlab.multimodal.data",
    "lmlab.multimodal.contrastive_task",
    "lmlab.multimodal.projector",
    "lmlab.multimodal.vlm_task",
    "lmlab.training.config",  # the schema of train.yaml
)


def load_catalog(plugins: Iterable[str] = ()) -> dict[str, Registry]:
    for module in BUILTIN_MODULES:
        importlib.import_module(module)
    load_plugins(plugins)
    return REGISTRIES

"""`lmlab-tokenize`: train a BPE tokenizer on a data source, or encode a source into the token cache.

    lmlab-tokenize train data=text_files 'data.paths=[corpus/*.txt]' tokenizer.vocab_size=32000
    lmlab-tokenize encode data=text_files 'data.paths=[corpus/*.txt]' tokenizer.path=outputs/tokenize/<date>/<time>

`train` writes vocab.json and merges.txt into its run folder; point `lmlab-train
tokenizer.path=...` (or `encode`) at that folder. `encode` writes the memory-mapped token array
that lmlab-train's data module reads, so training starts without tokenizing.
"""

from __future__ import annotations

import logging
import sys
import time

from omegaconf import DictConfig

from lmlab.cli.app import fail, run_hydra_app
from lmlab.errors import ConfigError

log = logging.getLogger(__name__)


def _train(cfg: DictConfig, output_dir: str) -> None:
    from lmlab.data import SOURCES
    from lmlab.tokenizers import TOKENIZERS, BPEConfig, train_on_source

    _, tok_cfg = TOKENIZERS.resolve(cfg.tokenizer)
    if not isinstance(tok_cfg, BPEConfig):
        raise ConfigError(f"lmlab-tokenize train trains tokenizer=bpe; tokenizer={cfg.tokenizer.name} needs no training")
    source = SOURCES.build(cfg.data)
    start = time.perf_counter()
    tokenizer = train_on_source(source, tok_cfg, progress=cfg.progress_bar)
    tokenizer.save(output_dir)
    log.info("trained %d tokens (%d merges) in %.1f s; saved vocab.json and merges.txt in %s\n"
             "use it with: lmlab-train tokenizer.path=%s", len(tokenizer.vocab), len(tokenizer.merges),
             time.perf_counter() - start, output_dir, output_dir)


def _encode(cfg: DictConfig, output_dir: str) -> None:
    from lmlab.data import SOURCES, load_or_build
    from lmlab.data.cache import cache_key
    from lmlab.tokenizers import TOKENIZERS

    source = SOURCES.build(cfg.data)
    tokenizer = TOKENIZERS.build(cfg.tokenizer, source, cfg.cache_dir, cfg.progress_bar)
    start = time.perf_counter()
    corpus = load_or_build(source, tokenizer, cfg.cache_dir, progress=cfg.progress_bar)
    seconds = time.perf_counter() - start
    log.info("%d tokens (%.2f bytes/token, %.1f MB/s) in %s/%s.bin", len(corpus.tokens), corpus.bytes_per_token,
             corpus.n_bytes / 1e6 / max(seconds, 1e-9), cfg.cache_dir, cache_key(source, tokenizer))


# `encode` writes only into the token cache, so it makes no run folder: Hydra's run dir is the
# working directory (which exists), with no .hydra/ config copy and logging to the console only.
NO_RUN_FOLDER = ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=stdout"]

# Each action: its job and the Hydra overrides it starts from (the user's come after them).
ACTIONS = {"train": (_train, []), "encode": (_encode, NO_RUN_FOLDER)}


def main() -> None:
    argv = sys.argv[1:]
    if not argv or argv[0] not in ACTIONS:
        fail("lmlab-tokenize", ConfigError(f"usage: lmlab-tokenize {{{','.join(ACTIONS)}}} [overrides...]"))
    job, overrides = ACTIONS[argv[0]]
    run_hydra_app("lmlab-tokenize", "tokenize", job, [*overrides, *argv[1:]])


if __name__ == "__main__":
    main()

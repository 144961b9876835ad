"""The LightningDataModule: random training windows, a fixed held-out validation split."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from torch.utils.data import DataLoader, TensorDataset

from lmlab.data.batches import RandomWindows, evenly_spaced_windows
from lmlab.data.cache import load_or_build
from lmlab.data.sources import DataConfig, DataSourceError, TextSource
from lmlab.parallel.strategies import data_parallel_rank
from lmlab.tokenizers import Tokenizer


class LMDataModule(L.LightningDataModule):
    """Tokenizes (or loads from cache) the whole corpus at construction, so bad data fails early."""

    def __init__(self, source: TextSource, tokenizer: Tokenizer, cfg: DataConfig, cache_dir: str | Path,
                 seed: int, val_batches: int, progress: bool = True, micro_batches: int = 1):
        super().__init__()
        self.cfg, self.seed, self.val_batches, self.micro_batches = cfg, seed, val_batches, micro_batches
        corpus = load_or_build(source, tokenizer, cache_dir, progress=progress)
        self.bytes_per_token = corpus.bytes_per_token
        split = int(len(corpus.tokens) * (1 - cfg.val_fraction))
        self.train_tokens, self.val_tokens = corpus.tokens[:split], corpus.tokens[split:]
        for part, tokens in (("training", self.train_tokens), ("validation", self.val_tokens)):
            if len(tokens) <= cfg.context_length + 1:
                raise DataSourceError(
                    f"the {part} split has {len(tokens)} tokens, too few for data.context_length={cfg.context_length}; "
                    "use more text, a shorter context or another data.val_fraction")
        # val/bpb's denominator: the bytes of the very tokens validation scores. The corpus's mean differs from the
        # split's (by 9% on the default corpus), and bits per byte compares runs only if it is the text's own.
        targets = self._val_windows()[1]
        self.val_bytes_per_token = tokenizer.text_bytes(targets.flatten()) / targets.numel()

    def train_dataloader(self) -> DataLoader:
        # global_step is restored before the loader is made, so a resumed run continues the stream.
        trainer = self.trainer
        start, (rank, world) = (trainer.global_step, data_parallel_rank(trainer)) if trainer else (0, (0, 1))
        windows = RandomWindows(self.train_tokens, self.cfg.batch_size, self.cfg.context_length, self.seed, start,
                                rank, world, self.micro_batches)
        return DataLoader(windows, batch_size=None)

    def val_dataloader(self) -> DataLoader:
        x, y = self._val_windows()
        # Accumulating runs say a whole batch does not fit at once: validate in micro-batches too.
        return DataLoader(TensorDataset(x, y), batch_size=self.cfg.batch_size // self.micro_batches)

    def _val_windows(self):
        """The fixed validation windows: (inputs, targets), each (windows, context_length)."""
        return evenly_spaced_windows(self.val_tokens, self.val_batches * self.cfg.batch_size, self.cfg.context_length)

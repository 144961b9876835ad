"""Data: text sources (registry), the token cache, batch sampling and the DataModule."""

from lmlab.data.batches import RandomWindows, get_batch
from lmlab.data.cache import TokenCorpus, load_or_build
from lmlab.data.datamodule import LMDataModule
from lmlab.data.mixture import MIXING, Mixture
from lmlab.data.sources import SOURCES, DataConfig, DataSourceError, HFDataset, PyDocs, TextFiles, TextSource

__all__ = [
    "MIXING", "Mixture", "SOURCES", "DataConfig", "DataSourceError", "HFDataset", "LMDataModule", "PyDocs", "RandomWindows",
    "TextFiles", "TextSource", "TokenCorpus", "get_batch", "load_or_build",
]

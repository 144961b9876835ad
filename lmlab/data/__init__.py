"""Data: text sources (registry), the token cache, batch sampling and the DataModule."""

from lmlab.data.batches import RandomWindows, get_batch
from lmlab.data.cache import TokenCorpus, load_or_build
from lmlab.data.mixture import MIXING, Mixture
from lmlab.data.sources import SOURCES, DataConfig, DataSourceError, HFDataset, PyDocs, TextFiles, TextSource
from lmlab.lazy import lazy_attributes

# The DataModule imports Lightning (seconds), which only training needs: generate, serve and eval start without it.
__getattr__ = lazy_attributes(__name__, {"LMDataModule": "lmlab.data.datamodule"})

__all__ = [
    "MIXING", "Mixture", "SOURCES", "DataConfig", "DataSourceError", "HFDataset", "LMDataModule", "PyDocs", "RandomWindows",
    "TextFiles", "TextSource", "TokenCorpus", "get_batch", "load_or_build",
]

"""lmlab: a research framework for language models from scratch."""

__version__ = "0.1.0"

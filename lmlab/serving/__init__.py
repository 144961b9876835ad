"""Serving: paged KV caches, continuous batching with prefix sharing, and an OpenAI-compatible server."""

from lmlab.serving.blocks import BlockManager, BlockTable, NoFreeBlocks
from lmlab.serving.engine import Completion, Event, SamplingParams, ServingConfig, ServingEngine
from lmlab.serving.scheduler import SCHEDULERS

__all__ = ["SCHEDULERS", "BlockManager", "BlockTable", "Completion", "Event", "NoFreeBlocks", "SamplingParams",
           "ServingConfig", "ServingEngine"]

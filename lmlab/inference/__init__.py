"""Generation: per-attention KV caches, the prefill/decode engine, samplers, speculative decoding
and weight quantization. Every job that generates (`lmlab generate`, evaluation, rollouts,
serving) runs on `Engine`."""

from lmlab.inference.samplers import SAMPLERS, Sampler, SamplerConfig
from lmlab.inference.engine import Engine
from lmlab.inference.generate import Generation, GenerationError, GenerationStats

__all__ = ["SAMPLERS", "Engine", "Generation", "GenerationError", "GenerationStats", "Sampler", "SamplerConfig"]

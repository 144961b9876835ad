"""Model parts: registries for norms, FFNs, positions, attention and blocks, and the Transformer."""

from lmlab.nn.attention import ATTENTION, MultiHeadAttention
from lmlab.nn.blocks import BLOCKS, PreNormBlock
from lmlab.nn.ffn import FFNS, GeluMLP, SwiGLU
from lmlab.nn.norms import NORMS, LayerNorm, RMSNorm
from lmlab.nn.positions import POSITIONS, LearnedPosition, PositionEncoding, RoPE
from lmlab.nn.transformer import ModelConfig, Transformer

__all__ = [
    "ATTENTION", "BLOCKS", "FFNS", "NORMS", "POSITIONS",
    "MultiHeadAttention", "PreNormBlock", "GeluMLP", "SwiGLU", "LayerNorm", "RMSNorm",
    "LearnedPosition", "PositionEncoding", "RoPE", "ModelConfig", "Transformer",
]

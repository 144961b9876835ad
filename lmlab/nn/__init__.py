"""Model parts: registries for norms, FFNs, positions, attention, blocks and MoE routers, and the Transformer."""

from lmlab.nn.attention import ATTENTION, MultiHeadAttention
from lmlab.nn.blocks import BLOCKS, Block, ParallelBlock, PostNormBlock, PreNormBlock, SandwichBlock
from lmlab.nn.init import INITS, GPT2Init, MuPInit, StandardInit
from lmlab.nn.ffn import FFN, FFNS, GLU, MLP, GeGLU, GeluMLP, ReluMLP, SiluMLP, SquaredReluMLP, SwiGLU
from lmlab.nn.gated_deltanet import GatedDeltaNet
from lmlab.nn.linear_attention import LinearAttention
from lmlab.nn.mamba2 import Mamba2
from lmlab.nn.mla import MultiHeadLatentAttention
from lmlab.nn.moe import ROUTERS, MoEConfig, MoELayer
from lmlab.nn.mtp import MTPConfig, MTPModule
from lmlab.nn.norms import NORMS, LayerNorm, NoNorm, RMSNorm
from lmlab.nn.positions import POSITIONS, LearnedPosition, PositionEncoding, RoPE
from lmlab.nn.sparse_attention import TopKSparseAttention
from lmlab.nn.transformer import ModelConfig, Transformer

__all__ = [
    "ATTENTION", "BLOCKS", "FFNS", "INITS", "NORMS", "POSITIONS", "ROUTERS", "MoEConfig", "MoELayer", "MTPConfig",
    "MTPModule", "GPT2Init", "MuPInit", "StandardInit",
    "MultiHeadAttention", "LinearAttention", "MultiHeadLatentAttention", "Mamba2", "GatedDeltaNet",
    "TopKSparseAttention",
    "Block", "PreNormBlock", "PostNormBlock", "SandwichBlock", "ParallelBlock",
    "FFN", "MLP", "ReluMLP", "GeluMLP", "SiluMLP", "SquaredReluMLP", "GLU", "SwiGLU", "GeGLU",
    "LayerNorm", "RMSNorm", "NoNorm",
    "LearnedPosition", "PositionEncoding", "RoPE", "ModelConfig", "Transformer",
]

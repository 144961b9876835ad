"""Mixture of experts: routers (config group `model/moe`), stacked experts and the MoE layer."""

from lmlab.nn.moe.experts import Experts, grouped_linear
from lmlab.nn.moe.layer import MoELayer, build_mlp, is_moe_layer
from lmlab.nn.moe.routers import ROUTERS, MoEConfig, Router, Routing

__all__ = ["ROUTERS", "Experts", "MoEConfig", "MoELayer", "Router", "Routing", "build_mlp", "grouped_linear",
           "is_moe_layer"]

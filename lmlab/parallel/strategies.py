"""Parallel strategies (config group `parallel`): how `lmlab-train` spreads a run over devices.

Each entry turns its Config into a Lightning strategy. Lightning's own `ddp` and `fsdp` sit next
to lmlab's readable `naive_ddp`, `bucketed_ddp`, `zero1` and `zero3`, which run through the same Lightning
plumbing (processes, ranks, samplers, checkpoints) with lmlab's wrappers doing the communication.
The model code never changes: a strategy wraps or shards the model it is handed, and the
LightningModule only asks its strategy, if the strategy offers it, to build the optimizer
(`build_optimizer`) or to shard the model (`parallelize_model`).

`data.batch_size` is the global batch: each of the world_size ranks trains on its slice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy
from torch import nn

from lmlab.errors import ConfigError
from lmlab.optim import OPTIMIZERS
from lmlab.parallel.bucketed_ddp import BucketedDDP
from lmlab.parallel.comm import own_group
from lmlab.parallel.fsdp import FSDP
from lmlab.parallel.context_parallel import apply_context_parallel, context_slice
from lmlab.parallel.context_parallel import problems as context_problems
from lmlab.parallel.expert_parallel import ExpertParallel
from lmlab.parallel.expert_parallel import problems as expert_problems
from lmlab.parallel.naive_ddp import NaiveDDP
from lmlab.parallel.pipeline import plan_problems
from lmlab.parallel.pipeline import problems as pipeline_problems
from lmlab.parallel.tensor_parallel import apply_tensor_parallel, problems
from lmlab.parallel.zero1 import ZeRO1
from lmlab.registry import Registry

PARALLEL = Registry("parallel", group="parallel",
                    doc="how training is spread over devices (trainer.devices processes per node)")

BACKENDS = ("gloo", "nccl")


@dataclass
class DistributedConfig:
    backend: str | None = None  # None: nccl on GPUs, gloo on CPUs


def data_parallel_rank(trainer) -> tuple[int, int]:
    """(this rank's index among the ranks that train on different rows of the batch, their number): under tensor
    parallelism, the ranks of one group share rows."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return kwargs.get("rank", 0), kwargs.get("num_replicas", 1)


class Parallel:
    """Base of the entries: `distributed` says whether the run has one process per device, and
    `shards_parameters` whether a rank holds only part of the weights (no rank can run the model alone)."""

    distributed = True
    shards_parameters = False
    supports_compile = True  # trainer.compile's per-block torch.compile works under this strategy

    def __init__(self, cfg: DistributedConfig | None = None):
        self.cfg = cfg
        backend = getattr(cfg, "backend", None)
        if backend is not None and backend not in BACKENDS:
            raise ConfigError(f"parallel.backend must be one of {', '.join(BACKENDS)} (or null), got '{backend}'")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ConfigError("parallel.backend=nccl needs CUDA GPUs; this machine has none (use gloo)")
        self.backend = backend

    def backend_for(self, accelerator_is_cuda: bool) -> str:
        return self.backend or ("nccl" if accelerator_is_cuda else "gloo")

    def data_parallel_size(self, world_size: int) -> int:
        """Ranks that train on different slices of the global batch (the others split the model)."""
        return world_size

    def check(self, cfg, world_size: int) -> None:
        """Checks of the run's config that must pass before any process starts (beyond the common ones)."""

    def lightning_strategy(self, world_size: int, cuda: bool) -> Strategy | str:
        raise NotImplementedError


@PARALLEL.register("single")
class Single(Parallel):
    """One device, one process (the default)."""

    distributed = False

    def lightning_strategy(self, world_size: int, cuda: bool) -> str:
        return "auto"


@PARALLEL.register("ddp")
class LightningDDP(Parallel):
    """Lightning's DistributedDataParallel: gradients all-reduced in buckets during backward."""

    @dataclass
    class Config(DistributedConfig):
        bucket_cap_mb: float = 25.0
        find_unused_parameters: bool = False

    def lightning_strategy(self, world_size: int, cuda: bool) -> Strategy:
        return DDPStrategy(process_group_backend=self.backend_for(cuda), bucket_cap_mb=self.cfg.bucket_cap_mb,
                           find_unused_parameters=self.cfg.find_unused_parameters)


class WrappedDDPStrategy(DDPStrategy):
    """Lightning's DDP plumbing with an lmlab wrapper (NaiveDDP, BucketedDDP) instead of torch's DDP,
    and optionally the optimizer sharded by ZeRO1."""

    def __init__(self, wrap: Callable[[nn.Module], nn.Module], shard_optimizer: bool, **kwargs):
        super().__init__(**kwargs)
        self._wrap = wrap
        self._shard_optimizer = shard_optimizer
        self._synchronize = True  # False inside block_backward_sync: the step's last micro-batch synchronizes

    def _setup_model(self, model: nn.Module) -> nn.Module:
        return self._wrap(model)

    def _register_ddp_hooks(self) -> None:
        """torch DDP's communication hooks do not apply to lmlab's wrappers."""

    def synchronizer(self):
        """What averages the gradients over the ranks (`finish_gradient_synchronization`): the wrapper."""
        return self.model

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's gradient accumulation: a synchronizer with `no_sync` (NaiveDDP, BucketedDDP, the pipeline) only
        accumulates the micro-batches but the last, which synchronizes the sums once; without it, every micro-batch
        synchronizes."""
        no_sync = getattr(self.synchronizer(), "no_sync", None)
        if no_sync is None:
            yield
            return
        self._synchronize = False
        try:
            with no_sync():
                yield
        finally:
            self._synchronize = True

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self._synchronize:
            self.synchronizer().finish_gradient_synchronization()  # before clipping and the optimizer step

    def build_optimizer(self, optim_cfg, model: nn.Module) -> torch.optim.Optimizer:
        return ZeRO1.from_registry(optim_cfg, model) if self._shard_optimizer else OPTIMIZERS.build(optim_cfg, model)

    def teardown(self) -> None:
        if isinstance(self.model, (NaiveDDP, BucketedDDP, FSDP, ExpertParallel)):
            self.model = self.lightning_module
        super().teardown()


class ShardedWrapperStrategy(WrappedDDPStrategy):
    """Lightning's DDP plumbing with an lmlab wrapper that leaves each rank part of the weights (FSDP,
    ExpertParallel): checkpoints hold whole weights and whole optimizer state (gathered by every rank, written by
    rank 0; loadable by one process), and the gradient norm is the whole model's. The wrapper offers
    gather_full_params, load_full_state_dict, full_optimizer_state_dict, load_full_optimizer_state_dict and
    clip_grad_norm_."""

    def __init__(self, shard: Callable[[nn.Module], FSDP | ExpertParallel], **kwargs):
        super().__init__(self._shard, shard_optimizer=False, **kwargs)
        self._make_sharded = shard
        self.sharded: FSDP | ExpertParallel | None = None  # kept after teardown: the last checkpoint is saved after fit

    def _shard(self, model: nn.Module) -> FSDP | ExpertParallel:
        self.sharded = self._make_sharded(model)
        return self.sharded

    def lightning_module_state_dict(self) -> dict:
        return self.sharded.gather_full_params(self.lightning_module)

    def load_model_state_dict(self, checkpoint: dict, strict: bool = True) -> None:
        if self.sharded is None:  # Lightning restores the weights before it wraps the model: they are whole
            super().load_model_state_dict(checkpoint, strict)
        else:
            self.sharded.load_full_state_dict(checkpoint["state_dict"], self.lightning_module, strict)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        return self.sharded.full_optimizer_state_dict(optimizer)

    def load_optimizer_state_dict(self, checkpoint: dict) -> None:
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            self.sharded.load_full_optimizer_state_dict(optimizer, state)

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        return self.sharded.clip_grad_norm_(params, max_norm)


@PARALLEL.register("zero3")
class ZeroStage3(Parallel):
    """lmlab's FSDP (ZeRO-3): each block's weights, gradients and optimizer state sharded across the ranks,
    gathered one block at a time (lmlab/parallel/fsdp.py, written to be read; `fsdp` is PyTorch's FSDP2)."""

    shards_parameters = True
    supports_compile = False  # its hooks swap each block's weights between shards and whole tensors

    @dataclass
    class Config(DistributedConfig):
        compute_dtype: str | None = None  # bfloat16: blocks run on bf16 copies of float32 master shards

    def __init__(self, cfg: Config | None = None):
        super().__init__(cfg)
        dtypes = {None: None, "float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if cfg is not None and cfg.compute_dtype not in dtypes:
            raise ConfigError(f"parallel.compute_dtype must be bfloat16, float16 or float32 (or null), "
                              f"got '{cfg.compute_dtype}'")
        self.compute_dtype = dtypes[getattr(cfg, "compute_dtype", None)]

    def lightning_strategy(self, world_size: int, cuda: bool) -> Strategy:
        return ShardedWrapperStrategy(partial(FSDP, compute_dtype=self.compute_dtype),
                                      process_group_backend=self.backend_for(cuda))


@PARALLEL.register("naive_ddp")
class NaiveDataParallel(Parallel):
    """lmlab's NaiveDDP: one all-reduce per gradient after backward (no overlap; a baseline)."""

    @dataclass
    class Config(DistributedConfig):
        pass

    def lightning_strategy(self, world_size: int, cuda: bool) -> Strategy:
        return WrappedDDPStrategy(NaiveDDP, shard_optimizer=False, process_group_backend=self.backend_for(cuda))


@dataclass
class BucketConfig(DistributedConfig):
    bucket_size_mb: float = 25.0  # gradients per asynchronous all-reduce

    def __post_init__(self):
        if not self.bucket_size_mb > 0:
            raise ConfigError(f"parallel.bucket_size_mb must be > 0, got {self.bucket_size_mb}")


@PARALLEL.register("bucketed_ddp")
class BucketedDataParallel(Parallel):
    """lmlab's BucketedDDP: bucket all-reduces start from backward hooks, overlapping backward."""

    shard_optimizer = False

    @dataclass
    class Config(BucketConfig):
        pass

    def lightning_strategy(self, world_size: int, cuda: bool) -> Strategy:
        wrap = partial(BucketedDDP, bucket_size_mb=self.cfg.bucket_size_mb)
        return WrappedDDPStrategy(wrap, shard_optimizer=self.shard_optimizer,
                                  process_group_backend=self.backend_for(cuda))


@PARALLEL.register("zero1")
class ZeroStage1(BucketedDataParallel):
    """ZeRO-1: BucketedDDP gradients, and each rank keeps the optimizer state of its share of the parameters."""

    shard_optimizer = True

    @dataclass
    class Config(BucketConfig):
        pass


class MeshStrategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy on a (data_parallel, tensor_parallel) device mesh: tensor and sequence
    parallelism within each group of tp ranks (lmlab.parallel.tensor_parallel), then FSDP2 over the dp ranks
    (every block, then the whole model, `fully_shard`ed: ZeRO-3). Checkpoints hold full state dicts."""

    def __init__(self, dp: int, tp: int, backend: str):
        super().__init__(data_parallel_size=dp, tensor_parallel_size=tp, save_distributed_checkpoint=False,
                         process_group_backend=backend)

    def parallelize_model(self, model: nn.Module) -> None:
        if self.device_mesh["tensor_parallel"].size() > 1:
            apply_tensor_parallel(model, self.device_mesh["tensor_parallel"])
        if self.device_mesh["data_parallel"].size() > 1:
            self._fully_shard(model, self.device_mesh["data_parallel"])

    @staticmethod
    def _fully_shard(model: nn.Module, mesh) -> None:
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        from lmlab.nn.blocks import Block

        for module in model.modules():  # one unit per block: gathered just before it runs, freed after
            if isinstance(module, Block):
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        # Training calls forward_train, not forward: it too must gather the root's parameters first.
        register_fsdp_forward_method(model, "forward_train")


@PARALLEL.register("fsdp")
class FullySharded(Parallel):
    """FSDP2 through Lightning: parameters, gradients and optimizer state sharded (ZeRO-3)."""

    shards_parameters = True

    @dataclass
    class Config(DistributedConfig):
        pass

    def lightning_strategy(self, world_size: int, cuda: bool) -> Strategy:
        return MeshStrategy(world_size, 1, self.backend_for(cuda))


class ContextParallelStrategy(DDPStrategy):
    """Lightning's DDP over all ranks, laid out as dp groups of cp consecutive ranks: the ranks of a group take
    the same rows, each its zigzag slice of every sequence, and attend through a ring over the group
    (lmlab.parallel.context_parallel). DDP averages the gradients over every rank: each rank's loss is the
    mean over its tokens, so the average is the whole batch's mean."""

    def __init__(self, cp: int, **kwargs):
        super().__init__(**kwargs)
        self.cp = cp
        self.cp_group = None

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.world_size // self.cp, "rank": self.global_rank // self.cp}

    def parallelize_model(self, model: nn.Module) -> None:
        self.cp_group = own_group([list(range(first, first + self.cp)) for first in range(0, self.world_size, self.cp)],
                                  self.global_rank)
        apply_context_parallel(model, self.cp_group)

    def context_slice(self, inputs: torch.Tensor, targets: torch.Tensor):
        """This rank's slice of a batch's rows: (inputs, targets, positions in the whole sequences)."""
        return context_slice(inputs, targets, self.cp_group)


@PARALLEL.register("nd")
class MeshParallel(Parallel):
    """Several kinds of parallelism on one layout of the ranks, dp x tp x cp x ep x pp = the world size: Megatron
    tensor + sequence parallelism within each group of tp ranks with FSDP2 (ZeRO-3) across the dp groups, or context
    parallelism (ring attention) within each group of cp ranks with DDP across all, or both: a (dp, cp, tp) mesh, tp
    innermost, each cp group ringing the heads its tp rank holds, FSDP2 over the dp x cp ranks of each tp rank
    (lmlab.parallel.tensor_context_strategy; rank = (d x cp + c) x tp + t), or expert parallelism: every
    MoE layer's experts split within each group of ep ranks, the rest replicated and data parallel over all ranks
    (lmlab.parallel.expert_parallel), or pipeline parallelism: the layers cut into pp x pp_stages_per_rank
    consecutive stages over pp ranks, run over pp_microbatches micro-batches by pp_schedule, in dp replicas
    (lmlab.parallel.pipeline_parallel; pipeline ranks outermost: rank = stage rank x dp + replica). The ranks of
    one tp, cp or pipeline group train on the same rows, those of an ep group each on their own: data.batch_size
    splits over dp x ep."""

    shards_parameters = True
    supports_compile = False  # trainer.compile's per-block compile is not set up for DTensor-split blocks or stages

    @dataclass
    class Config(DistributedConfig):
        dp: int = -1  # -1: the world size over tp x cp x ep x pp
        tp: int = 1  # tensor (+ sequence) parallel: consecutive ranks that split every layer's heads and FFN
        cp: int = 1  # context parallel: ranks that split each sequence (ring attention); with tp > 1, of tp groups
        ep: int = 1  # expert parallel: ranks that split every MoE layer's experts, each on its own rows; alone only
        pp: int = 1  # pipeline parallel: ranks that split the layers into consecutive stages; with dp only
        pp_schedule: str = "1f1b"  # gpipe, 1f1b, or interleaved_1f1b (with pp_stages_per_rank >= 2)
        pp_microbatches: int = 0  # micro-batches each replica's rows are cut into per step; 0: pp
        pp_stages_per_rank: int = 1  # stages each rank runs: 1, or >= 2 for interleaved_1f1b (a smaller bubble)

    def __init__(self, cfg: Config | None = None):
        super().__init__(cfg)
        self.tp, self.cp, self.ep, self.dp = (cfg.tp, cfg.cp, cfg.ep, cfg.dp) if cfg else (1, 1, 1, -1)
        self.pp = cfg.pp if cfg else 1
        if self.tp < 1 or self.cp < 1 or self.ep < 1 or (self.dp < 1 and self.dp != -1):
            raise ConfigError(f"parallel.dp={self.dp}, parallel.tp={self.tp}, parallel.cp={self.cp} and parallel.ep="
                              f"{self.ep} must be >= 1 (dp may be -1: the world size over tp x cp x ep x pp)")
        if self.pp < 1:
            raise ConfigError(f"parallel.pp={self.pp} must be >= 1")
        if self.pp > 1:
            self._check_pipeline_plan(cfg)
        if self.ep > 1 and (self.tp > 1 or self.cp > 1):
            raise ConfigError(f"parallel.ep={self.ep} with parallel.tp={self.tp} and parallel.cp={self.cp}: expert "
                              "parallelism does not compose with tensor or context parallelism yet; set tp=1 and cp=1 "
                              "(ep combines with data parallelism: dp = the world size / ep)")

    def _check_pipeline_plan(self, cfg: Config) -> None:
        if self.tp > 1 or self.cp > 1 or self.ep > 1:
            raise ConfigError(f"parallel.pp={self.pp} with parallel.tp={self.tp}, parallel.cp={self.cp} and parallel.ep="
                              f"{self.ep}: pipeline parallelism does not compose with tensor, context or expert "
                              "parallelism yet; set tp=1, cp=1 and ep=1 (pp combines with data parallelism: dp = the "
                              "world size / pp)")
        if cfg.pp_microbatches < 0 or cfg.pp_stages_per_rank < 1:
            raise ConfigError(f"parallel.pp_microbatches={cfg.pp_microbatches} must be >= 0 (0: pp) and "
                              f"parallel.pp_stages_per_rank={cfg.pp_stages_per_rank} >= 1")
        self.pp_schedule, self.pp_stages_per_rank = cfg.pp_schedule, cfg.pp_stages_per_rank
        self.pp_microbatches = cfg.pp_microbatches or self.pp  # the fewest that keep every stage busy
        if found := plan_problems(self.pp_schedule, self.pp, self.pp_stages_per_rank, self.pp_microbatches):
            raise ConfigError("; ".join(found))

    def _sizes(self, world_size: int) -> tuple[int, int]:
        """(data-parallel size, model-splitting size: tp, cp, ep or pp)."""
        split = self.tp * self.cp * self.ep * self.pp
        dp = world_size // split if self.dp == -1 else self.dp
        if dp * split != world_size:
            pp = f" x parallel.pp={self.pp}" if self.pp > 1 else ""
            raise ConfigError(f"parallel.dp={self.dp} x parallel.tp={self.tp} x parallel.cp={self.cp} x parallel.ep="
                              f"{self.ep}{pp} must equal the world size {world_size} (trainer.devices x "
                              "trainer.num_nodes)")
        return dp, split

    def data_parallel_size(self, world_size: int) -> int:
        return self._sizes(world_size)[0] * self.ep  # the ranks of an ep group split the experts, not the rows

    def check(self, cfg, world_size: int) -> None:
        from lmlab.nn.transformer import Transformer

        self._sizes(world_size)
        with torch.device("meta"):  # the model's shape, without its memory
            model = Transformer(cfg.model, cfg.model.vocab_size or 64 * self.tp)
        if self.tp > 1 and (found := problems(model, self.tp)):
            raise ConfigError("parallel.tp: " + "; ".join(found))
        if self.cp > 1:
            found = context_problems(model)
            if len(model.mtp_layers):
                found.append("model.mtp.depth > 0: multi-token prediction shifts tokens across the slices")
            length = cfg.data.context_length
            if length % (2 * self.cp):
                found.append(f"data.context_length={length} is not a multiple of 2 x cp = {2 * self.cp} "
                             "(the zigzag layout's chunks)")
            elif length // self.cp % self.tp:
                found.append(f"data.context_length={length} leaves each rank a slice of {length // self.cp} tokens, "
                             f"not divisible by parallel.tp={self.tp} (sequence parallelism splits the slice again); "
                             f"make it a multiple of {2 * self.cp} and of cp x tp = {self.cp * self.tp}")
            if found:
                raise ConfigError("parallel.cp: " + "; ".join(found))
        if self.ep > 1 and (found := expert_problems(model, self.ep)):
            raise ConfigError(f"parallel.ep={self.ep}: " + "; ".join(found))
        if self.pp > 1:
            self._check_pipeline_run(cfg, model, self._sizes(world_size)[0])

    def _check_pipeline_run(self, cfg, model: nn.Module, dp: int) -> None:
        from lmlab.data import SOURCES  # lmlab.data imports this module

        stages = self.pp * self.pp_stages_per_rank
        if found := pipeline_problems(model, stages):
            raise ConfigError(f"parallel.pp={self.pp} x parallel.pp_stages_per_rank={self.pp_stages_per_rank} = "
                              f"{stages} stages: " + "; ".join(found))
        t = cfg.trainer
        if str(t.precision) in ("16", "16-mixed"):
            raise ConfigError(f"trainer.precision={t.precision} with parallel.pp > 1: the schedule's backward runs "
                              "outside the fp16 loss scaler; use bf16-mixed or 32-true")
        batch = SOURCES.resolve(cfg.data)[1].batch_size
        parts = dp * t.accumulate_grad_batches
        if batch % parts == 0 and (rows := batch // parts) % self.pp_microbatches:  # else the common check says so
            raise ConfigError(f"data.batch_size={batch} leaves each pipeline {rows} rows per micro-step (over "
                              f"parallel.dp={dp} replicas x trainer.accumulate_grad_batches={t.accumulate_grad_batches}"
                              f"), not divisible by parallel.pp_microbatches={self.pp_microbatches}; make them divide")

    def lightning_strategy(self, world_size: int, cuda: bool) -> Strategy:
        dp, split = self._sizes(world_size)
        if self.pp > 1:
            from lmlab.parallel.pipeline_strategy import PipelineStrategy  # it builds on this module's strategies

            return PipelineStrategy(self.pp, self.pp_schedule, self.pp_microbatches, self.pp_stages_per_rank,
                                    process_group_backend=self.backend_for(cuda))
        if self.ep > 1:
            return ShardedWrapperStrategy(partial(ExpertParallel, ep=self.ep),
                                          process_group_backend=self.backend_for(cuda))
        if self.cp > 1 and self.tp > 1:
            from lmlab.parallel.tensor_context_strategy import TensorContextStrategy  # it builds on MeshStrategy

            return TensorContextStrategy(dp, self.cp, self.tp, self.backend_for(cuda))
        if self.cp > 1:
            return ContextParallelStrategy(self.cp, process_group_backend=self.backend_for(cuda))
        return MeshStrategy(dp, split, self.backend_for(cuda))

"""The inference engine: a Transformer with preallocated per-layer caches, run as prefill and decode.

    engine = Engine(model, compile=True)          # compile: torch.compile + a CUDA graph per shape
    engine = Engine(model, cuda_graphs=True)      # eager step replayed from a CUDA graph: no compile wait
    out = engine.generate([ids_a, ids_b], sampler=SAMPLERS.build("top_p"), max_new_tokens=200)

`Engine(model, batch_invariant=True)`: every token's logits are the same bits whatever the step's shape (one
token, a speculative verification, any batch), at some speed (lmlab.inference.batch_invariant).

Lower-level steps, for speculative decoding and other loops: `begin(batch, max_len, start)` resets
the caches for a batch whose prompts are left-padded so that sequence b starts at slot start[b];
`extend(ids)` runs S tokens per sequence at the next slots and returns their logits; `decode(tokens)`
runs one token per sequence (compiled and graph-replayed where enabled); `rewind(slot)` moves the
write position back. MTP modules are not run (drafting with them is lmlab.inference.speculative's).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable
from typing import Any

import torch

from lmlab.errors import ConfigError
from lmlab.inference import delta_state, linear_state, mla_cache, sparse_cache, ssm_state  # noqa: F401 - their caches register on import
from lmlab.inference.cache import CacheState, LayerCache, factory_for
from lmlab.inference.quant.linear import Int8Linear
from lmlab.kernels.registry import optional_triton_kernel, triton_unavailable
from lmlab.nn.fused import fuse_projections
from lmlab.nn.moe import MoELayer
from lmlab.nn.norms import RMSNorm
from lmlab.nn.transformer import OutputHead, Transformer

log = logging.getLogger(__name__)

CACHE_LEN_MULTIPLE = 128  # cache lengths are rounded up, so nearby lengths share compiled graphs
# Inductor's coordinate-descent tuning of its kernels' launch parameters: on an H200 it took the
# batch-1 decode step of the ~400M model from 1.58 to 0.88 ms (2026-12-01), at a longer compile.
COMPILE_OPTIONS = {"coordinate_descent_tuning": True}
# Folded norms by default from this batch size: on an H200 at 400M they gain 7-11% at batch 8 and 32, tie at 128,
# and lose 5-10% at batch 1 (experiments/inference/h200-2026-12-03h).
AUTO_FOLD_MIN_BATCH = 2


def check_generatable(model: Transformer) -> None:
    """One clear error for a model whose outputs at a position depend on later tokens."""
    for name, module in model.named_modules():
        if isinstance(module, MoELayer) and not getattr(module.router, "causal", True):
            raise ConfigError(f"{name}: model/moe={type(module.router).__name__} routes each expert's top tokens "
                              "over the whole batch, so a token's output depends on later tokens; it cannot generate")
    for block in model.layers:
        factory_for(block.self_attn)


class Engine:
    """Generation with a KV cache per layer; see the module docstring."""

    def __init__(self, model: Transformer, compile: bool = False, cuda_graphs: bool | None = None,
                 attention_kernel: bool | None = None, megakernel: bool = False, folded_norms: bool | None = None,
                 batch_invariant: bool = False, head_kernel: bool | None = None):
        """compile: torch.compile the decode step. cuda_graphs: replay it from a CUDA graph (default: when compiled on
        CUDA; without compile it still removes the Python cost of launching each kernel). attention_kernel: decode steps
        attend with the Triton flash-decoding kernel where it applies (default: on CUDA with Triton), else SDPA with a
        mask. megakernel: one-token steps run every layer in one persistent Triton kernel (lmlab.inference.megakernel;
        plain Llama stacks only). folded_norms: decode steps fold each RMSNorm into the kernels around it
        (lmlab.inference.folded_norms; plain unquantized Llama stacks with the attention kernel), for the batches the
        megakernel does not take; default: compiled on CUDA, at batches of AUTO_FOLD_MIN_BATCH or more, where the model
        allows it. batch_invariant: every step computes each token to the same bits whatever its shape
        (lmlab.inference.batch_invariant; eager steps, replayed from CUDA graphs unless cuda_graphs=False). head_kernel:
        one-token logits (batch 1) take the final norm and the head in one Triton kernel
        (lmlab.kernels.normed_head_triton: an RMSNorm before a plain head without soft-capping); default: on CUDA with
        Triton where the model allows, unless batch_invariant."""
        check_generatable(model)
        self.model = model.eval()
        weight = model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.compile = compile
        self.cuda_graphs = self.device.type == "cuda" and (compile or batch_invariant if cuda_graphs is None
                                                           else cuda_graphs)
        if batch_invariant and attention_kernel is None:  # it needs the kernel: Triton's interpreter serves on CPUs
            attention_kernel = os.environ.get("TRITON_INTERPRET") == "1" or None
        self.attention_kernel = optional_triton_kernel(self.device, attention_kernel,
                                                       "lmlab.kernels.decode_attention_triton", "decode_attention")
        self.invariant = self._batch_invariant(model, compile, megakernel, folded_norms) if batch_invariant else None
        if self.invariant is not None:
            self.attention_kernel = self.invariant.attention_kernel
        fuse_projections(model)  # q/k/v and gate/up as one matmul each
        self.megakernel = self._megakernel(model) if megakernel else None
        self.head_kernel = self._head_kernel(model, False if batch_invariant else head_kernel)
        self.folded_norms = (self._folded_norms(model, folded_norms) if self.invariant is None
                             else self.invariant.folded_norms(model))
        if compile:  # one compiled graph per (batch, cache length, tokens per step): allow many
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        self.state: CacheState | None = None
        self.caches: list[LayerCache] = []
        self.next_slot = 0
        self.shape: tuple[int, int, int] | None = None  # (batch, cache length, lookahead) of the caches
        self._steps: dict[int, _StaticStep] = {}  # tokens per sequence -> its static step
        self._prompt_step: _StaticStep | None = None  # a batch-invariant engine's prompt chunk, from a CUDA graph
        self.last_hidden: torch.Tensor | None = None  # the last extend's final hidden states (before the norm)
        self.drafted_rounds: Any = None  # speculative decoding's round as this engine drafts it (greedy_rounds)
        self.greedy_steps: Any = None  # generation's blocks of greedy decode steps (greedy_steps)

    def _batch_invariant(self, model: Transformer, compile: bool, megakernel: bool, folded_norms: bool | None):
        if compile or megakernel or folded_norms:
            raise ConfigError("batch_invariant=True runs its own kernels in eager steps: it excludes compile, "
                              "megakernel and folded_norms, whose kernels are chosen per shape")
        from lmlab.inference.batch_invariant import BatchInvariant  # here: Triton is optional

        return BatchInvariant(model, self.attention_kernel)

    def _numerics(self):
        """The context every forward runs in: the batch-invariant kernels' where asked for."""
        return self.invariant.active() if self.invariant is not None else contextlib.nullcontext()

    def _megakernel(self, model: Transformer):
        if self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError("megakernel=True needs a CUDA device (or TRITON_INTERPRET=1, Triton's CPU interpreter)")
        if self.device.type == "cuda" and (missing := triton_unavailable()):
            raise ConfigError(f"megakernel=True, but {missing}")
        from lmlab.inference.megakernel import Megakernel  # here: Triton is optional

        return Megakernel(model)

    def _head_kernel(self, model: Transformer, wanted: bool | None) -> Callable | None:
        kernel = optional_triton_kernel(self.device, wanted, "lmlab.kernels.normed_head_triton", "normed_head",
                                        option="head_kernel")
        if kernel is not None and wanted and (problem := self._head_problem()):
            raise ConfigError(f"head_kernel=True, but {problem}")
        return kernel

    def _head_problem(self, rows: torch.Tensor | None = None) -> str | None:
        """Why the model's head (now: quantizing may replace it), or these rows (n, d_model), cannot take the fused
        norm + head kernel (None: they can)."""
        model = self.model
        if type(model.norm) is not RMSNorm:
            return f"the final norm is {type(model.norm).__name__}, not rmsnorm"
        if type(model.lm_head) not in (torch.nn.Linear, Int8Linear) or model.lm_head.bias is not None:
            return "lm_head is not a bias-free Linear, plain or int8"
        if rows is None:
            return None
        from lmlab.kernels.normed_head_triton import unsupported

        return unsupported(rows, *self._head_parts())

    def _head_parts(self) -> tuple[OutputHead, torch.Tensor | None]:
        """The head kernel's view of lm_head: its weight (int8 codes where quantized), multiplier and soft-cap, and
        the codes' row scales (None: not quantized)."""
        model, head = self.model, self.model.lm_head
        scales = head.scales if type(head) is Int8Linear else None
        return OutputHead(head.weight, model.output_multiplier, model.logit_softcap), scales

    def _folded_norms(self, model: Transformer, wanted: bool | None):
        automatic = wanted is None  # on where it was measured faster: compiled CUDA steps of several sequences
        if wanted is False or automatic and not (self.compile and self.device.type == "cuda"
                                                 and self.attention_kernel is not None):
            return None
        if self.attention_kernel is None:
            raise ConfigError("folded_norms=True needs the Triton decode-attention kernel (CUDA with Triton, or "
                              "TRITON_INTERPRET=1), which applies the norms' scale")
        from lmlab.inference.folded_norms import FoldedNorms

        if automatic:
            return None if FoldedNorms.unsupported(model) else FoldedNorms(model, min_batch=AUTO_FOLD_MIN_BATCH)
        return FoldedNorms(model)

    # -- caches -------------------------------------------------------------------------------
    def cache_length(self, needed: int) -> int:
        return CACHE_LEN_MULTIPLE * math.ceil(needed / CACHE_LEN_MULTIPLE)

    @torch.inference_mode()
    def begin(self, batch_size: int, max_len: int, start: torch.Tensor | None = None, lookahead: int = 0,
              steps: tuple[int, ...] | None = None) -> None:
        """Empty caches for `batch_size` sequences of up to `max_len` slots; sequence b's first real
        slot is start[b] (left padding before it). `lookahead`: slots a forward may write and roll back;
        `steps`: the tokens per sequence of the static decode steps to prepare (default 1 and lookahead + 1).
        Caches and graphs are reused when the shape repeats."""
        shape = (batch_size, self.cache_length(max_len), lookahead)
        sizes = tuple(sorted(set(steps or (1, lookahead + 1))))
        if self.megakernel is not None:
            self.megakernel.refresh()  # before fusing: the fused groups are views of its stack
        fuse_projections(self.model)  # again where the model changed since (moved, quantized)
        if self.folded_norms is not None:
            self.folded_norms.refresh()  # the gains and weights as they are now
        if shape != self.shape or sizes != tuple(self._steps):
            self._allocate(*shape, sizes)
        else:
            for cache in self.caches:
                cache.reset()
        starts = torch.zeros(batch_size, dtype=torch.long) if start is None else start
        self.state.start.copy_(starts)
        self.next_slot = 0

    def _allocate(self, batch_size: int, length: int, lookahead: int, sizes: tuple[int, ...]) -> None:
        self.caches, self._steps = [], {}
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.shape = (batch_size, length, lookahead)
        self.state = CacheState.empty(batch_size, self.device)
        self.state.attention_kernel = self.attention_kernel
        self.caches = [factory_for(block.self_attn)(block.self_attn, self.state, batch_size, length, self.device,
                                                    self.dtype, lookahead=lookahead)
                       for block in self.model.applied_layers()]
        if self.megakernel is not None:
            self.megakernel.bind(self.caches)
        if self.folded_norms is not None:
            self.folded_norms.check(self.caches)
        if self.invariant is not None:
            self.invariant.check(self.caches)
        for size in sizes:
            self._steps[size] = _StaticStep(self, batch_size, size)
        self._prompt_step = (_StaticStep(self, batch_size, self.invariant.chunk, last_logits_only=True)
                             if self.invariant is not None and self.cuda_graphs else None)

    @torch.inference_mode()
    def select(self, index: torch.Tensor) -> None:
        """Go on with sequences `index` (B',) of the current batch, repeats allowed: a prompt prefilled
        once continues as several sequences (the choices of a question, n samples of a problem)."""
        if self.state is None:
            raise RuntimeError("Engine.begin and extend must run before select")
        index = index.to(self.device)
        old_caches, old_start, old_shape = self.caches, self.state.start, self.shape
        self._allocate(len(index), old_shape[1], old_shape[2], tuple(self._steps))
        for cache, old in zip(self.caches, old_caches):
            cache.copy_from(old, index)
        self.state.start.copy_(old_start.index_select(0, index))
        if self.last_hidden is not None:
            self.last_hidden = self.last_hidden.index_select(0, index)

    def kv_cache_bytes(self) -> int:
        return sum(cache.nbytes() for cache in self.caches)

    @property
    def rewindable(self) -> bool:
        return all(cache.rewindable for cache in self.caches)

    # -- forward passes -----------------------------------------------------------------------
    def _hidden(self, ids: torch.Tensor, embeds: torch.Tensor | None = None) -> torch.Tensor:
        model, positions = self.model, self.state.positions()
        model._route_by("layers.", ids)
        x = model.position.embed(model.token_embeddings(ids, embeds), positions)
        if self.megakernel is not None and ids.shape[1] == 1 and ids.shape[0] <= self.megakernel.max_batch:
            return self.megakernel.step(x, self.state)
        if self.folded_norms is not None and self.folded_norms.takes(*ids.shape):
            return self.folded_norms.step(x, self.state, self.caches)
        return model.run_layers(x, positions, self.caches)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden states (..., d_model)."""
        if self.head_kernel is not None:
            rows = hidden.reshape(-1, hidden.shape[-1])
            if self._head_problem(rows) is None:
                norm = self.model.norm
                logits = self.head_kernel(rows, norm.weight, norm.eps, *self._head_parts())
                return logits.view(*hidden.shape[:-1], -1)
        return self.model._head(self.model.norm(hidden)).float()

    @torch.inference_mode()
    def extend(self, ids: torch.Tensor, all_logits: bool = False, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Run ids (B, S) at the next S slots: float32 logits (B, S, V), or of the last token only (B, V).
        `embeds` (B, S, d_model): the inputs in place of the ids' embeddings (a VLM prompt's image features).
        A batch-invariant engine runs the prompt in chunks of its decode steps' size, through their kernels (whole
        chunks replayed from a CUDA graph where it replays graphs)."""
        self._check_room(ids.shape[1])
        ids = ids.to(self.device)
        embeds = None if embeds is None else embeds.to(self.device, self.dtype)
        chunk = ids.shape[1] if self.invariant is None else self.invariant.chunk
        hidden = torch.cat([self._prompt_chunk(ids[:, i:i + chunk], None if embeds is None else embeds[:, i:i + chunk])
                            for i in range(0, max(ids.shape[1], 1), chunk)], dim=1)
        self.last_hidden = hidden
        with self._numerics():
            return self.logits(hidden if all_logits else hidden[:, -1])

    def _prompt_chunk(self, ids: torch.Tensor, embeds: torch.Tensor | None) -> torch.Tensor:
        """The final hidden states of a piece of the prompt run at the next slots: a whole chunk replays the
        prompt step's graph, the rest runs eagerly."""
        step = self._prompt_step
        if step is None or embeds is not None or ids.shape[1] != step.ids.shape[1]:
            return self._forward_at_next_slots(ids, embeds)
        _, hidden = step(ids, self.next_slot)
        self.next_slot += ids.shape[1]
        return hidden.clone()  # the graph's output buffer is rewritten by its next replay

    def _forward_at_next_slots(self, ids: torch.Tensor, embeds: torch.Tensor | None) -> torch.Tensor:
        """The final hidden states of ids (B, S) run at the next S slots."""
        self.state.slots = torch.arange(self.next_slot, self.next_slot + ids.shape[1], device=self.device)
        with self._numerics():
            hidden = self._hidden(ids, embeds)
        self.next_slot += ids.shape[1]
        return hidden

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B,) -> float32 logits (B, V), or (B, S) -> (B, S, V) for S among begin's steps (by default
        lookahead + 1: a speculative step's verification). Compiled and replayed as a CUDA graph where enabled; the returned tensor
        is reused by the next call of the same size."""
        ids = tokens.view(tokens.shape[0], -1)
        step = self._steps.get(ids.shape[1])
        if step is None:
            raise ValueError(f"decode takes {' or '.join(map(str, self._steps))} tokens per sequence (begin's steps), "
                             f"got {ids.shape[1]}; use extend for other lengths")
        self._check_room(ids.shape[1])
        logits, self.last_hidden = step(ids, self.next_slot)
        self.next_slot += ids.shape[1]
        return logits[:, 0] if tokens.dim() == 1 else logits

    def rewind(self, slot: int) -> None:
        """Forget the tokens at slots >= `slot` (caches whose `rewindable` is true)."""
        if not self.rewindable:
            raise ConfigError("this model's caches cannot roll back (a recurrent state); rewind is not possible")
        self.next_slot = slot

    def _check_room(self, n: int) -> None:
        if self.state is None:
            raise RuntimeError("Engine.begin(batch_size, max_len) must run before extend or decode")
        if self.next_slot + n > self.shape[1]:
            raise ConfigError(f"{self.next_slot + n} slots needed but the caches hold {self.shape[1]}; "
                              "call begin with a larger max_len")

    def generate(self, prompts, sampler=None, max_new_tokens: int = 256, **kwargs):
        """Generate from token-id prompts; see `lmlab.inference.generate.generate` for the options."""
        from lmlab.inference.generate import generate

        return generate(self, prompts, sampler, max_new_tokens, **kwargs)


def capture_cuda_graph(run: Callable[[], Any], warmups: int) -> tuple[torch.cuda.CUDAGraph, Any]:
    """`run` called `warmups` times on a side stream (compilation, lazy allocations), then captured: the graph,
    and the outputs its replays write."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = run()
    return graph, outputs


class _StaticStep:
    """A forward of `size` tokens per sequence on static input tensors: eager, compiled, or replayed
    from a CUDA graph (captured when the caches are made; the warm-up writes are reset). last_logits_only: the
    logits of the last token alone, (B, 1, V) (a prompt chunk's)."""

    def __init__(self, engine: Engine, batch_size: int, size: int, last_logits_only: bool = False):
        self.engine, self.last_logits_only = engine, last_logits_only
        self.ids = torch.zeros(batch_size, size, dtype=torch.long, device=engine.device)
        self.slots = torch.arange(size, device=engine.device)
        self.offsets = torch.arange(size, device=engine.device)
        self.run = torch.compile(self._forward, dynamic=False, options=COMPILE_OPTIONS) if engine.compile else self._forward
        self.graph: torch.cuda.CUDAGraph | None = None
        if engine.cuda_graphs:
            try:
                self._capture()
            except RuntimeError as err:  # a host sync inside the step (e.g. a layer reading sizes back) cannot be captured
                self.graph = None
                for cache in engine.caches:
                    cache.reset()
                log.warning("the %d-token decode step runs without a CUDA graph: %s", size,
                            str(err).splitlines()[0])

    def _forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        with self.engine._numerics():
            hidden = self.engine._hidden(self.ids)
            return self.engine.logits(hidden[:, -1:] if self.last_logits_only else hidden), hidden

    def place(self, slot: int | torch.Tensor) -> None:
        """Point the step at slots slot, slot + 1, ... (slot: an int, or a (1,) tensor a captured graph updates)."""
        torch.add(self.offsets, slot, out=self.slots)
        self.engine.state.slots = self.slots

    def __call__(self, ids: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.ids.copy_(ids)
        self.place(slot)
        if self.graph is None:
            return self.run()
        self.graph.replay()
        return self.outputs

    @torch.inference_mode()
    def _capture(self) -> None:
        self.engine.state.slots = self.slots
        self.graph, self.outputs = capture_cuda_graph(self.run, warmups=3)  # compiles on the first call
        for cache in self.engine.caches:
            cache.reset()

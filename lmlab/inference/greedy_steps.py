"""Greedy decode steps in blocks, each block replayed as one CUDA graph where the engine replays its steps.

With a greedy sampler without bias or penalties, and no host in the loop (no streaming, no stop strings), a decode
step and its bookkeeping are static: the one-token step on the pending token, the argmax with its finite check and the
finished mask, the stop-token check, and the next step's input and slot (on a GPU the argmax's launch writes those
too: `pick`'s next_step). `generate` then runs a block of steps per replay of one graph and copies the block's
tokens and peaks out once. Launched from the host one step at a time, a step's few small launches each wait on the
host and leave the GPU idle between them, ~10 us of a ~0.5 ms batch-1 step on an H200
(experiments/inference/h200-2026-12-04d/5-log.txt); within a graph they follow each other at once. Without CUDA
graphs (the CPU, eager engines) the same block runs op by op.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from lmlab.inference.engine import Engine, capture_cuda_graph
from lmlab.inference.generate import mark_stop_tokens, pick, plain_greedy

log = logging.getLogger(__name__)

# Blocks pay where the host's launches are a visible share of a step. On an H200 at llama400m, 128-token prompts and
# 256 new tokens (experiments/inference/h200-2026-12-04e/, blocks of 64 against one step at a time, same process): the
# megakernel at batch 1 gained 1.8-2.4% (1,975-1,997 against 1,940-1,955 tokens/s), the compiled engine at batch 1
# moved within +-1%, and at batch 32 it lost 3% in two runs (30,685 and 30,777 against 31,582 and 31,744 tokens/s),
# its ~180 kernels a step replayed 64 steps to a graph with more idle time between them than its own step's graph.
MAX_BATCH = 1


class GreedySteps:
    """Blocks of greedy decode steps for one engine (its one-token step), stop tokens and usable vocabulary, one CUDA
    graph per block size; see the module docstring. `finished` (B,) is the generation's finished mask, which the
    blocks read and update; each `run` writes its block's tokens and peaks into the rows given."""

    @staticmethod
    def applies(sampler, host_every_step: bool, batch: int) -> bool:
        """Whether decode steps are static, plain greedy decoding (`plain_greedy`) with no host look each step, and
        blocks pay: batches of up to MAX_BATCH sequences."""
        return plain_greedy(sampler) and not host_every_step and batch <= MAX_BATCH

    @classmethod
    def prepare(cls, engine: Engine, sampler, sizes: set[int], stop_ids: Tensor, beyond: Tensor | None,
                usable: int) -> GreedySteps:
        """The blocks for this request, kept on the engine and captured on the first use of each size. After
        `engine.begin` and before any prefill: capturing writes into the caches, which are emptied after."""
        blocks = engine.greedy_steps
        if blocks is None or not blocks._matches(engine, stop_ids, usable):
            blocks = engine.greedy_steps = cls(engine, sampler, stop_ids, beyond, usable)
        blocks._hold(max(sizes))
        for size in sorted(sizes - blocks.graphs.keys()):
            blocks._capture(size)
        blocks.finished.zero_()
        return blocks

    def __init__(self, engine: Engine, sampler, stop_ids: Tensor, beyond: Tensor | None, usable: int):
        self.engine, self.sampler, self.stop_ids, self.beyond, self.usable = engine, sampler, stop_ids, beyond, usable
        self.step = engine._steps[1]
        batch = self.step.ids.shape[0]
        self.finished = torch.zeros(batch, dtype=torch.bool, device=engine.device)
        self.tokens = torch.zeros(0, batch, dtype=torch.long, device=engine.device)  # grown to the largest block
        self.peaks = torch.zeros(0, batch, device=engine.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph | None] = {}  # block size -> its graph (None: op by op)

    def _matches(self, engine: Engine, stop_ids: Tensor, usable: int) -> bool:
        return (self.step is engine._steps.get(1) and self.usable == usable
                and self.stop_ids.tolist() == stop_ids.tolist())

    def _hold(self, size: int) -> None:
        """Room for blocks of `size` steps; the graphs captured with smaller buffers are dropped (a graph keeps the
        addresses it was captured with)."""
        if size > len(self.tokens):
            self.graphs.clear()
            self.tokens = torch.zeros(size, *self.tokens.shape[1:], dtype=torch.long, device=self.tokens.device)
            self.peaks = torch.zeros(size, *self.peaks.shape[1:], device=self.peaks.device)

    def _capture(self, size: int) -> None:
        self.graphs[size] = None
        if not (self.engine.cuda_graphs and self.step.graph is not None):
            return
        try:
            self.graphs[size], _ = capture_cuda_graph(lambda: self._warm_or_captured_block(size), warmups=1)
        except RuntimeError as err:  # as the engine's own step: a host sync in a layer cannot be captured
            log.warning("greedy decode blocks run op by op, without a CUDA graph: %s", str(err).splitlines()[0])
        for cache in self.engine.caches:
            cache.reset()

    def _warm_or_captured_block(self, size: int) -> None:
        if not torch.cuda.is_current_stream_capturing():  # a warm-up: from slot 0, so it stays within the caches
            self.step.place(0)
        self._block(size)

    def _block(self, size: int) -> None:
        step = self.step
        for i in range(size):
            logits = step.run()[0][:, 0]
            token = pick(self.sampler, logits, None, None, self.beyond, self.usable, self.peaks[i], self.finished,
                         self.tokens[i], next_step=(step.ids[:, 0], step.slots))
            mark_stop_tokens(self.finished, token, self.stop_ids)

    def run(self, token: Tensor, tokens: Tensor, peaks: Tensor) -> None:
        """Decode len(tokens) steps from the pending `token` (B,) at the engine's next slot: each step's tokens into
        tokens (size, B) and largest |logit| into peaks (size, B)."""
        size, engine = len(tokens), self.engine
        engine._check_room(size)
        self.step.ids.copy_(token[:, None])
        self.step.place(engine.next_slot)
        graph = self.graphs[size]
        if graph is None:
            self._block(size)
        else:
            graph.replay()
        engine.next_slot += size
        tokens.copy_(self.tokens[:size])
        peaks.copy_(self.peaks[:size])

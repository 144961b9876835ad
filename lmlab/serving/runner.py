"""Forward passes over paged KV caches: any mix of sequences, each with its own new tokens, position
and blocks, as the scheduler hands them out.

    runner = PagedRunner(model, num_blocks=2048, block_size=16)
    logits = runner.forward([Row(tokens, start, table), ...])   # (rows, vocab) at each row's last token
    logits, every = runner.forward_every(rows, [0])            # and row 0's at each of its new tokens

Rows are right-padded to the longest; padded tokens write into the null block and their outputs are
dropped. On CUDA, one-token rows (decode) attend with the Triton paged flash-decoding kernel and run as
a CUDA graph per padded batch size (a graph replays the ~1,000 kernel launches of a step at once).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from lmlab.errors import ConfigError
from lmlab.inference.engine import capture_cuda_graph, check_generatable
from lmlab.kernels.registry import optional_triton_kernel
from lmlab.nn.fused import fuse_projections
from lmlab.nn.transformer import Transformer
from lmlab.serving.blocks import NULL_BLOCK, BlockTable
from lmlab.serving import sparse_paged_cache  # noqa: F401 - its cache registers on import
from lmlab.serving.paged_cache import PagedBatch, paged_factory_for

log = logging.getLogger(__name__)

GRAPH_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # decode batches are padded up to one of these


@dataclass
class Row:
    """One sequence in a forward: its new tokens, the position of the first, and its blocks (which
    already cover every position up to the last new token)."""

    tokens: list[int]
    start: int
    table: BlockTable


class PagedRunner:
    def __init__(self, model: Transformer, num_blocks: int, block_size: int, attention_kernel: bool | None = None,
                 cuda_graphs: bool | None = None, max_blocks_per_seq: int | None = None):
        """attention_kernel: decode rows attend with the Triton paged kernel (default: on CUDA with Triton).
        cuda_graphs: decode steps replay CUDA graphs (default: on CUDA)."""
        check_generatable(model)
        self.model = model.eval()
        weight = model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        fuse_projections(model)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.max_blocks_per_seq = max_blocks_per_seq or -(-model.max_seq_len // block_size)
        self.batch = PagedBatch(slot_mapping=torch.zeros(1, 1, dtype=torch.long, device=self.device),
                                block_tables=torch.zeros(1, 1, dtype=torch.int32, device=self.device),
                                context_lens=torch.ones(1, dtype=torch.int32, device=self.device),
                                block_size=block_size, attention_kernel=optional_triton_kernel(
                                    self.device, attention_kernel, "lmlab.kernels.paged_decode_attention_triton",
                                    "paged_decode_attention"))
        self.caches = [paged_factory_for(layer.self_attn)(layer.self_attn, self.batch, num_blocks, block_size,
                                                          self.device, self.dtype)
                       for layer in model.applied_layers()]
        on_cuda = self.device.type == "cuda"
        self.cuda_graphs = on_cuda if cuda_graphs is None else cuda_graphs and on_cuda
        self._graphs: dict[int, _DecodeGraph] = {}

    def kv_bytes_per_block(self) -> int:
        return sum(cache.nbytes() for cache in self.caches) // self.num_blocks

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: each (source, destination) block, in every layer."""
        if copies:
            sources, destinations = (torch.tensor(c, device=self.device) for c in zip(*copies))
            for cache in self.caches:
                cache.copy_blocks(sources, destinations)

    @torch.inference_mode()
    def forward(self, rows: list[Row]) -> torch.Tensor:
        """float32 logits (len(rows), vocab) at each row's last new token."""
        if self.cuda_graphs and all(len(r.tokens) == 1 for r in rows) and len(rows) <= GRAPH_BATCHES[-1]:
            padded = next(b for b in GRAPH_BATCHES if b >= len(rows))
            graph = self._graphs.get(padded)
            if graph is None:
                graph = self._graphs[padded] = _DecodeGraph(self, padded)
            return graph(rows)
        return self.forward_every(rows, [])[0]

    @torch.inference_mode()
    def forward_every(self, rows: list[Row], every: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`forward`'s logits, and the float32 logits (tokens, vocab) at every new token of the rows numbered in
        `every` (a prompt's log-probabilities); the head runs over those rows' tokens only."""
        ids, positions, last = self.load(rows, len(rows), max(len(r.tokens) for r in rows), self.batch)
        x = self.hidden(ids, positions)
        return self.head_at(x, last), [self.head(x[b, :len(rows[b].tokens)]) for b in every]

    def load(self, rows: list[Row], batch: int, width: int, into: PagedBatch, table_width: int | None = None):
        """Fill `into` for `rows` padded to `batch` rows of `width` tokens: (ids, positions, last index)."""
        ids = torch.zeros(batch, width, dtype=torch.long)
        positions = torch.zeros(batch, width, dtype=torch.long)
        slots = torch.full((batch, width), NULL_BLOCK * self.block_size, dtype=torch.long)
        lens = torch.ones(batch, dtype=torch.int32)
        last = torch.zeros(batch, dtype=torch.long)
        size = self.block_size
        for b, row in enumerate(rows):
            n, end = len(row.tokens), row.start + len(row.tokens)
            if end > self.max_blocks_per_seq * size:
                raise ConfigError(f"a sequence reaches position {end}, past the model's context of "
                                  f"{self.max_blocks_per_seq * size} slots")
            ids[b, :n] = torch.tensor(row.tokens)
            positions[b, :n] = torch.arange(row.start, end)
            positions[b, n:] = end - 1  # padding queries repeat the last position; their outputs are dropped
            slots[b, :n] = torch.tensor([row.table.slot(p, size) for p in range(row.start, end)])
            lens[b], last[b] = end, n - 1
        blocks = table_width or max(-(-int(lens.max()) // size), 1)
        tables = torch.full((batch, blocks), NULL_BLOCK, dtype=torch.int32)
        for b, row in enumerate(rows):
            used = row.table.blocks[:blocks]
            tables[b, :len(used)] = torch.tensor(used, dtype=torch.int32)
        into.slot_mapping = _fill(into.slot_mapping, slots, self.device)
        into.block_tables = _fill(into.block_tables, tables, self.device)
        into.context_lens = _fill(into.context_lens, lens, self.device)
        return ids.to(self.device), positions.to(self.device), last.to(self.device)

    def logits(self, ids: torch.Tensor, positions: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        return self.head_at(self.hidden(ids, positions), last)

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The last layer's output at every token, before the final norm."""
        model = self.model
        model._route_by("layers.", ids)
        return model.run_layers(model.position.embed(model.embed_tokens(ids), positions), positions, self.caches)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.model._head(self.model.norm(x)).float()

    def head_at(self, x: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """The float32 logits at each row's `last` token."""
        return self.head(x[torch.arange(x.shape[0], device=x.device), last])


def _fill(current: torch.Tensor, new: torch.Tensor, device) -> torch.Tensor:
    """`new` on the device: copied into `current` when the shapes agree (a CUDA graph reads that storage)."""
    if current.shape == new.shape:
        current.copy_(new, non_blocking=True)
        return current
    return new.to(device)


class _DecodeGraph:
    """The one-token step at a padded batch size, on static buffers, captured as a CUDA graph. Its block
    tables are as wide as the longest sequence, so one graph serves every context length."""

    def __init__(self, runner: PagedRunner, batch: int):
        self.runner, self.size = runner, batch
        device = runner.device
        self.batch = PagedBatch(slot_mapping=torch.zeros(batch, 1, dtype=torch.long, device=device),
                                block_tables=torch.zeros(batch, runner.max_blocks_per_seq, dtype=torch.int32,
                                                         device=device),
                                context_lens=torch.ones(batch, dtype=torch.int32, device=device),
                                block_size=runner.block_size, attention_kernel=runner.batch.attention_kernel)
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.last = torch.zeros(batch, dtype=torch.long, device=device)
        self._capture()

    def _run(self) -> torch.Tensor:
        shared = self.runner.batch  # every layer reads the runner's batch object: point it at the static one
        saved = (shared.slot_mapping, shared.block_tables, shared.context_lens)
        shared.slot_mapping, shared.block_tables, shared.context_lens = (
            self.batch.slot_mapping, self.batch.block_tables, self.batch.context_lens)
        try:
            return self.runner.logits(self.ids, self.positions, self.last)
        finally:
            shared.slot_mapping, shared.block_tables, shared.context_lens = saved

    @torch.inference_mode()
    def _capture(self) -> None:
        self.graph, self.outputs = capture_cuda_graph(self._run, warmups=2)  # padded rows write the null block

    def __call__(self, rows: list[Row]) -> torch.Tensor:
        ids, positions, last = self.runner.load(rows, self.size, 1, self.batch, self.runner.max_blocks_per_seq)
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        self.last.copy_(last)
        self.graph.replay()
        return self.outputs[:len(rows)]

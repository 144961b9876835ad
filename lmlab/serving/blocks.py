"""Paged KV memory on the host side: which blocks hold which sequence's keys and values.

The caches of every layer are pools of `num_blocks` blocks of `block_size` token slots; a sequence
owns a block table (its blocks in position order), so its memory grows a block at a time instead of
being reserved for the longest possible sequence. Block 0 is never handed out: padded tokens write
there, and no sequence reads it.

Prefix sharing: a block whose slots are all written is registered under a hash of its tokens and of
every token before it (a hash chain, so equal blocks after different prefixes never match). A new
sequence whose prompt starts with registered blocks takes them (reference count + 1) instead of
computing them again. A block whose count drops to zero keeps its registration and stays findable
until the allocator needs it back (least recently freed first), so a system prompt shared by requests
that do not overlap in time is still computed once. A shared block that must be written (the partial
last block of a prompt continued as several samples) is copied first: copy-on-write.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

NULL_BLOCK = 0  # padded tokens write into this block; it is never allocated or read


class NoFreeBlocks(RuntimeError):
    """Every block is in use: the scheduler preempts a sequence, or the request cannot be admitted."""


def chain_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The key of a full block: its tokens and, through `parent`, every token before it."""
    return hash((parent, tuple(tokens)))


@dataclass
class BlockTable:
    """One sequence's blocks in position order, and the hashes of its leading full blocks."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # hashes[i]: block i's key (full blocks only)

    def slot(self, position: int, block_size: int) -> int:
        """The pool slot of the token at `position`."""
        return self.blocks[position // block_size] * block_size + position % block_size


class BlockManager:
    """Allocates blocks, counts references, and finds registered full blocks by their chain hash."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block {NULL_BLOCK} is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.refs = [0] * num_blocks
        self.free: deque[int] = deque(range(1, num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # freed but registered blocks, oldest first
        self.block_of: dict[int, int] = {}  # chain hash -> block
        self.pending: dict[int, int] = {}  # chain hash -> block whose keys its sequence is still computing
        self.hash_of: dict[int, int] = {}  # block -> chain hash
        self.hits = self.queries = 0  # prefix-cache lookups of full prompt blocks, and how many found a block
        self.copies = 0  # copy-on-write copies of shared blocks

    # -- counts -----------------------------------------------------------------------------------
    @property
    def usable(self) -> int:
        return self.num_blocks - 1

    def num_free(self) -> int:
        """Blocks an allocation can take: never used, or freed (registered ones are given up oldest first)."""
        return len(self.free) + len(self.evictable)

    def num_used(self) -> int:
        """Blocks some sequence holds."""
        return self.usable - self.num_free()

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # -- single blocks ----------------------------------------------------------------------------
    def allocate(self) -> int:
        if self.free:
            block = self.free.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            del self.block_of[self.hash_of.pop(block)]
        else:
            raise NoFreeBlocks(f"all {self.usable} KV blocks are in use")
        self.refs[block] = 1
        return block

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] < 0:
            raise RuntimeError(f"block {block} released more often than it was taken")
        if self.refs[block] == 0:
            if block in self.hash_of:
                self.evictable[block] = None
            else:
                self.free.append(block)

    def _take(self, block: int) -> None:
        if self.refs[block] == 0:
            self.evictable.pop(block, None)
        self.refs[block] += 1

    # -- sequences --------------------------------------------------------------------------------
    def _keys(self, tokens: Sequence[int], blocks: int, parent: int | None = None, first: int = 0):
        for i in range(first, blocks):
            parent = chain_hash(parent, tokens[i * self.block_size:(i + 1) * self.block_size])
            yield i, parent

    def match_prefix(self, table: BlockTable, tokens: Sequence[int], wait: bool = True) -> int | None:
        """Fill an empty `table` with the registered blocks `tokens` starts with; returns how many tokens
        they hold. With `wait`, None (holding nothing) when the prefix goes on into a block that another
        sequence is still computing: waiting a step for it is cheaper than computing it twice. The last
        token is always left to compute, since its logits are what the prompt is for."""
        if table.blocks:
            raise ValueError("match_prefix fills an empty block table")
        if not self.prefix_caching:
            return 0
        for _, key in self._keys(tokens, (len(tokens) - 1) // self.block_size):
            self.queries += 1
            block = self.block_of.get(key)
            if block is None:
                if wait and key in self.pending:
                    self.free_table(table)
                    return None
                break
            self.hits += 1
            self._take(block)
            table.blocks.append(block)
            table.hashes.append(key)
        return len(table.blocks) * self.block_size

    def reserve(self, table: BlockTable, tokens: Sequence[int]) -> None:
        """Mark the full blocks of a just-admitted prompt that its sequence will compute, so that prompts
        admitted after it wait for them (match_prefix) instead of computing them too."""
        if not self.prefix_caching:
            return
        parent = table.hashes[-1] if table.hashes else None
        for i, key in self._keys(tokens, len(tokens) // self.block_size, parent, len(table.hashes)):
            if key not in self.block_of:
                self.pending.setdefault(key, table.blocks[i])

    def ensure(self, table: BlockTable, length: int, written_from: int) -> list[tuple[int, int]]:
        """Make room for tokens up to `length` whose keys are written from position `written_from` on:
        new blocks at the end, and a private copy of any shared block the writes reach (copy-on-write).
        Returns the (source, destination) block copies the caller must make in the pools before the writes.
        Raises NoFreeBlocks, leaving the table as it was, when the blocks run out."""
        needed = self.blocks_for(length) - len(table.blocks)
        shared = [i for i in range(written_from // self.block_size, len(table.blocks)) if self.refs[table.blocks[i]] > 1]
        if needed + len(shared) > self.num_free():
            raise NoFreeBlocks(f"{needed + len(shared)} KV blocks needed, {self.num_free()} free")
        copies = []
        for i in shared:
            private = self.allocate()
            copies.append((table.blocks[i], private))
            self.copies += 1
            self.release(table.blocks[i])
            table.blocks[i] = private
            del table.hashes[i:]  # a written copy is no longer the registered block
        table.blocks.extend(self.allocate() for _ in range(needed))
        return copies

    def register_full(self, table: BlockTable, tokens: Sequence[int], computed: int) -> None:
        """Register the blocks completed by the first `computed` tokens (their keys are now in the pools)."""
        if not self.prefix_caching:
            return
        parent = table.hashes[-1] if table.hashes else None
        for i, key in self._keys(tokens, computed // self.block_size, parent, len(table.hashes)):
            table.hashes.append(key)
            block = table.blocks[i]
            if self.pending.get(key) == block:
                del self.pending[key]
            if key not in self.block_of and block not in self.hash_of:
                self.block_of[key], self.hash_of[block] = block, key

    def fork(self, table: BlockTable) -> BlockTable:
        """A second table over the same blocks (n samples of one prompt): shared until one writes."""
        for block in table.blocks:
            self._take(block)
        return BlockTable(list(table.blocks), list(table.hashes))

    def free_table(self, table: BlockTable) -> None:
        if self.pending:  # blocks it was computing for others: they will not come
            mine = set(table.blocks)
            for key in [k for k, block in self.pending.items() if block in mine]:
                del self.pending[key]
        for block in reversed(table.blocks):  # the tail is freed first, so the head stays findable longer
            self.release(block)
        table.blocks.clear()
        table.hashes.clear()

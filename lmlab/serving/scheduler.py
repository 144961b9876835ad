"""Iteration-level scheduling (registry `scheduler`): which sequences run in the next forward.

Every step the scheduler plans one forward's worth of work under a token budget:
1. each running sequence that is decoding gets one token, and the block it writes (a new block, or a
   private copy of a shared one); when blocks run out, the most recently admitted running sequence is
   preempted: its blocks are freed and it waits at the head of the queue, to be computed again
   (prompt and generated tokens) when blocks free up;
2. running sequences still reading their prompt get a chunk of it, as much as the budget leaves, so a
   long prompt never stalls the decodes;
3. waiting sequences are admitted first-come-first-served while the policy allows, the batch has room
   and their whole prompt's blocks fit (full blocks already computed for an equal prefix are reused).

`continuous` admits at every step (Orca, vLLM); `static` admits only into an empty batch and runs it
until every sequence has finished: the baseline continuous batching is measured against.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lmlab.errors import ConfigError
from lmlab.registry import Registry
from lmlab.serving.blocks import BlockManager, BlockTable, NoFreeBlocks

SCHEDULERS = Registry("scheduler", group="scheduler", doc="serving batch policies: continuous, static")


@dataclass(eq=False)
class Sequence:
    """One generated continuation. `tokens` holds the prompt and what has been generated; the first
    `computed` of them have their keys and values in the blocks of `table`."""

    request: object  # the engine's request this sequence belongs to (a request with n > 1 has n)
    index: int  # which of the request's sequences
    tokens: list[int]
    prompt_len: int
    table: BlockTable = field(default_factory=BlockTable)
    computed: int = 0
    finished: bool = False
    reuse_prefix: bool = True  # False while its prompt's log-probabilities are wanted: every position is computed

    @property
    def remaining(self) -> int:
        """Tokens still to compute before the next token can be sampled."""
        return len(self.tokens) - self.computed

    @property
    def prefilling(self) -> bool:
        return self.remaining > 1


@dataclass
class Work:
    """One sequence's part of a step: `count` tokens from position `start`."""

    seq: Sequence
    start: int
    count: int

    @property
    def samples(self) -> bool:
        """Whether this work reaches the sequence's last token, whose logits give the next one."""
        return self.start + self.count == len(self.seq.tokens)


@dataclass
class Plan:
    decodes: list[Work] = field(default_factory=list)
    prefills: list[Work] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write block copies, before the forward
    preempted: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128  # sequences in a batch at most
    max_num_batched_tokens: int = 2048  # tokens of one step: decodes count one each, prompt chunks the rest

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"scheduler.{name} must be >= 1, got {getattr(self, name)}")


class Scheduler:
    admits_while_running = True

    def __init__(self, blocks: BlockManager, cfg: SchedulerConfig | None = None):
        self.blocks, self.cfg = blocks, cfg or SchedulerConfig()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Plan:
        plan, budget = Plan(), self.cfg.max_num_batched_tokens
        for seq in list(self.running):
            if seq not in self.running or seq.prefilling or budget < 1:
                continue
            if self._make_room(seq, plan):
                plan.decodes.append(Work(seq, seq.computed, 1))
                budget -= 1
        if self.admits_while_running or not self.running:
            # continuous: as the budget allows; static: a whole batch, whose prompts the next steps read
            while (self.waiting and len(self.running) < self.cfg.max_num_seqs
                   and (budget > 0 or not self.admits_while_running)):
                if not self._admit(self.waiting[0]):
                    break
                self.running.append(self.waiting.popleft())
        decoding = {id(work.seq) for work in plan.decodes}
        for seq in self.running:  # prompts being read, and those just admitted
            if id(seq) not in decoding and budget > 0:
                count = min(seq.remaining, budget)
                plan.prefills.append(Work(seq, seq.computed, count))
                budget -= count
        return plan

    def _make_room(self, seq: Sequence, plan: Plan) -> bool:
        """The block `seq`'s next token writes, preempting from the back of the batch while blocks are short;
        False when `seq` itself was preempted."""
        while True:
            try:
                plan.copies += self.blocks.ensure(seq.table, len(seq.tokens), seq.computed)
                return True
            except NoFreeBlocks:
                victim = self.running[-1]
                self.preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    return False

    def _admit(self, seq: Sequence) -> bool:
        """Take the blocks of seq's whole prompt (reusing registered ones); False, holding nothing, when
        they do not fit."""
        # continuous: a sequence whose prefix a running one is computing waits a step for its blocks
        cached = (self.blocks.match_prefix(seq.table, seq.tokens, wait=self.admits_while_running)
                  if seq.reuse_prefix else 0)
        if cached is None:
            return False
        seq.computed = cached
        try:
            self.blocks.ensure(seq.table, len(seq.tokens), seq.computed)
            self.blocks.reserve(seq.table, seq.tokens)
        except NoFreeBlocks:
            self.blocks.free_table(seq.table)
            seq.computed = 0
            if not self.running:
                raise NoFreeBlocks(f"a sequence of {len(seq.tokens)} tokens needs "
                                   f"{self.blocks.blocks_for(len(seq.tokens))} KV blocks and the pool has "
                                   f"{self.blocks.usable}: raise num_blocks") from None
            return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and queue it first, to compute its tokens again."""
        self.running.remove(seq)
        self.blocks.free_table(seq.table)
        seq.computed = 0
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Retire a sequence (done, or its request cancelled): its blocks go back at once."""
        seq.finished = True
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_table(seq.table)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Run `child` next to `parent`, sharing its blocks (a request's further samples of one prompt)."""
        child.table = self.blocks.fork(parent.table)
        child.computed = parent.computed
        self.running.insert(self.running.index(parent) + 1, child)


@SCHEDULERS.register("continuous")
class Continuous(Scheduler):
    """Admits waiting sequences at every step, next to the running ones (iteration-level batching)."""

    @dataclass
    class Config(SchedulerConfig):
        pass


@SCHEDULERS.register("static")
class Static(Scheduler):
    """Admits only into an empty batch, then runs that batch until all of it has finished."""

    admits_while_running = False

    @dataclass
    class Config(SchedulerConfig):
        pass

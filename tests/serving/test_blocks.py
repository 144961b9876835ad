"""The block manager: allocation and reference counts, prefix matching by chain hash (and only on equal
prefixes), registered blocks kept findable after release until the allocator needs them, copy-on-write
of shared blocks, and every block free again once every table is."""

import pytest

from lmlab.serving.blocks import NULL_BLOCK, BlockManager, BlockTable, NoFreeBlocks


def _filled(manager: BlockManager, tokens: list[int]) -> BlockTable:
    """A table holding `tokens`, computed and registered."""
    table = BlockTable()
    manager.ensure(table, len(tokens), 0)
    manager.register_full(table, tokens, len(tokens))
    return table


def test_allocation_never_hands_out_the_null_block_and_runs_out_cleanly():
    manager = BlockManager(4, 2)
    blocks = [manager.allocate() for _ in range(3)]
    assert NULL_BLOCK not in blocks and len(set(blocks)) == 3 and manager.num_free() == 0
    with pytest.raises(NoFreeBlocks):
        manager.allocate()
    table = BlockTable()
    with pytest.raises(NoFreeBlocks):
        manager.ensure(table, 2, 0)
    assert table.blocks == []  # a failed ensure leaves the table as it was


def test_a_prompt_reuses_the_full_blocks_of_an_equal_prefix_but_computes_its_last_token():
    manager = BlockManager(16, 4)
    first = _filled(manager, list(range(10)))  # blocks [0..3], [4..7] full; [8, 9] partial
    second = BlockTable()
    assert manager.match_prefix(second, list(range(9)) + [99]) == 8
    assert second.blocks == first.blocks[:2] and manager.refs[first.blocks[0]] == 2
    exact = BlockTable()  # the whole prompt is registered, yet its last token must still be computed
    assert manager.match_prefix(exact, list(range(8))) == 4


def test_equal_blocks_after_different_prefixes_do_not_match():
    manager = BlockManager(16, 2)
    _filled(manager, [1, 2, 3, 4, 5])
    table = BlockTable()
    assert manager.match_prefix(table, [9, 9, 3, 4, 5]) == 0  # block [3, 4] follows a different prefix
    assert manager.hits == 0 and manager.queries == 1


def test_released_registered_blocks_stay_findable_until_the_allocator_needs_them():
    manager = BlockManager(4, 2)
    table = _filled(manager, [1, 2, 3, 4, 5])  # 3 blocks: all of the pool
    manager.free_table(table)
    assert manager.num_used() == 0 and manager.num_free() == 3
    again = BlockTable()
    assert manager.match_prefix(again, [1, 2, 3, 4, 5]) == 4  # found after release
    manager.free_table(again)
    for _ in range(3):  # the allocator takes them back, oldest released first, and forgets their hashes
        manager.allocate()
    assert manager.block_of == {} and manager.match_prefix(BlockTable(), [1, 2, 3, 4, 5]) == 0


def test_forked_tables_copy_a_shared_block_before_writing_it():
    manager = BlockManager(8, 4)
    parent = _filled(manager, [1, 2, 3, 4, 5, 6])  # the second block is partial, with room for a token
    child = manager.fork(parent)
    assert manager.refs[parent.blocks[1]] == 2
    copies = manager.ensure(child, 7, 6)  # the child writes position 6, inside the shared partial block
    assert copies == [(parent.blocks[1], child.blocks[1])] and child.blocks[0] == parent.blocks[0]
    assert manager.refs[parent.blocks[1]] == 1 and manager.refs[child.blocks[0]] == 2
    assert manager.ensure(parent, 7, 6) == []  # now the parent holds its block alone: written in place


def test_no_block_leaks_once_every_table_is_freed():
    manager = BlockManager(32, 4)
    tables = [_filled(manager, list(range(n))) for n in (3, 9, 13)]
    tables.append(manager.fork(tables[1]))
    manager.ensure(tables[-1], 12, 9)
    for table in tables:
        manager.free_table(table)
    assert manager.num_used() == 0 and all(r == 0 for r in manager.refs)


def test_a_prefix_being_computed_makes_a_later_prompt_wait_unless_told_not_to():
    manager = BlockManager(16, 2)
    owner = BlockTable()
    manager.ensure(owner, 5, 0)
    manager.reserve(owner, [1, 2, 3, 4, 5])  # admitted: blocks [1, 2] and [3, 4] are being computed
    waiting = BlockTable()
    assert manager.match_prefix(waiting, [1, 2, 3, 4, 9]) is None and waiting.blocks == []
    assert manager.match_prefix(BlockTable(), [1, 2, 3, 4, 9], wait=False) == 0
    manager.register_full(owner, [1, 2, 3, 4, 5], 5)  # computed: now they are shared
    assert manager.match_prefix(waiting, [1, 2, 3, 4, 9]) == 4 and not manager.pending
    other = BlockTable()
    manager.ensure(other, 3, 0)
    manager.reserve(other, [7, 8, 9])
    manager.free_table(other)  # preempted or cancelled before computing: nobody waits for it
    assert manager.match_prefix(BlockTable(), [7, 8, 9]) == 0

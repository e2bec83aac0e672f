"""The paged KV-cache kernel's page-id ring on the CPU (kernels_cu/cache_rows.cuh RowOffsetRing,
flash_fwd_kvcache_mma.cu; docs/perf-log.md decode-v4): a model of its cp.async commit groups
and wait_group, walked over every start block, block count and stage count, checks the schedule
the kernel's key loop runs: each tile's table entries are read from a page-id slot only after the
group that copied them has completed, and a slot is copied into again only after its tile was
read. The schedule's expressions are checked in the kernel's source, so that the model and the
kernel cannot drift apart unnoticed."""
from __future__ import annotations

import re

import pytest

from cupyflash.kernels._module import kernels_dir


def _source(name: str) -> str:
    return " ".join((kernels_dir() / name).read_text().split())


def test_the_model_is_the_kernels_schedule():
    kernel = _source("flash_fwd_kvcache_mma.cu")
    ring = _source("cache_rows.cuh")
    for expression in ("typedef RowOffsetRing<BLOCK_N, NTHREADS, STAGES> Ring;",
                       # prologue: block j_begin + a's copies carry the table entries of the block STAGES after it
                       "if (PAGED && (j + STAGES) * BLOCK_N < n_end) ring.request(keys, j + STAGES, seqlen_k,"
                       " threadIdx.x); cp_async_commit();",
                       "if (j * BLOCK_N < n_end) ring.fill(keys, j, seqlen_k, threadIdx.x);",
                       "const int j = j_begin + STAGES - 1;",
                       # the loop: wait, then tile `ahead`'s copies with block ahead + STAGES's entries
                       "cp_async_wait<STAGES - 2>(); __syncthreads(); const int ahead = j + STAGES - 1;",
                       "if (PAGED && (ahead + STAGES) * BLOCK_N < n_end) ring.request(keys, ahead + STAGES, seqlen_k,"
                       " threadIdx.x); cp_async_commit();",
                       "if (look_ahead) pending = ring.requested(keys, ahead + 1, threadIdx.x);"):
        assert expression in kernel, expression
    assert "return base + 2 * SLOT_BYTES + (block % PAGE_SLOTS) * PAGE_SLOT_BYTES;" in ring
    # each row is requested and read by the same thread (r = thread + i * NTHREADS in both)
    assert len(re.findall(r"const int r = thread \+ i \* NTHREADS, n = block \* ROWS \+ r;", ring)) >= 3


def _walk(stages: int, j_begin: int, blocks: int, slots: int | None = None, distance: int | None = None) -> int:
    """Runs the kernel's prologue and key loop over blocks [j_begin, j_begin + blocks) with a ring
    of `slots` page-id slots (the kernel: STAGES), each block's copies carrying the table entries
    of the block `distance` after it (the kernel: STAGES); returns how many tiles' entries were
    read from the ring. Asserts the two orderings the module docstring names."""
    slots = stages if slots is None else slots
    distance = stages if distance is None else distance
    n_end = j_begin + blocks  # in blocks
    committed = 0  # commit groups so far
    slot_tile: dict[int, tuple[int, int]] = {}  # page-id slot -> (tile last copied into it, its group)
    read: set[int] = set()

    def request(tile: int):
        slot = tile % slots
        if slot in slot_tile:
            previous = slot_tile[slot][0]
            assert previous in read, f"slot {slot}: tile {tile} copied before tile {previous} was read"
        slot_tile[slot] = (tile, committed)  # in the group committed next

    committed += 1  # Q's group
    for a in range(stages - 1):  # STAGES - 1 K/V groups
        j = j_begin + a
        if j + distance < n_end:
            request(j + distance)
        committed += 1
    filled = j_begin + stages - 1  # ring.fill: the first tile the loop copies, read synchronously
    for j in range(j_begin, n_end):
        complete = committed - (stages - 2)  # cp_async_wait<STAGES - 2>: groups [0, complete) done
        ahead = j + stages - 1
        if ahead + distance < n_end:
            request(ahead + distance)
        committed += 1
        tile = ahead + 1
        if tile < n_end:  # look_ahead: ring.requested(ahead + 1)
            slot = tile % slots
            held, group = slot_tile.get(slot, (None, None))
            assert held == tile, f"tile {tile}: its slot {slot} holds tile {held}"
            assert group < complete, f"tile {tile}: read before the group that copies it completed"
            read.add(tile)
    assert read == set(range(filled + 1, n_end))  # every tile after the filled one came from the ring
    return len(read)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_every_tile_reads_entries_copied_by_a_completed_group(stages):
    reads = sum(_walk(stages, j_begin, blocks) for j_begin in range(4) for blocks in range(3 * stages + 5))
    assert reads > 0


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_the_model_catches_a_smaller_ring_or_a_shorter_lead(stages):
    """What the walk is there to catch: one slot fewer overwrites a tile before it is read; a lead
    of one block fewer reads entries whose group has not been waited for."""
    with pytest.raises(AssertionError, match="copied before"):
        for blocks in range(3 * stages + 5):
            _walk(stages, 0, blocks, slots=stages - 1)
    with pytest.raises(AssertionError, match="before the group"):
        for blocks in range(3 * stages + 5):
            _walk(stages, 0, blocks, distance=stages - 1)

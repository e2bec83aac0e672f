"""Sequence sharding for context parallelism: zigzag (causal balance) and contiguous.

Zigzag over P ranks cuts the sequence into 2P chunks of C = seqlen / (2P) rows and gives rank r
chunks r and 2P - 1 - r, in that order. Under a causal mask an early chunk sees few keys and a
late one many; pairing chunk r with its mirror gives every rank the same work (each ring step
after the first is one C x 2C block of attention on every rank).

    P = 2, chunks 0 1 2 3:  rank 0 holds [0, 3], rank 1 holds [1, 2]

Contiguous gives rank r rows r·S .. (r+1)·S - 1, S = seqlen / P: what a non-causal ring needs
(any sharding works there, as long as q and its o, lse share it).

The helpers take NumPy or CuPy arrays and a sequence ``axis``: 1 for (batch, seqlen, heads, dim)
tensors, 2 for a (batch, heads, seqlen) lse. ``*_shard(x, P)`` returns every rank's shard (a
list), ``*_shard(x, P, rank)`` one; the shards are views where slicing allows (contiguous) and new
arrays otherwise (zigzag). ``*_unshard(shards)`` is the inverse.
"""
from __future__ import annotations

import numpy as np

__all__ = ["zigzag_shard", "zigzag_unshard", "contiguous_shard", "contiguous_unshard", "check_divisible"]


def _xp(x):
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy.get_array_module(x)


def _check_size(size) -> int:
    if isinstance(size, (bool, np.bool_)) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"the number of ranks must be a positive int, got {size!r}")
    return int(size)


def check_divisible(seqlen: int, size: int, *, zigzag: bool) -> int:
    """The shard length seqlen / P (zigzag: the chunk length seqlen / 2P, each rank holding two),
    or a ValueError saying what divides what."""
    parts = 2 * size if zigzag else size
    if seqlen % parts:
        how = f"2P = {parts} chunks (zigzag)" if zigzag else f"P = {parts} shards"
        raise ValueError(f"a sequence of {seqlen} rows cannot be cut into {how}: the sequence length must be a "
                         f"multiple of {parts}")
    return seqlen // parts


def _chunk(x, axis: int, start: int, length: int):
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, start + length)
    return x[tuple(index)]


def zigzag_shard(x, size: int, rank: int | None = None, *, axis: int = 1):
    """Chunks r and 2P - 1 - r of ``x`` along ``axis`` (joined), for ``rank`` r or every rank."""
    size = _check_size(size)
    chunk = check_divisible(x.shape[axis], size, zigzag=True)
    xp = _xp(x)

    def shard(r):
        return xp.concatenate([_chunk(x, axis, r * chunk, chunk), _chunk(x, axis, (2 * size - 1 - r) * chunk, chunk)],
                              axis=axis)

    if rank is not None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in 0..{size - 1}")
        return shard(rank)
    return [shard(r) for r in range(size)]


def zigzag_unshard(shards, *, axis: int = 1):
    """The sequence whose zigzag shards are ``shards`` (one per rank, in rank order)."""
    shards = list(shards)
    size = len(shards)
    if size == 0:
        raise ValueError("zigzag_unshard: no shards")
    length = shards[0].shape[axis]
    if any(s.shape[axis] != length for s in shards) or length % 2:
        raise ValueError(f"zigzag_unshard: every shard must hold two chunks of one length, got lengths "
                         f"{[s.shape[axis] for s in shards]}")
    chunk = length // 2
    first = [_chunk(s, axis, 0, chunk) for s in shards]
    second = [_chunk(s, axis, chunk, chunk) for s in reversed(shards)]  # chunk 2P-1-r of rank r
    return _xp(shards[0]).concatenate(first + second, axis=axis)


def contiguous_shard(x, size: int, rank: int | None = None, *, axis: int = 1):
    """Rows r·S .. (r+1)·S - 1 of ``x`` along ``axis`` (a view), S = seqlen / P."""
    size = _check_size(size)
    length = check_divisible(x.shape[axis], size, zigzag=False)
    if rank is not None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in 0..{size - 1}")
        return _chunk(x, axis, rank * length, length)
    return [_chunk(x, axis, r * length, length) for r in range(size)]


def contiguous_unshard(shards, *, axis: int = 1):
    """The sequence whose contiguous shards are ``shards``."""
    shards = list(shards)
    if not shards:
        raise ValueError("contiguous_unshard: no shards")
    return _xp(shards[0]).concatenate(shards, axis=axis)

"""Functions that cupyflash.distributed.launch runs in its processes, for the tests: they live in a
module of their own so that a spawned process imports only this (the processes import a function
by its module and name)."""
from __future__ import annotations

import numpy as np


def stand_in_unique_id():
    return ("unique id", 42)


def stand_in_comm(unique_id, rank, size):
    """What the launcher hands fn, without NCCL: the id, the rank and the size it was given."""
    return {"unique_id": unique_id, "rank": rank, "size": size}


def report(comm, offset):
    return comm["unique_id"], comm["rank"], comm["size"], np.arange(3) + offset


def fail_on_rank_one(comm):
    if comm["rank"] == 1:
        raise ValueError("rank one fails on purpose")
    return comm["rank"]


def ring_on_gpu(comm, shards, options):
    """Rank comm.rank's ring forward and backward on CuPy arrays: (o, lse, dq, dk, dv), which the
    launcher returns as NumPy."""
    import cupy

    from cupyflash.distributed import ring_flash_attn_backward, ring_flash_attn_func

    q, k, v, do = (cupy.asarray(x[comm.rank]) for x in shards)
    o, lse = ring_flash_attn_func(q, k, v, comm=comm, return_lse=True, **options)
    return (o, lse, *ring_flash_attn_backward(do, q, k, v, o, lse, comm=comm, **options))

"""Launcher of ``kernels_cu/flash_kvcache_append.cu``: new keys and values into their KV-cache
slots on the device, at each sequence's cache_seqlens through the block table (the calls of
cupyflash.capture, which read no index array back). One specialization per element width: the
values are copied as raw bits."""
from __future__ import annotations

import numpy as np

from ._module import Specialization, launch
from .params import APPEND_PARAMS, fast_divmod, pointer, set_cache_rows, set_rows

__all__ = ["THREADS", "specialization", "specializations", "append"]

THREADS = 128  # flash_kvcache_append.cu's APPEND_THREADS
WIDTHS = (2, 4, 8)


def specialization(itemsize: int) -> Specialization:
    if itemsize not in WIDTHS:
        raise ValueError(f"cupyflash: no append kernel for {itemsize}-byte elements")
    return Specialization(f"flash_kvcache_append_{8 * itemsize}bit", "flash_kvcache_append.cu",
                          f"cf::flash_kvcache_append<{itemsize}>", THREADS, 0)


def specializations() -> list[Specialization]:
    """Every append kernel (for the compile check)."""
    return [specialization(width) for width in WIDTHS]


def append(k_new, v_new, k_cache, v_cache, *, cache_seqlens, block_table, page_size: int, seqlens_k=None,
           row_pages: bool = False) -> None:
    """k_new, v_new (batch, seqlen_new, nheads_kv, headdim / headdim_v) into the caches (pages,
    page_size, nheads_kv, headdim / headdim_v) at positions cache_seqlens[b] + t through block_table (batch, n) int32 (a
    contiguous cache: its rows, one column, page_size its capacity), on the current stream; and
    seqlens_k[b] = cache_seqlens[b] + seqlen_new when given. CuPy arrays, last dimensions
    contiguous, checked by the caller; the index values are taken as given. ``row_pages``: the table's
    entries count cache rows (params.set_cache_rows: left-padded sequences)."""
    batch, seqlen_new, nheads_kv, headdim = k_new.shape
    if batch * seqlen_new * nheads_kv == 0:
        if seqlens_k is not None:
            seqlens_k[...] = cache_seqlens
        return
    for a, what in ((k_new, "k"), (v_new, "v"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        if a.strides[3] != a.itemsize:
            raise ValueError(f"cupyflash: {what} must have a contiguous last dimension")
    params = np.zeros(1, APPEND_PARAMS)
    for name, a in (("k_new", k_new), ("v_new", v_new)):
        set_rows(params, name, a)
    set_cache_rows(params, k_cache, v_cache, row_pages)
    params["cache_seqlens"], params["block_table"] = pointer(cache_seqlens), pointer(block_table)
    params["block_table_stride"] = np.int64(block_table.strides[0] // 4)
    params["seqlens_k"] = pointer(seqlens_k)
    params["page"]["divisor"], params["page"]["multiplier"], params["page"]["shift"] = fast_divmod(page_size)
    params["batch"], params["seqlen_new"] = np.int32(batch), np.int32(seqlen_new)
    params["nheads_kv"], params["headdim"] = np.int32(nheads_kv), np.int32(headdim)
    params["headdim_v"] = np.int32(v_new.shape[3])
    launch(specialization(k_cache.itemsize), (batch * seqlen_new, nheads_kv, 1), (params,))

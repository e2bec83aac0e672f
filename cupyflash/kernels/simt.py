"""SIMT kernel family (CUDA cores): every dtype, head dimensions 1..256.

Tiles (BLOCK_M query rows and BLOCK_N key rows per block, TPR lanes per tile row, by accumulator
width and head-dim tile) and specializations come from ``cupyflash.plans``; the backward kernels
run on the forward's tiles. This module turns arrays into kernel arguments.
"""
from __future__ import annotations

import math

import numpy as np

from ._module import Specialization, backward_is_empty, launch, row_strides
from .. import plans
from .._dtypes import SHORT_NAMES, dtype_name, is_float64
from ..masks import KINDS, Mask, mask_for

D_TILES = plans.SIMT_D_TILES

LOG2E = 1.4426950408889634


def d_tile(headdim: int) -> int:
    return plans.d_tile(headdim, D_TILES)


def tile_config(dtype, headdim: int) -> plans.SimtTiles:
    """(BLOCK_M, BLOCK_N, TPR) of every SIMT kernel at ``headdim``."""
    return plans.simt_tiles(dtype, headdim)


def _spec(kind: str, dtype, headdim: int, mask: Mask | bool) -> Specialization:
    """``kind`` "fwd", "dkdv" or "dq"; ``mask``: the policy (kernels_cu/mask.cuh), or a causal flag."""
    return plans.simt_specialization(kind, dtype, headdim, mask)


def _preprocess_spec(dtype) -> Specialization:
    name_dtype = dtype_name(dtype)
    return Specialization(f"flash_bwd_preprocess_{SHORT_NAMES[name_dtype]}", "flash_bwd_simt.cu",
                          f"cf::flash_bwd_preprocess<{plans.CTYPES[name_dtype]}>", 128, 0)


def specialization(kind: str, dtype, headdim: int, mask: Mask | bool) -> Specialization:
    return _spec(kind, dtype, headdim, mask)


def specializations() -> list[Specialization]:
    """Every specialization the dispatcher can launch (for the compile check)."""
    out = []
    for dtype in plans.CTYPES:
        out.append(_preprocess_spec(dtype))
        for dt in D_TILES:
            for mask in KINDS:
                for kind in ("fwd", "dkdv", "dq"):
                    out.append(_spec(kind, dtype, dt, mask))
    return out


def _acc_scalar(dtype, x: float):
    return np.float64(x) if is_float64(dtype) else np.float32(x)


def forward(q, k, v, o, lse, *, softmax_scale: float, causal: bool, window_size=(-1, -1)) -> None:
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    if batch == 0 or seqlen_q == 0 or nheads == 0:
        return
    mask = mask_for(causal, window_size)
    plan = plans.plan_forward(None, q.dtype, headdim, mask, None, family="simt")  # SIMT tiles do not depend on the device
    grid = (math.ceil(seqlen_q / plan.block_m), nheads, batch)
    args = (q, k, v, o, lse, np.int32(seqlen_q), np.int32(seqlen_k), np.int32(nheads),
            np.int32(nheads // nheads_kv), np.int32(headdim),
            *row_strides(q), *row_strides(k), *row_strides(v), *row_strides(o),
            _acc_scalar(q.dtype, softmax_scale * LOG2E), *mask.window_args())
    launch(plan.spec, grid, args)


def backward_preprocess(do, o):
    """D = rowsum(dO * O) as a (B, H, Sq) array of the accumulator dtype."""
    import cupy

    batch, seqlen_q, nheads, headdim = o.shape
    acc = np.float64 if is_float64(o.dtype) else np.float32
    delta = cupy.empty((batch, nheads, seqlen_q), dtype=acc)
    rows = batch * nheads * seqlen_q
    if rows == 0:
        return delta
    args = (do, o, delta, np.int32(batch), np.int32(seqlen_q), np.int32(nheads), np.int32(headdim),
            *row_strides(do), *row_strides(o))
    launch(_preprocess_spec(o.dtype), (math.ceil(rows / 4), 1, 1), args)
    return delta


def backward(do, q, k, v, o, lse, dq, dk, dv, *, softmax_scale: float, causal: bool,
             deterministic: bool = True, window_size=(-1, -1)) -> None:
    """dq, dk, dv (preallocated, C-contiguous) from the saved lse. Always deterministic."""
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    if backward_is_empty(q, k, dq, dk, dv):
        return
    mask = mask_for(causal, window_size)
    delta = backward_preprocess(do, o)
    bm, bn, _ = tile_config(q.dtype, headdim)
    common = (np.int32(seqlen_q), np.int32(seqlen_k), np.int32(nheads),
              np.int32(nheads // nheads_kv), np.int32(headdim),
              *row_strides(q), *row_strides(k), *row_strides(v), *row_strides(do))
    scales = (_acc_scalar(q.dtype, softmax_scale * LOG2E), _acc_scalar(q.dtype, softmax_scale),
              *mask.window_args())
    launch(_spec("dkdv", q.dtype, headdim, mask), (math.ceil(seqlen_k / bn), nheads_kv, batch),
           (q, k, v, do, lse, delta, dk, dv, *common, *row_strides(dk), *row_strides(dv), *scales))
    launch(_spec("dq", q.dtype, headdim, mask), (math.ceil(seqlen_q / bm), nheads, batch),
           (q, k, v, do, lse, delta, dq, *common, *row_strides(dq), *scales))

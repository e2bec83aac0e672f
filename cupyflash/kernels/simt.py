"""SIMT kernel family (CUDA cores): every dtype, head dimensions 1..256.

Tile configuration per (accumulator width, head-dim tile): BLOCK_M query rows and BLOCK_N key rows
per block, TPR lanes per tile row. Rows of shared-memory tiles are padded by one element.
"""
from __future__ import annotations

import math

import numpy as np

from ._module import Specialization, backward_is_empty, launch, row_strides
from .._dtypes import dtype_name, is_float64
from ..masks import KINDS, Mask, as_mask, mask_for

D_TILES = (16, 32, 64, 128, 256)

# (BLOCK_M, BLOCK_N, TPR) by head-dim tile; float64 tiles are smaller (twice the bytes per element,
# twice the registers per accumulator).
_CONFIG_32BIT = {16: (64, 64, 4), 32: (64, 64, 4), 64: (64, 64, 4), 128: (32, 32, 8), 256: (32, 32, 8)}
_CONFIG_64BIT = {16: (32, 32, 4), 32: (32, 32, 4), 64: (32, 32, 4), 128: (16, 16, 8), 256: (16, 16, 16)}

_CTYPE = {"float16": "cf::half_t", "bfloat16": "cf::bf16_t", "float32": "float", "float64": "double"}
_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}

LOG2E = 1.4426950408889634


def d_tile(headdim: int) -> int:
    for t in D_TILES:
        if headdim <= t:
            return t
    raise ValueError(f"headdim {headdim} > {D_TILES[-1]}")


def tile_config(dtype, headdim: int) -> tuple[int, int, int]:
    table = _CONFIG_64BIT if is_float64(dtype) else _CONFIG_32BIT
    return table[d_tile(headdim)]


def _acc_bytes(dtype) -> int:
    return 8 if is_float64(dtype) else 4


def _spec(kind: str, dtype, headdim: int, mask: Mask | bool) -> Specialization:
    """``mask``: the policy (kernels_cu/mask.cuh), or a causal flag."""
    mask = as_mask(mask)
    name_dtype = dtype_name(dtype)
    dt = d_tile(headdim)
    bm, bn, tpr = tile_config(dtype, headdim)
    ab = _acc_bytes(dtype)
    ld = dt + 1
    ctype = _CTYPE[name_dtype]
    if kind == "fwd":
        smem = ab * (bm * ld + 2 * bn * ld + bm * (bn + 1))
        threads, source, fn = bm * tpr, "flash_fwd_simt.cu", "flash_fwd_simt"
    elif kind == "dkdv":
        smem = ab * (2 * bn * ld + 2 * bm * ld + 2 * bn * (bm + 1) + 2 * bm)
        threads, source, fn = bn * tpr, "flash_bwd_simt.cu", "flash_bwd_dkdv_simt"
    elif kind == "dq":
        smem = ab * (2 * bm * ld + 2 * bn * ld + bm * (bn + 1))
        threads, source, fn = bm * tpr, "flash_bwd_simt.cu", "flash_bwd_dq_simt"
    else:
        raise ValueError(kind)
    name = f"{fn}_{_SHORT[name_dtype]}_hdim{dt}_{mask.name}_bm{bm}_bn{bn}_tpr{tpr}"
    expression = f"cf::{fn}<{ctype}, {dt}, {mask.cpp}, {bm}, {bn}, {tpr}>"
    return Specialization(name, source, expression, threads, smem)


def _preprocess_spec(dtype) -> Specialization:
    name_dtype = dtype_name(dtype)
    return Specialization(f"flash_bwd_preprocess_{_SHORT[name_dtype]}", "flash_bwd_simt.cu",
                          f"cf::flash_bwd_preprocess<{_CTYPE[name_dtype]}>", 128, 0)


def specialization(kind: str, dtype, headdim: int, mask: Mask | bool) -> Specialization:
    return _spec(kind, dtype, headdim, mask)


def specializations() -> list[Specialization]:
    """Every specialization the dispatcher can launch (for the compile check)."""
    out = []
    for dtype in _CTYPE:
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
    spec = _spec("fwd", q.dtype, headdim, mask)
    bm = tile_config(q.dtype, headdim)[0]
    grid = (math.ceil(seqlen_q / bm), nheads, batch)
    args = (q, k, v, o, lse, np.int32(seqlen_q), np.int32(seqlen_k), np.int32(nheads),
            np.int32(nheads // nheads_kv), np.int32(headdim),
            *row_strides(q), *row_strides(k), *row_strides(v), *row_strides(o),
            _acc_scalar(q.dtype, softmax_scale * LOG2E), *mask.window_args())
    launch(spec, grid, args)


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

"""Fixed-point dQ for the wgmma backward (``DqAdd::fixed``, kernels_cu/dq_add.cuh).

Every key block's contribution to dQ_i is added into an int64 ``dq_accum`` as round(x 2^E_i),
with 2^E_i a per-row power of two chosen from a bound on |dQ_i|. Integer adds are exact and
associative, so dQ is the same bits whatever order the CTAs add in: deterministic without the
ordered kernels' waiting. Around the backward kernel (kernels_cu/flash_bwd_dq_fixed.cu):

1. ``flash_bwd_kv_bounds``: max |K| and max |V| per (batch, kv head);
2. ``flash_bwd_preprocess_fixed``: D_i = dO_i . O_i (the backward's row statistic, which
   ``simt.backward_preprocess`` computes for the other paths, summed in another order) and 2^E_i
   from the bound max|K| (||dO_i||_1 max|V| + |D_i|);
3. the backward kernel adds into ``dq_accum``;
4. ``flash_bwd_dq_convert_fixed``: dq = softmax_scale * dq_accum * 2^-E_i in the input dtype.

A row whose contributions are not finite, or large enough that int64 sums could wrap (an lse that
is not the forward's), comes out NaN (the backward kernel marks it by storing NaN over its scale);
the bound ignores non-finite K and V entries, so rows that never see them are not affected.
"""
from __future__ import annotations

import math

import numpy as np

from ._module import Specialization, launch, row_strides
from .constants import CTYPES, SHORT_NAMES, SIXTEEN_BIT, TENSOR_CORE_D_TILES, d_tile
from .._dtypes import dtype_name

_SOURCE = "flash_bwd_dq_fixed.cu"
ROW_THREADS = 256
KV_BOUND_ROWS = 128  # key rows per block of flash_bwd_kv_bounds (ROWS in the kernel)


def kv_bounds_spec(dtype, dt: int) -> Specialization:
    name = dtype_name(dtype)
    return Specialization(f"flash_bwd_kv_bounds_{SHORT_NAMES[name]}_hdim{dt}", _SOURCE,
                          f"cf::flash_bwd_kv_bounds<{CTYPES[name]}, {dt}>", ROW_THREADS, 0)


def preprocess_spec(dtype, dt: int) -> Specialization:
    name = dtype_name(dtype)
    return Specialization(f"flash_bwd_preprocess_fixed_{SHORT_NAMES[name]}_hdim{dt}", _SOURCE,
                          f"cf::flash_bwd_preprocess_fixed<{CTYPES[name]}, {dt}>", ROW_THREADS, 0)


def convert_spec(dtype) -> Specialization:
    name = dtype_name(dtype)
    return Specialization(f"flash_bwd_dq_convert_fixed_{SHORT_NAMES[name]}", _SOURCE,
                          f"cf::flash_bwd_dq_convert_fixed<{CTYPES[name]}>", ROW_THREADS, 0)


def specializations() -> list[Specialization]:
    """Every specialization these launchers use (for the compile check)."""
    return [spec for name in SIXTEEN_BIT
            for spec in ([kv_bounds_spec(name, dt) for dt in TENSOR_CORE_D_TILES] + [preprocess_spec(name, dt) for dt in TENSOR_CORE_D_TILES]
                         + [convert_spec(name)])]


def preprocess(do, o, k, v):
    """(delta, dq_scale), both (B, H, Sq) float32: D_i and the fixed-point scale 2^E_i of each row.

    The arrays meet the mma family's guarantees (16-byte aligned rows)."""
    import cupy

    batch, seqlen_q, nheads, headdim = o.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    dt = d_tile(headdim)
    kv_bound = cupy.zeros((batch, nheads_kv, 2), dtype=np.uint32)
    launch(kv_bounds_spec(o.dtype, dt), (math.ceil(seqlen_k / KV_BOUND_ROWS), nheads_kv, batch),
           (k, v, kv_bound, np.int32(seqlen_k), np.int32(nheads_kv), np.int32(headdim),
            *row_strides(k), *row_strides(v)))
    delta = cupy.empty((batch, nheads, seqlen_q), dtype=np.float32)
    dq_scale = cupy.empty((batch, nheads, seqlen_q), dtype=np.float32)
    rows_per_block = ROW_THREADS // (dt // 8)
    launch(preprocess_spec(o.dtype, dt), (math.ceil(seqlen_q / rows_per_block), nheads, batch),
           (do, o, kv_bound, delta, dq_scale, np.int32(seqlen_q), np.int32(nheads),
            np.int32(nheads // nheads_kv), np.int32(headdim), *row_strides(do), *row_strides(o)))
    return delta, dq_scale


def accum_panels(batch: int, seqlen_q: int, nheads: int, dt: int, block_m: int):
    """A zeroed panel-major int64 dq_accum for DqAdd::fixed_panels: (batch, nheads * dt / 64,
    rows, 64), row count rounded up to whole query blocks (a warp adds 16 whole rows)."""
    import cupy

    rows = math.ceil(seqlen_q / block_m) * block_m
    return cupy.zeros((batch, nheads * (dt // 64), rows, 64), dtype=np.int64)


def panel_strides(dq_accum) -> tuple:
    """(batch, row, panel) strides of a panel-major dq_accum in elements: the backward kernel's
    (dqa_sb, dqa_ss, dqa_sh), where a head is dt / 64 consecutive panels."""
    sb, sp, ss, _ = (s // dq_accum.itemsize for s in dq_accum.strides)
    return np.int64(sb), np.int64(ss), np.int64(sp)


def convert(dq_accum, dq_scale, dq, softmax_scale: float, panel_major: bool = False) -> None:
    """dq = softmax_scale * dq_accum * 2^-E_i in dq's dtype: ``dq_accum`` int64, (batch, seqlen,
    nheads, head-dim tile) or, ``panel_major``, from ``accum_panels``."""
    batch, seqlen_q, nheads, headdim = dq.shape
    n_chunks = batch * seqlen_q * nheads * (headdim // 8)
    launch(convert_spec(dq.dtype), (math.ceil(n_chunks / ROW_THREADS), 1, 1),
           (dq_accum, dq_scale, dq, np.int32(seqlen_q), np.int32(nheads), np.int32(headdim), np.int64(n_chunks),
            *convert_strides(dq_accum, nheads, panel_major), *row_strides(dq), np.float32(softmax_scale)))


def convert_strides(dq_accum, nheads: int, panel_major: bool) -> tuple:
    """The convert kernel's (dqa_sb, dqa_ss, dqa_sh, dqa_sp): element (b, m, h, c) of dQ is at
    b sb + m ss + h sh + (c // 64) sp + c % 64."""
    if not panel_major:
        return (*row_strides(dq_accum), np.int64(64))
    sb, ss, sp = panel_strides(dq_accum)
    return sb, ss, np.int64(sp * (dq_accum.shape[1] // nheads)), sp

"""Fixed-point dQ for the wgmma backward (``DqAdd::fixed``, kernels_cu/dq_add.cuh).

Every key block's contribution to dQ_i is added into an int64 ``dq_accum`` as round(x 2^E_i),
with 2^E_i a per-row power of two chosen from a bound on |dQ_i|. Integer adds are exact and
associative, so dQ is the same bits whatever order the CTAs add in: deterministic without the
ordered kernels' waiting. Around the backward kernel (kernels_cu/dq_fixed.cuh; each kernel in
kernels_cu/<kernel>.cu):

1. ``flash_bwd_kv_bounds``: max |K| and max |V| per (batch, kv head);
2. ``flash_bwd_preprocess_fixed``: D_i = dO_i . O_i (the backward's row statistic, which
   ``simt.backward_preprocess`` computes for the other paths, summed in another order) and 2^E_i
   from the bound max|K| (||dO_i||_1 max|V| + |D_i|);
3. the backward kernel adds into ``dq_accum``;
4. ``flash_bwd_dq_convert_fixed``: dq = softmax_scale * dq_accum * 2^-E_i in the input dtype.

Every kernel takes the call's ``BwdParams`` (kernels/params.py): ``preprocess`` allocates the
bounds, D and the scales and puts their addresses into it; the launcher (mma_bwd.backward) adds
dq_accum (``panel_strides``, ``panel_stride`` for ``accum_panels``' layout) and launches the
backward kernel and the convert with the same struct.

A row whose contributions are not finite, or large enough that int64 sums could wrap (an lse that
is not the forward's), comes out NaN (the backward kernel marks it by storing NaN over its scale);
the bound ignores non-finite K and V entries, so rows that never see them are not affected.
"""
from __future__ import annotations

import math

import numpy as np

from ._module import Specialization, launch
from .constants import CTYPES, SHORT_NAMES, SIXTEEN_BIT, TENSOR_CORE_D_TILES, d_tile
from .params import pointer
from .._dtypes import dtype_name

ROW_THREADS = 256
KV_BOUND_ROWS = 128  # key rows per block of flash_bwd_kv_bounds (ROWS in the kernel)


def _spec(kernel: str, suffix: str, arguments: str) -> Specialization:
    """``kernel`` (kernels_cu/<kernel>.cu) at template ``arguments``, named <kernel>_<suffix>."""
    return Specialization(f"{kernel}_{suffix}", f"{kernel}.cu", f"cf::{kernel}<{arguments}>", ROW_THREADS, 0)


def kv_bounds_spec(dtype, dt: int) -> Specialization:
    name = dtype_name(dtype)
    return _spec("flash_bwd_kv_bounds", f"{SHORT_NAMES[name]}_hdim{dt}", f"{CTYPES[name]}, {dt}")


def preprocess_spec(dtype, dt: int) -> Specialization:
    name = dtype_name(dtype)
    return _spec("flash_bwd_preprocess_fixed", f"{SHORT_NAMES[name]}_hdim{dt}", f"{CTYPES[name]}, {dt}")


def convert_spec(dtype) -> Specialization:
    name = dtype_name(dtype)
    return _spec("flash_bwd_dq_convert_fixed", SHORT_NAMES[name], CTYPES[name])


def specializations() -> list[Specialization]:
    """Every specialization these launchers use (for the compile check)."""
    return [spec for name in SIXTEEN_BIT
            for spec in ([kv_bounds_spec(name, dt) for dt in TENSOR_CORE_D_TILES]
                         + [preprocess_spec(name, dt) for dt in TENSOR_CORE_D_TILES] + [convert_spec(name)])]


def preprocess(params, do, o, k, v) -> tuple:
    """(kv_bound, delta, dq_scale): max |K|, max |V| per (batch, kv head) (B, Hkv, 2) uint32 float
    bits, and D_i and the fixed-point scale 2^E_i of each row, both (B, H, Sq) float32; their
    addresses go into ``params`` (kv_bound, delta, dq_row_scale), the call's BwdParams, which both
    kernels read (k, v, dout, o and the shape with them).

    The arrays meet the mma family's guarantees (16-byte aligned rows); the caller keeps them
    referenced until the launches that read them are queued."""
    import cupy

    batch, seqlen_q, nheads, _ = o.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    dt = d_tile(max(k.shape[3], v.shape[3]))  # the backward kernel's tile: holds q, k and v
    kv_bound = cupy.zeros((batch, nheads_kv, 2), dtype=np.uint32)
    delta = cupy.empty((batch, nheads, seqlen_q), dtype=np.float32)
    dq_scale = cupy.empty((batch, nheads, seqlen_q), dtype=np.float32)
    params["kv_bound"] = pointer(kv_bound)
    params["delta"] = pointer(delta)
    params["dq_row_scale"] = pointer(dq_scale)
    launch(kv_bounds_spec(o.dtype, dt), (math.ceil(seqlen_k / KV_BOUND_ROWS), nheads_kv, batch), (params,))
    rows_per_block = ROW_THREADS // (dt // 8)
    launch(preprocess_spec(o.dtype, dt), (math.ceil(seqlen_q / rows_per_block), nheads, batch), (params,))
    return kv_bound, delta, dq_scale


def accum_panels(batch: int, seqlen_q: int, nheads: int, dt: int, block_m: int):
    """A zeroed panel-major int64 dq_accum for DqAdd::fixed_panels: (batch, nheads * dt / 64,
    rows, 64), row count rounded up to whole query blocks (a warp adds 16 whole rows)."""
    import cupy

    rows = math.ceil(seqlen_q / block_m) * block_m
    return cupy.zeros((batch, nheads * (dt // 64), rows, 64), dtype=np.int64)


def panel_strides(dq_accum, nheads: int) -> tuple:
    """(batch, row, head) strides in elements of a panel-major dq_accum (``accum_panels``), as
    BwdParams' dq_accum takes them: a head is dt / 64 consecutive panels, so its stride is that
    many panel strides (``panel_stride``)."""
    sb, sp, ss, _ = (s // dq_accum.itemsize for s in dq_accum.strides)
    return np.int64(sb), np.int64(ss), np.int64(sp * (dq_accum.shape[1] // nheads))


def panel_stride(dq_accum) -> np.int64:
    """The stride in elements between consecutive 64-column panels of a panel-major dq_accum
    (BwdParams' dq_accum_panel_stride: column c of a row is at (c / 64) panel strides + c % 64)."""
    return np.int64(dq_accum.strides[1] // dq_accum.itemsize)

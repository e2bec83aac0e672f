"""SIMT kernel family (CUDA cores): every dtype, head dimensions 1..256.

Tiles (BLOCK_M query rows and BLOCK_N key rows per block, TPR lanes per tile row, by accumulator
width and head-dim tile) and specializations come from ``cupyflash.plans``; the backward kernels
run on the forward's tiles. This module turns arrays into kernel arguments.
"""
from __future__ import annotations

import math

import numpy as np

from ._module import Specialization, backward_is_empty, launch
from .constants import CTYPES, SIMT_D_TILES
from .params import PackedBatch, backward_params, forward_params, pointer, set_lse_unit
from .. import backward_plans, plans
from .._dtypes import is_16bit, is_float64
from ..masks import KINDS, PACKED_KINDS, VARIANT_KINDS, Mask, mask_for
from ..scores import PLAIN

D_TILES = SIMT_D_TILES


def d_tile(headdim: int) -> int:
    return plans.d_tile(headdim, D_TILES)


def tile_config(dtype, headdim: int) -> plans.SimtTiles:
    """(BLOCK_M, BLOCK_N, TPR) of every SIMT kernel at ``headdim``."""
    return plans.simt_tiles(dtype, headdim)


def _spec(kind: str, dtype, headdim: int, mask: Mask | bool) -> Specialization:
    """``kind`` "fwd", "dkdv" or "dq"; ``mask``: the policy (kernels_cu/mask.cuh), or a causal flag."""
    return plans.simt_specialization(kind, dtype, headdim, mask)


def _preprocess_spec(dtype) -> Specialization:
    return backward_plans.preprocess_spec(dtype)


def specialization(kind: str, dtype, headdim: int, mask: Mask | bool) -> Specialization:
    return _spec(kind, dtype, headdim, mask)


def _kinds(dtype) -> tuple[str, ...]:
    """The SIMT kernels of ``dtype``: the forward, then the backward's (statistics="recomputed"'s
    flash_bwd_stats_simt for float32 and float64)."""
    return ("fwd", "dkdv", "dq") if is_16bit(dtype) else ("fwd", "stats", "dkdv", "dq")


def specializations() -> list[Specialization]:
    """Every specialization the dispatcher can launch (for the compile check)."""
    out = []
    for dtype in CTYPES:
        out.append(_preprocess_spec(dtype))
        for dt in D_TILES:
            for mask in KINDS:
                for kind in _kinds(dtype):
                    out.append(_spec(kind, dtype, dt, mask))
            for mask in VARIANT_KINDS + PACKED_KINDS:
                out.append(_spec("fwd", dtype, dt, mask))
                out.extend(_spec(kind, dtype, dt, mask.backward()) for kind in _kinds(dtype)[1:])
    return out


def forward(q, k, v, o, lse, *, softmax_scale: float, causal: bool, window_size=(-1, -1), variant=None,
            packed: PackedBatch | None = None) -> None:
    """o and lse ((B, H, Sq), the accumulator dtype) from q, k, v, as mma_fwd.forward (``packed``:
    a varlen batch, B = 1)."""
    from .mma_fwd import query_grid

    batch, seqlen_q, nheads, headdim = q.shape
    if batch == 0 or seqlen_q == 0 or nheads == 0:
        return
    mask = mask_for(causal, window_size, PLAIN if variant is None else variant.score, packed is not None)
    # SIMT tiles do not depend on the device; one head-dim tile holds q, k and v.
    plan = plans.plan_forward(None, q.dtype, max(headdim, v.shape[3]), mask, None, family="simt")
    grid = query_grid(plan.block_m, batch, seqlen_q, nheads, packed)
    launch(plan.spec, grid, (forward_params(q, k, v, o, lse, softmax_scale=softmax_scale, mask=mask,
                                            variant=variant, packed=packed),))


def backward_preprocess(params, do, o):
    """D = rowsum(dO * O) as a (B, H, Sq) array of the accumulator dtype, its address put in
    ``params`` (the call's BwdParams, which holds dO and O)."""
    import cupy

    batch, seqlen_q, nheads, headdim = o.shape
    acc = np.float64 if is_float64(o.dtype) else np.float32
    delta = cupy.empty((batch, nheads, seqlen_q), dtype=acc)
    params["delta"] = pointer(delta)
    rows = batch * nheads * seqlen_q
    if rows == 0:
        return delta
    launch(_preprocess_spec(o.dtype), (math.ceil(rows / backward_plans.PREPROCESS_ROWS), 1, 1), (params,))
    return delta


def backward_statistics(params, plan, grid, o):
    """flash_bwd_stats_simt's row statistics (params.cuh's BwdParams: D - dp_ref, the top score,
    the weight 1 / sum, dp_ref), one (4, B, H, Sq) array of the accumulator dtype, their addresses
    put in ``params`` in place of the saved lse's."""
    import cupy

    batch, seqlen_q, nheads, _ = o.shape
    acc = np.float64 if is_float64(o.dtype) else np.float32
    stats = cupy.empty((4, batch, nheads, seqlen_q), dtype=acc)
    params["delta"], params["lse"], params["weight"], params["dp_ref"] = (pointer(x) for x in stats)
    set_lse_unit(params, 1.0)
    launch(plan.spec("stats"), grid, (params,))
    return stats


def backward(do, q, k, v, o, lse, dq, dk, dv, *, softmax_scale: float, causal: bool,
             deterministic: bool = True, window_size=(-1, -1), variant=None,
             packed: PackedBatch | None = None) -> None:
    """dq, dk, dv (preallocated, C-contiguous) from the saved lse, by the plan of
    backward_plans.plan_backward (D, then the dK/dV kernel, then the dQ kernel). Always
    deterministic. ``packed``: a varlen batch (B = 1). The variant's ``statistics``
    "recomputed": lse and D from flash_bwd_stats_simt instead of the saved lse and o."""
    headdim = q.shape[3]
    if backward_is_empty(q, k, dq, dk, dv):
        return
    mask = mask_for(causal, window_size, PLAIN if variant is None else variant.score, packed is not None).backward()
    plan = backward_plans.plan_backward(None, q.dtype, max(headdim, v.shape[3]), mask, None, True, family="simt",
                                        statistics="saved" if variant is None else variant.statistics)
    run_backward(plan, do, q, k, v, o, lse, dq, dk, dv, softmax_scale=softmax_scale, mask=mask, variant=variant,
                 packed=packed)


def run_backward(plan, do, q, k, v, o, lse, dq, dk, dv, *, softmax_scale: float, mask: Mask, variant=None,
                 packed: PackedBatch | None = None) -> None:
    """Launches ``plan``, a plan of three kernels on one BwdParams (the SIMT family's, float64's
    DMMA kernels', the float32 candidates'): D or the recomputed row statistics, then dK/dV, then
    dQ (none where the dK/dV kernel adds it)."""
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    grids = {launch.role: launch.grid(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, packed)
             for launch in plan.launches}
    params = backward_params(do, q, k, v, o, lse, dq, dk, dv, softmax_scale=softmax_scale, mask=mask,
                             variant=variant, packed=packed)
    if plan.spec("stats") is not None:
        rows = backward_statistics(params, plan, grids["stats"], o)
    else:
        rows = backward_preprocess(params, do, o)
    sequences = None if packed is None else packed.sequences

    def split_image(role: str, field: str, nbytes) -> object:
        """The plan's split-once kernel ``role`` (tf32 wgmma presplit), if any, run into a fresh image
        of nbytes() bytes that params' ``field`` points at; None without one."""
        if plan.spec(role) is None:
            return None
        import cupy

        image = cupy.empty(nbytes(), np.uint8)
        params[field] = pointer(image)
        launch(plan.spec(role), grids[role], (params,))
        return image

    # the tf32 wgmma dK/dV's query blocks split once (presplit), then the dQ's key blocks (dq_presplit)
    q_split = split_image("split_q", "q_split", lambda: backward_plans.q_split_bytes(
        plan.d_tile, plan.kernels.block_m, batch, seqlen_q, nheads, sequences))
    launch(plan.spec("dkdv"), grids["dkdv"], (params,))
    kv_split = split_image("split_kv", "kv_split", lambda: backward_plans.kv_split_bytes(
        plan.d_tile, plan.kernels.dq_block_n, batch, seqlen_k, nheads_kv, sequences))
    if plan.spec("dq") is not None:  # none: the dK/dV kernel adds dQ (the tf32 wgmma candidate's fused_dq)
        launch(plan.spec("dq"), grids["dq"], (params,))
    del rows, q_split, kv_split  # back to CuPy's pool in stream order, after the launches

"""Tensor-core backward (fp16/bf16, head dim <= 256): FlashAttention-2 work split.

A dK/dV kernel (one CTA per key block) accumulates dK, dV in registers over every query block of
every query head of its GQA group. dQ comes either from a dQ kernel of its own (one CTA per query
block, no adds: bitwise reproducible) or from the dK/dV kernel, added into ``dq_accum`` (float32
atomics; on sm_90 earlier versions also added in key-block order or as int64 fixed point) and
scaled and converted afterwards. Which kernels run, with which tiles, is the call's plan
(``cupyflash.backward_plans.plan_backward``: one row of ``BACKWARD_KERNELS`` per device class,
head-dim tile and ``deterministic``); this module turns arrays into the plan's kernel arguments
and launches them in the plan's order.

``backward(..., version=...)`` runs a superseded version instead, from the repository's
``dev/mma_bwd.py`` (a source checkout only), as do ``dq_config``, ``fused`` and ``wgmma`` (the
tuner's tiles).
"""
from __future__ import annotations

import numpy as np

from . import dq_fixed, simt
from ._module import Specialization, backward_is_empty, launch
from .constants import SIXTEEN_BIT
from .mma_fwd import _check_layout
from .params import PackedBatch, backward_params, pointer, set_rows
from .. import backward_plans
from .._dtypes import is_16bit
from ..backward_plans import (
    CONVERT_THREADS, D_TILES, DKDV_CONFIG, DKDV_CONFIG_SPLIT, DKDV_CONFIG_V2, DKDV_KERNELS, DQ_ADDS, DQ_CONFIG,
    DQ_CONFIG_V2, DQ_STAGE_ROW, DQ_WGMMA_CONFIG, FIXED_DQ_ADDS, FUSED_CONFIG, WGMMA_CONFIG,
    WGMMA_FIXED_KERNEL_D_TILES, BackwardPlan, convert_spec, d_tile, dkdv_smem_bytes, dkdv_spec,
    dkdv_split_smem_bytes, dq_smem_bytes, dq_smem_bytes_v2, dq_spec, dq_wgmma_smem_bytes, dq_wgmma_spec,
    fused_smem_bytes, fused_spec, supports, wgmma_smem_bytes, wgmma_spec)
from ..masks import KINDS, PACKED_KINDS, VARIANT_KINDS, Mask, mask_for
from ..scores import PLAIN

__all__ = ["backward", "plan", "specializations", "supports", "d_tile", "DEV_VERSION",
           # backward_plans' tables and builders, here beside the launcher that runs them
           "CONVERT_THREADS", "D_TILES", "DKDV_CONFIG", "DKDV_CONFIG_SPLIT", "DKDV_CONFIG_V2", "DKDV_KERNELS",
           "DQ_ADDS", "DQ_CONFIG", "DQ_CONFIG_V2", "DQ_STAGE_ROW", "DQ_WGMMA_CONFIG", "FIXED_DQ_ADDS", "FUSED_CONFIG",
           "WGMMA_CONFIG", "WGMMA_FIXED_KERNEL_D_TILES", "BackwardPlan", "convert_spec", "dkdv_smem_bytes",
           "dkdv_spec", "dkdv_split_smem_bytes", "dq_smem_bytes", "dq_smem_bytes_v2", "dq_spec",
           "dq_wgmma_smem_bytes", "dq_wgmma_spec", "fused_smem_bytes", "fused_spec", "wgmma_smem_bytes",
           "wgmma_spec"]

# A dev/mma_bwd.py version that every call without ``version=`` runs instead of its plan (None: the
# plan). The GPU tests set it to run the superseded versions through the public API.
DEV_VERSION: str | None = None


def plan(dtype, headdim: int, mask: Mask, deterministic: bool, version: str | None = None,
         **tiles) -> BackwardPlan:
    """The plan ``backward`` runs at exactly ``headdim`` on the current device: plan_backward's, or
    dev/mma_bwd.py's for ``version`` or for the tuner's ``tiles`` (dq_config, fused, wgmma,
    wgmma_ws, dq_ws)."""
    from .mma_fwd import current_arch, current_smem_optin

    if not supports(dtype, headdim):
        raise ValueError(f"cupyflash: mma backward does not support {np.dtype(dtype)} with headdim {headdim}")
    tiles = {key: value for key, value in tiles.items() if value is not None}
    version = version if version is not None else DEV_VERSION
    if version is None and not tiles:
        return backward_plans.plan_backward(current_arch(), dtype, headdim, mask, current_smem_optin(),
                                            deterministic)
    from .. import _dev

    dev = _dev.load("mma_bwd")
    if dev is None:
        raise ValueError("cupyflash: backward versions and tuning tiles are in dev/mma_bwd.py, which only a "
                         "source checkout has (a wheel ships the plans alone)")
    kernels = dev.kernels(version or dev.LAST_VERSION, current_arch(), current_smem_optin(), dtype, headdim, mask,
                          deterministic, **tiles)
    return backward_plans.backward_plan(dtype, headdim, mask, kernels)


def specializations() -> list[Specialization]:
    """Every specialization the plans and dev/mma_bwd.py's versions launch (for the compile check):
    every tile table's kernel with each dQ mode it has, for both 16-bit dtypes and every mask but
    the window, and with a window the kernels the plans launch."""
    out = dq_fixed.specializations()
    for name in SIXTEEN_BIT:
        out.append(convert_spec(name))
        for dt in D_TILES:
            for mask in KINDS[:2]:
                for dq_add in ("none", "atomic"):
                    out.extend(dict.fromkeys(dkdv_spec(name, dt, mask, dq_add, kernel) for kernel, table
                                             in DKDV_KERNELS.items() if dt in table
                                             and not (kernel == "split" and dq_add == "atomic")))
                out.append(dq_spec(name, dt, mask, DQ_CONFIG[dt]))
                if dt in DQ_CONFIG_V2:
                    out.append(dq_spec(name, dt, mask, DQ_CONFIG_V2[dt]))
                if dt in FUSED_CONFIG:
                    out.extend(fused_spec(name, dt, mask, dq_add) for dq_add in ("ordered", "atomic"))
                if dt in WGMMA_CONFIG:
                    out.extend(wgmma_spec(name, dt, mask, dq_add) for dq_add in DQ_ADDS
                               if dq_add not in FIXED_DQ_ADDS or dt in WGMMA_FIXED_KERNEL_D_TILES)
                if dt in DQ_WGMMA_CONFIG:
                    out.append(dq_wgmma_spec(name, dt, mask))
                if dt in backward_plans.WGMMA_WS_D_TILES:  # v13's producer rows (v10's kernels above stay: dev/)
                    out.extend(launch.spec for launch in backward_plans.plan_backward(
                        "90", name, dt, mask, None, True).launches if launch.role in ("dkdv", "dq"))
            # with a window and with the score variants, the kernels the plans launch
            for mask in (KINDS[2], *(m.backward() for m in VARIANT_KINDS + PACKED_KINDS)):
                launched = [backward_plans.plan_backward(arch, name, dt, mask, None, deterministic).launches
                            for arch in ("80", "90") for deterministic in (True, False)]
                # where the fused kernel does not fit (sm_80 at d256), the atomic dK/dV kernel runs
                launched += [backward_plans.plan_backward("80", name, dt, mask, 0, False).launches]
                out.extend(dict.fromkeys(launch.spec for launches in launched for launch in launches
                                         if launch.role in ("dkdv", "dq")))
    return out


def _zero_padded(x, width: int):
    """x (B, S, H, D) with zero columns D .. width - 1, C-contiguous."""
    import cupy

    padded = cupy.zeros(x.shape[:3] + (width,), x.dtype)
    padded[..., :x.shape[3]] = x
    return padded


def backward(do, q, k, v, o, lse, dq, dk, dv, *, softmax_scale: float, causal: bool,
             deterministic: bool = True, version: str | None = None,
             dq_config: tuple | None = None, fused: tuple | None = None, wgmma: tuple | None = None,
             wgmma_ws: tuple | None = None, dq_ws: tuple | None = None, window_size=(-1, -1), variant=None,
             packed: PackedBatch | None = None) -> None:
    """Fill the preallocated dq, dk, dv (C-contiguous, dtype of q) from the saved lse (B, H, Sq);
    ``packed`` a varlen batch (B = 1, its sequences' rows packed; dQ without adds or by float
    atomics, the plans' two modes).

    Inputs are CuPy arrays meeting the mma family's guarantees (fp16/bf16, last dim contiguous,
    row strides multiples of 8 elements, 16-byte aligned, headdim % 8 == 0, headdim <= 256).
    ``version`` runs an entry of dev/mma_bwd.py's VERSIONS instead of the plan; ``dq_config``,
    ``fused`` and ``wgmma`` other tiles of the dQ kernel, the fused kernel and the wgmma kernel
    (tuning); ``wgmma_ws`` and ``dq_ws`` run dK/dV and dQ on the producer candidates
    flash_bwd_wgmma_ws and flash_bwd_dq_wgmma_ws at those tiles. ``window_size`` is flash-attn's
    (left, right) (cupyflash.masks).
    """
    import cupy

    if not is_16bit(q.dtype):  # float64's DMMA kernels, float32's tf32x3 on the same (kernels/dmma.py)
        if any(x is not None for x in (version, dq_config, fused, wgmma, wgmma_ws, dq_ws)):
            raise ValueError("cupyflash: versions and tuning tiles are the 16-bit backward's; the float32 and float64 "
                             "backward take dmma.backward(config=...)")
        from . import dmma

        dmma.backward(do, q, k, v, o, lse, dq, dk, dv, softmax_scale=softmax_scale, causal=causal,
                      window_size=window_size, variant=variant, packed=packed)
        return
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    if backward_is_empty(q, k, dq, dk, dv):
        return
    # A sink changes only lse, which the kernels read (scores.Score.backward); dsink is the API's.
    mask = mask_for(causal, window_size, PLAIN if variant is None else variant.score, packed is not None).backward()
    planned = plan(q.dtype, max(headdim, v.shape[3]), mask, deterministic, version, dq_config=dq_config, fused=fused,
                   wgmma=wgmma, wgmma_ws=wgmma_ws, dq_ws=dq_ws)  # one head-dim tile holds q, k and v
    if packed is not None and planned.dq_add not in ("none", "atomic"):
        raise ValueError(f"cupyflash: a packed batch's backward adds dQ by its own kernel or by float atomics; "
                         f"this plan adds it as {planned.dq_add!r} (a dev/ version)")
    lse = cupy.ascontiguousarray(lse, dtype=np.float32)  # indexed as (batch, head, row) in C order
    if q.shape[3] != do.shape[3]:
        # The mma.sync dK/dV kernels load their Q and dO tiles under one column bound, the wider
        # head dim (mma_bwd_layouts.cuh, cp_async_query_block): the narrower of the two gets zero
        # columns up to it (one copy of q or do; BwdParams' headdim is k's, so the kernels still
        # write dq and dk at it).
        width = max(q.shape[3], do.shape[3])
        q, do = (x if x.shape[3] == width else _zero_padded(x, width) for x in (q, do))
    # The kernels' loads take 16-byte row chunks, and their epilogues store dQ, dK and dV as whole
    # 16-byte chunks of each row below the head dim (stage_acc, store_tile): a silent overrun of
    # the next row's elements if a head dim or stride were not a multiple of 8.
    for a, what in ((q, "q"), (k, "k"), (v, "v"), (do, "do"), (o, "o"), (dq, "dq"), (dk, "dk"), (dv, "dv")):
        _check_layout(a, what, whole_chunks=True)
    dt, dq_add = planned.d_tile, planned.dq_add
    grids = {launch.role: launch.grid(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, packed)
             for launch in planned.launches}
    # One BwdParams for every kernel of the call; each buffer the plan needs is added to it as it
    # is allocated (the arrays stay referenced here until the launches are queued).
    params = backward_params(do, q, k, v, o, lse, dq, dk, dv, softmax_scale=softmax_scale, mask=mask,
                             variant=variant, packed=packed)
    if dq_add in FIXED_DQ_ADDS:
        buffers = dq_fixed.preprocess(params, do, o, k, v)  # kv_bound, delta, dq_row_scale
    else:
        buffers = (simt.backward_preprocess(params, do, o),)  # the plan's "preprocess" launch: delta
    dq_accum = None
    if dq_add == "fixed_panels":
        dq_accum = dq_fixed.accum_panels(batch, seqlen_q, nheads, dt, planned.kernels.dkdv_tiles[0])
        set_rows(params, "dq_accum", dq_accum, dq_fixed.panel_strides(dq_accum, nheads))
        params["dq_accum_panel_stride"] = dq_fixed.panel_stride(dq_accum)
    elif dq_add != "none":  # dQ added across key blocks; "none": dQ by its own kernel, no dq_accum
        dq_accum = cupy.zeros((batch, seqlen_q, nheads, dt), dtype=np.int64 if dq_add == "fixed" else np.float32)
        set_rows(params, "dq_accum", dq_accum)
        params["dq_accum_panel_stride"] = 64
    semaphore = None
    if dq_add == "ordered":
        # one counter per (batch, head, query block): how many warps of earlier key blocks have added
        block_m = planned.kernels.dkdv_tiles[0]
        semaphore = cupy.zeros((batch, nheads, -(-seqlen_q // block_m)), dtype=np.int32)
        params["dq_semaphore"] = pointer(semaphore)
    launch(planned.spec("dkdv"), grids["dkdv"], (params,))
    if dq_add == "none":
        launch(planned.spec("dq"), grids["dq"], (params,))
    else:
        launch(planned.spec("convert"), grids["convert"], (params,))
    del buffers, dq_accum, semaphore  # freed to CuPy's pool in stream order, after the launches

"""float64 on the FP64 tensor cores (issue 18). The forward (``kernels_cu/flash_fwd_dmma.cu``): the
float64 rows of ``cupyflash.plans`` (``("dmma", class, d_tile)``) up to d128, which
``cupyflash.kernels.mma_fwd.forward`` launches on the head dims padded to a multiple of 8; past
128 the kernel's Q fragments and O accumulators alone would take 256 registers, and float64 runs
the SIMT forward. The backward (``flash_bwd_{dkdv,dq,stats}_dmma.cu``): the float64 plans of
``cupyflash.backward_plans`` (``DMMA_BACKWARD_TILES``) up to d128, which
``cupyflash.kernels.mma_bwd.backward`` hands to ``backward`` here. Both launch on any head dim
and strides, with other tiles if asked (dev/bench_dmma.py, the tests).
"""
from __future__ import annotations

import numpy as np

from ._module import Specialization, launch
from .params import forward_params
from .. import backward_plans, plans
from ..backward_plans import DMMA_BACKWARD_TILES, DmmaBwdConfig, Tf32WgmmaBwdConfig
from ..masks import KINDS, PACKED_KINDS, VARIANT_KINDS, mask_for
from ..plans import DmmaFwdConfig
from ..scores import PLAIN

D_TILES = plans.DMMA_D_TILES


def d_tile(headdim: int) -> int:
    return plans.d_tile(headdim, D_TILES)


def specialization(headdim: int, mask, config: DmmaFwdConfig | None = None) -> Specialization:
    """The specialization at ``headdim``'s tile: ``config``'s, or the SM90 row's."""
    dt = d_tile(headdim)
    return plans.specialization_for("float64", dt, mask, config or plans.FORWARD_TILES[("dmma", plans.SM90, dt)])


def specializations() -> list[Specialization]:
    """Every specialization the float64 rows launch, forward and backward, and float32's backward rows
    (tf32x3) and wgmma candidates (for the compile check)."""
    configs = sorted({(dt, c) for (family, _, dt), c in plans.FORWARD_TILES.items() if family == "dmma"})
    out = [specialization(dt, mask, c) for dt, c in configs for mask in KINDS + VARIANT_KINDS + PACKED_KINDS]
    backward_masks = list(KINDS) + [mask.backward() for mask in VARIANT_KINDS + PACKED_KINDS]
    for (_, dt), c in sorted(DMMA_BACKWARD_TILES.items()):
        out.extend(backward_plans.dmma_spec(kind, dt, mask, c) for mask in backward_masks
                   for kind in ("stats", "dkdv", "dq"))
    for dt in D_TILES:  # float32's rows: tf32x3 on the same kernels
        out.extend(backward_plans.dmma_spec(kind, dt, mask, backward_plans.tf32x3_backward_config(dt), "float32")
                   for mask in backward_masks for kind in ("stats", "dkdv", "dq"))
    for dt, configs in sorted(backward_plans.TF32_WGMMA_BACKWARD_CONFIGS.items()):  # its wgmma candidates
        out.extend(backward_plans.tf32_wgmma_spec(kind, dt, mask, c) for c in configs for mask in backward_masks
                   for kind in ("dkdv", "dq") if kind == "dkdv" or c.dq_block_n)  # (0: the tf32x3 dQ)
        out.extend(backward_plans.tf32_split_kv_spec(dt, mask, c) for c in configs if c.dq_presplit
                   for mask in backward_masks)  # the key blocks' split, dense and packed
        out.extend(backward_plans.tf32_split_q_spec(dt, mask, c) for c in configs if c.presplit
                   for mask in backward_masks)  # the query blocks' split, dense and packed
    for (where, dt) in sorted(backward_plans.TF32_WGMMA_BACKWARD_ROUTE):  # the route, as each mask takes it
        # (none where tf32_wgmma_route gives none; and at d128 none for the user modifiers, whose
        # pair dQ spills with the sample modifier: the plan asks ptxas and runs tf32x3 there)
        out.extend(backward_plans.tf32_wgmma_spec(kind, dt, mask, backward_plans.tf32_wgmma_route(where, dt, mask))
                   for mask in backward_masks for kind in ("dkdv", "dq")
                   if backward_plans.tf32_wgmma_route(where, dt, mask) is not None
                   and not (dt == 128 and mask.score.user is not None))
    return list(dict.fromkeys(out))


def forward(q, k, v, o, lse, *, softmax_scale: float, causal: bool, window_size=(-1, -1), variant=None,
            packed=None, config: DmmaFwdConfig | None = None) -> None:
    """o and lse ((B, H, Sq), float64) from float64 q, k, v, as mma_fwd.forward (``packed``: a
    varlen batch, B = 1), on flash_fwd_dmma with ``config`` (the plan's by default); any head dim
    up to 128 and any strides (the kernel copies single doubles)."""
    from ._module import device_arch
    from .mma_fwd import current_smem_optin, query_grid

    if any(x.dtype != np.float64 for x in (q, k, v, o, lse)):
        raise TypeError("cupyflash: flash_fwd_dmma takes float64 q, k, v, o and lse")
    if int(device_arch()) < 80:
        raise ValueError(f"cupyflash: flash_fwd_dmma needs sm_80 or newer (DMMA), not sm_{device_arch()}")
    if config is not None and config.wide and device_arch() != "90":
        raise ValueError(f"cupyflash: flash_fwd_dmma's wide layout (m16n8k8 .f64) is compiled for sm_90, "
                         f"not sm_{device_arch()}")
    batch, seqlen_q, nheads, headdim = q.shape
    if batch == 0 or seqlen_q == 0 or nheads == 0:
        return
    mask = mask_for(causal, window_size, PLAIN if variant is None else variant.score, packed is not None)
    dt = d_tile(max(headdim, v.shape[3]))
    if config is None:
        config = plans.plan_forward(device_arch(), np.float64, dt, mask, current_smem_optin(), family="mma").tiles
    grid = query_grid(config.block_m, batch, seqlen_q, nheads, packed)
    launch(specialization(dt, mask, config), grid,
           (forward_params(q, k, v, o, lse, softmax_scale=softmax_scale, mask=mask, variant=variant, packed=packed),))


def backward(do, q, k, v, o, lse, dq, dk, dv, *, softmax_scale: float, causal: bool, deterministic: bool = True,
             window_size=(-1, -1), variant=None, packed=None,
             config: DmmaBwdConfig | Tf32WgmmaBwdConfig | None = None) -> None:
    """dq, dk, dv (preallocated, C-contiguous, float64) from float64 do, q, k, v, o and the saved lse
    ((B, H, Sq), float64), as simt.backward (``packed``: a varlen batch, B = 1; the variant's
    ``statistics`` "recomputed": flash_bwd_stats_dmma's row statistics), on the DMMA kernels with
    ``config`` (the plan's by default: the SIMT kernels where the device has no DMMA or too little
    shared memory for the row); any head dim up to 128 and any strides. Always deterministic
    (``deterministic`` is accepted and has nothing to choose), except the fused_dq candidate below.
    float32 arrays: the same kernels on T = float, each product three tf32 products of split
    operands ("tf32x3"; the plan's TF32X3_BACKWARD_CONFIGS by default, at sm_90 with statistics
    "saved" its TF32_WGMMA_BACKWARD_ROUTE where the arrays fit it, or a DmmaBwdConfig), or with a
    Tf32WgmmaBwdConfig dK and dV on flash_bwd_dkdv_tf32_wgmma(_ws) and dQ on flash_bwd_dq_tf32_wgmma(_ws),
    or by the dK/dV kernel's atomics (``fused_dq``: not bitwise reproducible, so it takes
    ``deterministic=False``) (sm_90; head dims up to 64, multiples of 4, rows 16-byte aligned)."""
    from ._module import backward_is_empty, device_arch
    from .mma_fwd import current_smem_optin
    from .simt import run_backward

    dtype = q.dtype
    if dtype not in (np.float64, np.float32) or any(x.dtype != dtype for x in (do, q, k, v, o, lse, dq, dk, dv)):
        raise TypeError("cupyflash: the DMMA backward takes float64 arrays (float32: its tf32x3 form)")
    if config is not None and int(device_arch()) < 80:
        raise ValueError(f"cupyflash: the DMMA backward needs sm_80 or newer, not sm_{device_arch()}")
    wgmma = isinstance(config, Tf32WgmmaBwdConfig)
    if wgmma:
        _check_tf32_wgmma_operands(do, q, k, v, dq, dk, dv)
        if config.fused_dq and deterministic:
            raise ValueError("cupyflash: fused_dq adds dQ by float32 atomics, in no fixed order: pass "
                             "deterministic=False")
    if config is not None and not wgmma and config.wide and device_arch() != "90":
        raise ValueError(f"cupyflash: the DMMA backward's wide layout (m16n8k8 .f64) is compiled for sm_90, "
                         f"not sm_{device_arch()}")
    if backward_is_empty(q, k, dq, dk, dv):
        return
    mask = mask_for(causal, window_size, PLAIN if variant is None else variant.score, packed is not None).backward()
    statistics = "saved" if variant is None else variant.statistics
    headdim = max(q.shape[3], v.shape[3])
    if config is None:
        plan = backward_plans.plan_backward(device_arch(), dtype, headdim, mask, current_smem_optin(), True,
                                            statistics=statistics,
                                            tf32_wgmma_layout=_tf32_wgmma_layout(do, q, k, v, dq, dk, dv))
    elif wgmma:
        plan = backward_plans.tf32_wgmma_backward_plan(headdim, mask, config, statistics)
        if config.fused_dq:
            dq.fill(0)  # the dK/dV kernel adds every key block's dQ into it
    else:
        plan = backward_plans.dmma_backward_plan(headdim, mask, config, statistics, dtype=dtype)
    run_backward(plan, do, q, k, v, o, lse, dq, dk, dv, softmax_scale=softmax_scale, mask=mask, variant=variant,
                 packed=packed)


def _tf32_wgmma_layout(do, q, k, v, dq, dk, dv) -> bool:
    """Whether the arrays fit the tf32 wgmma backward (_check_tf32_wgmma_operands: its loaders'
    16-byte chunks of float32 on sm_90); where not, the plan's float32 row stays on tf32x3, which
    takes any strides."""
    try:
        _check_tf32_wgmma_operands(do, q, k, v, dq, dk, dv)
    except (TypeError, ValueError):
        return False
    return True


def _check_tf32_wgmma_operands(do, q, k, v, dq, dk, dv) -> None:
    """The tf32 wgmma backward's needs (its loaders move 16-byte chunks of float32): float32,
    sm_90, head dims up to the last tf32 wgmma tile (128: the pair's) and multiples of 4, unit column
    strides, other strides multiples of 4 elements, 16-byte aligned data."""
    from ._module import device_arch

    if q.dtype != np.float32:
        raise TypeError("cupyflash: the tf32 wgmma backward takes float32 arrays")
    if device_arch() != "90":
        raise ValueError(f"cupyflash: the tf32 wgmma backward is compiled for sm_90a, not sm_{device_arch()}")
    from .mma_fwd import _check_layout

    for name, x in (("do", do), ("q", q), ("k", k), ("v", v), ("dq", dq), ("dk", dk), ("dv", dv)):
        widest = backward_plans.TF32_WGMMA_D_TILES[-1]
        if x.shape[-1] % 4 or x.shape[-1] > widest:
            raise ValueError(f"cupyflash: the tf32 wgmma backward takes head dims up to {widest} in multiples of 4; "
                             f"{name} has {x.shape[-1]}")
        _check_layout(x, name, 4)

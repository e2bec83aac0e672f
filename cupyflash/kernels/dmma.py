"""The float64 forward on the FP64 tensor cores (``kernels_cu/flash_fwd_dmma.cu``, issue 18): a
candidate, launched here with its tiles but not yet a plan row (``cupyflash.plans``) nor a
dispatch choice; it has not run on a GPU. ``CANDIDATES`` holds its tiles per head-dim tile, up to
128: at 256 the kernel's Q fragments and O accumulators alone would take 256 registers.
"""
from __future__ import annotations

import numpy as np

from ._module import Specialization, launch
from .params import PackedBatch, forward_params
from .. import plans
from ..masks import KINDS, PACKED_KINDS, VARIANT_KINDS, mask_for
from ..plans import DmmaFwdConfig
from ..scores import PLAIN

D_TILES = (16, 32, 64, 128)
# head-dim tile -> tiles. Registers per thread: Q's D/4 and O's D/4 doubles, S's block_n/4 (two
# 32-bit registers each); shared memory 102 KiB at d64, 132 KiB at d128 (sm_80's 163 hold both),
# one block of 8 warps per SM either way (178-238 registers a thread).
CANDIDATES = {16: DmmaFwdConfig(64, 8), 32: DmmaFwdConfig(64, 8), 64: DmmaFwdConfig(64, 8),
              128: DmmaFwdConfig(32, 8)}


def d_tile(headdim: int) -> int:
    return plans.d_tile(headdim, D_TILES)


def specialization(headdim: int, mask, config: DmmaFwdConfig | None = None) -> Specialization:
    dt = d_tile(headdim)
    return plans.specialization_for("float64", dt, mask, config or CANDIDATES[dt])


def specializations() -> list[Specialization]:
    """Every candidate specialization (for the compile check)."""
    return [specialization(dt, mask) for dt in D_TILES for mask in KINDS + VARIANT_KINDS + PACKED_KINDS]


def forward(q, k, v, o, lse, *, softmax_scale: float, causal: bool, window_size=(-1, -1), variant=None,
            packed: PackedBatch | None = None, config: DmmaFwdConfig | None = None) -> None:
    """o and lse ((B, H, Sq), float64) from float64 q, k, v, as simt.forward (``packed``: a varlen
    batch, B = 1), on flash_fwd_dmma with ``config`` (CANDIDATES by default)."""
    from .mma_fwd import query_grid

    from ._module import device_arch

    if any(x.dtype != np.float64 for x in (q, k, v, o, lse)):
        raise TypeError("cupyflash: flash_fwd_dmma takes float64 q, k, v, o and lse")
    if int(device_arch()[:2]) < 80:
        raise ValueError(f"cupyflash: flash_fwd_dmma needs sm_80 or newer (DMMA), not sm_{device_arch()}")
    batch, seqlen_q, nheads, headdim = q.shape
    if batch == 0 or seqlen_q == 0 or nheads == 0:
        return
    mask = mask_for(causal, window_size, PLAIN if variant is None else variant.score, packed is not None)
    dt = d_tile(max(headdim, v.shape[3]))
    config = config or CANDIDATES[dt]
    grid = query_grid(config.block_m, batch, seqlen_q, nheads, packed)
    launch(specialization(dt, mask, config), grid,
           (forward_params(q, k, v, o, lse, softmax_scale=softmax_scale, mask=mask, variant=variant, packed=packed),))

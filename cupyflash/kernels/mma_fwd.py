"""Tensor-core forward (``kernels_cu/flash_fwd_mma.cu``; on sm_90 ``kernels_cu/flash_fwd_wgmma.cu``,
the same work split on warpgroup MMA, see ``WgmmaFwdConfig``): float16 / bfloat16, head dims 8..256;
float32 on tf32 tensor cores (``kernels_cu/flash_fwd_tf32.cu``, ``Tf32FwdConfig``, cupyflash.precision;
on sm_90 at head dims up to 64 ``kernels_cu/flash_fwd_tf32_wgmma_ws.cu``, ``WgmmaTf32FwdConfig``);
float64 up to d128 on the FP64 tensor cores (``kernels_cu/flash_fwd_dmma.cu``, ``DmmaFwdConfig``,
``cupyflash.kernels.dmma``).

FlashAttention-2 work split: a block owns BLOCK_M query rows of one (batch, head), each warp owns
16-row strips of them; K and V tiles stream through a ring of STAGES shared-memory stages filled
by cp.async. Which kernel and tiles run on which device is ``cupyflash.plans``' table (by head-dim
tile D_TILE, the smallest of 64, 128, 256 that holds headdim; columns past headdim are zero-filled
in shared memory and never stored); this module turns arrays into the plan's kernel arguments.

The dispatcher guarantees what the kernel relies on: a dtype of ``supports``, last dim contiguous, every
other stride of q/k/v/o a multiple of 8 elements, data pointers 16-byte aligned, headdim % 8 == 0
(``forward`` re-checks the layout, which is cheap, because a violation would be silent corruption).
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ._module import _max_smem_optin, device_arch, launch
from .constants import TENSOR_CORE_D_TILES
from .params import PackedBatch, forward_params, pointer
from .. import plans
from ..masks import KINDS, PACKED_KINDS, VARIANT_KINDS, Mask, mask_for
from ..scores import PLAIN
from ..plans import (LARGE_SMEM_BYTES, ROW_STATES, DmmaFwdConfig, FwdConfig, ForwardPlan, Tf32FwdConfig,
                     WgmmaFwdConfig, WgmmaTf32FwdConfig, smem_bytes, wgmma_smem_bytes)
from ..precision import DEFAULT as DEFAULT_PRECISION, PRECISIONS

__all__ = ["forward", "specialization", "specializations", "supports", "d_tile", "FwdConfig", "WgmmaFwdConfig",
           "Tf32FwdConfig", "WgmmaTf32FwdConfig",
           "ROW_STATES", "LARGE_SMEM_BYTES", "smem_bytes", "wgmma_smem_bytes"]

D_TILES = TENSOR_CORE_D_TILES


def current_arch() -> str | None:
    """Compute capability of the current CUDA device ("80", "90"), or None without a usable device."""
    try:
        return device_arch()
    except (ImportError, RuntimeError):
        return None


def current_smem_optin() -> int | None:
    """Opt-in shared memory per block of the current CUDA device (cached per device), or None
    where no device is usable (CPU-only machines: compile checks, documentation)."""
    try:
        import cupy

        return _max_smem_optin(cupy.cuda.Device().id)
    except (ImportError, RuntimeError):  # CUDARuntimeError derives from RuntimeError
        return None


def supports(dtype, headdim: int) -> bool:
    """Whether this family runs ``dtype`` at exactly ``headdim`` (16-bit or float32, a multiple of 8,
    <= 256; float64 <= 128)."""
    return plans.tensor_core_supports(dtype, headdim)


def d_tile(headdim: int) -> int:
    return plans.d_tile(headdim, D_TILES)


def plan(dtype, headdim: int, mask: Mask | bool,
         config: FwdConfig | WgmmaFwdConfig | Tf32FwdConfig | DmmaFwdConfig | None = None,
         headdim_v: int | None = None, precision: str = DEFAULT_PRECISION,
         image_readers: int | None = None) -> ForwardPlan:
    """The plan ``forward`` runs at exactly ``headdim`` (the wider of q's and v's; ``headdim_v``
    v's, ``precision`` float32's, ``image_readers`` the query blocks that read each key block:
    plans.plan_forward's) on the current device: plans.plan_forward's, or ``config``'s (the
    tuner's)."""
    if not supports(dtype, headdim):
        raise ValueError(f"cupyflash: mma forward does not support dtype {np.dtype(dtype)}, headdim {headdim}")
    if config is not None:
        if not isinstance(config, (FwdConfig, WgmmaFwdConfig, Tf32FwdConfig, WgmmaTf32FwdConfig, DmmaFwdConfig)):
            raise TypeError(f"cupyflash: config must be a FwdConfig, WgmmaFwdConfig, Tf32FwdConfig, "
                            f"WgmmaTf32FwdConfig or DmmaFwdConfig, not {config!r}")
        return plans.forward_plan(dtype, headdim, mask, config, headdim_v, precision)
    return plans.plan_forward(current_arch(), dtype, headdim, mask, current_smem_optin(), family="mma",
                              headdim_v=headdim_v, precision=precision, image_readers=image_readers)


def specialization(dtype, headdim: int, mask: Mask | bool, config: FwdConfig | None = None):
    """The specialization ``forward`` launches on the current device (``config`` overrides the
    plan, for tuning); ``mask`` is the policy or a causal flag."""
    return plan(dtype, headdim, mask, config).spec


def specializations() -> list:
    """Every specialization the plans can launch on any supported GPU (for the compile check,
    which builds them all for sm_80 and sm_90)."""
    rows = [(dt, where) for (family, where, dt) in plans.FORWARD_TILES if family == "mma"]
    # user modifiers: the tiles their plans choose (plans.forward_tiles); a window narrow and wide
    # (plans.band_forms: a wide one can take the producer row)
    entries = [(dtype, dt, form, plans.forward_tiles("mma", where, dt, dtype, form, None))
               for dtype in ("float16", "bfloat16") for dt, where in rows
               for mask in KINDS + VARIANT_KINDS + PACKED_KINDS for form in plans.band_forms(mask)]
    entries.sort(key=lambda e: (e[0] != "float16", *_by_tile((e[1], e[3]))))
    # a user modifier's fast-math struct where the plan keeps it (the producer kernel, no spills)
    entries = [(dtype, dt, plans.with_fast_modifiers(mask, "90", lambda m, d=dtype, h=dt, t=t: [
                    plans.specialization_for(d, h, m, t)]) if plans.takes_fast_modifiers(t) else mask, t)
               for dtype, dt, mask, t in entries]
    specs = [plans.specialization_for(dtype, dt, mask, t) for dtype, dt, mask, t in entries]
    # softcap with the cap as each row's maximum (plans.takes_fixed_max): bfloat16 on the kernels
    # that ask for it
    specs += [plans.specialization_for(dtype, dt, mask.with_score(replace(mask.score, fixed_max=True)), t)
              for dtype, dt, mask, t in entries
              if plans.takes_fixed_max(plans.specialization_for(dtype, dt, mask, t), dtype, mask, 30.0)]
    # the wgmma kernel with v in a narrower tile of its own (plans.v_tile): MLA's 192 / 128, and
    # every narrower pair, for the plain masks
    # (the row's own-v tiles: ONE_ROLE_FORWARD_TILES' where the row is the producer kernel)
    own_v = [(dtype, dt, mask, plans.forward_tiles("mma", where, dt, dtype, mask, None, own_v=True))
             for dtype in ("float16", "bfloat16") for dt, where in rows for mask in KINDS]
    specs += [plans.specialization_for(dtype, dt, mask, t, dvt) for dtype, dt, mask, t in own_v
              if isinstance(t, WgmmaFwdConfig) for dvt in D_TILES if dvt < dt]
    # float32 (tf32 tensor cores), each precision and mask on its row (sm_90's d64 row: the wgmma
    # producer kernel, plans.WGMMA_FLOAT32_FORWARD_TILES)
    kinds = KINDS + VARIANT_KINDS + PACKED_KINDS
    # (and where the key blocks have enough readers, WGMMA_FLOAT32_PRESPLIT_FORWARD_TILES' rows)
    tf32_entries = [(dt, precision, plans.forward_candidates(family, where, dt, mask, precision,
                                                             image_readers=readers)[0], mask)
                    for (family, where, dt) in plans.FORWARD_TILES if family == "tf32"
                    for precision in PRECISIONS for mask in kinds if mask.score.user is None
                    for readers in (None, plans.PRESPLIT_MIN_IMAGE_READERS)]
    specs += [plans.specialization_for("float32", dt, mask, t, precision=precision)
              for dt, precision, t, mask in sorted(tf32_entries, key=lambda e: (e[0], e[1], e[2].block_m,
                                                                                 e[2].block_n))]
    # user modifiers: the tiles their plans choose, per class (plans.forward_tiles)
    user_entries = [(dt, precision, plans.forward_tiles(family, where, dt, "float32", mask, None, precision,
                                                        image_readers=readers), mask)
                    for (family, where, dt) in plans.FORWARD_TILES if family == "tf32"
                    for precision in PRECISIONS for mask in kinds if mask.score.user is not None
                    for readers in (None, plans.PRESPLIT_MIN_IMAGE_READERS)]
    specs += [plans.specialization_for("float32", dt, mask, t, precision=precision)
              for dt, precision, t, mask in user_entries]
    # and the split kernel the presplit rows launch first (flash_fwd_split_kv_tf32)
    specs += [plans.tf32_fwd_split_kv_spec(dt, mask, t, precision) for dt, precision, t, mask in
              tf32_entries + user_entries if isinstance(t, WgmmaTf32FwdConfig) and t.presplit]
    return list(dict.fromkeys(specs))


def _by_tile(entry) -> tuple:
    """mma.sync tiles by key block, then the wgmma tiles, per head-dim tile."""
    dt, tiles = entry
    return dt, isinstance(tiles, WgmmaFwdConfig), tiles.block_n


def _check_layout(a, what: str, multiple: int = 8, whole_chunks: bool = False) -> None:
    """The tensor-core kernels' layout: contiguous rows, strides multiples of ``multiple`` elements
    (8; the float32 wgmma loaders' 16-byte chunks: 4), 16-byte aligned (the dispatcher guarantees
    it; a violation would be silent corruption). ``whole_chunks``: the head dim a multiple of 8
    too, for the kernels that store whole 16-byte chunks of a row below it (store_o, store_tile).
    A dimension of size 1 has no stride the kernels step by (its index is always 0), so its stride
    is not asked, as the API's ``_mma_ready`` does not ask it before passing an array on unpadded."""
    item = a.itemsize
    if a.strides[3] != item:
        raise ValueError(f"cupyflash: {what} must be contiguous in its last dimension")
    strides = tuple(s // item for size, s in zip(a.shape[:3], a.strides[:3]) if size > 1)
    if any(s % multiple for s in strides) or a.data.ptr % 16:
        raise ValueError(f"cupyflash: {what} needs strides that are multiples of {multiple} elements and a "
                         f"16-byte aligned pointer for the tensor-core kernel")
    if whole_chunks and a.shape[3] % 8:
        raise ValueError(f"cupyflash: {what}'s head dim must be a multiple of 8 for the tensor-core kernel "
                         f"(got {a.shape[3]}; the API pads it)")


def forward(q, k, v, o, lse, *, softmax_scale: float, causal: bool,
            config: FwdConfig | WgmmaFwdConfig | Tf32FwdConfig | DmmaFwdConfig | None = None, window_size=(-1, -1),
            variant=None,
            packed: PackedBatch | None = None) -> None:
    """o ((B, Sq, H, Dv) C-contiguous) and lse ((B, H, Sq) float32, float64 for float64 q;
    contiguous) from q (B, Sq, H, D),
    k (B, Sk, Hkv, D) and v (B, Sk, Hkv, Dv), on the current stream, by the plan of the current device (``config``:
    other tiles, e.g. a dev/ version's); ``variant`` a cupyflash.scores.Variant with CuPy arrays
    (None: the plain softmax); ``packed`` a varlen batch (B = 1, its sequences' rows packed)."""
    batch, seqlen_q, nheads, headdim = q.shape
    if batch == 0 or seqlen_q == 0 or nheads == 0:
        return
    lse_dtype = np.float64 if q.dtype == np.float64 else np.float32
    if lse.dtype != lse_dtype or not lse.flags.c_contiguous or lse.shape != (batch, nheads, seqlen_q):
        raise ValueError(f"cupyflash: lse must be a C-contiguous {np.dtype(lse_dtype)} (batch, nheads, seqlen_q) array")
    mask = mask_for(causal, window_size, PLAIN if variant is None else variant.score, packed is not None)
    # The tile of the wider head dim (the wgmma kernel takes v's own where narrower: plans.v_tile).
    precision = DEFAULT_PRECISION if variant is None else variant.precision
    readers = plans.image_readers(seqlen_q if packed is None else packed.max_seqlen_q, nheads // k.shape[2])
    planned = plan(q.dtype, max(headdim, v.shape[3]), mask, config, v.shape[3], precision, readers)
    if mask.score.softcap and plans.takes_fixed_max(planned.spec, q.dtype, mask, variant.softcap):
        # the same tiles (the producer kernel: v in q's tile), the cap as each row's maximum
        mask = mask.with_score(replace(mask.score, fixed_max=True))
        planned = replace(planned, spec=plans.specialization_for(q.dtype, planned.d_tile, mask, planned.tiles))
    grid = query_grid(planned.block_m, batch, seqlen_q, nheads, packed)
    for a, what in ((q, "q"), (k, "k"), (v, "v"), (o, "o")):
        _check_layout(a, what, whole_chunks=True)
    params = forward_params(q, k, v, o, lse, softmax_scale=softmax_scale, mask=mask, variant=variant, packed=packed)
    kv_split = None
    split_rows = k.shape[1] if packed is None else packed.max_seqlen_k
    if planned.split_kv is not None and split_rows > 0:  # the float32 producer's key blocks split once
        import cupy

        seqlen_k, nheads_kv, block_n = k.shape[1], k.shape[2], planned.tiles.block_n
        kv_split = cupy.empty(plans.kv_fwd_split_bytes(planned.d_tile, block_n, batch, seqlen_k, nheads_kv,
                                                       None if packed is None else packed.sequences), np.uint8)
        params["kv_split"] = pointer(kv_split)
        launch(planned.split_kv, (math.ceil(split_rows / block_n), nheads_kv, grid[2]), (params,))
    launch(planned.spec, grid, (params,))
    del kv_split  # back to CuPy's pool in stream order, after the launches


def query_grid(block_m: int, batch: int, seqlen_q: int, nheads: int, packed: PackedBatch | None) -> tuple:
    """(query blocks, heads, sequences) of a forward grid: a packed batch's x covers its longest
    sequence (a CTA past its own sequence's end leaves at once) and its z counts sequences."""
    if packed is not None:
        return math.ceil(packed.max_seqlen_q / block_m), nheads, packed.sequences
    return math.ceil(seqlen_q / block_m), nheads, batch

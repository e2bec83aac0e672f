"""Tensor-core backward (fp16/bf16, head dim <= 256): FlashAttention-2 work split.

``flash_bwd_dkdv_mma`` (one CTA per key block) accumulates dK, dV in registers over every query
block of every query head of its GQA group. dQ comes either from ``flash_bwd_dq_mma`` (one CTA
per query block, no atomics, bitwise reproducible: ``deterministic=True``) or from the dK/dV
kernel itself, added by float32 atomics into ``dq_accum`` and scaled/converted by
``flash_bwd_dq_convert`` (``deterministic=False``: S and dP are computed once instead of twice).

Tile sizes, per head-dim tile D_TILE (64, 128 or 256, the smallest that holds the head dim).
Registers per thread are what limit them (255 at most, and no spills):

* dK/dV: a warp owns 16 key rows and DW = D_TILE / WARPS_D columns of dK and dV, that is
  DW fp32 accumulator registers per thread, plus M_SUB for the S^T and dP^T of one sub-block of
  M_SUB query columns. D_TILE = 128: 128 + 32 (M_SUB = 64 spills). D_TILE = 256 needs
  WARPS_D = 2 (two warps per key-row group, partial S^T and dP^T swapped through shared memory).
  BLOCK_M, the query rows per pipeline stage (and the dS block of the atomic dQ), may exceed
  M_SUB: the CTA then walks a query block in BLOCK_M / M_SUB steps between two barriers.
* dQ: a warp owns 16 query rows: D_TILE / 2 accumulator registers plus BLOCK_N for S and dP.

Versions (``VERSIONS``, ``backward(..., version=...)``): v1 as above; v2 and v3 give a warp 2 x 16
rows (``flash_bwd_dq_mma_v2``, ``flash_bwd_dkdv_mma_v2``, ``flash_bwd_dkdv_mma_split``), so each
shared-memory fragment feeds twice the mma. v4 is one fused kernel, ``flash_bwd_fused_mma``
(flash_bwd_fused_mma.cu): FlashAttention-2's 32-row warp tiles for all five products, P^T and dS^T
through shared memory, dQ by float32 atomics or, deterministic, in a fixed key-block order. v5 runs
v3's two kernels when ``deterministic`` (on an H200 they beat the ordered fused kernel) and v4's
fused atomic kernel otherwise. v6 is v5 except on sm_90, where v4's work split runs on warpgroup
MMA (wgmma, sm_90a: ``flash_bwd_wgmma.cu``, and ``flash_bwd_wgmma_dsplit.cu`` at head-dim tile
256): always with ``deterministic=False``, and with ordered dQ adds at the head-dim tiles of
``WGMMA_ORDERED_D_TILES``. v7 is v6 with fixed-point dQ adds (int64, exact in any order:
``dq_fixed.py``) instead of ordered ones, at the head-dim tiles of ``WGMMA_FIXED_D_TILES``. v9 is
v7 with dq_accum laid out in 64-column panels, so that each warp adds its part of a dQ panel by one
bulk reduction instead of 16. v10, the default, returns to the two-kernel split on sm_90 when
``deterministic``: the wgmma kernel for dK and dV only and ``flash_bwd_dq_wgmma.cu`` for dQ (the
forward's work split, S and dP recomputed), at every head dim, and at d256 with
``deterministic=False`` too. See the notes at ``VERSIONS`` and docs/perf-log.md.

Shared memory (bytes; mirrored by DkdvSmem / DqSmem in flash_bwd_mma.cu): K, V of the key block,
two stages of Q, dO (and lse, D) per query block, the 16-bit dS^T block (atomic dQ) and the
partial-sum exchange (WARPS_D = 2). All fit sm_80's 163 KiB too (the largest, the atomic
head-dim-256 dK/dV kernel, takes 148.5 KiB); GPUs with 99 KiB per block (sm_86, sm_89) can run
only head-dim tile 64 (get_function raises a clear error otherwise). The wgmma kernels take up to
218 KiB (sm_90 only).
"""
from __future__ import annotations

import math

import numpy as np

from ._module import Specialization, backward_is_empty, launch, row_strides
from .._dtypes import dtype_name
from ..masks import KINDS, Local, Mask, as_mask, mask_for

D_TILES = (64, 128, 256)

# D_TILE -> (BLOCK_M, M_SUB, BLOCK_N, NWARPS, WARPS_D); BLOCK_N = 16 * NWARPS / WARPS_D.
DKDV_CONFIG = {64: (64, 64, 128, 8, 1), 128: (64, 32, 128, 8, 1), 256: (32, 16, 64, 8, 2)}
# D_TILE -> (BLOCK_M, BLOCK_N, NWARPS); BLOCK_M = 16 * NWARPS.
DQ_CONFIG = {64: (64, 64, 4), 128: (128, 64, 8), 256: (64, 32, 4)}

# flash_bwd_dq_mma_v2: D_TILE -> (BLOCK_M, BLOCK_N, NWARPS, ROW_GROUPS); BLOCK_M = 16 * ROW_GROUPS
# * NWARPS. Head dim 256 has no entry: two 16-row dQ accumulators would take 256 registers.
DQ_CONFIG_V2 = {64: (128, 32, 4, 2), 128: (128, 32, 4, 2)}
# Alternatives for the tuner (``backward(..., dq_config=...)``), compiled without spills on CPU:
# 8 warps of 32 rows (one CTA per SM, 162 KiB of shared memory at d128: sm_90 only).
DQ_CANDIDATES_V2 = {64: ((256, 32, 8, 2),), 128: ((256, 32, 8, 2),)}

# flash_bwd_dkdv_mma_v2: D_TILE -> (BLOCK_M, M_SUB, BLOCK_N, NWARPS, ROW_GROUPS); BLOCK_N = 16 *
# ROW_GROUPS * NWARPS. Head dim 64 only: two 16-row groups of dK and dV take 4 D_TILE / 8
# accumulator registers per thread (256 at head dim 128).
DKDV_CONFIG_V2 = {64: (64, 32, 128, 4, 2)}
# With a window's left bound and the atomic dQ it needs more than 255 registers (ptxas spills 24-36
# bytes at sm_80 / sm_90), so v1's kernel runs there instead.

# flash_bwd_dkdv_mma_split (v3, deterministic path only: with the atomic dQ it spills): D_TILE ->
# (BLOCK_M, M_SUB, BLOCK_N, NWARPS, ROW_GROUPS); BLOCK_N = 16 * ROW_GROUPS * NWARPS / 2. Shared
# memory 161 KiB (d128) and 144.5 KiB (d256): both fit sm_80's 163 KiB. At d256 one 16-row group
# per pair (128 accumulator registers per warp) replaces v1's head-dim split and its partial-sum
# exchange of S^T and dP^T.
DKDV_CONFIG_SPLIT = {128: (64, 32, 128, 8, 2), 256: (32, 32, 64, 8, 1)}

# flash_bwd_fused_mma (v4): D_TILE -> (BLOCK_M, BLOCK_N, WARPS_N, WARPS_D, DQ_WARPS_M, S_UNROLL). A warp owns
# BLOCK_N / WARPS_N key rows x D_TILE / WARPS_D columns of dK and dV (accumulators), the same key
# rows x BLOCK_M / WARPS_D query columns of S^T and dP^T, and BLOCK_M / DQ_WARPS_M query rows x
# D_TILE / (8 / DQ_WARPS_M) columns of each step's dQ; S_UNROLL k-steps of S^T and dP^T are unrolled
# (fewer hold fewer fragments in flight). With P_PACKED (8th entry, see below) d128 runs 2 of its 8
# k-steps unrolled (4 spill in the fp16 ordered kernel): tuner, bf16 16k atomic, 255.8 / 260.3
# TFLOP/s (u1, non-causal / causal) -> 262.0 / 266.7 (u4: 261.7 / 271.1). d256 unrolls all 16
# (202.5 / 207.8 at u2 -> 213.4 / 210.8). Shared
# memory: d64 97 KiB, d128 161 KiB (fits sm_80), d256 209 KiB (sm_90 only).
# Head dim 64 has no entry: there v4 runs v3's kernels (the tuner measured the fused kernel at
# 0.82x of flash_bwd_dkdv_mma_v2 with atomic dQ: at 64 columns a query block is too little work
# per barrier and per P^T / dS^T round trip).
FUSED_CONFIG = {128: (64, 128, 4, 2, 2, 2, 0, 1), 256: (64, 64, 2, 4, 2, 16)}
# Alternatives for the tuner (``backward(..., fused=...)``).
# Optional 7th and 8th entries: EAGER_RELEASE (release each query block's dQ counter right after
# the adds) and P_PACKED (step 5 reads the 16-bit P^T: fewer registers, so more unrolling fits).
FUSED_CANDIDATES = {64: ((64, 128, 4, 2, 2, 4),),
                    128: ((64, 128, 4, 2, 2, 1), (64, 128, 4, 2, 2, 2), (64, 128, 4, 2, 2, 1, 1),
                          (64, 128, 4, 2, 2, 4, 0, 1)),
                    256: ((64, 64, 2, 4, 2, 2), (64, 64, 2, 4, 2, 1), (64, 64, 4, 2, 2, 1), (64, 64, 2, 4, 2, 2, 1),
                          (64, 64, 2, 4, 2, 4), (64, 64, 2, 4, 2, 8))}

# flash_bwd_wgmma (v6, sm_90a): D_TILE -> (BLOCK_M, BLOCK_N); BLOCK_N / 64 warpgroups, each owning 64
# key rows: 64 x D_TILE dK and dV accumulators (D_TILE / 2 registers each per thread) and 64 x BLOCK_M
# S^T and dP^T (BLOCK_M / 2 each). d128: 128 + 64 with BLOCK_M = 64; d64: 64 + 128 with BLOCK_M = 128.
# d256 would need 256 registers for dK and dV alone: flash_bwd_wgmma_dsplit (64 x 64 blocks) gives
# each of its two warpgroups half of the head dim instead, and S^T to one, dP^T to the other.
WGMMA_CONFIG = {64: (128, 128), 128: (64, 128), 256: (64, 64)}
# Head-dim tiles where v6 runs the wgmma kernel with ordered dQ when deterministic; elsewhere v3's
# two kernels, where the ordered adds cost more than the wgmma kernels gain at short or causal
# sequences (bf16, TFLOP/s at 16k non-causal / 2k causal: d64 ordered wgmma 268 / 138 against v3's
# 244 / 196, d256 ordered dsplit 212 / 122 against 172 / 151; docs/perf-log.md, mma-bwd-v6).
# Tests widen it to run every ordered kernel.
WGMMA_ORDERED_D_TILES = (128,)
# How the wgmma kernels add dQ (kernels_cu/dq_add.cuh): float32 in any order, float32 in key-block
# order, int64 fixed point (exact, so reproducible in any order); none: no dQ in this kernel
# (flash_bwd_dq_wgmma computes it).
DQ_ADDS = ("atomic", "ordered", "fixed", "fixed_panels", "none")
# DQ_ADDS entries that add int64 fixed point (an int64 dq_accum, row scales, dq_fixed's convert).
FIXED_DQ_ADDS = ("fixed", "fixed_panels")
# Head-dim tiles where v7 runs the wgmma kernel with fixed-point dQ when deterministic: the kernel
# stages each dQ panel in shared memory and adds it by bulk reductions, one per row (per-thread
# int64 reductions measured 207 against the float atomics' 370 TFLOP/s at d128 16k). Measured (bf16,
# TFLOP/s at 16k non-causal / 16k causal / 2k non-causal / 2k causal; docs/perf-log.md, mma-bwd-v7):
# d128 fixed 281 / 286 / 244 / 202 against v6's ordered adds 310 / 291 / 239 / 185: even on
# average, better at the short and causal shapes, exact, and free of waiting on other CTAs. d64
# fixed 244 / 249 / 217 / 186 against v3's 244 / 234 / 229 / 196, so v3 stays there (no int64
# buffer either). The d256 kernel has no room for the staging tile (per-thread int64 reductions
# there: 95-112 against v3's 151-175), so v3 runs there too. Tests widen it to run d64.
WGMMA_FIXED_D_TILES = (128,)
# The head-dim tiles that have a fixed-point wgmma kernel at all (flash_bwd_wgmma; not dsplit).
WGMMA_FIXED_KERNEL_D_TILES = (64, 128)
# Head-dim tiles where v9 runs the panel-major fixed-point kernel when deterministic (v3
# elsewhere).
WGMMA_PANEL_D_TILES = (128,)

# flash_bwd_dq_wgmma (v10, sm_90a): D_TILE -> (BLOCK_M, BLOCK_N, K_STAGES); BLOCK_M / 64 warpgroups,
# each owning 64 query rows: a 64 x D_TILE dQ accumulator (D_TILE / 2 registers per thread) and
# 64 x BLOCK_N S and dP (BLOCK_N / 2 each). Q and dO stay in shared memory for the CTA's life; K
# has K_STAGES stages (2: dS K_j is waited for before the next barrier; 3: it runs on across it),
# V two. Measured (bf16, whole backward in TFLOP/s at 16k / 16k causal / 2k / 2k causal;
# docs/perf-log.md, mma-bwd-v10): d64 (128, 128, 2) 303 / 293 / 266 / 217 against (128, 64, 2)'s
# 286 / 280 / 251 / 209; d128 (128, 64, 2) 356 / 358 / 327 / 264 (BLOCK_N 128 spills there);
# d256 (128, 32, 2) 306 / 306 / 277 / 232 against K_STAGES 3's 302 / 305 / 263 / 230. K_STAGES 3
# at d64 and d128 compiles with its wgmma serialized by ptxas (C7515), so it is no candidate there.
DQ_WGMMA_CONFIG = {64: (128, 128, 2), 128: (128, 64, 2), 256: (128, 32, 2)}
# Further tiles the tuner times on sm_90 (python -m cupyflash.bench.tune --direction bwd).
DQ_WGMMA_CANDIDATES = {64: ((128, 64, 2),), 256: ((128, 32, 3),)}
# Tiles of the dK/dV-only kernel (DqAdd::none) the tuner times besides WGMMA_CONFIG's.
WGMMA_NONE_CANDIDATES = {64: ((64, 128),)}
# Head-dim tiles where v10 runs the dK/dV-only wgmma kernel and flash_bwd_dq_wgmma when
# deterministic.
WGMMA_SPLIT_D_TILES = (64, 128, 256)
# ... and with deterministic=False too, where that beats the float atomics (d256: 306 / 306 / 277 /
# 232 against the atomic dsplit kernel's 248 / 253 / 216 / 198; d128 356 / 358 / 327 / 264 against
# 367 / 363 / 320 / 260, d64 303 / 293 / 266 / 217 against 311 / 305 / 268 / 218).
WGMMA_SPLIT_ATOMIC_D_TILES = (256,)

# Kernel versions, all launchable side by side (``backward(..., version=...)``); DEFAULT_VERSION
# is what the dispatcher launches. ldmatrix.x4 per mma.sync counted in the SASS (sm_90).
#   v1: dK/dV with 16 key rows per warp; dQ with 16 query rows per warp, so every warp reads all
#       of K_j and V_j and each B fragment feeds 2 mma (0.58 ldmatrix.x4 per mma at d64 and d128).
#   v2: dQ by flash_bwd_dq_mma_v2: 2 x 16 query rows per warp, each K_j / V_j fragment feeds 4
#       mma (0.42 at d64, 0.50 at d128, where dP is built in 16-key slices to fit the registers);
#       lse and D in shared memory. At d64 also dK/dV by flash_bwd_dkdv_mma_v2: 2 x 16 key rows
#       per warp, each Q / dO fragment feeds 4 mma (0.44, dP^T in 16-query slices; v1 0.56; 0.50
#       vs 0.63 with the atomic dQ). Head dim 256 as v1; dK/dV at d128 as v1.
#   v3: v2, plus dK/dV at d128 (deterministic path) by flash_bwd_dkdv_mma_split: warp pairs share
#       2 x 16 key rows, one warp accumulates dV (S^T, P^T), the other dK (dP^T, dS^T), P^T passes
#       through shared memory (0.38 ldmatrix.x4 per mma plus 32 B of exchange per mma; v1 0.63).
#       At d256 the same kernel with 16 key rows per pair: 0.63 plus 16 B per mma (v1: 0.75 plus
#       64 B of partial sums per mma).
#   v4: one kernel, flash_bwd_fused_mma (flash_bwd_fused_mma.cu): S and dP computed once per block
#       pair (5 products, v1-v3's deterministic path does 7), FlashAttention-2's 32-row warp tiles
#       for all five products, P^T and dS^T through shared memory. dQ by float32 adds to dq_accum,
#       in a fixed key-block order (deterministic=True: per-query-block counters) or unordered.
#       Where the device's shared memory per block is below a configuration's need (head dim 256
#       needs sm_90's 227 KiB), v3 runs instead.
#   v6: on sm_90 (Hopper): flash_bwd_wgmma (flash_bwd_wgmma.cu), v4's work split on warpgroup MMA
#       (wgmma.mma_async, sm_90a): one warpgroup per 64 key rows, every operand read by the tensor
#       cores straight from 128-byte-swizzled shared memory or, for P^T and dS^T, from registers;
#       at d256 flash_bwd_wgmma_dsplit (warpgroups split the head dim). dQ ordered or atomic as in
#       v4. Elsewhere (sm_80) as v5.
#   v7: v6, but deterministic=True runs the wgmma kernel with fixed-point dQ adds (dq_fixed.py,
#       kernels_cu/dq_add.cuh) at the head-dim tiles of WGMMA_FIXED_D_TILES (v3 elsewhere): each
#       contribution rounded to a multiple of a per-row power of two and added as an int64, which
#       is exact in any order, so no CTA waits for its turn; the int64 reductions move twice the
#       float atomics' bytes through L2.
#   v8: not on this branch: fixed-point dQ summed by cluster pairs through distributed shared memory
#       first, measured slower than v7 (docs/perf-log.md; branch experiment/dq-cluster-pairs).
#   v9: v7, but dq_accum is panel-major ([batch][head][head-dim tile / 64][rows][64]), so a warp's
#       16 rows of a 64 x 64 dQ panel are 8 KiB of contiguous int64 and one bulk reduction adds
#       them; v7 issues one per row, 16 per warp, which the uniform datapath serialises. At the
#       head-dim tiles of WGMMA_PANEL_D_TILES.
#   v10: deterministic=True on sm_90 by two wgmma kernels and no dQ adds at all: the v6 kernel
#       (flash_bwd_wgmma, or _dsplit at d256) computing dK and dV only (DqAdd::none), and
#       flash_bwd_dq_wgmma, which walks the key blocks for one query block (the forward's work
#       split) and recomputes S and dP: 7 products per block pair instead of 5, but no dq_accum,
#       no int64 reductions through L2 and no convert kernel. At the head-dim tiles of
#       WGMMA_SPLIT_D_TILES.
VERSIONS = {
    "v1": "dK/dV 16 key rows per warp; dQ 16 query rows per warp",
    "v2": "v1, but 2 x 16 rows per warp in dQ (d64, d128) and dK/dV (d64): fewer shared reads per mma",
    "v3": "v2, but d128/d256 dK/dV by warp pairs split into a dV warp and a dK warp over the same keys",
    "v4": "one fused kernel with 32-row warp tiles; dQ added in a fixed key-block order (or unordered)",
    "v5": "v3's two kernels when deterministic (faster than v4's ordered adds), v4's fused atomic otherwise",
    "v6": "on sm_90, one warpgroup-MMA (wgmma) kernel, dQ ordered or atomic; elsewhere v5",
    "v7": "v6, but deterministic dQ on sm_90 by fixed-point int64 adds (exact in any order) in the wgmma kernel",
    "v9": "v7, but dq_accum in 64-column panels: one bulk reduction per warp instead of one per row",
    "v10": "v9, but deterministic dQ on sm_90 by its own wgmma kernel (query block outermost, S and dP recomputed)",
}
DEFAULT_VERSION = "v10"
CONVERT_THREADS = 256

_CTYPE = {"float16": "cf::half_t", "bfloat16": "cf::bf16_t"}
_SHORT = {"float16": "fp16", "bfloat16": "bf16"}
_SOURCE = "flash_bwd_mma.cu"

LOG2E = 1.4426950408889634


def supports(dtype, headdim: int) -> bool:
    """fp16/bf16 with headdim a multiple of 8 in [8, 256] (the dispatcher checks strides)."""
    try:
        name = dtype_name(dtype)
    except ValueError:
        return False
    return name in _CTYPE and 8 <= headdim <= D_TILES[-1] and headdim % 8 == 0


def d_tile(headdim: int) -> int:
    for t in D_TILES:
        if headdim <= t:
            return t
    raise ValueError(f"headdim {headdim} > {D_TILES[-1]}")


def dkdv_smem_bytes(dt: int, block_m: int, m_sub: int, block_n: int, nwarps: int, warps_d: int,
                    atomic_dq: bool) -> int:
    """Mirror of DkdvSmem<...>::BYTES in flash_bwd_mma.cu."""
    kv = 2 * block_n * dt * 2  # K, V
    qdo = 2 * 2 * block_m * dt * 2  # Q, dO, two stages each
    ds = block_n * block_m * 2 if atomic_dq else 0
    xchg = nwarps * 2 * (m_sub // 8) * 32 * 16 if warps_d > 1 else 0
    stats = 2 * 2 * block_m * 4  # lse, D, two stages each
    return kv + qdo + ds + xchg + stats


def dq_smem_bytes(dt: int, block_m: int, block_n: int) -> int:
    """Mirror of DqSmem<...>::BYTES in flash_bwd_mma.cu."""
    return 2 * block_m * dt * 2 + 2 * 2 * block_n * dt * 2


def _flag(x: bool) -> str:
    return "true" if x else "false"


def _check_version(version: str) -> None:
    if version not in VERSIONS:
        raise ValueError(f"cupyflash: unknown backward version {version!r} (known: {', '.join(VERSIONS)})")


def _since(version: str, first: str) -> bool:
    """Whether ``version`` is ``first`` or a later entry of VERSIONS (each builds on the last)."""
    order = list(VERSIONS)
    return order.index(version) >= order.index(first)


def dkdv_tiles(headdim: int, version: str = DEFAULT_VERSION, atomic_dq: bool = False,
               mask: Mask | None = None) -> tuple[str, tuple]:
    """The dK/dV kernel and its tiles: ("v1", DKDV_CONFIG entry), ("v2", DKDV_CONFIG_V2 entry) or
    ("split", DKDV_CONFIG_SPLIT entry). v4 launches these only where the fused kernel does not run
    (fused_config() is None)."""
    _check_version(version)
    dt = d_tile(headdim)
    if _since(version, "v3") and not atomic_dq and dt in DKDV_CONFIG_SPLIT:
        return "split", DKDV_CONFIG_SPLIT[dt]
    if _since(version, "v2") and dt in DKDV_CONFIG_V2 and not (atomic_dq and mask is not None and mask.HAS_LEFT):
        return "v2", DKDV_CONFIG_V2[dt]
    return "v1", DKDV_CONFIG[dt]


def dkdv_split_smem_bytes(dt: int, block_m: int, m_sub: int, block_n: int, nwarps: int, row_groups: int,
                          atomic_dq: bool) -> int:
    """Mirror of DkdvSplitSmem<...>::BYTES: the v1 layout (WARPS_D = 1) plus two P^T slots per pair."""
    slot = row_groups * (m_sub // 8) * 32 * 16
    return dkdv_smem_bytes(dt, block_m, m_sub, block_n, nwarps, 1, atomic_dq) + (nwarps // 2) * 2 * slot


def dkdv_spec(dtype, headdim: int, causal: Mask | bool, atomic_dq: bool,
              version: str = DEFAULT_VERSION) -> Specialization:
    """flash_bwd_dkdv_mma (v1 tiles, last entry WARPS_D), flash_bwd_dkdv_mma_v2 or
    flash_bwd_dkdv_mma_split (last entry ROW_GROUPS), as dkdv_tiles picks for the version;
    ``causal`` the mask policy (kernels_cu/mask.cuh) or a causal flag."""
    mask = as_mask(causal)
    name = dtype_name(dtype)
    dt = d_tile(headdim)
    kernel, (bm, ms, bn, nw, last) = dkdv_tiles(headdim, version, atomic_dq, mask)
    suffix, last_name = {"v1": ("", "wd"), "v2": ("_v2", "rg"), "split": ("_split", "rg")}[kernel]
    spec_name = (f"flash_bwd_dkdv_mma{suffix}_{_SHORT[name]}_hdim{dt}_{mask.name}"
                 f"_bm{bm}_ms{ms}_bn{bn}_w{nw}_{last_name}{last}{'_dqatomic' if atomic_dq else ''}")
    expression = (f"cf::flash_bwd_dkdv_mma{suffix}<{_CTYPE[name]}, {dt}, {mask.cpp}, {bm}, {ms}, {bn}, "
                  f"{nw}, {last}, {_flag(atomic_dq)}>")
    if kernel == "split":
        smem = dkdv_split_smem_bytes(dt, bm, ms, bn, nw, last, atomic_dq)
    else:  # v2 keeps v1's layout with one warp per key-row group
        smem = dkdv_smem_bytes(dt, bm, ms, bn, nw, last if kernel == "v1" else 1, atomic_dq)
    return Specialization(spec_name, _SOURCE, expression, nw * 32, smem)


def dq_smem_bytes_v2(dt: int, block_m: int, block_n: int) -> int:
    """Mirror of DqSmemV2<...>::BYTES: v1's tiles plus lse and D of the block's rows."""
    return dq_smem_bytes(dt, block_m, block_n) + 2 * block_m * 4


def dq_tiles(headdim: int, version: str = DEFAULT_VERSION) -> tuple:
    """The dQ kernel's tile configuration: v1's (BLOCK_M, BLOCK_N, NWARPS) or v2's (..., ROW_GROUPS)."""
    _check_version(version)
    dt = d_tile(headdim)
    if _since(version, "v2") and dt in DQ_CONFIG_V2:
        return DQ_CONFIG_V2[dt]
    return DQ_CONFIG[dt]


def dq_spec(dtype, headdim: int, causal: Mask | bool, version: str = DEFAULT_VERSION,
            config: tuple | None = None) -> Specialization:
    """flash_bwd_dq_mma (a 3-tuple config) or flash_bwd_dq_mma_v2 (a 4-tuple with ROW_GROUPS);
    ``causal`` the mask policy or a causal flag."""
    mask = as_mask(causal)
    name = dtype_name(dtype)
    dt = d_tile(headdim)
    config = tuple(config or dq_tiles(headdim, version))
    if len(config) == 4:
        bm, bn, nw, rg = config
        spec_name = f"flash_bwd_dq_mma_v2_{_SHORT[name]}_hdim{dt}_{mask.name}_bm{bm}_bn{bn}_w{nw}_rg{rg}"
        expression = f"cf::flash_bwd_dq_mma_v2<{_CTYPE[name]}, {dt}, {mask.cpp}, {bm}, {bn}, {nw}, {rg}>"
        return Specialization(spec_name, _SOURCE, expression, nw * 32, dq_smem_bytes_v2(dt, bm, bn))
    bm, bn, nw = config
    spec_name = f"flash_bwd_dq_mma_{_SHORT[name]}_hdim{dt}_{mask.name}_bm{bm}_bn{bn}_w{nw}"
    expression = f"cf::flash_bwd_dq_mma<{_CTYPE[name]}, {dt}, {mask.cpp}, {bm}, {bn}, {nw}>"
    return Specialization(spec_name, _SOURCE, expression, nw * 32, dq_smem_bytes(dt, bm, bn))


def convert_spec(dtype) -> Specialization:
    name = dtype_name(dtype)
    return Specialization(f"flash_bwd_dq_convert_{_SHORT[name]}", _SOURCE,
                          f"cf::flash_bwd_dq_convert<{_CTYPE[name]}>", CONVERT_THREADS, 0)


def specializations() -> list[Specialization]:
    """Every specialization ``backward`` can launch (for the compile check)."""
    from . import dq_fixed

    out = dq_fixed.specializations()
    for name in _CTYPE:
        out.append(convert_spec(name))
        for dt in D_TILES:
            for causal in (False, True):
                for atomic in (False, True):
                    out.extend(dict.fromkeys(dkdv_spec(name, dt, causal, atomic, version) for version in VERSIONS))
                out.append(dq_spec(name, dt, causal, version="v1"))
                if dt in DQ_CONFIG_V2:
                    out.append(dq_spec(name, dt, causal, version="v2"))
                if dt in FUSED_CONFIG:
                    out.extend(fused_spec(name, dt, causal, ordered) for ordered in (True, False))
                if dt in WGMMA_CONFIG:
                    out.extend(wgmma_spec(name, dt, causal, dq_add) for dq_add in DQ_ADDS
                               if dq_add not in FIXED_DQ_ADDS or dt in WGMMA_FIXED_KERNEL_D_TILES)
                if dt in DQ_WGMMA_CONFIG:
                    out.append(dq_wgmma_spec(name, dt, causal))
            # Windows: the kernels the default dispatch (v10) launches, on sm_80 (v3's two kernels
            # when deterministic; the fused atomic kernel, or v3's atomic dK/dV kernel where it
            # does not fit, otherwise) and on sm_90.
            local = KINDS[2]
            out.extend(dict.fromkeys(dkdv_spec(name, dt, local, atomic, "v3") for atomic in (False, True)))
            out.append(dq_spec(name, dt, local, "v3"))
            if dt in FUSED_CONFIG:
                out.append(fused_spec(name, dt, local, False))
            if dt in WGMMA_CONFIG:
                out.extend(wgmma_spec(name, dt, local, dq_add) for dq_add in ("atomic", "none")
                           if dq_add == "none" or dt not in WGMMA_SPLIT_ATOMIC_D_TILES)
            if dt in DQ_WGMMA_CONFIG:
                out.append(dq_wgmma_spec(name, dt, local))
    return out


def candidate_specializations() -> list[Specialization]:
    """The tuner's alternatives (``FUSED_CANDIDATES``, ``DQ_WGMMA_CANDIDATES``,
    ``WGMMA_NONE_CANDIDATES``), bf16 only (the compile check's spill report)."""
    return ([fused_spec("bfloat16", dt, causal, ordered, config)
             for dt, configs in FUSED_CANDIDATES.items() for config in configs
             for causal in (False, True) for ordered in (True, False)] +
            [dq_wgmma_spec("bfloat16", dt, causal, config)
             for dt, configs in DQ_WGMMA_CANDIDATES.items() for config in configs for causal in (False, True)] +
            [wgmma_spec("bfloat16", dt, causal, "none", config)
             for dt, configs in WGMMA_NONE_CANDIDATES.items() for config in configs for causal in (False, True)])


def fused_smem_bytes(dt: int, block_m: int, block_n: int) -> int:
    """Mirror of FusedSmem<...>::BYTES in flash_bwd_fused_mma.cu: K, V; two stages of Q, dO; P^T,
    dS^T; two stages of lse and D."""
    return 2 * block_n * dt * 2 + 2 * 2 * block_m * dt * 2 + 2 * block_n * block_m * 2 + 2 * 2 * block_m * 4


def fused_spec(dtype, headdim: int, causal: Mask | bool, ordered: bool,
               config: tuple | None = None) -> Specialization:
    """flash_bwd_fused_mma (v4) with dQ added in key-block order (``ordered``) or unordered;
    ``causal`` the mask policy or a causal flag (the ordered adds take no window)."""
    mask = as_mask(causal)
    if isinstance(mask, Local) and ordered:
        raise ValueError("cupyflash: the ordered dQ adds need every key block, so they take no window")
    name = dtype_name(dtype)
    dt = d_tile(headdim)
    bm, bn, wn, wd, dqm, unroll, *extra = tuple(config or FUSED_CONFIG[dt])
    eager = bool(extra and extra[0]) and ordered
    packed = len(extra) > 1 and bool(extra[1])
    spec_name = (f"flash_bwd_fused_mma_{_SHORT[name]}_hdim{dt}_{mask.name}"
                 f"_bm{bm}_bn{bn}_wn{wn}_wd{wd}_dqm{dqm}_u{unroll}_{'dqordered' if ordered else 'dqatomic'}"
                 f"{'_eager' if eager else ''}{'_p16' if packed else ''}")
    expression = (f"cf::flash_bwd_fused_mma<{_CTYPE[name]}, {dt}, {mask.cpp}, {bm}, {bn}, {wn}, {wd}, "
                  f"{dqm}, {unroll}, {_flag(ordered)}, {_flag(eager)}, {_flag(packed)}>")
    return Specialization(spec_name, "flash_bwd_fused_mma.cu", expression, wn * wd * 32,
                          fused_smem_bytes(dt, bm, bn))


DQ_STAGE_ROW = 64 * 8 + 64  # bytes per row of a fixed-point dQ staging tile (kernels_cu/dq_add.cuh)


def wgmma_smem_bytes(dt: int, block_m: int, block_n: int, dq_add: str = "atomic") -> int:
    """Mirror of WgmmaSmem<...>::BYTES in flash_bwd_wgmma.cu (K, V; two stages of Q, dO; dS^T; two
    stages of lse and D; with fixed-point dQ a 64-row int64 staging tile per warpgroup, rows
    DQ_STAGE_ROW bytes apart, or 512 with fixed_panels) or, at d256,
    of DsplitSmem in flash_bwd_wgmma_dsplit.cu (P^T as well, no staging), plus 1024 bytes to align
    the base for the 128-byte swizzle."""
    pt = block_n * block_m * 2 if dt == 256 else 0
    stage_row = {"fixed": DQ_STAGE_ROW, "fixed_panels": 512}.get(dq_add, 0) if dt != 256 else 0
    stage = block_n // 64 * 64 * stage_row
    return (2 * block_n * dt * 2 + 2 * 2 * block_m * dt * 2 + block_n * block_m * 2 + pt + 2 * 2 * block_m * 4
            + stage + 1024)


def wgmma_spec(dtype, headdim: int, causal: Mask | bool, dq_add: str, config: tuple | None = None) -> Specialization:
    """flash_bwd_wgmma, or flash_bwd_wgmma_dsplit at head-dim tile 256 (two warpgroups of 128
    threads); ``dq_add`` is one of DQ_ADDS (kernels_cu/dq_add.cuh); ``causal`` the mask policy
    (kernels_cu/mask.cuh) or a causal flag."""
    mask = as_mask(causal)
    if isinstance(mask, Local) and dq_add == "ordered":
        raise ValueError("cupyflash: the ordered dQ adds need every key block, so they take no window")
    if dq_add not in DQ_ADDS:
        raise ValueError(f"cupyflash: unknown dQ add mode {dq_add!r} (known: {', '.join(DQ_ADDS)})")
    name = dtype_name(dtype)
    dt = d_tile(headdim)
    if dq_add in FIXED_DQ_ADDS and dt not in WGMMA_FIXED_KERNEL_D_TILES:
        raise ValueError(f"cupyflash: no fixed-point wgmma backward at head-dim tile {dt}")
    bm, bn = tuple(config or WGMMA_CONFIG[dt])
    kernel = "flash_bwd_wgmma_dsplit" if dt == 256 else "flash_bwd_wgmma"
    spec_name = f"{kernel}_{_SHORT[name]}_hdim{dt}_{mask.name}_bm{bm}_bn{bn}_dq{dq_add}"
    expression = f"cf::{kernel}<{_CTYPE[name]}, {dt}, {mask.cpp}, {bm}, {bn}, cf::DqAdd::{dq_add}>"
    threads = 256 if dt == 256 else bn // 64 * 128
    return Specialization(spec_name, f"{kernel}.cu", expression, threads, wgmma_smem_bytes(dt, bm, bn, dq_add),
                          arch="90a")


def dq_wgmma_smem_bytes(dt: int, block_m: int, block_n: int, k_stages: int) -> int:
    """Mirror of DqWgmmaSmem<...>::BYTES in flash_bwd_dq_wgmma.cu (Q, dO; K_STAGES stages of K, two of
    V), plus 1024 bytes to align the base for the 128-byte swizzle."""
    return 2 * block_m * dt * 2 + (k_stages + 2) * block_n * dt * 2 + 1024


def dq_wgmma_spec(dtype, headdim: int, causal: Mask | bool, config: tuple | None = None) -> Specialization:
    """flash_bwd_dq_wgmma (v10): dQ with the query block outermost, BLOCK_M / 64 warpgroups;
    ``causal`` the mask policy or a causal flag."""
    mask = as_mask(causal)
    name = dtype_name(dtype)
    dt = d_tile(headdim)
    bm, bn, stages = tuple(config or DQ_WGMMA_CONFIG[dt])
    spec_name = f"flash_bwd_dq_wgmma_{_SHORT[name]}_hdim{dt}_{mask.name}_bm{bm}_bn{bn}_k{stages}"
    expression = f"cf::flash_bwd_dq_wgmma<{_CTYPE[name]}, {dt}, {mask.cpp}, {bm}, {bn}, {stages}>"
    return Specialization(spec_name, "flash_bwd_dq_wgmma.cu", expression, bm // 64 * 128,
                          dq_wgmma_smem_bytes(dt, bm, bn, stages), arch="90a")


def fused_config(headdim: int, smem_optin: int | None) -> tuple | None:
    """The fused kernel's tiles for this head dim, or None where they need more shared memory per
    block than the device grants (``smem_optin`` None: assume it fits)."""
    config = FUSED_CONFIG.get(d_tile(headdim))
    if config is None or (smem_optin is not None and
                          fused_smem_bytes(d_tile(headdim), config[0], config[1]) > smem_optin):
        return None
    return config


def wgmma_dq_add(version: str, deterministic: bool, dt: int) -> str | None:
    """How v6 / v7 / v9 / v10 add dQ in the wgmma kernel at head-dim tile ``dt`` on sm_90 (an entry
    of DQ_ADDS; "none": v10's dK/dV-only kernel and flash_bwd_dq_wgmma), or None where they run v5's
    kernels instead."""
    if dt not in WGMMA_CONFIG:
        return None
    if not deterministic:
        return "none" if _since(version, "v10") and dt in WGMMA_SPLIT_ATOMIC_D_TILES else "atomic"
    if _since(version, "v10"):
        return "none" if dt in WGMMA_SPLIT_D_TILES else None
    if _since(version, "v9"):
        return "fixed_panels" if dt in WGMMA_PANEL_D_TILES else None
    if _since(version, "v7"):
        return "fixed" if dt in WGMMA_FIXED_D_TILES else None
    return "ordered" if dt in WGMMA_ORDERED_D_TILES else None


def backward(do, q, k, v, o, lse, dq, dk, dv, *, softmax_scale: float, causal: bool,
             deterministic: bool = True, version: str | None = None,
             dq_config: tuple | None = None, fused: tuple | None = None, wgmma: tuple | None = None,
             window_size=(-1, -1)) -> None:
    """Fill the preallocated dq, dk, dv (C-contiguous, dtype of q) from the saved lse (B, H, Sq).

    Inputs are CuPy arrays meeting the mma family's guarantees (fp16/bf16, last dim contiguous,
    row strides multiples of 8 elements, 16-byte aligned, headdim % 8 == 0, headdim <= 256).
    ``version`` picks an entry of VERSIONS (None: DEFAULT_VERSION, read at call time, so that tests
    can run every version through the public API); ``dq_config`` overrides the dQ kernel's tiles (v1-v5's
    flash_bwd_dq_mma, or v10's flash_bwd_dq_wgmma where that runs), ``fused`` the fused kernel's (v4)
    tiles and ``wgmma`` the wgmma kernel's (WGMMA_CONFIG; tuning). ``window_size`` is flash-attn's
    (left, right) (cupyflash.masks); every kernel takes it except the ordered dQ adds (v4 and v6
    with ``deterministic``), which need every key block: with a window v4 runs v3's kernels there
    and v6 v5's, as where a configuration does not fit.
    """
    import cupy

    from .simt import backward_preprocess

    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    if backward_is_empty(q, k, dq, dk, dv):
        return
    if not supports(q.dtype, headdim):
        raise ValueError(f"cupyflash: mma backward does not support {q.dtype} with headdim {headdim}")
    version = DEFAULT_VERSION if version is None else version
    dq_tiles(headdim, version)  # rejects an unknown version before anything is launched
    mask = mask_for(causal, window_size)
    lse = cupy.ascontiguousarray(lse, dtype=np.float32)  # indexed as (batch, head, row) in C order
    dt = d_tile(headdim)
    scales = (np.float32(softmax_scale * LOG2E), np.float32(softmax_scale))
    common = (np.int32(seqlen_q), np.int32(seqlen_k), np.int32(nheads), np.int32(nheads // nheads_kv),
              np.int32(headdim), *row_strides(q), *row_strides(k), *row_strides(v), *row_strides(do))

    if _since(version, "v6"):
        from .mma_fwd import current_arch

        if fused is None and current_arch() == "90":
            dq_add = wgmma_dq_add(version, deterministic, dt)
            if dq_add == "ordered" and isinstance(mask, Local):
                dq_add = None
            if dq_add is not None:
                _wgmma_backward(q, k, v, do, o, lse, dq, dk, dv, common, scales, wgmma or WGMMA_CONFIG[dt], mask,
                                dq_add, dq_config)
                return
        version = "v5"
    delta = backward_preprocess(do, o)
    if version == "v5" and deterministic and fused is None:
        version = "v3"
    if version == "v4" and deterministic and isinstance(mask, Local) and fused is None:
        version = "v3"
    if version in ("v4", "v5") or fused is not None:
        from .mma_fwd import current_smem_optin

        config = fused or fused_config(headdim, current_smem_optin())
        if config is not None:
            _fused_backward(q, k, v, do, lse, delta, dq, dk, dv, common, scales, config, mask, deterministic)
            return
        version = "v3"
    dkdv_grid = (math.ceil(seqlen_k / dkdv_tiles(headdim, version, not deterministic, mask)[1][2]), nheads_kv, batch)

    if deterministic:
        # dq_accum is not touched without ATOMIC_DQ; dk stands in for the pointer.
        launch(dkdv_spec(q.dtype, headdim, mask, atomic_dq=False, version=version), dkdv_grid,
               (q, k, v, do, lse, delta, dk, dv, dk, *common, *row_strides(dk), *row_strides(dv),
                np.int64(0), np.int64(0), np.int64(0), *scales, *mask.window_args()))
        bm = (dq_config or dq_tiles(headdim, version))[0]
        launch(dq_spec(q.dtype, headdim, mask, version, dq_config), (math.ceil(seqlen_q / bm), nheads, batch),
               (q, k, v, do, lse, delta, dq, *common, *row_strides(dq), *scales, *mask.window_args()))
        return

    dq_accum = cupy.zeros((batch, seqlen_q, nheads, dt), dtype=np.float32)
    launch(dkdv_spec(q.dtype, headdim, mask, atomic_dq=True, version=version), dkdv_grid,
           (q, k, v, do, lse, delta, dk, dv, dq_accum, *common, *row_strides(dk), *row_strides(dv),
            *row_strides(dq_accum), *scales, *mask.window_args()))
    _convert_dq(dq_accum, dq, softmax_scale)


def _fused_backward(q, k, v, do, lse, delta, dq, dk, dv, common, scales, config, mask, deterministic):
    """v4: flash_bwd_fused_mma, then dq = scale * dq_accum."""
    import cupy

    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    bm, bn = config[0], config[1]
    dq_accum = cupy.zeros((batch, seqlen_q, nheads, d_tile(headdim)), dtype=np.float32)
    # One counter per (batch, head, query block): how many warps of earlier key blocks have added.
    semaphore = cupy.zeros((batch, nheads, math.ceil(seqlen_q / bm)) if deterministic else (1,), dtype=np.int32)
    launch(fused_spec(q.dtype, headdim, mask, deterministic, config), (math.ceil(seqlen_k / bn), nheads_kv, batch),
           (q, k, v, do, lse, delta, dk, dv, dq_accum, semaphore, *common, *row_strides(dk), *row_strides(dv),
            *row_strides(dq_accum), *scales, *mask.window_args()))
    _convert_dq(dq_accum, dq, scales[1])


def _wgmma_backward(q, k, v, do, o, lse, dq, dk, dv, common, scales, config, mask, dq_add, dq_config=None):
    """v6/v7/v9 (sm_90): flash_bwd_wgmma, dQ added as ``dq_add`` says (DQ_ADDS), then dq = scale *
    dq_accum (float32, or int64 fixed point scaled per row); v10 (dq_add "none"): dQ by
    flash_bwd_dq_wgmma (``dq_config`` overrides its DQ_WGMMA_CONFIG tiles)."""
    import cupy

    from . import dq_fixed
    from .simt import backward_preprocess

    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    shape = (batch, seqlen_q, nheads, d_tile(headdim))
    if dq_add == "none":
        _split_wgmma_backward(q, k, v, do, o, lse, dq, dk, dv, common, scales, config, mask, dq_config)
        return
    if dq_add in FIXED_DQ_ADDS:
        delta, dq_scale = dq_fixed.preprocess(do, o, k, v)
    else:
        delta = backward_preprocess(do, o)
        dq_scale = delta  # not read: only the fixed-point kernels take the row scales
    if dq_add == "fixed_panels":
        dq_accum = dq_fixed.accum_panels(batch, seqlen_q, nheads, d_tile(headdim), config[0])
        accum_strides = dq_fixed.panel_strides(dq_accum)
    else:
        dq_accum = cupy.zeros(shape, dtype=np.int64 if dq_add == "fixed" else np.float32)
        accum_strides = row_strides(dq_accum)
    # ordered: one counter per (batch, head, query block), how many warps of earlier key blocks added.
    semaphore = cupy.zeros((batch, nheads, math.ceil(seqlen_q / config[0])) if dq_add == "ordered" else (1,),
                           dtype=np.int32)
    launch(wgmma_spec(q.dtype, headdim, mask, dq_add, config),
           (math.ceil(seqlen_k / config[1]), nheads_kv, batch),
           (q, k, v, do, lse, delta, dk, dv, dq_accum, semaphore, dq_scale, *common, *row_strides(dk),
            *row_strides(dv), *accum_strides, *scales, *mask.window_args()))
    if dq_add in FIXED_DQ_ADDS:
        dq_fixed.convert(dq_accum, dq_scale, dq, scales[1], panel_major=dq_add == "fixed_panels")
    else:
        _convert_dq(dq_accum, dq, scales[1])


def _split_wgmma_backward(q, k, v, do, o, lse, dq, dk, dv, common, scales, config, mask,
                          dq_config: tuple | None = None) -> None:
    """v10 (sm_90, deterministic): the wgmma kernel for dK and dV only (DqAdd::none), then
    flash_bwd_dq_wgmma for dQ, written straight into dq."""
    from .simt import backward_preprocess

    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    delta = backward_preprocess(do, o)
    # dq_accum, the semaphore and the row scales are not touched with DqAdd::none; dk and delta
    # stand in for the pointers, zeros for the dq_accum strides.
    launch(wgmma_spec(q.dtype, headdim, mask, "none", config), (math.ceil(seqlen_k / config[1]), nheads_kv, batch),
           (q, k, v, do, lse, delta, dk, dv, dk, delta, delta, *common, *row_strides(dk), *row_strides(dv),
            np.int64(0), np.int64(0), np.int64(0), *scales, *mask.window_args()))
    dq_cfg = tuple(dq_config or DQ_WGMMA_CONFIG[d_tile(headdim)])
    launch(dq_wgmma_spec(q.dtype, headdim, mask, dq_cfg), (math.ceil(seqlen_q / dq_cfg[0]), nheads, batch),
           (q, k, v, do, lse, delta, dq, *common, *row_strides(dq), *scales, *mask.window_args()))


def _convert_dq(dq_accum, dq, scale) -> None:
    """flash_bwd_dq_convert: dq = scale * dq_accum in dq's dtype."""
    batch, seqlen_q, nheads, headdim = dq.shape
    n_chunks = batch * seqlen_q * nheads * (headdim // 8)
    launch(convert_spec(dq.dtype), (math.ceil(n_chunks / CONVERT_THREADS), 1, 1),
           (dq_accum, dq, np.int32(seqlen_q), np.int32(nheads), np.int32(headdim), np.int64(n_chunks),
            *row_strides(dq_accum), *row_strides(dq), np.float32(scale)))

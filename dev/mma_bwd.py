"""Every version the tensor-core backward has shipped, v1 to v16, and the candidates that lost:
the history of ``cupyflash.backward_plans.BACKWARD_KERNELS``. Not part of the library (a wheel has
no dev/); ``python -m cupyflash tune --direction bwd`` from a source checkout times each entry
against the shipped plan, after checking it against the float64 reference, and
``mma_bwd.backward(..., version="v3")`` runs one (the GPU tests run every version that way).

The kernels are the shipped ones: a version is a choice of kernels and tiles, ``kernels(...)``
returns it as a ``BackwardKernels`` (the type of a plan row) for a device, dtype, head dim, mask
and ``deterministic``. Each version builds on the one before it; ``kernels`` walks them as the
dispatch did before plans (v10 there is ``plan_backward``'s rows, which tests/dev checks).
ldmatrix.x4 per mma.sync counted in the SASS (sm_90).
"""
from __future__ import annotations

from dataclasses import dataclass

from cupyflash.backward_plans import (DKDV_CONFIG, DKDV_CONFIG_SPLIT, DKDV_CONFIG_V2, DQ_CONFIG, DQ_CONFIG_V2,
                                      DQ_WGMMA_CONFIG, FUSED_CONFIG, WGMMA_CONFIG, WGMMA_WS_VARIANT_D64,
                                      BackwardKernels, d_tile, fused_smem_bytes)
from cupyflash.masks import Causal, Local, NoMask, as_mask

PERF_LOG = "docs/perf-log.md"


@dataclass(frozen=True)
class Version:
    name: str
    note: str
    perf_log: str  # the heading anchor of its entry in docs/perf-log.md
    shipped: str = ""  # the BACKWARD_KERNELS rows that still run it, if any


VERSIONS = (
    # dK/dV with 16 key rows per warp; dQ with 16 query rows per warp, so every warp reads all of
    # K_j and V_j and each B fragment feeds 2 mma (0.58 ldmatrix.x4 per mma at d64 and d128).
    Version("v1", "dK/dV 16 key rows per warp; dQ 16 query rows per warp", "mma-bwd-v1",
            shipped="mma_sync d128/d256 without determinism, where the fused kernel does not fit; d64 with a "
                    "window's left bound"),
    # dQ by flash_bwd_dq_mma_v2: 2 x 16 query rows per warp, each K_j / V_j fragment feeds 4 mma
    # (0.42 at d64, 0.50 at d128, where dP is built in 16-key slices to fit the registers); lse and
    # D in shared memory. At d64 also dK/dV by flash_bwd_dkdv_mma_v2: 2 x 16 key rows per warp,
    # each Q / dO fragment feeds 4 mma (0.44, dP^T in 16-query slices; v1 0.56; 0.50 vs 0.63 with
    # the atomic dQ). Head dim 256 as v1; dK/dV at d128 as v1.
    Version("v2", "v1, but 2 x 16 rows per warp in dQ (d64, d128) and dK/dV (d64): fewer shared reads per mma",
            "mma-bwd-v2--v3-candidates-in-the-first-session-v3-is-v5s-deterministic-path",
            shipped="mma_sync d64 without determinism"),
    # v2, plus dK/dV at d128 (deterministic path) by flash_bwd_dkdv_mma_split: warp pairs share
    # 2 x 16 key rows, one warp accumulates dV (S^T, P^T), the other dK (dP^T, dS^T), P^T passes
    # through shared memory (0.38 ldmatrix.x4 per mma plus 32 B of exchange per mma; v1 0.63). At
    # d256 the same kernel with 16 key rows per pair: 0.63 plus 16 B per mma (v1: 0.75 plus 64 B of
    # partial sums per mma).
    Version("v3", "v2, but d128/d256 dK/dV by warp pairs split into a dV warp and a dK warp over the same keys",
            "mma-bwd-v2--v3-candidates-in-the-first-session-v3-is-v5s-deterministic-path",
            shipped="mma_sync with determinism"),
    # One kernel, flash_bwd_fused_mma: S and dP computed once per block pair (5 products, v1-v3's
    # deterministic path does 7), FlashAttention-2's 32-row warp tiles for all five products, P^T
    # and dS^T through shared memory. dQ by float32 adds to dq_accum, in a fixed key-block order
    # (deterministic: per-query-block counters) or unordered. Where the device's shared memory per
    # block is below a configuration's need (d256 needs 209 KiB), or at d64 (no tiles: at 64
    # columns a query block is too little work per barrier), v3 runs instead; the ordered adds need
    # every key block, so with a window v3 runs too.
    Version("v4", "one fused kernel with 32-row warp tiles; dQ added in a fixed key-block order (or unordered)",
            "mma-bwd-v4-fused-backward-measured-the-default-only-for-deterministicfalse",
            shipped="mma_sync d128/d256 without determinism (the unordered adds)"),
    Version("v5", "v3's two kernels when deterministic (faster than v4's ordered adds), v4's fused atomic otherwise",
            "mma-bwd-v5-the-backward-default-until-v6-still-the-default-on-sm_80", shipped="mma_sync"),
    # On sm_90: flash_bwd_wgmma, v4's work split on warpgroup MMA (wgmma.mma_async, sm_90a): one
    # warpgroup per 64 key rows, every operand read by the tensor cores straight from 128-byte-
    # swizzled shared memory or, for P^T and dS^T, from registers; at d256 flash_bwd_wgmma_dsplit
    # (warpgroups split the head dim). dQ ordered (at WGMMA_ORDERED_D_TILES) or atomic as in v4.
    # Elsewhere as v5.
    Version("v6", "on sm_90, one warpgroup-MMA (wgmma) kernel, dQ ordered or atomic; elsewhere v5",
            "mma-fwd-v6--mma-bwd-v6-hopper-wgmma-the-forward-default-on-sm_90-the-backward-default-until-v7",
            shipped="sm_90 d64/d128 without determinism"),
    # v6, but deterministic runs the wgmma kernel with fixed-point dQ adds (cupyflash/kernels/
    # dq_fixed.py, kernels_cu/dq_add.cuh) at WGMMA_FIXED_D_TILES (v3 elsewhere): each contribution
    # rounded to a multiple of a per-row power of two and added as an int64, exact in any order, so
    # no CTA waits for its turn; the int64 reductions move twice the float atomics' bytes.
    Version("v7", "v6, but deterministic dQ on sm_90 by fixed-point int64 adds (exact in any order) in the wgmma "
            "kernel", "mma-bwd-v7-fixed-point-dq-the-deterministic-default-on-sm_90-at-d128-until-v9"),
    # v7, but dq_accum is panel-major ([batch][head][head-dim tile / 64][rows][64]), so a warp's 16
    # rows of a 64 x 64 dQ panel are 8 KiB of contiguous int64 and one bulk reduction adds them; v7
    # issues one per row, 16 per warp, which the uniform datapath serialises.
    Version("v9", "v7, but dq_accum in 64-column panels: one bulk reduction per warp instead of one per row",
            "mma-bwd-v9-panel-major-fixed-point-dq-the-deterministic-default-on-sm_90-at-d128"),
    # Deterministic on sm_90 by two wgmma kernels and no dQ adds at all: the v6 kernel computing dK
    # and dV only (DqAdd::none), and flash_bwd_dq_wgmma, which walks the key blocks for one query
    # block (the forward's work split) and recomputes S and dP: 7 products per block pair instead
    # of 5, but no dq_accum, no int64 reductions and no convert kernel; at d256 without determinism
    # too.
    Version("v10", "v9, but deterministic dQ on sm_90 by its own wgmma kernel (query block outermost, S and dP "
            "recomputed)", "mma-bwd-v10-two-wgmma-kernels-no-dq-adds-the-default-on-sm_90",
            shipped="sm_90 (a window at d128: v11)"),
    # A sliding window at sm_90 d128, deterministic or not: v10's two kernels on 64 x 64 blocks,
    # whose walks pass 64 diagonals beyond the band where 128-row blocks pass 128 (H100, 8k / 16k,
    # window 1024: 1.13-1.15x v10's row, 1.14-1.18x the atomic row; backward_plans.
    # LOCAL_BACKWARD_KERNELS).
    Version("v11", "v10, but a window at d128 on sm_90 runs dK/dV and dQ on 64 x 64 blocks, with determinism "
            "or without", "windows-bwd-tiles-the-backwards-two-wgmma-kernels-with-64-row-blocks-for-windows--v11-"
            "shipped-113-116x-flexattention", shipped="sm_90 (a window at d128)"),
    # A packed causal batch at sm_90 d128 (not with softcap or a user modifier): v11's window tiles,
    # two CTAs an SM hiding each other's prologue and epilogue on the short walks of mixed lengths
    # (H100, the varlen bench: 0.84 -> 0.93 of dense; at d64 no gain, not taken; v16 left it for the
    # producer pair).
    Version("v12", "v11, but a packed causal batch at d128 on sm_90 runs the window's 64 x 64 blocks too",
            "varlen-v3-the-packed-causal-backward-on-two-ctas-an-sm"),
    # Deterministic d64 / d128 on sm_90: v10's two kernels, each with a producer warpgroup copying its
    # walked blocks into stages and two consumer warpgroups in turns at the tensor cores
    # (flash_bwd_wgmma_ws, flash_bwd_dq_wgmma_ws), bitwise v10's results (H100: the backward
    # 1.05-1.14x at d128 8k / 16k, 1.08-1.13x at d64 8k). A window at d128 and a packed causal batch
    # keep v11 / v12's 64 x 64 rows.
    Version("v13", "v12, but deterministic d64 / d128 on sm_90 by v10's two kernels with a producer warpgroup each",
            "wgmma-bwd-ws-route-v13-sm_90s-deterministic-d64--d128-backward-on-the-producer-kernels",
            shipped="sm_90 d64 / d128 with determinism"),
    # d128 without determinism on sm_90: the pair too, not the atomic row (H100, one tuner call:
    # 1.07x / 1.19x at 8k non-causal / causal, 1.09x / 1.14x at 16k). d64 kept its atomic row (not
    # measured against the pair until v15).
    Version("v14", "v13, but d128 without determinism on sm_90 runs the producer pair too",
            "wgmma-bwd-ws-nondet-v14-d128-without-determinism-on-the-producer-pair-too",
            shipped="sm_90 d128 without determinism"),
    # d64 without determinism on sm_90: the pair as well (H100, one tuner call: 1.03x / 1.08x at 8k
    # non-causal / causal, 1.05x / 1.07x at 16k), so sm_90 d64 / d128 run it whatever determinism.
    Version("v15", "v14, but d64 without determinism on sm_90 runs the producer pair too",
            "wgmma-bwd-ws-nondet-d64-v15-d64-without-determinism-on-the-producer-pair-too",
            shipped="sm_90 d64 without determinism"),
    # A packed causal batch at sm_90 d128: the producer pair as a dense batch, not v12's 64 x 64
    # rows (H100, the varlen bench alternated twice: 1.10x, 0.83 -> 0.91 of one dense sequence).
    Version("v16", "v15, but a packed causal batch at d128 on sm_90 runs the producer pair as a dense one does",
            "varlen-bwd-pair-v16-a-packed-causal-batch-at-d128-on-the-producer-pair--"
            "measured-on-an-h100-twenty-eighth-session-110x-083---091-of-dense-routed",
            shipped="sm_90 (a packed causal batch at d128)"),
)
# Numbers that were never a version of this tree.
REJECTED = {"v8": ("fixed-point dQ summed by cluster pairs through distributed shared memory first, measured "
                   "slower than v7 (branch experiment/dq-cluster-pairs)",
                   "mma-bwd-v8-rejected-fixed-point-dq-summed-by-cluster-pairs")}
LAST_VERSION = VERSIONS[-1].name
_ORDER = [v.name for v in VERSIONS]

# Head-dim tiles where v6 runs the wgmma kernel with ordered dQ when deterministic; elsewhere v3's
# two kernels, where the ordered adds cost more than the wgmma kernels gain at short or causal
# sequences (bf16, TFLOP/s at 16k non-causal / 2k causal: d64 ordered wgmma 268 / 138 against v3's
# 244 / 196, d256 ordered dsplit 212 / 122 against 172 / 151; perf log mma-bwd-v6). The GPU tests
# widen it to run every ordered kernel.
WGMMA_ORDERED_D_TILES = (128,)
# Head-dim tiles where v7 runs the wgmma kernel with fixed-point dQ when deterministic: the kernel
# stages each dQ panel in shared memory and adds it by bulk reductions, one per row (per-thread
# int64 reductions measured 207 against the float atomics' 370 TFLOP/s at d128 16k). Measured (bf16,
# TFLOP/s at 16k non-causal / 16k causal / 2k non-causal / 2k causal; perf log mma-bwd-v7): d128
# fixed 281 / 286 / 244 / 202 against v6's ordered adds 310 / 291 / 239 / 185; d64 fixed 244 /
# 249 / 217 / 186 against v3's 244 / 234 / 229 / 196, so v3 stays there. The d256 kernel has no
# room for the staging tile (per-thread int64 reductions there: 95-112 against v3's 151-175).
WGMMA_FIXED_D_TILES = (128,)
# Head-dim tiles where v9 runs the panel-major fixed-point kernel when deterministic (v3 elsewhere).
WGMMA_PANEL_D_TILES = (128,)
# Head-dim tiles where v10 runs the dK/dV-only wgmma kernel and flash_bwd_dq_wgmma when
# deterministic, and where it does so without determinism too (perf log mma-bwd-v10).
WGMMA_SPLIT_D_TILES = (64, 128, 256)
WGMMA_SPLIT_ATOMIC_D_TILES = (256,)

# --- candidates: alternatives the tuner times, never a default --------------------------------
# flash_bwd_dq_mma_v2 (``dq_config=``): 8 warps of 32 rows (one CTA per SM, 162 KiB of shared
# memory at d128: sm_90 only); compiled without spills.
DQ_CANDIDATES_V2 = {64: ((256, 32, 8, 2),), 128: ((256, 32, 8, 2),)}
# flash_bwd_fused_mma (``fused=``): the unroll depth of S^T and dP^T (6th entry), EAGER_RELEASE
# (7th: release each query block's dQ counter right after the adds) and P_PACKED (8th: step 5
# reads the 16-bit P^T). Tuner, bf16 16k atomic, d128: 255.8 / 260.3 TFLOP/s (u1, non-causal /
# causal) -> 262.0 / 266.7 (u2 with P_PACKED, the shipped tiles; u4: 261.7 / 271.1); d256 unrolls
# all 16 (202.5 / 207.8 at u2 -> 213.4 / 210.8). d64: 0.82x of flash_bwd_dkdv_mma_v2 with atomic dQ.
FUSED_CANDIDATES = {64: ((64, 128, 4, 2, 2, 4),),
                    128: ((64, 128, 4, 2, 2, 1), (64, 128, 4, 2, 2, 2), (64, 128, 4, 2, 2, 1, 1),
                          (64, 128, 4, 2, 2, 4, 0, 1)),
                    256: ((64, 64, 2, 4, 2, 2), (64, 64, 2, 4, 2, 1), (64, 64, 4, 2, 2, 1), (64, 64, 2, 4, 2, 2, 1),
                          (64, 64, 2, 4, 2, 4), (64, 64, 2, 4, 2, 8))}
# flash_bwd_dq_wgmma (``dq_config=`` where v10's kernels run): d64 (128, 64, 2) 286 / 280 / 251 /
# 209 against the shipped (128, 128, 2)'s 303 / 293 / 266 / 217; d256 K_STAGES 3 302 / 305 / 263 /
# 230 against 2's 306 / 306 / 277 / 232. K_STAGES 3 at d64 and d128 compiles with its wgmma
# serialized by ptxas (C7515), so it is no candidate there.
DQ_WGMMA_CANDIDATES = {64: ((128, 64, 2),), 256: ((128, 32, 3),)}
# Tiles of the dK/dV-only wgmma kernel (DqAdd::none, ``wgmma=``) besides WGMMA_CONFIG's.
WGMMA_NONE_CANDIDATES = {64: ((64, 128),)}
# v13's producer kernels (perf log wgmma-bwd-ws-v0, wgmma-bwd-ws-route): flash_bwd_wgmma_ws's tiles
# (BLOCK_M, BLOCK_N, STAGES, PINGPONG) and flash_bwd_dq_wgmma_ws's, by head-dim tile.
WGMMA_WS_ROUTE = {64: ((128, 128, 3, True), (128, 128, 3, True)), 128: ((64, 128, 3, True), (128, 64, 3, True))}
# Other tiles of the producer kernels (``wgmma_ws=`` dK/dV, ``dq_ws=`` dQ), each beside v13's other
# kernel. H100, the whole backward against v10 at 8k (wgmma-bwd-ws-v0): dK/dV d128 four stages
# 1.00-1.11x, three without turns 1.06-1.09x (v13's three with turns 1.02-1.11x beside v10's dQ);
# dQ d128 four stages 0.92-0.97x; d64 dK/dV on 64 queries 0.99-1.01x.
WGMMA_WS_CANDIDATES = {64: ((64, 128, 3, True),), 128: ((64, 128, 4, True), (64, 128, 3, False))}
DQ_WS_CANDIDATES = {128: ((128, 64, 4, True),)}
# For sliding windows: v10's two kernels with 64-row blocks, (dK/dV-only wgmma tiles, dq_wgmma tiles)
# pairs. The backward ran a causal window of 1024 at 16k (bf16, d128) at 0.73-0.74 of causal's
# TFLOP/s over the visible pairs (issue 15's bar: 0.85). A 128-key block walks the queries of
# 1024 + 128 diagonals for a window of 1024, a 64-key block 1024 + 64; the same holds for dQ's
# 128-query blocks walking keys. The forward's 64 x 64 tiles gained 1.07-1.14x on windows (perf log
# windows-tiles). 64 x 64 dK/dV is one warpgroup of 128 threads, and dq_wgmma's 64-query block is
# one warpgroup too. Not yet timed:
# `tune --direction bwd --headdim 128 --seqlen 16384 --window 1024 0 --only default "(64, 64"`.
# (The pair of both, ((64, 64), (64, 64, 2)), is v11 since the eighth session's timings.)
WINDOW_SPLIT_CANDIDATES = {128: (((64, 64), (128, 64, 2)), ((64, 128), (64, 64, 2)))}
# Head-dim tiles where v11 runs a window's two kernels on 64 x 64 blocks (with or without determinism),
# and v12 a packed causal batch's.
WINDOW_SPLIT_D_TILES = {128: ((64, 64), (64, 64, 2))}
PACKED_CAUSAL_D_TILES = WINDOW_SPLIT_D_TILES
CANDIDATES_PERF_LOG = "mma-bwd-v4-second-round-of-tiles-p_packed-unrolled-st--dpt"


def _since(version: str, first: str) -> bool:
    return _ORDER.index(version) >= _ORDER.index(first)


def check_version(version: str) -> None:
    if version not in _ORDER:
        raise ValueError(f"cupyflash: unknown backward version {version!r} (known: {', '.join(_ORDER)})")


def dkdv_tiles(headdim: int, version: str, atomic_dq: bool, mask=None) -> tuple[str, tuple]:
    """The mma.sync dK/dV kernel of ``version`` (a key of backward_plans.DKDV_KERNELS) and its tiles.
    flash_bwd_dkdv_mma_v2 with atomic dQ and a window's left bound spills, so v1's runs there."""
    check_version(version)
    dt = d_tile(headdim)
    if _since(version, "v3") and not atomic_dq and dt in DKDV_CONFIG_SPLIT:
        return "split", DKDV_CONFIG_SPLIT[dt]
    if _since(version, "v2") and dt in DKDV_CONFIG_V2 and not (atomic_dq and mask is not None and mask.HAS_LEFT):
        return "v2", DKDV_CONFIG_V2[dt]
    return "v1", DKDV_CONFIG[dt]


def dq_tiles(headdim: int, version: str) -> tuple:
    """The mma.sync dQ kernel's tiles of ``version``: v1's (BLOCK_M, BLOCK_N, NWARPS) or v2's (...,
    ROW_GROUPS)."""
    check_version(version)
    dt = d_tile(headdim)
    return DQ_CONFIG_V2[dt] if _since(version, "v2") and dt in DQ_CONFIG_V2 else DQ_CONFIG[dt]


def fused_config(headdim: int, smem_optin: int | None) -> tuple | None:
    """The fused kernel's tiles, or None where it has none or they need more shared memory per
    block than the device grants (``smem_optin`` None: assume it fits)."""
    config = FUSED_CONFIG.get(d_tile(headdim))
    if config is None or (smem_optin is not None and
                          fused_smem_bytes(d_tile(headdim), config[0], config[1]) > smem_optin):
        return None
    return config


def wgmma_dq_add(version: str, deterministic: bool, dt: int) -> str | None:
    """How v6 / v7 / v9 / v10 form dQ with the wgmma kernel at head-dim tile ``dt`` on sm_90 (an
    entry of backward_plans.DQ_ADDS), or None where they run v5's kernels instead."""
    if not deterministic:
        return "none" if _since(version, "v10") and dt in WGMMA_SPLIT_ATOMIC_D_TILES else "atomic"
    if _since(version, "v10"):
        return "none" if dt in WGMMA_SPLIT_D_TILES else None
    if _since(version, "v9"):
        return "fixed_panels" if dt in WGMMA_PANEL_D_TILES else None
    if _since(version, "v7"):
        return "fixed" if dt in WGMMA_FIXED_D_TILES else None
    return "ordered" if dt in WGMMA_ORDERED_D_TILES else None


def kernels(version: str, arch: str | None, smem_optin: int | None, dtype, headdim: int, mask,
            deterministic: bool, dq_config: tuple | None = None, fused: tuple | None = None,
            wgmma: tuple | None = None, wgmma_ws: tuple | None = None,
            dq_ws: tuple | None = None) -> BackwardKernels:
    """The kernels ``version`` runs on a device of compute capability ``arch`` with ``smem_optin``
    bytes per block; ``dq_config``, ``fused`` and ``wgmma`` replace the tiles of the dQ kernel, the
    fused kernel (and run it) and the wgmma kernel; ``wgmma_ws`` runs dK/dV on flash_bwd_wgmma_ws at
    those tiles instead, ``dq_ws`` dQ on flash_bwd_dq_wgmma_ws (sm_90, v10's rows otherwise)."""
    check_version(version)
    mask = as_mask(mask)
    dt = d_tile(headdim)
    # v13: the producer kernels where deterministic at d64 / d128 on sm_90 (v14: d128 without
    # determinism too, v15: d64 too), not a window at d128 nor (v12 to v15) a packed causal batch there
    # without softcap or a user modifier (v11 / v12's rows); softcap, dropout and user modifiers at d64
    # on 64-query dK/dV blocks. With ``wgmma_ws`` or ``dq_ws`` given, those tiles beside v13's other
    # kernel.
    variant = mask.score.softcap or mask.score.dropout or mask.score.user is not None
    packed_causal_rows = (_since(version, "v12") and not _since(version, "v16") and mask.packed
                          and mask.band == "causal" and not mask.score.softcap and mask.score.user is None)
    v12_rows = dt in WINDOW_SPLIT_D_TILES and (isinstance(mask, Local) or packed_causal_rows)
    ws = (arch == "90" and (deterministic or (_since(version, "v14") and dt == 128) or _since(version, "v15"))
          and _since(version, "v13")
          and dt in WGMMA_WS_ROUTE and fused is None and wgmma is None and dq_config is None and not v12_rows)
    if wgmma_ws is not None or dq_ws is not None:
        if arch != "90" or not _since(version, "v10") or not deterministic or dt not in WGMMA_WS_ROUTE:
            raise ValueError("cupyflash: the producer backward kernels are sm_90's, deterministic, d64 / d128")
        dq_ws = dq_ws if dq_ws is not None else WGMMA_WS_ROUTE[dt][1]
        wgmma_ws = wgmma_ws if wgmma_ws is not None else WGMMA_WS_ROUTE[dt][0]
        return BackwardKernels("wgmma_ws", tuple(wgmma_ws), "none", "dq_wgmma_ws", tuple(dq_ws))
    if ws:
        dkdv = WGMMA_WS_VARIANT_D64 if variant and dt == 64 else WGMMA_WS_ROUTE[dt][0]
        return BackwardKernels("wgmma_ws", dkdv, "none", "dq_wgmma_ws", WGMMA_WS_ROUTE[dt][1])
    if _since(version, "v6"):
        if fused is None and wgmma is None and dq_config is None and arch == "90":
            if _since(version, "v11") and isinstance(mask, Local) and dt in WINDOW_SPLIT_D_TILES:
                return BackwardKernels("wgmma", WINDOW_SPLIT_D_TILES[dt][0], "none", "dq_wgmma",
                                       WINDOW_SPLIT_D_TILES[dt][1])
            if packed_causal_rows and dt in PACKED_CAUSAL_D_TILES:
                return BackwardKernels("wgmma", PACKED_CAUSAL_D_TILES[dt][0], "none", "dq_wgmma",
                                       PACKED_CAUSAL_D_TILES[dt][1])
        if fused is None and arch == "90":
            dq_add = wgmma_dq_add(version, deterministic, dt)
            if dq_add == "ordered" and isinstance(mask, Local):
                dq_add = None
            if dq_add == "none":
                return BackwardKernels("wgmma", tuple(wgmma or WGMMA_CONFIG[dt]), "none", "dq_wgmma",
                                       tuple(dq_config or DQ_WGMMA_CONFIG[dt]))
            if dq_add is not None:
                return BackwardKernels("wgmma", tuple(wgmma or WGMMA_CONFIG[dt]), dq_add)
        version = "v5"
    if version == "v5" and deterministic and fused is None:
        version = "v3"
    if version == "v4" and deterministic and isinstance(mask, Local) and fused is None:
        version = "v3"
    if version in ("v4", "v5") or fused is not None:
        config = fused or fused_config(headdim, smem_optin)
        if config is not None:
            return BackwardKernels("fused_mma", tuple(config), "ordered" if deterministic else "atomic")
        version = "v3"
    kernel, tiles = dkdv_tiles(headdim, version, not deterministic, mask)
    dkdv = {"v1": "dkdv_mma", "v2": "dkdv_mma_v2", "split": "dkdv_mma_split"}[kernel]
    if deterministic:
        return BackwardKernels(dkdv, tiles, "none", "dq_mma", tuple(dq_config or dq_tiles(headdim, version)))
    return BackwardKernels(dkdv, tiles, "atomic")


def entries(dt: int, arch: str | None) -> list[tuple[str, dict]]:
    """(label, mma_bwd.backward keywords) of every version and candidate worth timing at head-dim
    tile ``dt`` on a device of compute capability ``arch``, each set of kernels once."""
    out, seen = [], set()
    for version in _ORDER:
        for deterministic in (True, False):
            row = kernels(version, arch, None, "bfloat16", dt, as_mask(False), deterministic)
            if row in seen:  # a later version that launches the same kernels here
                continue
            seen.add(row)
            out.append((f"{version} {_describe(row)}", dict(version=version, deterministic=deterministic)))
    split_tiles = arch == "90" and dt in WGMMA_SPLIT_D_TILES  # elsewhere dq_config reaches v3's dQ kernel
    for tiles in DQ_WGMMA_CANDIDATES.get(dt, ()) if split_tiles else ():
        out.append((f"v10 wgmma{WGMMA_CONFIG[dt]} + dq_wgmma{tiles}",
                    dict(version="v10", deterministic=True, dq_config=tiles)))
    for tiles in WGMMA_NONE_CANDIDATES.get(dt, ()) if split_tiles else ():
        out.append((f"v10 wgmma{tiles} + dq_wgmma{DQ_WGMMA_CONFIG[dt]}",
                    dict(version="v10", deterministic=True, wgmma=tiles)))
    for tiles in WGMMA_WS_CANDIDATES.get(dt, ()) if split_tiles else ():
        out.append((f"v13 wgmma_ws{tiles} + dq_wgmma_ws{WGMMA_WS_ROUTE[dt][1]}",
                    dict(version="v13", deterministic=True, wgmma_ws=tiles)))
    for tiles in DQ_WS_CANDIDATES.get(dt, ()) if split_tiles else ():
        out.append((f"v13 wgmma_ws{WGMMA_WS_ROUTE[dt][0]} + dq_wgmma_ws{tiles}",
                    dict(version="v13", deterministic=True, dq_ws=tiles)))
    for wgmma, dq in WINDOW_SPLIT_CANDIDATES.get(dt, ()) if split_tiles else ():
        out.append((f"v10 wgmma{wgmma} + dq_wgmma{dq}", dict(version="v10", deterministic=True, wgmma=wgmma,
                                                               dq_config=dq)))
    for tiles in DQ_CANDIDATES_V2.get(dt, ()):
        out.append((f"v3 dq{tiles}", dict(version="v3", deterministic=True, dq_config=tiles)))
    for tiles in FUSED_CANDIDATES.get(dt, ()):
        eager = len(tiles) > 6 and tiles[6]  # ordered release timing: no atomic variant
        for deterministic in (True,) if eager else (True, False):
            out.append((f"v4 fused{tiles} {'ordered' if deterministic else 'atomic'} dq",
                        dict(version="v4", deterministic=deterministic, fused=tiles)))
    return out


def _describe(row: BackwardKernels) -> str:
    text = f"{row.dkdv}{row.dkdv_tiles} {row.dq_add} dq"
    return text + (f" + {row.dq}{row.dq_tiles}" if row.dq else "")


def candidate_specializations() -> list:
    """The candidates' specializations, bf16 only (``python -m cupyflash compile-check`` reports
    their spills when given them)."""
    from cupyflash.backward_plans import dq_wgmma_spec, dq_wgmma_ws_spec, fused_spec, wgmma_spec, wgmma_ws_spec

    return ([fused_spec("bfloat16", dt, causal, dq_add, config)
             for dt, configs in FUSED_CANDIDATES.items() for config in configs
             for causal in (False, True) for dq_add in ("ordered", "atomic")] +
            [dq_wgmma_spec("bfloat16", dt, causal, config)
             for dt, configs in DQ_WGMMA_CANDIDATES.items() for config in configs for causal in (False, True)] +
            [wgmma_spec("bfloat16", dt, causal, "none", config)
             for dt, configs in WGMMA_NONE_CANDIDATES.items() for config in configs for causal in (False, True)] +
            [wgmma_ws_spec("bfloat16", dt, causal, config)
             for dt, configs in WGMMA_WS_CANDIDATES.items() for config in configs for causal in (False, True)] +
            [dq_wgmma_ws_spec("bfloat16", dt, causal, config)
             for dt, configs in DQ_WS_CANDIDATES.items() for config in configs for causal in (False, True)] +
            # the window pairs' tiles that no plan row runs (the other half of a pair is shipped)
            [wgmma_spec("bfloat16", dt, mask, "none", tiles)
             for dt, pairs in WINDOW_SPLIT_CANDIDATES.items() for tiles in {w for w, _ in pairs} - {WGMMA_CONFIG[dt]}
             for mask in (NoMask(), Causal(), Local())] +
            [dq_wgmma_spec("bfloat16", dt, mask, tiles)
             for dt, pairs in WINDOW_SPLIT_CANDIDATES.items() for tiles in {d for _, d in pairs} - {DQ_WGMMA_CONFIG[dt]}
             for mask in (NoMask(), Causal(), Local())])


if __name__ == "__main__":
    for version in VERSIONS:
        shipped = f" [shipped: {version.shipped}]" if version.shipped else ""
        print(f"{version.name}: {version.note}{shipped}\n    {PERF_LOG}#{version.perf_log}")
    for name, (note, anchor) in REJECTED.items():
        print(f"{name} (rejected): {note}\n    {PERF_LOG}#{anchor}")
    count = sum(map(len, (*FUSED_CANDIDATES.values(), *DQ_CANDIDATES_V2.values(), *DQ_WGMMA_CANDIDATES.values(),
                          *WGMMA_NONE_CANDIDATES.values(), *WGMMA_WS_CANDIDATES.values(), *DQ_WS_CANDIDATES.values(),
                          *WINDOW_SPLIT_CANDIDATES.values())))
    print(f"candidates: {count}\n    {PERF_LOG}#{CANDIDATES_PERF_LOG}")

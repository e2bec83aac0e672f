"""Backward plans: which kernels a backward call launches, in which order, with which tiles and
under which specialization names.

``plan_backward(arch, dtype, headdim, mask, smem_optin, deterministic)`` is, like
``cupyflash.plans.plan_forward``, a pure function of the problem and the device's two numbers that
matter: it makes no CUDA call. What runs on sm_90 at d128 with ``deterministic=True`` is the row
``(SM90, 128, True)`` of ``BACKWARD_KERNELS``. ``deterministic`` is read here once and becomes the
plan's ``dq_add`` (``DQ_ADDS``: how dQ is formed), the one encoding the launcher and the kernels'
specializations see from then on.

This module also holds the tile tables and specialization builders of the tensor-core backward
kernels, each in ``kernels_cu/<kernel>.cu``: ``flash_bwd_dkdv_mma*``, ``flash_bwd_dq_mma*``,
``flash_bwd_dq_convert``, ``flash_bwd_fused_mma``, ``flash_bwd_wgmma``, ``flash_bwd_wgmma_dsplit``,
``flash_bwd_dq_wgmma``; ``kernels/mma_bwd.py`` launches a plan and keeps no tables. The versions that led here (v1-v10) and the tuner's candidates are in the
repository's ``dev/mma_bwd.py``, with their numbers in docs/perf-log.md.

Tile sizes, per head-dim tile D_TILE (64, 128 or 256, the smallest that holds the head dim).
Registers per thread are what limit them (255 at most, and no spills):

* dK/dV: a warp owns 16 key rows and DW = D_TILE / WARPS_D columns of dK and dV, that is
  DW fp32 accumulator registers per thread, plus M_SUB for the S^T and dP^T of one sub-block of
  M_SUB query columns. D_TILE = 128: 128 + 32 (M_SUB = 64 spills). D_TILE = 256 needs
  WARPS_D = 2 (two warps per key-row group, partial S^T and dP^T swapped through shared memory).
  BLOCK_M, the query rows per pipeline stage (and the dS block of the atomic dQ), may exceed
  M_SUB: the CTA then walks a query block in BLOCK_M / M_SUB steps between two barriers.
* dQ: a warp owns 16 query rows: D_TILE / 2 accumulator registers plus BLOCK_N for S and dP.

Shared memory (bytes; mirrored by DkdvSmem / DqSmem in mma_bwd_layouts.cuh): K, V of the key block,
two stages of Q, dO (and lse, D) per query block, the 16-bit dS^T block (atomic dQ) and the
partial-sum exchange (WARPS_D = 2). The mma.sync rows fit sm_80's 163 KiB (the largest, the atomic
head-dim-256 dK/dV kernel, takes 148.5 KiB); GPUs with 99 KiB per block (sm_86, sm_89) can run
only head-dim tile 64 (the launch refuses the others with the bytes they need). The wgmma kernels
take up to 218 KiB (sm_90 only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from ._dtypes import dtype_name, is_16bit, is_float64
from .kernels import dq_fixed
from .kernels._module import Specialization
from .kernels.constants import CTYPES, DMMA_D_TILES, SHORT_NAMES, SIXTEEN_BIT, TENSOR_CORE_D_TILES
from .kernels.constants import d_tile as _d_tile
from .masks import Local, Mask, as_mask
from .plans import (SIMT_D_TILES, image_blocks, mma_headdim, simt_specialization, simt_tiles, with_fast_modifiers,
                    without_spills)
from .precision import PRODUCTS, check_precision

__all__ = ["BackwardPlan", "BackwardKernels", "BACKWARD_KERNELS", "DQ_ADDS", "STATISTICS", "plan_backward",
           "DmmaBwdConfig", "DMMA_BACKWARD_TILES", "dmma_backward_plan", "dmma_spec", "backward_family",
           "check_statistics", "own_forward_statistics", "backward_plan", "Tf32WgmmaBwdConfig",
           "TF32_WGMMA_BACKWARD_CONFIGS", "TF32_WGMMA_BACKWARD_ROUTE", "tf32_wgmma_backward_plan", "tf32_wgmma_route",
           "backward_device_class", "SM90", "MMA_SYNC"]

D_TILES = TENSOR_CORE_D_TILES
CONVERT_THREADS = 256


def d_tile(headdim: int) -> int:
    return _d_tile(headdim, D_TILES)


def supports(dtype, headdim: int) -> bool:
    """Whether the tensor-core backward runs ``dtype`` at exactly ``headdim``: fp16/bf16 with headdim
    a multiple of 8 in [8, 256] (the dispatcher checks strides), float64 (DMMA) and float32 (the same
    kernels on tf32x3) up to 128."""
    try:
        name = dtype_name(dtype)
    except ValueError:
        return False
    if headdim % 8 or headdim < 8:
        return False
    if name in ("float32", "float64"):
        return headdim <= DMMA_D_TILES[-1]
    return name in SIXTEEN_BIT and headdim <= D_TILES[-1]


def backward_family(dtype, headdim: int) -> str:
    """The family a backward call runs on a GPU unless the caller asks for one: tensor cores for
    float16 / bfloat16, and for float32 and float64 up to d128 (the head dim padded to a multiple of
    8), SIMT for float32 and float64 past it."""
    return "mma" if supports(dtype, mma_headdim(headdim)) else "simt"


# --- tiles of each kernel ---------------------------------------------------------------------

# D_TILE -> (BLOCK_M, M_SUB, BLOCK_N, NWARPS, WARPS_D); BLOCK_N = 16 * NWARPS / WARPS_D.
DKDV_CONFIG = {64: (64, 64, 128, 8, 1), 128: (64, 32, 128, 8, 1), 256: (32, 16, 64, 8, 2)}
# D_TILE -> (BLOCK_M, BLOCK_N, NWARPS); BLOCK_M = 16 * NWARPS.
DQ_CONFIG = {64: (64, 64, 4), 128: (128, 64, 8), 256: (64, 32, 4)}

# flash_bwd_dq_mma_v2: D_TILE -> (BLOCK_M, BLOCK_N, NWARPS, ROW_GROUPS); BLOCK_M = 16 * ROW_GROUPS
# * NWARPS. Head dim 256 has no entry: two 16-row dQ accumulators would take 256 registers.
DQ_CONFIG_V2 = {64: (128, 32, 4, 2), 128: (128, 32, 4, 2)}

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

# flash_bwd_wgmma (v6, sm_90a): D_TILE -> (BLOCK_M, BLOCK_N); BLOCK_N / 64 warpgroups, each owning 64
# key rows: 64 x D_TILE dK and dV accumulators (D_TILE / 2 registers each per thread) and 64 x BLOCK_M
# S^T and dP^T (BLOCK_M / 2 each). d128: 128 + 64 with BLOCK_M = 64; d64: 64 + 128 with BLOCK_M = 128.
# d256 would need 256 registers for dK and dV alone: flash_bwd_wgmma_dsplit (64 x 64 blocks) gives
# each of its two warpgroups half of the head dim instead, and S^T to one, dP^T to the other.
WGMMA_CONFIG = {64: (128, 128), 128: (64, 128), 256: (64, 64)}

# How dQ is formed, the one encoding of ``deterministic`` (kernels_cu/dq_add.cuh): float32 adds in any
# order (not deterministic), float32 adds in key-block order, int64 fixed point (exact, so
# reproducible in any order); none: no dQ in the dK/dV kernel, a dQ kernel of its own computes it
# (flash_bwd_dq_mma, flash_bwd_dq_wgmma; deterministic).
DQ_ADDS = ("atomic", "ordered", "fixed", "fixed_panels", "none")
# DQ_ADDS entries that add int64 fixed point (an int64 dq_accum, row scales, dq_fixed's convert).
FIXED_DQ_ADDS = ("fixed", "fixed_panels")
# The head-dim tiles that have a fixed-point wgmma kernel at all (flash_bwd_wgmma; not dsplit).
WGMMA_FIXED_KERNEL_D_TILES = (64, 128)

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


# --- specializations ---------------------------------------------------------------------------

def _mma_sync_dq_add(dq_add: str) -> str:
    """The dQ adds of the mma.sync dK/dV kernels: "atomic" (float32 adds into dq_accum) or "none"
    (dQ by flash_bwd_dq_mma)."""
    if dq_add not in ("atomic", "none"):
        raise ValueError(f"cupyflash: the mma.sync dK/dV kernels add dQ atomic or not at all, not {dq_add!r}")
    return dq_add


def dkdv_smem_bytes(dt: int, block_m: int, m_sub: int, block_n: int, nwarps: int, warps_d: int,
                    dq_add: str) -> int:
    """Mirror of DkdvSmem<...>::BYTES in mma_bwd_layouts.cuh (``dq_add`` "atomic" or "none")."""
    kv = 2 * block_n * dt * 2  # K, V
    qdo = 2 * 2 * block_m * dt * 2  # Q, dO, two stages each
    ds = block_n * block_m * 2 if _mma_sync_dq_add(dq_add) == "atomic" else 0  # dS^T of the atomic adds
    xchg = nwarps * 2 * (m_sub // 8) * 32 * 16 if warps_d > 1 else 0
    stats = 2 * 2 * block_m * 4  # lse, D, two stages each
    return kv + qdo + ds + xchg + stats


def dq_smem_bytes(dt: int, block_m: int, block_n: int) -> int:
    """Mirror of DqSmem<...>::BYTES in mma_bwd_layouts.cuh."""
    return 2 * block_m * dt * 2 + 2 * 2 * block_n * dt * 2



def _flag(x: bool) -> str:
    return "true" if x else "false"



def dkdv_split_smem_bytes(dt: int, block_m: int, m_sub: int, block_n: int, nwarps: int, row_groups: int,
                          dq_add: str) -> int:
    """Mirror of DkdvSplitSmem<...>::BYTES: the v1 layout (WARPS_D = 1) plus two P^T slots per pair."""
    slot = row_groups * (m_sub // 8) * 32 * 16
    return dkdv_smem_bytes(dt, block_m, m_sub, block_n, nwarps, 1, dq_add) + (nwarps // 2) * 2 * slot



def dq_smem_bytes_v2(dt: int, block_m: int, block_n: int) -> int:
    """Mirror of DqSmemV2<...>::BYTES: v1's tiles plus lse and D of the block's rows."""
    return dq_smem_bytes(dt, block_m, block_n) + 2 * block_m * 4



def convert_spec(dtype) -> Specialization:
    name = dtype_name(dtype)
    return Specialization(f"flash_bwd_dq_convert_{SHORT_NAMES[name]}", "flash_bwd_dq_convert.cu",
                          f"cf::flash_bwd_dq_convert<{CTYPES[name]}>", CONVERT_THREADS, 0)



def fused_smem_bytes(dt: int, block_m: int, block_n: int) -> int:
    """Mirror of FusedSmem<...>::BYTES in flash_bwd_fused_mma.cu: K, V; two stages of Q, dO; P^T,
    dS^T; two stages of lse and D."""
    return 2 * block_n * dt * 2 + 2 * 2 * block_m * dt * 2 + 2 * block_n * block_m * 2 + 2 * 2 * block_m * 4


def fused_spec(dtype, headdim: int, causal: Mask | bool, dq_add: str,
               config: tuple | None = None) -> Specialization:
    """flash_bwd_fused_mma with dQ added in key-block order (``dq_add`` "ordered") or unordered
    ("atomic"); ``causal`` the mask policy or a causal flag (the ordered adds take no window)."""
    mask = as_mask(causal)
    if dq_add not in ("ordered", "atomic"):
        raise ValueError(f"cupyflash: the fused kernel adds dQ ordered or atomic, not {dq_add!r}")
    ordered = dq_add == "ordered"
    if isinstance(mask, Local) and ordered:
        raise ValueError("cupyflash: the ordered dQ adds need every key block, so they take no window")
    name = dtype_name(dtype)
    dt = d_tile(headdim)
    bm, bn, wn, wd, dqm, unroll, *extra = tuple(config or FUSED_CONFIG[dt])
    eager = bool(extra and extra[0]) and ordered
    packed = len(extra) > 1 and bool(extra[1])
    spec_name = (f"flash_bwd_fused_mma_{SHORT_NAMES[name]}_hdim{dt}_{mask.name}"
                 f"_bm{bm}_bn{bn}_wn{wn}_wd{wd}_dqm{dqm}_u{unroll}_{'dqordered' if ordered else 'dqatomic'}"
                 f"{'_eager' if eager else ''}{'_p16' if packed else ''}")
    expression = (f"cf::flash_bwd_fused_mma<{CTYPES[name]}, {dt}, {mask.cpp}, {bm}, {bn}, {wn}, {wd}, "
                  f"{dqm}, {unroll}, cf::DqAdd::{dq_add}, {_flag(eager)}, {_flag(packed)}>")
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
    spec_name = f"{kernel}_{SHORT_NAMES[name]}_hdim{dt}_{mask.name}_bm{bm}_bn{bn}_dq{dq_add}"
    expression = f"cf::{kernel}<{CTYPES[name]}, {dt}, {mask.cpp}, {bm}, {bn}, cf::DqAdd::{dq_add}>"
    threads = 256 if dt == 256 else bn // 64 * 128
    return Specialization(spec_name, f"{kernel}.cu", expression, threads, wgmma_smem_bytes(dt, bm, bn, dq_add),
                          arch="90a")


# flash_bwd_wgmma_ws and flash_bwd_dq_wgmma_ws (sm_90a, docs/perf-log.md wgmma-bwd-ws-v0; the d64 / d128
# deterministic rows since v13):
# flash_bwd_wgmma's dK and dV without dQ (DqAdd::none) and flash_bwd_dq_wgmma's dQ, each with a
# producer warpgroup copying the walked blocks into STAGES stages and two consumer warpgroups of 64
# rows, taking turns at the tensor cores when PINGPONG. Tiles (BLOCK_M, BLOCK_N, STAGES, PINGPONG):
# dK/dV's BLOCK_N and dQ's BLOCK_M always 128; head-dim tiles 64 and 128.
WGMMA_WS_D_TILES = (64, 128)


def wgmma_ws_smem_bytes(dt: int, block_m: int, stages: int) -> int:
    """Mirror of BwdWgmmaWsSmem<...>::BYTES in flash_bwd_wgmma_ws.cu (K, V; STAGES stages of Q and
    dO; the dS^T tile; STAGES slots of lse and D; a full and an empty barrier a stage), plus 1024
    bytes to align the base for the 128-byte swizzle."""
    return (2 * 128 * dt * 2 + 2 * stages * block_m * dt * 2 + 128 * block_m * 2 + 2 * stages * block_m * 4
            + 16 * stages + 1024)


def wgmma_ws_spec(dtype, headdim: int, causal: Mask | bool, config: tuple) -> Specialization:
    """flash_bwd_wgmma_ws at ``config`` = (BLOCK_M, BLOCK_N, STAGES, PINGPONG): 384 threads (the
    producer warpgroup and two consumers of 64 keys)."""
    bm, bn, stages, _ = config
    if bn != 128 or bm not in (64, 128) or stages < 2:
        raise ValueError(f"cupyflash: flash_bwd_wgmma_ws takes 128 keys a block, query blocks of 64 or 128 rows "
                         f"and two or more stages: {config!r}")
    return _producer_spec("flash_bwd_wgmma_ws", dtype, headdim, causal, config, bm,
                          lambda dt: wgmma_ws_smem_bytes(dt, bm, stages))


def dq_wgmma_ws_smem_bytes(dt: int, block_n: int, stages: int) -> int:
    """Mirror of DqWgmmaWsSmem<...>::BYTES in flash_bwd_dq_wgmma_ws.cu (Q, dO of 128 rows; STAGES
    stages of K and of V; a full and an empty barrier a stage), plus the 1024 bytes of alignment."""
    return 2 * 128 * dt * 2 + 2 * stages * block_n * dt * 2 + 16 * stages + 1024


def dq_wgmma_ws_spec(dtype, headdim: int, causal: Mask | bool, config: tuple) -> Specialization:
    """flash_bwd_dq_wgmma_ws at ``config`` = (BLOCK_M, BLOCK_N, STAGES, PINGPONG), BLOCK_M always
    128: 384 threads (the producer warpgroup and two consumers of 64 query rows)."""
    bm, bn, stages, _ = config
    if bm != 128 or bn % 16 or bn > 128 or stages < 2:
        raise ValueError(f"cupyflash: flash_bwd_dq_wgmma_ws takes 128 queries a block, key blocks of a multiple of 16 "
                         f"up to 128 and two or more stages: {config!r}")
    return _producer_spec("flash_bwd_dq_wgmma_ws", dtype, headdim, causal, config, bn,
                          lambda dt: dq_wgmma_ws_smem_bytes(dt, bn, stages))


def _producer_spec(kernel: str, dtype, headdim: int, causal: Mask | bool, config: tuple, walked: int,
                   smem_bytes) -> Specialization:
    """The specialization of a producer backward kernel at ``config`` = (BLOCK_M, BLOCK_N, STAGES,
    PINGPONG), whose template takes the walked block's rows (``walked``: dK/dV's BLOCK_M, dQ's
    BLOCK_N), STAGES and PINGPONG; ``smem_bytes(dt)`` its shared memory at head-dim tile dt."""
    mask = as_mask(causal)
    name = dtype_name(dtype)
    dt = d_tile(headdim)
    bm, bn, stages, pingpong = config
    if dt not in WGMMA_WS_D_TILES:
        raise ValueError(f"cupyflash: {kernel} takes head-dim tiles {WGMMA_WS_D_TILES}, not {dt}")
    smem = smem_bytes(dt)
    if smem > 227 * 1024:
        raise ValueError(f"cupyflash: {kernel}'s tiles take {smem} bytes, more than 227 KiB: {config!r}")
    spec_name = (f"{kernel}_{SHORT_NAMES[name]}_hdim{dt}_{mask.name}_bm{bm}_bn{bn}_s{stages}"
                 f"{'_pingpong' if pingpong else ''}")
    expression = f"cf::{kernel}<{CTYPES[name]}, {dt}, {mask.cpp}, {walked}, {stages}, {_flag(pingpong)}>"
    return Specialization(spec_name, f"{kernel}.cu", expression, 384, smem, arch="90a")


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
    spec_name = f"flash_bwd_dq_wgmma_{SHORT_NAMES[name]}_hdim{dt}_{mask.name}_bm{bm}_bn{bn}_k{stages}"
    expression = f"cf::flash_bwd_dq_wgmma<{CTYPES[name]}, {dt}, {mask.cpp}, {bm}, {bn}, {stages}>"
    return Specialization(spec_name, "flash_bwd_dq_wgmma.cu", expression, bm // 64 * 128,
                          dq_wgmma_smem_bytes(dt, bm, bn, stages), arch="90a")



# The mma.sync dK/dV kernels: "v1" flash_bwd_dkdv_mma (DKDV_CONFIG, last entry WARPS_D), "v2"
# flash_bwd_dkdv_mma_v2 (DKDV_CONFIG_V2) and "split" flash_bwd_dkdv_mma_split (DKDV_CONFIG_SPLIT;
# last entry ROW_GROUPS).
DKDV_KERNELS = {"v1": DKDV_CONFIG, "v2": DKDV_CONFIG_V2, "split": DKDV_CONFIG_SPLIT}


def dkdv_spec(dtype, headdim: int, causal: Mask | bool, dq_add: str, kernel: str | None = None,
              tiles: tuple | None = None) -> Specialization:
    """An mma.sync dK/dV kernel (``kernel`` a key of DKDV_KERNELS; None: the one the mma.sync plan
    runs) with dQ added by float32 atomics (``dq_add`` "atomic") or left to a dQ kernel ("none");
    ``causal`` the mask policy (kernels_cu/mask.cuh) or a causal flag."""
    mask = as_mask(causal)
    atomic_dq = _mma_sync_dq_add(dq_add) == "atomic"
    name = dtype_name(dtype)
    dt = d_tile(headdim)
    if kernel is None:
        kernel, tiles = mma_sync_dkdv(dt, dq_add, mask)
    bm, ms, bn, nw, last = tuple(tiles or DKDV_KERNELS[kernel][dt])
    suffix, last_name = {"v1": ("", "wd"), "v2": ("_v2", "rg"), "split": ("_split", "rg")}[kernel]
    spec_name = (f"flash_bwd_dkdv_mma{suffix}_{SHORT_NAMES[name]}_hdim{dt}_{mask.name}"
                 f"_bm{bm}_ms{ms}_bn{bn}_w{nw}_{last_name}{last}{'_dqatomic' if atomic_dq else ''}")
    expression = (f"cf::flash_bwd_dkdv_mma{suffix}<{CTYPES[name]}, {dt}, {mask.cpp}, {bm}, {ms}, {bn}, "
                  f"{nw}, {last}, cf::DqAdd::{dq_add}>")
    if kernel == "split":
        smem = dkdv_split_smem_bytes(dt, bm, ms, bn, nw, last, dq_add)
    else:  # v2 keeps v1's layout with one warp per key-row group
        smem = dkdv_smem_bytes(dt, bm, ms, bn, nw, last if kernel == "v1" else 1, dq_add)
    return Specialization(spec_name, f"flash_bwd_dkdv_mma{suffix}.cu", expression, nw * 32, smem)


def dq_spec(dtype, headdim: int, causal: Mask | bool, config: tuple | None = None) -> Specialization:
    """flash_bwd_dq_mma (a 3-tuple config) or flash_bwd_dq_mma_v2 (a 4-tuple with ROW_GROUPS; None:
    the mma.sync plan's tiles); ``causal`` the mask policy or a causal flag."""
    mask = as_mask(causal)
    name = dtype_name(dtype)
    dt = d_tile(headdim)
    config = tuple(config or mma_sync_dq(dt))
    if len(config) == 4:
        bm, bn, nw, rg = config
        spec_name = f"flash_bwd_dq_mma_v2_{SHORT_NAMES[name]}_hdim{dt}_{mask.name}_bm{bm}_bn{bn}_w{nw}_rg{rg}"
        expression = f"cf::flash_bwd_dq_mma_v2<{CTYPES[name]}, {dt}, {mask.cpp}, {bm}, {bn}, {nw}, {rg}>"
        return Specialization(spec_name, "flash_bwd_dq_mma_v2.cu", expression, nw * 32, dq_smem_bytes_v2(dt, bm, bn))
    bm, bn, nw = config
    spec_name = f"flash_bwd_dq_mma_{SHORT_NAMES[name]}_hdim{dt}_{mask.name}_bm{bm}_bn{bn}_w{nw}"
    expression = f"cf::flash_bwd_dq_mma<{CTYPES[name]}, {dt}, {mask.cpp}, {bm}, {bn}, {nw}>"
    return Specialization(spec_name, "flash_bwd_dq_mma.cu", expression, nw * 32, dq_smem_bytes(dt, bm, bn))


# --- the table --------------------------------------------------------------------------------

class BackwardKernels(NamedTuple):
    """One way to run a tensor-core backward: the dK/dV kernel and its tiles, how dQ is formed
    (``dq_add``, an entry of DQ_ADDS) and, where the dK/dV kernel adds no dQ ("none"), the dQ kernel
    and its tiles. Kernels: "dkdv_mma", "dkdv_mma_v2", "dkdv_mma_split", "fused_mma", "wgmma"
    (flash_bwd_wgmma, or flash_bwd_wgmma_dsplit at head-dim tile 256), "wgmma_ws" (flash_bwd_wgmma_ws,
    dQ "none" only); dQ: "dq_mma" (3 tiles, or flash_bwd_dq_mma_v2 with 4), "dq_wgmma" and
    "dq_wgmma_ws"."""

    dkdv: str
    dkdv_tiles: tuple
    dq_add: str
    dq: str | None = None
    dq_tiles: tuple | None = None
    perf_log: str = ""  # the heading anchor of the docs/perf-log.md entry that chose the row


# Device classes of the backward: sm_90 runs the wgmma kernels; every other device the mma.sync ones.
SM90 = "sm_90"
MMA_SYNC = "mma_sync"
_V10 = "mma-bwd-v10-two-wgmma-kernels-no-dq-adds-the-default-on-sm_90"
_V5 = "mma-bwd-v5-the-backward-default-until-v6-still-the-default-on-sm_80"
_V13 = "wgmma-bwd-ws-route-v13-sm_90s-deterministic-d64--d128-backward-on-the-producer-kernels"
_V14 = "wgmma-bwd-ws-nondet-v14-d128-without-determinism-on-the-producer-pair-too"
_V15 = "wgmma-bwd-ws-nondet-d64-v15-d64-without-determinism-on-the-producer-pair-too"

# (class, head-dim tile, deterministic) -> BackwardKernels in order of preference: a plan takes the
# first whose shared memory fits the device (or the last: its launch then refuses with the bytes it
# needs). sm_90 (perf log mma-bwd-v10): with determinism, dK/dV by the wgmma kernel without dQ and
# dQ by flash_bwd_dq_wgmma (the forward's work split, S and dP recomputed), no adds at all; without,
# float32 atomic adds from the wgmma kernel at d64 and d128 (d128 367 / 363 / 320 / 260 TFLOP/s at
# 16k / 16k causal / 2k / 2k causal against the split's 356 / 358 / 327 / 264, d64 311 / 305 / 268
# / 218 against 303 / 293 / 266 / 217) and the split at d256 (306 / 306 / 277 / 232 against the
# atomic dsplit kernel's 248 / 253 / 216 / 198). Other devices (mma-bwd-v5): with determinism two
# kernels, dK/dV with 2 x 16 key rows per warp (d64) or warp pairs split into a dV and a dK warp
# (d128, d256), dQ with 2 x 16 query rows per warp where registers allow; without, the fused
# kernel (S and dP once per block pair) where it fits, else the dK/dV kernel with atomic dQ.
# sm_90 d64 / d128 with determinism since wgmma-bwd-ws-v0 (v13): the same two kernels' work split
# with a producer warpgroup each (flash_bwd_wgmma_ws, flash_bwd_dq_wgmma_ws), bitwise their results;
# H100, the backward 1.05-1.14x at d128 8k / 16k, 1.08-1.13x at d64 8k. softcap, dropout and user
# modifiers run them too, at d64 on 64-query dK/dV blocks (_without_spills). d128 without determinism
# too: the pair against the atomic row in one run (H100) 1.07x / 1.19x at 8k (non-causal / causal),
# 1.09x / 1.14x at 16k; d64 too (v15): 1.03x / 1.08x at 8k, 1.05x / 1.07x at 16k.
BACKWARD_KERNELS = {
    (SM90, 64, True): (BackwardKernels("wgmma_ws", (128, 128, 3, True), "none", "dq_wgmma_ws", (128, 128, 3, True),
                                       _V13),),
    (SM90, 128, True): (BackwardKernels("wgmma_ws", (64, 128, 3, True), "none", "dq_wgmma_ws", (128, 64, 3, True),
                                        _V13),),
    (SM90, 256, True): (BackwardKernels("wgmma", (64, 64), "none", "dq_wgmma", (128, 32, 2), _V10),),
    (SM90, 64, False): (BackwardKernels("wgmma_ws", (128, 128, 3, True), "none", "dq_wgmma_ws", (128, 128, 3, True),
                                        _V15),),
    (SM90, 128, False): (BackwardKernels("wgmma_ws", (64, 128, 3, True), "none", "dq_wgmma_ws", (128, 64, 3, True),
                                         _V14),),
    (SM90, 256, False): (BackwardKernels("wgmma", (64, 64), "none", "dq_wgmma", (128, 32, 2), _V10),),
    (MMA_SYNC, 64, True): (BackwardKernels("dkdv_mma_v2", (64, 32, 128, 4, 2), "none", "dq_mma", (128, 32, 4, 2), _V5),),
    (MMA_SYNC, 128, True): (BackwardKernels("dkdv_mma_split", (64, 32, 128, 8, 2), "none", "dq_mma", (128, 32, 4, 2),
                                            _V5),),
    (MMA_SYNC, 256, True): (BackwardKernels("dkdv_mma_split", (32, 32, 64, 8, 1), "none", "dq_mma", (64, 32, 4), _V5),),
    (MMA_SYNC, 64, False): (BackwardKernels("dkdv_mma_v2", (64, 32, 128, 4, 2), "atomic", perf_log=_V5),),
    (MMA_SYNC, 128, False): (BackwardKernels("fused_mma", (64, 128, 4, 2, 2, 2, 0, 1), "atomic", perf_log=_V5),
                             BackwardKernels("dkdv_mma", (64, 32, 128, 8, 1), "atomic", perf_log=_V5)),
    (MMA_SYNC, 256, False): (BackwardKernels("fused_mma", (64, 64, 2, 4, 2, 16), "atomic", perf_log=_V5),
                             BackwardKernels("dkdv_mma", (32, 16, 64, 8, 2), "atomic", perf_log=_V5)),
}
# The producer dK/dV kernel's tiles at d64 with softcap, dropout or a user modifier: 64-query blocks,
# as v10's d64 rule (its 128-query blocks spill 28-128 bytes there).
WGMMA_WS_VARIANT_D64 = (64, 128, 3, True)
# Rows a sliding window (the Local band) replaces, deterministic or not (perf log windows-bwd-tiles):
# at sm_90 d128 dK/dV on 64 x 64 blocks without dQ adds and dQ by flash_bwd_dq_wgmma on 64 x 64
# (106 and 97 KiB, two CTAs an SM each), whose blocks walk 64 diagonals past the band where 128-row
# blocks walk 128. H100, median of 30, window (1024, 0) at 8k / 16k: 1.282 / 1.314-1.321 ms against
# the deterministic row's 1.461-1.469 / 1.492-1.506 and the atomic row's 1.477-1.480 / 1.500-1.501.
_WINDOWS_BWD = "windows-bwd-tiles-the-backwards-two-wgmma-kernels-with-64-row-blocks-for-windows--v11-shipped-113-116x-flexattention"
LOCAL_BACKWARD_KERNELS = {
    (SM90, 128): BackwardKernels("wgmma", (64, 64), "none", "dq_wgmma", (64, 64, 2), _WINDOWS_BWD),
}
# A packed (varlen) causal batch runs the dense rows. Until v16 it had a row of its own at sm_90
# d128 (perf log varlen-v3): the window row's 64 x 64 blocks, two CTAs an SM hiding each CTA's
# prologue and epilogue on the short walks of mixed lengths, 0.84 -> 0.93 of dense on an H100
# against the one-role kernels of the time. The producer pair (v13-v15) since outran it: the
# varlen bench's packed causal backward at d128, 335.8 / 335.3 TFLOP/s on that row against
# 370.3 / 369.7 on the pair, alternated twice (1.10x; 0.83 -> 0.91 of one dense sequence of the
# same tokens; perf log varlen-bwd-pair).

# flash_bwd_dkdv_mma_v2 with atomic dQ and a window's left bound needs more than 255 registers
# (ptxas spills 24-36 bytes at sm_80 / sm_90): there flash_bwd_dkdv_mma runs (DKDV_CONFIG's tiles).
_DKDV_KIND = {"dkdv_mma": "v1", "dkdv_mma_v2": "v2", "dkdv_mma_split": "split"}


def mma_sync_dkdv(dt: int, dq_add: str, mask: Mask) -> tuple[str, tuple]:
    """(DKDV_KERNELS key, tiles) of the mma.sync plan's dK/dV kernel with ``dq_add`` at head-dim tile
    ``dt`` (the fused kernel's fallback where dQ is atomic)."""
    row = BACKWARD_KERNELS[(MMA_SYNC, dt, dq_add != "atomic")][-1]
    row = _without_spills(row, as_mask(mask), dt)
    return _DKDV_KIND[row.dkdv], row.dkdv_tiles


def mma_sync_dq(dt: int) -> tuple:
    """The tiles of the mma.sync plan's dQ kernel at head-dim tile ``dt``."""
    return BACKWARD_KERNELS[(MMA_SYNC, dt, True)][0].dq_tiles


def _without_spills(row: BackwardKernels, mask: Mask, dt: int) -> BackwardKernels:
    """The row's kernels, or where they spill registers with this mask and score (ptxas, sm_80 /
    sm_90a) the nearest kernels that do not: the producer dK/dV kernel at d64 with softcap, dropout
    or a user modifier (BLOCK_M 128: 28-128 bytes) query blocks of 64 (WGMMA_WS_VARIANT_D64);
    flash_bwd_dkdv_mma_v2 with the window's left bound and
    atomic dQ, or with softcap's derivative (4-44 bytes), runs v1's flash_bwd_dkdv_mma; the fused
    kernel with ALiBi (8-24 bytes at d128) the atomic dK/dV kernel, v1; flash_bwd_wgmma at d64
    with softcap (BLOCK_M 128: 4-84 bytes) the d128 tiles, BLOCK_M 64, without dQ adds (their
    static layout needs two dQ panels per warpgroup), and dQ by flash_bwd_dq_wgmma.

    User modifiers (cupyflash.modifiers) are routed as softcap and ALiBi together, their derivative
    as softcap's, their per-element reads as ALiBi's, and the dQ kernel at d64 with BLOCK_N 64 (the
    compile check's modifiers, a capped score with a table read and a document mask, spill 88
    bytes at BLOCK_N 128 there): what a modifier costs in registers depends on its code, which
    these rules cannot see (docs/api.md, "User modifiers"). Dropout's Philox words (dropout.cuh)
    are routed as softcap's derivative (v2 spills 24 bytes at d64, the wgmma d64 tile 16-32), and
    flash_bwd_dkdv_mma_split at d128 (64 bytes) runs v1's kernel."""
    score = mask.score
    user = score.user is not None
    if row.dkdv == "wgmma_ws" and dt == 64 and (score.softcap or score.dropout or user):
        return row._replace(dkdv_tiles=WGMMA_WS_VARIANT_D64)
    if row.dkdv == "dkdv_mma_v2" and ((row.dq_add == "atomic" and mask.HAS_LEFT) or score.has_grad or score.dropout):
        return row._replace(dkdv="dkdv_mma", dkdv_tiles=DKDV_CONFIG[dt])
    if row.dkdv == "dkdv_mma_split" and dt == 128 and score.dropout:
        return row._replace(dkdv="dkdv_mma", dkdv_tiles=DKDV_CONFIG[dt])
    if row.dkdv == "fused_mma" and (score.alibi or user):
        return row._replace(dkdv="dkdv_mma", dkdv_tiles=DKDV_CONFIG[dt])
    if row.dkdv == "wgmma" and dt == 64 and (score.softcap or user or score.dropout):
        dq_tiles = (128, 64, 2) if user else DQ_WGMMA_CONFIG[64]
        return row._replace(dkdv_tiles=(64, 128), dq_add="none", dq="dq_wgmma", dq_tiles=dq_tiles)
    return row


# --- the plan ---------------------------------------------------------------------------------

class Launch(NamedTuple):
    """One kernel of a plan: its specialization and what its grid's x dimension counts."""

    role: str  # "preprocess", "stats", "kv_bounds", "preprocess_fixed", "split_q", "dkdv", "split_kv", "dq", "convert"
    spec: Specialization
    per_block: int  # rows (keys for dkdv, kv_bounds, split_kv; queries for dq, split_q), or elements, per block

    def grid(self, batch: int, seqlen_q: int, seqlen_k: int, nheads: int, nheads_kv: int,
             headdim: int, packed=None) -> tuple[int, int, int]:
        """The launch's grid; ``packed`` (kernels.params.PackedBatch): a varlen batch, whose
        tensors are batch 1 of the total rows (the row-wise kernels cover them all) and whose
        attention kernels take a CTA column per sequence, covering its longest one."""
        if self.role == "preprocess":
            return math.ceil(batch * nheads * seqlen_q / self.per_block), 1, 1
        if self.role == "convert":
            return math.ceil(batch * seqlen_q * nheads * (headdim // 8) / self.per_block), 1, 1
        if packed is not None:
            batch, seqlen_q, seqlen_k = packed.sequences, packed.max_seqlen_q, packed.max_seqlen_k
        if self.role in ("dkdv", "kv_bounds", "split_kv"):
            return math.ceil(seqlen_k / self.per_block), nheads_kv, batch
        return math.ceil(seqlen_q / self.per_block), nheads, batch  # dq, stats, preprocess_fixed


@dataclass(frozen=True)
class BackwardPlan:
    """What a backward call launches, in order (``launches``)."""

    family: str  # "mma" or "simt"
    device_class: str  # the BACKWARD_KERNELS class ("simt" for the SIMT family, "explicit": given kernels)
    headdim: int
    d_tile: int
    dq_add: str  # DQ_ADDS: how dQ is formed (the SIMT family's dQ kernel: "none")
    kernels: BackwardKernels | DmmaBwdConfig | None  # the tensor-core row (float64's tiles; None for SIMT)
    launches: tuple[Launch, ...]

    @property
    def deterministic(self) -> bool:
        return self.dq_add != "atomic"

    def spec(self, role: str) -> Specialization | None:
        return next((launch.spec for launch in self.launches if launch.role == role), None)

    def grids(self, batch: int, seqlen_q: int, seqlen_k: int, nheads: int, nheads_kv: int) -> list:
        """[(specialization, grid)] of every launch, in order."""
        return [(launch.spec, launch.grid(batch, seqlen_q, seqlen_k, nheads, nheads_kv, self.headdim))
                for launch in self.launches]


def backward_device_class(arch: str | None) -> str:
    return SM90 if arch == "90" else MMA_SYNC


STATISTICS = ("saved", "recomputed")


def check_statistics(statistics, dtype) -> str:
    """``statistics`` of a backward call, checked: "saved" (the forward's o and lse) or
    "recomputed" (float32 and float64 only)."""
    if statistics not in STATISTICS:
        raise ValueError(f"cupyflash: statistics must be one of {', '.join(map(repr, STATISTICS))}; "
                         f"got {statistics!r}")
    if statistics == "recomputed" and is_16bit(dtype):
        raise ValueError(f"cupyflash: statistics='recomputed' is for float32 and float64 (their own kernels); "
                         f"the {dtype_name(dtype)} backward takes the saved o and lse")
    return statistics


def own_forward_statistics(dtype) -> str:
    """The statistics of a backward whose o and lse come from its own forward call (flash_attn_vjp,
    the torch autograd): "recomputed" where it exists (float32, float64), else "saved"."""
    return "saved" if is_16bit(dtype) else "recomputed"


def plan_backward(arch: str | None, dtype, headdim: int, mask: Mask | bool, smem_optin: int | None,
                  deterministic: bool, family: str | None = None, statistics: str = "saved",
                  tf32_wgmma_layout: bool = True) -> BackwardPlan:
    """The kernels a backward call with this dtype, head dim, mask and ``deterministic`` launches on
    a device of compute capability ``arch`` whose blocks may opt in to ``smem_optin`` bytes (None,
    None: not known). 16-bit dtypes run the tensor-core family at the head dim padded to a multiple
    of 8 (as the dispatcher pads it), and so do float64 up to d128 (the DMMA kernels,
    DMMA_BACKWARD_TILES) and float32 up to d128 (the same kernels on T = float, each product three
    tf32 products of split operands: TF32X3_BACKWARD_CONFIGS); wider float32 and float64, and
    devices before sm_80, the SIMT family. The float32, float64 and SIMT kernels are always
    deterministic. ``family`` ("mma", "simt") overrides that choice (backward_family).

    ``statistics`` says where the row statistics come from: "saved", the forward's lse and
    D = rowsum(dO * O) from its o (flash_bwd_preprocess), or "recomputed" (float32 / float64):
    a statistics kernel (flash_bwd_stats_simt, flash_bwd_stats_dmma) walks each row's keys first and
    forms lse and D = sum_j P_ij dP_ij from the very scores and dP the gradient kernels form, so a
    saturated row cancels exactly as in standard attention (kernels_cu/flash_bwd_stats_simt.cu).

    float32 with statistics "saved" at sm_90 takes TF32_WGMMA_BACKWARD_ROUTE's row where it has one
    for the head-dim tile, unless ``tf32_wgmma_layout`` is False (the arrays' strides or alignment
    do not fit its 16-byte loaders) or a user modifier's code spills there (without_spills)."""
    mask = as_mask(mask)
    family = family or backward_family(dtype, headdim)
    check_statistics(statistics, dtype)
    if family == "simt":
        return _simt_plan(dtype, headdim, mask, statistics)
    if family != "mma":
        raise ValueError(f"cupyflash: unknown backward family {family!r} (known: mma, simt)")
    headdim = mma_headdim(headdim)
    where = backward_device_class(arch)
    if not is_16bit(dtype):
        if not supports(dtype, headdim):
            raise ValueError(f"cupyflash: the {dtype_name(dtype)} tensor-core backward takes head dims up to "
                             f"{DMMA_D_TILES[-1]}, not {headdim}")
        dt = d_tile_dmma(headdim)
        config = DMMA_BACKWARD_TILES[(where, dt)] if is_float64(dtype) else tf32x3_backward_config(headdim)
        route = tf32_wgmma_route(where, dt, mask)
        if (route is not None and not is_float64(dtype) and statistics == "saved" and tf32_wgmma_layout
                and (smem_optin is None or all(tf32_wgmma_smem_bytes(kind, dt, route) <= smem_optin
                                               for kind in ("dkdv", "dq")))):
            planned = tf32_wgmma_backward_plan(headdim, mask, route, statistics, where)
            if mask.score.user is None:
                return planned
            # a user modifier's code in the route's kernels, unless ptxas spills it there
            return without_spills([planned, dmma_backward_plan(headdim, mask, config, statistics, where, dtype)],
                                  arch, lambda p: [launch.spec for launch in p.launches
                                                   if launch.role in ("dkdv", "dq")])
        itemsize = 8 if is_float64(dtype) else 4
        too_large = smem_optin is not None and any(dmma_smem_bytes(kind, dt, config, itemsize) > smem_optin
                                                   for kind in ("dkdv", "dq"))
        if too_large or (arch is not None and int(arch) < 80):
            # float64 d128's dK/dV block of the other archs (99.5 KiB) on sm_86 / sm_89 (99 KiB), and
            # GPUs without DMMA or tf32 mma: the SIMT kernels, as before
            return _simt_plan(dtype, headdim, mask, statistics)
        return dmma_backward_plan(headdim, mask, config, statistics, where, dtype)
    dt = d_tile(headdim)
    candidates = backward_candidates(where, dtype, dt, mask, smem_optin, deterministic)
    row = candidates[0] if len(candidates) == 1 else without_spills(
        candidates, arch, lambda r: [launch.spec for launch in _plan(dtype, headdim, mask, r, where).launches
                                     if launch.role in ("dkdv", "dq")])
    if row.dkdv == "wgmma_ws" or row.dq == "dq_wgmma_ws":  # the producer kernels (FAST_MODS)
        mask = with_fast_modifiers(mask, arch or "90", lambda m: [
            launch.spec for launch in _plan(dtype, headdim, m, row, where).launches
            if launch.role in ("dkdv", "dq")])
    return _plan(dtype, headdim, mask, row, where)


# flash_bwd_dq_mma's tiles for a packed batch with a score at head-dim tile 256, and
# flash_bwd_dq_mma_v2's with a user modifier at 128 (backward_candidates).
PACKED_DQ_D256_TILES = (64, 16, 4)
PACKED_USER_DQ_D128_TILES = (128, 16, 4, 2)


def backward_candidates(where: str, dtype, dt: int, mask: Mask, smem_optin: int | None,
                        deterministic: bool) -> list:
    """The rows plan_backward chooses from, in order: the first of BACKWARD_KERNELS' rows that fits
    ``smem_optin`` (routed by _without_spills), and with user modifiers on sm_90 the mma.sync row
    after it (fewer accumulators per thread than the wgmma kernels: where a modifier's code
    leaves those short of registers, the mma.sync kernels run instead)."""
    # Packed batches on mma.sync take the deterministic row: their atomic-dQ kernels (dkdv_mma_v2
    # at d64, dkdv_mma and the fused kernel at d128) spill 8-24 bytes with the sequence's values
    # in registers (ptxas, sm_80 / sm_90), the dQ-kernel rows do not.
    packed_mma_sync = mask.packed and where == MMA_SYNC
    rows = BACKWARD_KERNELS[(where, dt, bool(deterministic) or packed_mma_sync)]
    if mask.band == "local" and (where, dt) in LOCAL_BACKWARD_KERNELS:
        rows = (LOCAL_BACKWARD_KERNELS[(where, dt)],)
    row = next((r for r in rows if smem_optin is None or _dkdv_spec(dtype, dt, mask, r).smem_bytes <= smem_optin),
               rows[-1])
    row = _without_spills(row, mask, dt)
    if packed_mma_sync and dt == 256 and not mask.score.plain:
        # the d256 dQ kernel with a score and packed: 12 bytes of spills at BLOCK_N 32 (sm_90), none at 16
        row = row._replace(dq_tiles=PACKED_DQ_D256_TILES)
    if packed_mma_sync and dt == 128 and mask.score.user is not None and len(row.dq_tiles or ()) == 4:
        # the d128 dQ kernel with the compile check's user modifiers, packed: 8 bytes of spills at
        # BLOCK_N 32 on sm_80 (255 registers) since the sequence's index is read (the issue order,
        # mask.cuh's cta_sequence), none at 16 (244)
        row = row._replace(dq_tiles=PACKED_USER_DQ_D128_TILES)
    if mask.score.user is None or where != SM90:
        return [row]
    return [row, _without_spills(BACKWARD_KERNELS[(MMA_SYNC, dt, bool(deterministic))][0], mask, dt)]


def candidate_specs(where: str, dtype, headdim: int, mask: Mask, smem_optin: int | None,
                    deterministic: bool) -> list:
    """The dK/dV and dQ specializations of every candidate row (what ``without_spills`` compiles to
    choose: scripts/warm_kernel_cache.py compiles them all at once first)."""
    dt = d_tile(mma_headdim(headdim))
    return [launch.spec for r in backward_candidates(where, dtype, dt, mask, smem_optin, deterministic)
            for launch in _plan(dtype, mma_headdim(headdim), mask, r, where).launches if launch.role in ("dkdv", "dq")]


def backward_plan(dtype, headdim: int, mask: Mask | bool, kernels: BackwardKernels) -> BackwardPlan:
    """The plan that runs ``kernels`` (any BackwardKernels: dev/'s versions and the tuner's, not only
    BACKWARD_KERNELS') at exactly ``headdim``."""
    if not is_16bit(dtype) or not supports(dtype, headdim):
        raise ValueError(f"cupyflash: mma backward does not support dtype {dtype_name(dtype)}, headdim {headdim}")
    return _plan(dtype, headdim, as_mask(mask), kernels, "explicit")


def _plan(dtype, headdim: int, mask: Mask, row: BackwardKernels, where: str) -> BackwardPlan:
    if row.dq_add not in DQ_ADDS:
        raise ValueError(f"cupyflash: unknown dQ add mode {row.dq_add!r} (known: {', '.join(DQ_ADDS)})")
    if (row.dq is None) != (row.dq_add != "none"):
        raise ValueError(f"cupyflash: a dQ kernel runs exactly where the dK/dV kernel adds no dQ: {row!r}")
    dt = d_tile(headdim)
    dkdv = _dkdv_spec(dtype, dt, mask, row)
    if row.dq_add in FIXED_DQ_ADDS:
        launches = [Launch("kv_bounds", dq_fixed.kv_bounds_spec(dtype, dt), dq_fixed.KV_BOUND_ROWS),
                    Launch("preprocess_fixed", dq_fixed.preprocess_spec(dtype, dt), dq_fixed.ROW_THREADS // (dt // 8))]
    else:
        launches = [Launch("preprocess", preprocess_spec(dtype), PREPROCESS_ROWS)]
    launches.append(Launch("dkdv", dkdv, _key_rows(row)))
    if row.dq == "dq_mma":
        launches.append(Launch("dq", dq_spec(dtype, dt, mask, row.dq_tiles), row.dq_tiles[0]))
    elif row.dq == "dq_wgmma":
        launches.append(Launch("dq", dq_wgmma_spec(dtype, dt, mask, row.dq_tiles), row.dq_tiles[0]))
    elif row.dq == "dq_wgmma_ws":
        launches.append(Launch("dq", dq_wgmma_ws_spec(dtype, dt, mask, row.dq_tiles), row.dq_tiles[0]))
    elif row.dq_add in FIXED_DQ_ADDS:
        launches.append(Launch("convert", dq_fixed.convert_spec(dtype), dq_fixed.ROW_THREADS))
    else:
        launches.append(Launch("convert", convert_spec(dtype), CONVERT_THREADS))
    return BackwardPlan("mma", where, headdim, dt, row.dq_add, row, tuple(launches))


def _key_rows(row: BackwardKernels) -> int:
    """Key rows per block of the dK/dV kernel (BLOCK_N)."""
    return row.dkdv_tiles[2] if row.dkdv in _DKDV_KIND else row.dkdv_tiles[1]


def _dkdv_spec(dtype, dt: int, mask: Mask, row: BackwardKernels) -> Specialization:
    if row.dkdv in _DKDV_KIND:
        return dkdv_spec(dtype, dt, mask, row.dq_add, _DKDV_KIND[row.dkdv], row.dkdv_tiles)
    if row.dkdv == "fused_mma":
        return fused_spec(dtype, dt, mask, row.dq_add, row.dkdv_tiles)
    if row.dkdv == "wgmma":
        return wgmma_spec(dtype, dt, mask, row.dq_add, row.dkdv_tiles)
    if row.dkdv == "wgmma_ws":
        if row.dq_add != "none":
            raise ValueError(f"cupyflash: flash_bwd_wgmma_ws forms no dQ (dq_add 'none'): {row!r}")
        return wgmma_ws_spec(dtype, dt, mask, row.dkdv_tiles)
    raise ValueError(f"cupyflash: unknown backward kernel {row.dkdv!r}")


# --- the SIMT family and the row statistic D ---------------------------------------------------

PREPROCESS_ROWS = 4  # rows of D per block of flash_bwd_preprocess (a warp per row)


def preprocess_spec(dtype) -> Specialization:
    """flash_bwd_preprocess (kernels_cu/flash_bwd_preprocess.cu): D = rowsum(dO * O), every family."""
    name = dtype_name(dtype)
    return Specialization(f"flash_bwd_preprocess_{SHORT_NAMES[name]}", "flash_bwd_preprocess.cu",
                          f"cf::flash_bwd_preprocess<{CTYPES[name]}>", 32 * PREPROCESS_ROWS, 0)


def _simt_plan(dtype, headdim: int, mask: Mask, statistics: str) -> BackwardPlan:
    """The SIMT family: D (or, recomputed, lse and D), then dK/dV with one block per BLOCK_N keys
    and dQ with one per BLOCK_M queries, on the forward's tiles."""
    bm, bn, _ = simt_tiles(dtype, headdim)
    first = (Launch("stats", simt_specialization("stats", dtype, headdim, mask), bm) if statistics == "recomputed"
             else Launch("preprocess", preprocess_spec(dtype), PREPROCESS_ROWS))
    launches = (first,
                Launch("dkdv", simt_specialization("dkdv", dtype, headdim, mask), bn),
                Launch("dq", simt_specialization("dq", dtype, headdim, mask), bm))
    return BackwardPlan("simt", "simt", headdim, _d_tile(headdim, SIMT_D_TILES), "none", None, launches)


# --- the float64 backward on the FP64 tensor cores (issue 18) ------------------------------------

class DmmaBwdConfig(NamedTuple):
    """flash_bwd_dkdv_dmma, flash_bwd_dq_dmma and flash_bwd_stats_dmma (kernels_cu/, DMMA .f64):
    the dK/dV kernel's blocks of ``dkdv_warps`` warps of 8 ``dkdv_m_tiles`` keys, stepping over
    ``dkdv_block_m`` queries; the dQ and statistics kernels' blocks of ``dq_warps`` warps of
    8 ``dq_m_tiles`` query rows, stepping over ``dq_block_n`` keys; ``wide`` (sm_90, m-tiles 2): the
    products as m16n8k8, one for four m8n8k4. One product shape for the plan's three kernels: their
    scores must agree to the bit (dmma_bwd_steps.cuh). ``dkdv_pairs`` (wide, m-tiles 2): the dK/dV
    kernel's warps in pairs of one dV and one dK warp over 16 keys (flash_bwd_dkdv_dmma_pairs, a
    candidate for d128)."""

    dkdv_block_m: int
    dkdv_warps: int
    dkdv_m_tiles: int
    dq_block_n: int
    dq_warps: int
    dq_m_tiles: int
    wide: bool = False
    dkdv_pairs: bool = False

    @property
    def dkdv_block_n(self) -> int:
        return 8 * self.dkdv_m_tiles * self.dkdv_warps // (2 if self.dkdv_pairs else 1)

    @property
    def dq_block_m(self) -> int:
        return 8 * self.dq_m_tiles * self.dq_warps


# (device class, head-dim tile) -> tiles (perf log dmma-bwd-v0). Registers: dK and dV take D_TILE
# m_tiles / 2 doubles a thread each (2 registers apiece), so d128 runs 8-key warps (m_tiles 1,
# m8n8k4: 128 registers for both) and the narrower tiles 16-key warps as m16n8k8. Rows are padded to
# D_TILE + 4 doubles. Shared memory on sm_90: 103-104 KiB at d64 (two blocks of 4 warps per SM),
# 199 KiB at d128 (one of 8). Other archs (A100, sm_86 / sm_89): m8n8k4, 69-70 KiB at d64 and
# 99-99.5 KiB at d128 (sm_86 / sm_89's 99 KiB takes d128's dQ kernel, not its dK/dV kernel:
# plan_backward runs the SIMT plan there); measured on the H200 only.
DMMA_BACKWARD_TILES = {
    **{(SM90, dt): DmmaBwdConfig(16, 4, 2, 16, 4, 2, True) for dt in (16, 32, 64)},
    # perf log dmma-bwd-v1: the dK/dV kernel's warps in pairs (one dV, one dK warp per 16 keys,
    # m16n8k8) and the dQ kernel wide over 8 keys a step, 1.20-1.29x dmma-bwd-v0's row (16, 8, 1,
    # 16, 8, 1: 8-key m8n8k4 warps, dev/bench_dmma_bwd.py's "v0_d128")
    (SM90, 128): DmmaBwdConfig(16, 8, 2, 8, 4, 2, True, True),
    **{(MMA_SYNC, dt): DmmaBwdConfig(16, 2, 2, 16, 2, 2) for dt in (16, 32, 64)},
    (MMA_SYNC, 128): DmmaBwdConfig(8, 4, 1, 8, 4, 1),
}



def d_tile_dmma(headdim: int) -> int:
    return _d_tile(headdim, DMMA_D_TILES)


def dmma_smem_bytes(kind: str, dt: int, config: DmmaBwdConfig, itemsize: int = 8) -> int:
    """Shared memory of one block (mirrors the kernels' SMEM_BYTES): rows of dt + 4 elements of
    ``itemsize`` bytes (8: float64; 4: the float32 experiment). dK/dV: K and V, then two stages of
    Q, dO and four row statistics; dQ and statistics: Q and dO, then two stages of K and V."""
    ld = dt + 4
    if kind == "dkdv":
        # the pairs' kernel: the P entries each dV warp hands its partner, per lane
        handed = config.dkdv_warps // 2 * (config.dkdv_block_m // 8 * 4) * 32 if config.dkdv_pairs else 0
        return itemsize * (2 * config.dkdv_block_n * ld + 2 * (2 * config.dkdv_block_m * ld + 4 * config.dkdv_block_m)
                           + handed)
    return itemsize * (2 * config.dq_block_m * ld + 4 * config.dq_block_n * ld)


def dmma_spec(kind: str, dt: int, mask: Mask, config: DmmaBwdConfig, dtype="float64") -> Specialization:
    """The specialization of flash_bwd_{kind}_dmma (``kind`` "dkdv", "dq" or "stats"); ``dtype``
    float32: the experiment of its template on float, each product three tf32 products of split
    operands ("tf32x3" in names; two m-tiles, not wide, no pairs)."""
    fn = f"flash_bwd_{kind}_dmma"
    if dtype_name(dtype) == "float32":
        if config.wide or config.dkdv_pairs or (config.dkdv_m_tiles, config.dq_m_tiles) != (2, 2):
            raise ValueError(f"cupyflash: the float32 experiment takes m16n8k8 .tf32 of two m-tiles: {config!r}")
        bm, bn, warps, step = ((config.dkdv_block_m, config.dkdv_block_n, config.dkdv_warps, config.dkdv_block_m)
                               if kind == "dkdv" else
                               (config.dq_block_m, config.dq_block_n, config.dq_warps, config.dq_block_n))
        return Specialization(f"{fn}_{SHORT_NAMES['float32']}_hdim{dt}_{mask.name}_bm{bm}_bn{bn}_w{warps}_tf32x3",
                              f"{fn}.cu", f"cf::{fn}<{dt}, {mask.cpp}, {step}, {warps}, 2, false, float>", 32 * warps,
                              dmma_smem_bytes(kind, dt, config, 4))
    if kind == "dkdv":
        bm, bn, warps, m_tiles, step = (config.dkdv_block_m, config.dkdv_block_n, config.dkdv_warps,
                                        config.dkdv_m_tiles, config.dkdv_block_m)
    elif kind in ("dq", "stats"):
        bm, bn, warps, m_tiles, step = (config.dq_block_m, config.dq_block_n, config.dq_warps, config.dq_m_tiles,
                                        config.dq_block_n)
    else:
        raise ValueError(f"cupyflash: no DMMA backward kernel {kind!r} (known: dkdv, dq, stats)")
    wide = "true" if config.wide else "false"
    if kind == "dkdv" and config.dkdv_pairs:
        if not (config.wide and m_tiles == 2 and warps % 2 == 0):
            raise ValueError(f"cupyflash: the dK/dV warp pairs are wide, of two m-tiles and an even warp count: {config!r}")
        fn = "flash_bwd_dkdv_dmma_pairs"
        return Specialization(f"{fn}_{SHORT_NAMES['float64']}_hdim{dt}_{mask.name}_bm{bm}_bn{bn}_w{warps}", f"{fn}.cu",
                              f"cf::{fn}<{dt}, {mask.cpp}, {step}, {warps}>", 32 * warps,
                              dmma_smem_bytes(kind, dt, config), arch="90")
    return Specialization(f"{fn}_{SHORT_NAMES['float64']}_hdim{dt}_{mask.name}_bm{bm}_bn{bn}_w{warps}_mt{m_tiles}"
                          f"{'_wide' if config.wide else ''}", f"{fn}.cu",
                          f"cf::{fn}<{dt}, {mask.cpp}, {step}, {warps}, {m_tiles}, {wide}>", 32 * warps,
                          dmma_smem_bytes(kind, dt, config), arch="90" if config.wide else "")


def dmma_backward_plan(headdim: int, mask: Mask | bool, config: DmmaBwdConfig, statistics: str = "saved",
                       where: str = "explicit", dtype="float64") -> BackwardPlan:
    """The float64 backward on the FP64 tensor cores with ``config``'s tiles (DMMA_BACKWARD_TILES'
    or the bench's): D (or, recomputed, the row statistics by flash_bwd_stats_dmma), then dK/dV,
    then dQ; deterministic, no atomics."""
    mask = as_mask(mask)
    check_statistics(statistics, dtype)
    dt = d_tile_dmma(headdim)
    first = (Launch("stats", dmma_spec("stats", dt, mask, config, dtype), config.dq_block_m) if statistics == "recomputed"
             else Launch("preprocess", preprocess_spec(dtype), PREPROCESS_ROWS))
    launches = (first,
                Launch("dkdv", dmma_spec("dkdv", dt, mask, config, dtype), config.dkdv_block_n),
                Launch("dq", dmma_spec("dq", dt, mask, config, dtype), config.dq_block_m))
    return BackwardPlan("mma", where, headdim, dt, "none", config, launches)


# float32 on the same kernels (perf log tf32-bwd-v0; the plan's rows since tf32x3-route): every
# device class, sm_80 and newer.
# d128's dK/dV kernel steps over 8 queries: at 16, dK and dV (128 registers) beside S^T, dP^T and
# the split fragments spill 24-88 bytes at sm_80 and with a user modifier at sm_90.
# The d64 tiles serve d16 and d32 too (as the float64 rows do); the compile check builds d64 and d128.
TF32X3_BACKWARD_CONFIGS = {64: DmmaBwdConfig(16, 4, 2, 16, 4, 2), 128: DmmaBwdConfig(8, 4, 2, 16, 4, 2)}


def tf32x3_backward_config(headdim: int) -> DmmaBwdConfig:
    """float32's tf32x3 tiles at ``headdim`` (its DMMA head-dim tile's)."""
    return TF32X3_BACKWARD_CONFIGS[64 if d_tile_dmma(headdim) <= 64 else 128]


@dataclass(frozen=True)
class Tf32WgmmaBwdConfig:
    """The float32 backward's wgmma candidates (wgmma .tf32, sm_90a; perf log tf32-wgmma-bwd-v0),
    "ieee" (three tf32 products a product). flash_bwd_dkdv_tf32_wgmma
    (``kernels_cu/flash_bwd_dkdv_tf32_wgmma.cu``): dK and dV on one warpgroup of 64 keys, stepping
    over ``block_m`` queries (32 or 64); ``raw_stages`` > 0: the raw Q and dO rows of that many
    query blocks ahead copied by cp.async (0: read from global memory by the split).
    flash_bwd_dq_tf32_wgmma (``flash_bwd_dq_tf32_wgmma.cu``): dQ on one warpgroup of 64 queries,
    stepping over ``dq_block_n`` keys (32 or 64; 0: dQ on the tf32x3 experiment's mma.sync kernel),
    its raw K and V ``dq_raw_stages`` blocks ahead. ``fused_dq``: dQ in the dK/dV kernel instead,
    dQ^T = K^T dS^T added by float32 atomics (FA2's form: S, dP and dS formed once; not bitwise
    reproducible; d64 tile only). ``sums_apart`` (all): the rows-times-rows
    products' small products and hi hi chains summed apart, and each block's accumulator-times-tile
    products in fresh accumulators, for accuracy. ``precision``: "ieee" (three tf32 products a
    product), or "tf32" (one, the operands rounded to tf32; chained sums only; the tf32x3 dQ
    kernel is "ieee" whatever it says). The recomputed statistics run on the tf32x3
    experiment's kernel, whose S is not these kernels' to the bit: a saturated (one-hot) row does
    not cancel exactly in dK / dV, nor in dQ unless dq_block_n is 0. ``producer``
    (flash_bwd_dkdv_tf32_wgmma_ws, perf log tf32-wgmma-bwd-v1): dK / dV by two warpgroups, a
    producer splitting each query block into one of ``stages`` stages (raw_stages >= 1 ahead) while
    the consumer computes on the other; not with fused_dq. ``dq_producer``
    (flash_bwd_dq_tf32_wgmma_ws, perf log tf32-wgmma-dq-ws): dQ the same way, a producer splitting
    each key block (K, K^T, V) into one of ``dq_stages`` stages (dq_raw_stages >= 1 ahead) for a
    consumer of the 64 query rows (``dq_consumers`` 2: two consumers taking turns at the key
    blocks, their dQ added at the end). ``dq_presplit`` (with dq_producer and dq_raw_stages 0; perf
    log tf32-split-once): each key block split once for the grid by flash_bwd_split_kv_tf32 into a
    workspace (kv_split_bytes), the dQ producer one thread copying it into the stages by bulk copies.
    ``presplit`` (with producer and raw_stages 0; perf log tf32-split-once-dkdv): the same for the
    dK/dV kernel's query blocks, Q and dO split once with their statistics by flash_bwd_split_q_tf32
    (q_split_bytes). ``pair`` (flash_bwd_dkdv_tf32_wgmma_pair, perf log tf32-wgmma-bwd-pair; the d128
    tile, block_m 32, raw_stages 0, dq_block_n 0): dK / dV by two warpgroups that form S^T and dP^T
    one each (A = K or V from their raw rows, split a k-step at a time), trade them, and each sum
    dK and dV over one half of the head dim. ``dq_pair`` (flash_bwd_dq_tf32_wgmma_pair; the d128 tile,
    dq_block_n 32, dq_raw_stages 0 or 1): dQ the same way, S and dP one each (A = Q or dO from their
    raw rows), traded, dQ summed by head-dim half.
    Candidates, in no plan (but the route's row):
    ``dmma.backward(config=...)`` on float32 arrays,
    head dims up to 64 and multiples of 4, and with ``pair`` up to 128 (at d128 the other forms'
    K, V and a query block's four tile pairs, hi and lo, take 256 KiB of shared memory at 32 queries
    a block)."""

    block_m: int = 32
    raw_stages: int = 2
    sums_apart: bool = True
    dq_block_n: int = 32
    dq_raw_stages: int = 2
    fused_dq: bool = False
    precision: str = "ieee"
    producer: bool = False
    stages: int = 2
    dq_producer: bool = False
    dq_stages: int = 2
    dq_consumers: int = 1
    dq_presplit: bool = False
    presplit: bool = False
    pair: bool = False
    dq_pair: bool = False
    prefetch: bool = False  # the pair's dK/dV kernel: the next query block's rows into L1 (tf32-pair-prefetch)

    threads = 128
    block_n = 64
    dq_block_m = 64


# The candidates the compile check builds for every mask, at their one head-dim tile (head dims up
# to 64; at d32 the 64-query blocks, the tile the transposed split deals to four warps there, spill
# 48-108 bytes with a window or dropout): the single warpgroup's, the producer dK/dV form's with the
# one-warpgroup dQ (the route's row of the tenth session), with dQ by a producer too (the route's
# row now, tf32-wgmma-dq-ws), that producer copying key blocks split once (tf32-split-once), and both
# producers copying blocks split once (tf32-split-once-dkdv).
TF32_WGMMA_BACKWARD_CONFIGS = {64: (Tf32WgmmaBwdConfig(), Tf32WgmmaBwdConfig(32, 1, producer=True),
                                    Tf32WgmmaBwdConfig(32, 1, producer=True, dq_raw_stages=1, dq_producer=True),
                                    Tf32WgmmaBwdConfig(32, 1, producer=True, dq_raw_stages=0, dq_producer=True,
                                                       dq_presplit=True),
                                    Tf32WgmmaBwdConfig(32, 0, producer=True, presplit=True, dq_raw_stages=0,
                                                       dq_producer=True, dq_presplit=True))}
# d128: the pair's dK/dV kernel (Tf32WgmmaBwdConfig(pair=True)) beside the tf32x3 experiment's dQ or
# the pair's dQ kernel (dq_pair=True) (perf log tf32-wgmma-bwd-pair), candidates of the bench and the
# GPU tests only (the dK/dV kernel's causal dropout form spills, ptxas at sm_90a: the compile
# check's every-mask list is for candidates that do not).
TF32_WGMMA_D_TILES = (64, 128)

# float32's backward with statistics "saved" at sm_90, head-dim tile 64 (head dims 40-64): dK / dV and
# dQ each by a producer warpgroup's kernel, sums apart (perf log tf32-wgmma-bwd-route: 1.39-1.57x
# the tf32x3 row at d64, the same error to the SIMT backward; tf32-wgmma-dq-ws: dQ's producer
# 1.13-1.16x the one-warpgroup dQ kernel, the backward 1.05x; a second dQ consumer gained nothing).
# tf32-split-once: the key blocks split once for the grid by flash_bwd_split_kv_tf32, the dQ producer
# one thread's bulk copies, and now a second dQ consumer pays (dQ 1.41-1.56x the route before, the
# backward 1.05-1.14x on an H100). tf32-split-once-dkdv: the query blocks split once too by
# flash_bwd_split_q_tf32, the dK/dV producer one thread's bulk copies (dK/dV 1.15-1.54x, the
# backward 0.99-1.26x the split-once dQ alone, 1k-4k on an H100: the gain is the full mask's).
# "recomputed" stays on tf32x3, whose statistics kernel forms S as its gradient kernels do (a
# saturated row cancels to the bit there, not here); so does a user modifier whose code spills in
# these kernels (ptxas asked, as for the 16-bit rows).
TF32_WGMMA_BACKWARD_ROUTE = {(SM90, 64): Tf32WgmmaBwdConfig(32, 0, producer=True, presplit=True, dq_raw_stages=0,
                                                            dq_producer=True, dq_consumers=2, dq_presplit=True),
                             # the d128 tile on the pair's kernels (perf log tf32-wgmma-bwd-pair)
                             (SM90, 128): Tf32WgmmaBwdConfig(32, 0, dq_raw_stages=1, pair=True, dq_pair=True)}


def tf32_wgmma_route(where: str, dt: int, mask: Mask) -> Tf32WgmmaBwdConfig | None:
    """TF32_WGMMA_BACKWARD_ROUTE's row for ``mask`` (None where the table has none): with two dQ
    consumers, one where dropout's keep bits are formed, which spill there (124 bytes, ptxas at
    sm_90a: flash_bwd_dq_tf32_wgmma_ws's second consumer holds its own dQ rows beside them)."""
    route = TF32_WGMMA_BACKWARD_ROUTE.get((where, dt))
    if route is not None and route.dq_consumers == 2 and mask.score.dropout:
        route = replace(route, dq_consumers=1)
    if route is not None and route.pair and mask.score.dropout:
        return None  # tf32x3 until the pairs' dropout kernels have run on a GPU (perf log tf32-pair-dropout)
    return route


def tf32_wgmma_smem_bytes(kind: str, dt: int, config: Tf32WgmmaBwdConfig) -> int:
    """The shared memory of flash_bwd_{kind}_tf32_wgmma, plus the 1024 bytes that align its base.
    "dkdv" mirrors BwdTf32WgmmaSmem<...>::BYTES: K and V (64 rows) and the query block's Q, dO,
    Q^T and dO^T, each a hi and a lo tile of float32 words (fused_dq: K^T and dS too), the raw
    stages of Q and dO, and raw_stages + 1 slots of four row statistics. "dq" mirrors DqTf32WgmmaSmem<...>::BYTES: Q and
    dO (64 rows), K, V and K^T (dq_block_n rows or slots), hi and lo, and the raw stages of K and V.
    "dkdv" with ``pair`` mirrors BwdTf32PairSmem: K and V raw, the query block's tiles and
    statistics, and the trade of two warpgroups' block_m / 2 values a thread; "dq" with ``dq_pair``
    DqTf32PairSmem: Q and dO raw, the key block's tiles, the raw stages of K and V, and the trade
    of dq_block_n / 2 values a thread."""
    if kind == "dq" and config.dq_pair:  # DqTf32PairSmem: Q, dO raw; one stage; raw K, V; the trade
        stage = -(-(6 * 4 * config.dq_block_n * dt) // 1024) * 1024
        return (2 * 4 * 64 * dt + stage + config.dq_raw_stages * 2 * 4 * config.dq_block_n * dt
                + 2 * 4 * (config.dq_block_n // 2) * 128 + 1024)
    if kind == "dkdv" and config.pair:  # BwdTf32PairSmem: K, V raw; one stage; the trade
        stage = -(-(8 * 4 * config.block_m * dt + 4 * config.block_m * 4) // 1024) * 1024
        return 2 * 4 * 64 * dt + stage + 3 * 4 * (config.block_m // 2) * 128 + 1024
    if kind == "dkdv" and config.producer:  # BwdTf32WgmmaWsSmem: K, V; stages (tiles, statistics); raw; barriers
        q_tile = 4 * config.block_m * dt
        stage = -(-(8 * q_tile + 4 * config.block_m * 4) // 1024) * 1024
        return 4 * 4 * 64 * dt + config.stages * stage + config.raw_stages * 2 * q_tile + 16 * config.stages + 1024
    if kind == "dkdv":  # fused_dq: K^T and dS, hi and lo, after the tiles
        q_tile = 4 * config.block_m * dt
        return (4 * 4 * 64 * dt + 8 * q_tile + config.raw_stages * 2 * q_tile
                + (config.raw_stages + 1) * 4 * config.block_m * 4
                + (2 * 4 * 64 * dt + 2 * 4 * config.block_m * 64 if config.fused_dq else 0) + 1024)
    kv_tile = 4 * config.dq_block_n * dt
    if config.dq_producer:  # DqTf32WgmmaWsSmem: Q, dO; stages (K, K^T, V); raw; barriers
        stage = -(-(6 * kv_tile) // 1024) * 1024
        return 4 * 4 * 64 * dt + config.dq_stages * stage + config.dq_raw_stages * 2 * kv_tile + 16 * config.dq_stages + 1024
    return 4 * 4 * 64 * dt + 6 * kv_tile + config.dq_raw_stages * 2 * kv_tile + 1024


def tf32_wgmma_spec(kind: str, dt: int, mask: Mask, config: Tf32WgmmaBwdConfig) -> Specialization:
    """The specialization of flash_bwd_{kind}_tf32_wgmma (``kind`` "dkdv" or "dq"; _ws, the producer
    forms; _pair at the d128 tile, with ``pair`` / ``dq_pair``) at head-dim tile ``dt``
    (TF32_WGMMA_D_TILES): its blocks of 64 keys stepping over block_m queries, or of 64 queries
    stepping over dq_block_n keys."""
    if kind not in ("dkdv", "dq"):
        raise ValueError(f"cupyflash: no tf32 wgmma backward kernel {kind!r} (known: dkdv, dq)")
    if dt not in TF32_WGMMA_D_TILES:
        raise ValueError(f"cupyflash: the tf32 wgmma backward takes head-dim tiles {TF32_WGMMA_D_TILES}, not {dt}")
    bm, bn, raw, step = ((config.block_m, 64, config.raw_stages, config.block_m) if kind == "dkdv" else
                         (64, config.dq_block_n, config.dq_raw_stages, config.dq_block_n))
    if step not in (32, 64) or raw < 0:
        raise ValueError(f"cupyflash: flash_bwd_{kind}_tf32_wgmma steps over blocks of 32 or 64 rows: {config!r}")
    if tf32_wgmma_smem_bytes(kind, dt, config) > 227 * 1024:
        raise ValueError(f"cupyflash: flash_bwd_{kind}_tf32_wgmma's tiles take more than 227 KiB: {config!r}")
    fused = kind == "dkdv" and config.fused_dq
    if fused and dt != 64:
        raise ValueError(f"cupyflash: the fused dQ (dQ^T = K^T dS^T) takes the d64 tile, not {dt}")
    products = PRODUCTS[check_precision(config.precision)]
    if config.sums_apart and products != 3:
        raise ValueError(f"cupyflash: apart sums are the split products' (precision \"ieee\"): {config!r}")
    # the producer forms (flash_bwd_{kind}_tf32_wgmma_ws): STAGES after the tile
    ws = config.producer if kind == "dkdv" else config.dq_producer
    n_stages = config.stages if kind == "dkdv" else config.dq_stages
    presplit = config.presplit if kind == "dkdv" else config.dq_presplit
    if config.dq_presplit and (not config.dq_producer or config.dq_raw_stages != 0):
        raise ValueError(f"cupyflash: dq_presplit is the dQ producer form's, with no raw stages "
                         f"(dq_raw_stages=0): {config!r}")
    if config.presplit and (not config.producer or config.raw_stages != 0):
        raise ValueError(f"cupyflash: presplit is the dK/dV producer form's, with no raw stages "
                         f"(raw_stages=0): {config!r}")
    if ws and (fused or n_stages < 2 or (raw < 1 and not presplit)):
        raise ValueError(f"cupyflash: the producer form takes two or more stages, raw rows one or more blocks "
                         f"ahead, and no fused dQ: {config!r}")
    consumers = config.dq_consumers if kind == "dq" and ws else 1
    if config.dq_consumers not in (1, 2) or (config.dq_consumers == 2 and not config.dq_producer):
        raise ValueError(f"cupyflash: one or two dQ consumers, two only in the producer form: {config!r}")
    if config.pair and (dt != 128 or config.block_m != 32 or config.raw_stages != 0
                        or config.producer or config.presplit or fused):
        raise ValueError(f"cupyflash: the pair dK/dV kernel takes the d128 tile and 32-query blocks read by the "
                         f"split (raw_stages 0): {config!r}")
    if config.prefetch and not config.pair:
        raise ValueError(f"cupyflash: prefetch is the pair dK/dV kernel's: {config!r}")
    if config.dq_pair and (dt != 128 or config.dq_block_n != 32 or config.dq_raw_stages not in (0, 1)
                           or config.dq_producer or config.dq_presplit or config.dq_consumers != 1):
        raise ValueError(f"cupyflash: the pair dQ kernel takes the d128 tile and 32-key blocks, raw K and V up to "
                         f"one block ahead: {config!r}")
    if dt == 128 and not (config.pair if kind == "dkdv" else config.dq_pair):
        raise ValueError(f"cupyflash: at the d128 tile the tf32 wgmma {kind} kernel is the pair's: {config!r}")
    if config.dq_pair and kind == "dq":
        apart = "true" if config.sums_apart else "false"
        tail = "" if products == 3 else f", {products}"
        return Specialization(f"flash_bwd_dq_tf32_wgmma_pair_{SHORT_NAMES['float32']}_hdim{dt}_{mask.name}_bm64_bn{bn}"
                              f"_r{raw}" + ("_apart" if config.sums_apart else "") + ("_tf32" if products == 1 else ""),
                              "flash_bwd_dq_tf32_wgmma_pair.cu",
                              f"cf::flash_bwd_dq_tf32_wgmma_pair<{dt}, {mask.cpp}, {bn}, {raw}, {apart}{tail}>",
                              256, tf32_wgmma_smem_bytes(kind, dt, config), arch="90a")
    if config.pair and kind == "dkdv":
        apart = "true" if config.sums_apart else "false"
        tail = "" if products == 3 else f", {products}"
        if config.prefetch:  # PREFETCH after PRODUCTS; "_pf" in the name
            tail = f", {products}, true"
        return Specialization(f"flash_bwd_dkdv_tf32_wgmma_pair_{SHORT_NAMES['float32']}_hdim{dt}_{mask.name}"
                              f"_bm{bm}_bn64" + ("_pf" if config.prefetch else "") + ("_apart" if config.sums_apart else "")
                              + ("_tf32" if products == 1 else ""),
                              "flash_bwd_dkdv_tf32_wgmma_pair.cu",
                              f"cf::flash_bwd_dkdv_tf32_wgmma_pair<{dt}, {mask.cpp}, {bm}, {apart}{tail}>",
                              256, tf32_wgmma_smem_bytes(kind, dt, config), arch="90a")
    fn = f"flash_bwd_{kind}_tf32_wgmma" + ("_ws" if ws else "")
    stages = (f"_s{n_stages}", f"{n_stages}, ") if ws else ("", "")
    # template arguments after SUMS_APART: (DQ_ATOMIC,) PRODUCTS, each written only when not its default
    tail = ([] if kind == "dq" or ws else ["true" if fused else "false"]) + [str(products)] + (
        [str(consumers)] if kind == "dq" and (consumers > 1 or presplit) else []) + (["true"] if presplit else [])
    while tail and tail[-1] in ("false", "3"):
        tail.pop()
    suffix = (("_apart" if config.sums_apart else "") + ("_dq" if fused else "") + ("_tf32" if products == 1 else "")
              + (f"_c{consumers}" if consumers > 1 else "") + ("_presplit" if presplit else ""))
    return Specialization(f"{fn}_{SHORT_NAMES['float32']}_hdim{dt}_{mask.name}_bm{bm}_bn{bn}{stages[0]}_r{raw}{suffix}",
                          f"{fn}.cu",
                          f"cf::{fn}<{dt}, {mask.cpp}, {step}, {stages[1]}{raw}, "
                          f"{'true' if config.sums_apart else 'false'}{''.join(', ' + t for t in tail)}>",
                          128 * (1 + consumers) if ws else config.threads, tf32_wgmma_smem_bytes(kind, dt, config),
                          arch="90a")


def _split_spec(kernel: str, dt: int, tag: str, rows: int, mask: Mask, config: Tf32WgmmaBwdConfig,
                block_bytes: int) -> Specialization:
    """A split-once kernel (flash_bwd_split_{kv,q}_tf32) at head-dim tile ``dt``, one block of
    ``rows`` rows a CTA of 128 threads (named ``tag`` rows: "bn32", "bm32"): only the mask's packing
    matters (every row of a sequence is split); one product ("tf32") splits no lo tiles."""
    products = PRODUCTS[check_precision(config.precision)]
    return Specialization(f"{kernel}_{SHORT_NAMES['float32']}_hdim{dt}_{tag}{rows}"
                          + ("_packed" if mask.packed else "") + ("_tf32" if products == 1 else ""),
                          f"{kernel}.cu",
                          f"cf::{kernel}<{dt}, {rows}, {'true' if mask.packed else 'false'}"
                          + (f", {products}>" if products != 3 else ">"),
                          128, block_bytes + 1024, arch="90a")


def tf32_split_kv_spec(dt: int, mask: Mask, config: Tf32WgmmaBwdConfig) -> Specialization:
    """flash_bwd_split_kv_tf32 at head-dim tile ``dt``: each key block of dq_block_n keys split once
    into the kv_split image that dq_presplit's producer copies (Tf32KeyBlockTiles: 6 tiles)."""
    return _split_spec("flash_bwd_split_kv_tf32", dt, "bn", config.dq_block_n, mask, config,
                       6 * 4 * config.dq_block_n * dt)


def tf32_split_q_spec(dt: int, mask: Mask, config: Tf32WgmmaBwdConfig) -> Specialization:
    """flash_bwd_split_q_tf32 at head-dim tile ``dt``: each query block of block_m rows split once,
    with its statistics, into the q_split image that presplit's dK/dV producer copies
    (Tf32QueryBlockTiles: 8 tiles and 4 statistics a row)."""
    return _split_spec("flash_bwd_split_q_tf32", dt, "bm", config.block_m, mask, config,
                       8 * 4 * config.block_m * dt + 4 * config.block_m * 4)


def q_split_bytes(dt: int, block_m: int, batch: int, seqlen_q: int, nheads: int, sequences: int | None = None) -> int:
    """The q_split image's bytes (wgmma_tf32_bwd_steps.cuh's q_image_offset): a block of
    Tf32QueryBlockTiles (8 tiles of block_m x dt float32 and 4 x block_m statistics) per image
    block and query head."""
    return image_blocks(block_m, batch, seqlen_q, sequences) * nheads * (8 * 4 * block_m * dt + 4 * block_m * 4)


def kv_split_bytes(dt: int, block_n: int, batch: int, seqlen_k: int, nheads_kv: int, sequences: int | None = None) -> int:
    """The kv_split image's bytes (wgmma_tf32_bwd_steps.cuh's kv_image_offset): a block of
    Tf32KeyBlockTiles (6 tiles of block_n x dt float32) per image block and kv head."""
    return image_blocks(block_n, batch, seqlen_k, sequences) * nheads_kv * 6 * 4 * block_n * dt


def tf32_wgmma_d_tile(headdim: int) -> int:
    if headdim > TF32_WGMMA_D_TILES[-1]:
        raise ValueError(f"cupyflash: the tf32 wgmma backward takes head dims up to {TF32_WGMMA_D_TILES[-1]}, "
                         f"not {headdim}")
    return _d_tile(headdim, TF32_WGMMA_D_TILES)


def tf32_wgmma_backward_plan(headdim: int, mask: Mask | bool, config: Tf32WgmmaBwdConfig,
                             statistics: str = "saved", where: str = "explicit") -> BackwardPlan:
    """The float32 backward with dK / dV on flash_bwd_dkdv_tf32_wgmma(_ws) and dQ on
    flash_bwd_dq_tf32_wgmma(_ws) (``config``; dq_block_n 0: dQ on the tf32x3 experiment's kernel;
    fused_dq: by the dK/dV kernel's float32 atomics, the one plan here that is not deterministic),
    D or the recomputed statistics on the tf32x3 experiment's kernels."""
    mask = as_mask(mask)
    check_statistics(statistics, "float32")
    if config.dq_producer and (config.fused_dq or not config.dq_block_n):
        raise ValueError(f"cupyflash: dq_producer is flash_bwd_dq_tf32_wgmma_ws's, which a fused dQ or dq_block_n 0 "
                         f"does not launch: {config!r}")
    dt = tf32_wgmma_d_tile(headdim)
    experiment, experiment_dt = tf32x3_backward_config(headdim), d_tile_dmma(headdim)
    first = (Launch("stats", dmma_spec("stats", experiment_dt, mask, experiment, "float32"), experiment.dq_block_m)
             if statistics == "recomputed" else Launch("preprocess", preprocess_spec("float32"), PREPROCESS_ROWS))
    dkdv = Launch("dkdv", tf32_wgmma_spec("dkdv", dt, mask, config), config.block_n)
    if config.presplit:  # the query blocks split once (after D or the statistics), before the dK/dV kernel
        first = (first, Launch("split_q", tf32_split_q_spec(dt, mask, config), config.block_m))
    else:
        first = (first,)
    if config.fused_dq:  # dQ by the dK/dV kernel's atomics
        return BackwardPlan("mma", where, headdim, dt, "atomic", config, (*first, dkdv))
    dq = (Launch("dq", tf32_wgmma_spec("dq", dt, mask, config), config.dq_block_m) if config.dq_block_n else
          Launch("dq", dmma_spec("dq", experiment_dt, mask, experiment, "float32"), experiment.dq_block_m))
    if config.dq_presplit:  # the key blocks split once, before the dQ kernel copies them
        split = Launch("split_kv", tf32_split_kv_spec(dt, mask, config), config.dq_block_n)
        return BackwardPlan("mma", where, headdim, dt, "none", config, (*first, dkdv, split, dq))
    return BackwardPlan("mma", where, headdim, dt, "none", config, (*first, dkdv, dq))

"""Tensor-core forward (``kernels_cu/flash_fwd_mma.cu``; on sm_90 ``kernels_cu/flash_fwd_wgmma.cu``,
the same work split on warpgroup MMA, see ``WgmmaFwdConfig``): float16 / bfloat16, head dims 8..256.

FlashAttention-2 work split: a block owns BLOCK_M query rows of one (batch, head), each warp owns
16-row strips of them; K and V tiles stream through a ring of STAGES shared-memory stages filled
by cp.async. Tile configurations by head-dim tile D_TILE (the smallest of 64, 128, 256 that holds
headdim; columns past headdim are zero-filled in shared memory and never stored).

The dispatcher guarantees what the kernel relies on: 16-bit dtype, last dim contiguous, every
other stride of q/k/v/o a multiple of 8 elements, data pointers 16-byte aligned, headdim % 8 == 0
(``forward`` re-checks the layout, which is cheap, because a violation would be silent corruption).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ._module import Specialization, _max_smem_optin, device_arch, launch
from .._dtypes import dtype_name
from ..masks import KINDS, Mask, as_mask, mask_for

D_TILES = (64, 128, 256)
LOG2E = 1.4426950408889634

_CTYPE = {"float16": "cf::half_t", "bfloat16": "cf::bf16_t"}
_SHORT = {"float16": "fp16", "bfloat16": "bf16"}
# FwdConfig.row_state -> the kernel's RowState: where the online softmax keeps a row's running max
# and sum, on all 4 lanes of the row's quad or on one of them (see kernels_cu/flash_fwd_mma.cu).
ROW_STATES = {"one_lane": "cf::RowState::ONE_LANE", "all_lanes": "cf::RowState::ALL_LANES"}


@dataclass(frozen=True)
class FwdConfig:
    block_m: int  # query rows per block
    block_n: int  # key rows per pipeline stage
    warps: int  # each owns block_m / (16 warps) strips of 16 query rows
    q_in_regs: bool  # Q fragments loaded once into registers (else re-read from shared memory)
    stages: int = 2  # K/V shared-memory stages (prefetch distance stages - 1)
    min_blocks: int = 1  # __launch_bounds__ minimum resident blocks per SM (caps registers)
    # "one_lane": m and l of a row on one lane of its quad, loop invariants re-read from shared
    # memory (fewest registers); "all_lanes": on every lane, invariants in registers (fewest
    # instructions per key block)
    row_state: str = "one_lane"

    def __post_init__(self):
        if self.row_state not in ROW_STATES:
            raise ValueError(f"cupyflash: row_state must be one of {sorted(ROW_STATES)}, not {self.row_state!r}")

    @property
    def threads(self) -> int:
        return 32 * self.warps


# Registers per thread are dominated by the fp32 accumulators: O is strips x D_TILE / 2 and S is
# strips x BLOCK_N / 2 per thread (strips = BLOCK_M / (16 warps)). Two strips per warp halve the
# shared-memory reads of K and V per flop, as in FlashAttention-2, but cost registers; every
# configuration the dispatcher can launch compiles without spills for sm_80 and sm_90 (see
# tests/kernels/test_compile_check.py or ``python -m cupyflash compile-check``). D_TILE 128 with
# BLOCK_N = 64 takes all 255 registers: there row_state="one_lane" keeps the running max and sum
# of a row in one lane of its quad and re-reads loop invariants from shared memory to stay clear
# of spills. D_TILE 64 has registers to spare (about 220 of 255 with "all_lanes") and half the mma
# work per key block to hide what "one_lane" adds (7 shuffles, the re-reads): that cost it 7% on
# an H200 (bf16, 16k: 307 -> 285 TFLOP/s), so it uses "all_lanes", and spends the spare registers
# on Q fragments held for the whole block (tuner, bf16 d64 16k: 299.6 -> 324.5 TFLOP/s).
#
# Default configurations per GPU generation. CONFIGS fits every supported GPU (an A100 opts in to
# 163 KiB of shared memory per block and has 164 KiB per SM). Where a block may opt in to
# LARGE_SMEM_BYTES or more (sm_90: 227 KiB per block, 228 KiB per SM), LARGE_SMEM_CONFIGS
# replaces entries: D_TILE 128 with BLOCK_N = 64 (96 KiB, two blocks per SM; on an A100 only one
# would fit) and D_TILE 256 with BLOCK_N = 64 (192 KiB: Q 64 KiB, two stages of K and V 64 KiB
# each). Both halve the barriers and rescales per key of the BLOCK_N = 32 tiles.
CONFIGS = {
    64: FwdConfig(block_m=128, block_n=64, warps=4, q_in_regs=True, min_blocks=2, row_state="all_lanes"),
    128: FwdConfig(block_m=128, block_n=32, warps=4, q_in_regs=False, min_blocks=2),
    256: FwdConfig(block_m=128, block_n=32, warps=8, q_in_regs=False),
}
LARGE_SMEM_BYTES = 193 * 1024  # opt-in per block that admits the tier (H100/H200: 227 KiB, A100: 163 KiB)
LARGE_SMEM_CONFIGS = {
    128: FwdConfig(block_m=128, block_n=64, warps=4, q_in_regs=False, min_blocks=2),
    256: FwdConfig(block_m=128, block_n=64, warps=8, q_in_regs=False),
}


@dataclass(frozen=True)
class WgmmaFwdConfig:
    """flash_fwd_wgmma (``kernels_cu/flash_fwd_wgmma.cu``, sm_90a only): block_m query rows, one
    warpgroup (4 warps) per 64 of them; block_n keys per K/V stage (two K stages, three V)."""

    block_m: int
    block_n: int

    @property
    def threads(self) -> int:
        return self.block_m // 64 * 128


# flash_fwd_wgmma tiles by D_TILE. Registers per thread: O is D_TILE / 2, S is BLOCK_N / 2 and P
# BLOCK_N / 4: d256 keeps BLOCK_N at 64 (O alone is 128). Shared memory: Q, 2 K and 3 V stages.
# Tuner, bf16, TFLOP/s at 16k / 2k, non-causal (docs/perf-log.md, mma-fwd-v6): d64 128x64 372 / 349
# (128x128: 282 at 2k), d128 128x128 503 / 435 (128x64: 458 / 363), d256 128x64 538 / 475.
WGMMA_CONFIGS = {64: WgmmaFwdConfig(128, 64), 128: WgmmaFwdConfig(128, 128), 256: WgmmaFwdConfig(128, 64)}

# The default tables so far, kept launchable (``forward(..., config=...)``) so that the tuner
# (``python -m cupyflash.bench.tune``) times old and new side by side: {version: (note, {D_TILE:
# config on an sm_90 device})}. v5 is CONFIGS with LARGE_SMEM_CONFIGS applied (the default below
# sm_90), v6 the wgmma kernel (the default on sm_90). The mma.sync kernel had no row_state before
# v4: v1 and v2 ran what is now "all_lanes" (and their entries say so), v3 "one_lane".
VERSIONS = {
    "v1": ("128x32 tiles for d128 (no spills); 128x32, 8 warps for d256",
           {64: FwdConfig(128, 64, 4, False, min_blocks=2, row_state="all_lanes"),
            128: FwdConfig(128, 32, 4, False, min_blocks=2, row_state="all_lanes"),
            256: FwdConfig(128, 32, 8, False, row_state="all_lanes")}),
    "v2": ("v1, but 128x64 tiles, 8 warps for d256 where 193 KiB of shared memory fit (sm_90)",
           {64: FwdConfig(128, 64, 4, False, min_blocks=2, row_state="all_lanes"),
            128: FwdConfig(128, 32, 4, False, min_blocks=2, row_state="all_lanes"),
            256: FwdConfig(128, 64, 8, False, row_state="all_lanes")}),
    "v3": ("v2, plus spill-free 128x64 tiles for d128 where 193 KiB fit (sm_90)",
           {64: FwdConfig(128, 64, 4, False, min_blocks=2), 128: FwdConfig(128, 64, 4, False, min_blocks=2),
            256: FwdConfig(128, 64, 8, False)}),
    "v4": ("v3, but all-lanes row state for d64",
           {64: FwdConfig(128, 64, 4, False, min_blocks=2, row_state="all_lanes"),
            128: FwdConfig(128, 64, 4, False, min_blocks=2), 256: FwdConfig(128, 64, 8, False)}),
    "v5": ("v4, but Q in registers for d64",
           {64: FwdConfig(128, 64, 4, True, min_blocks=2, row_state="all_lanes"),
            128: FwdConfig(128, 64, 4, False, min_blocks=2), 256: FwdConfig(128, 64, 8, False)}),
    "v6": ("warpgroup MMA (wgmma.mma_async) kernel on sm_90: S = Q K^T and O += P V with operands "
           "read from swizzled shared memory (P from registers)", WGMMA_CONFIGS),
}

# Alternatives worth timing on the GPU (``forward(..., config=...)``), not launched by default:
# FlashAttention-2's 128 x 128 tiles for d64 still spill a few registers here (12 to 52 bytes with
# "one_lane", 160 to 200 with "all_lanes"), the 8-warp variants give each warp one 16-row strip;
# last, the wgmma tiles that lost to WGMMA_CONFIGS.
CANDIDATES = {
    64: (FwdConfig(128, 64, 8, False, min_blocks=2), FwdConfig(128, 128, 4, False),
         FwdConfig(128, 64, 8, False, min_blocks=2, row_state="all_lanes"),
         FwdConfig(128, 128, 4, False, row_state="all_lanes"), WgmmaFwdConfig(128, 128)),
    128: (FwdConfig(128, 64, 8, False), FwdConfig(128, 32, 4, False, stages=3, min_blocks=2),
          WgmmaFwdConfig(128, 64)),
    256: (),
}


def default_config(dt: int, smem_optin: int | None = None, arch: str | None = None):
    """The configuration ``forward`` launches for head-dim tile ``dt`` on a device of compute
    capability ``arch`` ("90": the wgmma kernel) whose blocks may opt in to ``smem_optin`` bytes of
    shared memory (None, None: the portable table)."""
    if arch == "90":
        return WGMMA_CONFIGS[dt]
    if smem_optin is not None and smem_optin >= LARGE_SMEM_BYTES and dt in LARGE_SMEM_CONFIGS:
        return LARGE_SMEM_CONFIGS[dt]
    return CONFIGS[dt]


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
    try:
        name = dtype_name(dtype)
    except ValueError:
        return False
    return name in _CTYPE and headdim % 8 == 0 and 8 <= headdim <= D_TILES[-1]


def d_tile(headdim: int) -> int:
    for t in D_TILES:
        if headdim <= t:
            return t
    raise ValueError(f"cupyflash: headdim {headdim} > {D_TILES[-1]}")


def wgmma_smem_bytes(dt: int, config: WgmmaFwdConfig) -> int:
    """Mirror of FwdWgmmaSmem<...>::BYTES (Q, two K and three V stages), plus 1024 bytes to align
    the base for the 128-byte swizzle."""
    return 2 * dt * (config.block_m + 5 * config.block_n) + 1024


def smem_bytes(dt: int, config: FwdConfig) -> int:
    """Dynamic shared memory of one block: Q tile plus `stages` K and V tiles, 16-bit elements,
    then the KvSource record (K and V head pointers and row strides, 32 bytes). Mirrors
    FwdSmemLayout in flash_fwd_mma.cu."""
    return 2 * dt * (config.block_m + 2 * config.stages * config.block_n) + 32


def _spec_for(dtype, dt: int, mask: Mask | bool, config) -> Specialization:
    """``mask``: the policy (kernels_cu/mask.cuh), or a causal flag."""
    mask = as_mask(mask)
    name_dtype = dtype_name(dtype)
    c = config
    if isinstance(c, WgmmaFwdConfig):
        name = f"flash_fwd_wgmma_{_SHORT[name_dtype]}_hdim{dt}_{mask.name}_bm{c.block_m}_bn{c.block_n}"
        expression = f"cf::flash_fwd_wgmma<{_CTYPE[name_dtype]}, {dt}, {mask.cpp}, {c.block_m}, {c.block_n}>"
        return Specialization(name, "flash_fwd_wgmma.cu", expression, c.threads, wgmma_smem_bytes(dt, c),
                              arch="90a")
    name = (f"flash_fwd_mma_{_SHORT[name_dtype]}_hdim{dt}_{mask.name}"
            f"_bm{c.block_m}_bn{c.block_n}_w{c.warps}_{'qreg' if c.q_in_regs else 'qsmem'}_s{c.stages}_mb{c.min_blocks}"
            f"_{c.row_state}")
    expression = (f"cf::flash_fwd_mma<{_CTYPE[name_dtype]}, {dt}, {mask.cpp}, "
                  f"{c.block_m}, {c.block_n}, {c.warps}, {'true' if c.q_in_regs else 'false'}, {c.stages}, {c.min_blocks}, "
                  f"{ROW_STATES[c.row_state]}>")
    return Specialization(name, "flash_fwd_mma.cu", expression, c.threads, smem_bytes(dt, c))


def specialization(dtype, headdim: int, mask: Mask | bool, config: FwdConfig | None = None) -> Specialization:
    """The specialization ``forward`` launches on the current device (``config`` overrides the
    tables, for tuning); ``mask`` is the policy or a causal flag."""
    if not supports(dtype, headdim):
        raise ValueError(f"cupyflash: mma forward does not support dtype {np.dtype(dtype)}, headdim {headdim}")
    dt = d_tile(headdim)
    return _spec_for(dtype, dt, mask, config or default_config(dt, current_smem_optin(), current_arch()))


def specializations() -> list[Specialization]:
    """Every specialization the dispatcher can launch on any supported GPU (for the compile check,
    which builds them all for sm_80 and sm_90)."""
    configs = {dt: {CONFIGS[dt]} | ({LARGE_SMEM_CONFIGS[dt]} if dt in LARGE_SMEM_CONFIGS else set())
               for dt in D_TILES}
    return [_spec_for(dtype, dt, mask, config)
            for dtype in _CTYPE for dt in D_TILES
            for config in sorted(configs[dt], key=lambda c: c.block_n) + [WGMMA_CONFIGS[dt]]
            for mask in KINDS]


def _strides(a, what: str) -> tuple:
    """(batch, seq, head) strides of a (B, S, H, D) array in elements, as int64 kernel arguments."""
    item = a.itemsize
    if a.strides[3] != item:
        raise ValueError(f"cupyflash: {what} must be contiguous in its last dimension")
    strides = tuple(s // item for s in a.strides[:3])
    if any(s % 8 for s in strides) or a.data.ptr % 16:
        raise ValueError(f"cupyflash: {what} needs strides that are multiples of 8 elements and a "
                         f"16-byte aligned pointer for the tensor-core kernel")
    return tuple(np.int64(s) for s in strides)


def forward(q, k, v, o, lse, *, softmax_scale: float, causal: bool, config: FwdConfig | None = None,
            window_size=(-1, -1)) -> None:
    """o (like q, C-contiguous) and lse ((B, H, Sq) float32, contiguous) from q (B, Sq, H, D) and
    k, v (B, Sk, Hkv, D), on the current stream."""
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    if batch == 0 or seqlen_q == 0 or nheads == 0:
        return
    if lse.dtype != np.float32 or not lse.flags.c_contiguous or lse.shape != (batch, nheads, seqlen_q):
        raise ValueError("cupyflash: lse must be a C-contiguous float32 (batch, nheads, seqlen_q) array")
    config = config or default_config(d_tile(headdim), current_smem_optin(), current_arch())
    mask = mask_for(causal, window_size)
    spec = specialization(q.dtype, headdim, mask, config)
    block_m = config.block_m
    grid = (math.ceil(seqlen_q / block_m), nheads, batch)
    args = (q, k, v, o, lse, np.int32(seqlen_q), np.int32(seqlen_k), np.int32(nheads),
            np.int32(nheads // nheads_kv), np.int32(headdim),
            *_strides(q, "q"), *_strides(k, "k"), *_strides(v, "v"), *_strides(o, "o"),
            np.float32(softmax_scale * LOG2E), *mask.window_args())
    launch(spec, grid, args)

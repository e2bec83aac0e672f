"""Plans: which kernel runs a forward call, with which tiles, under which specialization name.

``plan_forward(arch, dtype, headdim, mask, smem_optin)`` is a pure function of the problem and the
device's two numbers that matter (compute capability, opt-in shared memory per block): it makes no
CUDA call, so a machine without a GPU can say what an H200 launches. What runs on sm_90 at d128
bf16 causal is the row ``("mma", SM90, 128)`` of ``FORWARD_TILES``; the mask never changes the tiles,
only the template argument and the name of the specialization. User modifiers are the exception
(``without_spills``): their register cost is their code's, so their plans ask ptxas (NVRTC, no GPU
needed) which of a few tiles compiles without spills.

The layers of a call: ``api`` (public functions) -> ``_arrays`` (argument checks) -> ``dispatch``
(the backend request: NumPy twin or a kernel family) -> ``plans`` (kernel, tiles, specialization)
-> ``kernels/*.py`` (arguments and launch). The launchers build their plan here; they keep no
tables of their own.

The backward's plan, ``plan_backward(arch, dtype, headdim, mask, smem_optin, deterministic)``, and
its table ``BACKWARD_KERNELS`` are in ``cupyflash.backward_plans`` (beside its kernels' tiles).

The library ships only the configurations that are some device's best. Every earlier default and
every candidate that lost is kept, numbered and with its note, in the repository's ``dev/`` folder,
where ``python -m cupyflash tune`` times it against these rows (docs/perf-log.md has the numbers).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from ._dtypes import dtype_name, is_float64
from .precision import DEFAULT as DEFAULT_PRECISION, PRODUCTS, check_precision
from .kernels._module import Specialization
from .kernels.constants import CTYPES, DMMA_D_TILES, SHORT_NAMES, SIMT_D_TILES, TENSOR_CORE_D_TILES, d_tile
from .masks import Mask, as_mask

__all__ = ["ForwardPlan", "FwdConfig", "WgmmaFwdConfig", "Tf32FwdConfig", "WgmmaTf32FwdConfig", "DmmaFwdConfig", "SimtTiles", "FORWARD_TILES",
           "plan_forward",
           "forward_plan", "forward_family", "device_class"]

# Opt-in shared memory per block that admits the LARGE_SMEM tiles (H100/H200: 227 KiB; A100: 163).
LARGE_SMEM_BYTES = 193 * 1024

# FwdConfig.row_state -> the kernel's RowState: where the online softmax keeps a row's running max
# and sum, on all 4 lanes of the row's quad or on one of them (see kernels_cu/flash_fwd_mma.cu).
ROW_STATES = {"one_lane": "cf::RowState::ONE_LANE", "all_lanes": "cf::RowState::ALL_LANES"}


# --- tile types, one per kernel ---------------------------------------------------------------

@dataclass(frozen=True)
class FwdConfig:
    """flash_fwd_mma (``kernels_cu/flash_fwd_mma.cu``, mma.sync, sm_80+)."""

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


@dataclass(frozen=True)
class WgmmaFwdConfig:
    """flash_fwd_wgmma (``kernels_cu/flash_fwd_wgmma.cu``, sm_90a only): block_m query rows, one
    warpgroup (4 warps) per 64 of them; block_n keys per K/V stage (two K stages, three V).
    ``producer``: flash_fwd_wgmma_ws (``kernels_cu/flash_fwd_wgmma_ws.cu``, a candidate: perf log
    wgmma-fwd-ws-v0), a producer warpgroup filling ``stages`` K/V stages and two consumer
    warpgroups of 64 rows (block_m 128), taking turns at the tensor cores with ``pingpong``."""

    block_m: int
    block_n: int
    producer: bool = False
    stages: int = 2
    pingpong: bool = True

    def __post_init__(self):
        if self.producer and self.block_m != 128:
            raise ValueError(f"cupyflash: the wgmma producer kernel has 128 query rows a block, not {self.block_m}")

    @property
    def threads(self) -> int:
        return 384 if self.producer else self.block_m // 64 * 128


@dataclass(frozen=True)
class Tf32FwdConfig:
    """flash_fwd_tf32 (``kernels_cu/flash_fwd_tf32.cu``, mma.sync m16n8k8 tf32, sm_80+): float32;
    block_m query rows, 16 per warp; block_n keys per K/V stage."""

    block_m: int
    block_n: int
    warps: int
    stages: int = 2
    # each key block's P V in accumulators of its own, merged into O by FFMA (FRESH_O; a candidate
    # in dev/tf32_accumulation_probe.py, not a shipped row)
    fresh_o: bool = False
    # K and V split once per tile in shared memory by the threads that copied them (PRESPLIT; the
    # "ieee" rows of IEEE_FORWARD_TILES): lo tiles of their own for three products
    presplit: bool = False
    # each k-step's three products summed apart and added by FADD, rounded to nearest, into S, and
    # into O unless fresh_o (STEP_SUMS; a candidate, perf log tf32-fwd-v2; "ieee" only: one product
    # is one product)
    step_sums: bool = False

    @property
    def threads(self) -> int:
        return 32 * self.warps


@dataclass(frozen=True)
class WgmmaTf32FwdConfig:
    """flash_fwd_tf32_wgmma (``kernels_cu/flash_fwd_tf32_wgmma.cu``, wgmma .tf32, sm_90a): float32;
    one warpgroup of 64 query rows, block_n keys per block. docs/perf-log.md tf32-wgmma-v0 .. v3;
    v2 (``producer``) is sm_90's d64 float32 row (WGMMA_FLOAT32_FORWARD_TILES), the others
    candidates reached as ``config=`` of mma_fwd.forward.
    ``raw_stages`` > 0: the raw K and V rows of that many blocks ahead copied by cp.async into
    staging tiles (v1; 0: read from global memory by the split, v0); ``q_registers``: Q split once
    into registers, S's A operand (else Q's hi and lo tiles in shared memory). ``producer`` (v2,
    ``flash_fwd_tf32_wgmma_ws.cu``): a producer warpgroup stages and splits K and V into ``stages``
    stages for two consumer warpgroups of 64 rows each (128 a CTA; Q in registers, raw_stages >= 1,
    head dims up to 64). ``sums_apart`` ("ieee"): S's small products and each block's P V in
    accumulators of their own, for accuracy (wgmma_tf32_fwd_steps.cuh). ``pingpong`` (producer
    only): the two consumers take turns at issuing their products, one's softmax under the
    other's products (ConsumerTurns). ``presplit`` (producer, raw_stages 0; perf log
    tf32-fwd-split-once): each key block split once for the grid by flash_fwd_split_kv_tf32 into a
    workspace (kv_fwd_split_bytes), the producer one thread copying a stage from it. ``q_staged``
    (producer only; perf log tf32-wgmma-d128): each consumer warp's rows of Q copied raw into shared
    memory and split a k-step at a time as S needs them, not held split in registers (which spill
    at d128); the producer kernel's head dims up to 128 with it. ``hh_chain`` ("ieee", a candidate;
    perf log tf32-hh-chain-4): the k-steps of one of S's hi hi chains (tf32_product_sums), 2 or 4."""

    block_n: int = 64
    raw_stages: int = 0
    q_registers: bool = False
    producer: bool = False
    stages: int = 2
    sums_apart: bool = False
    pingpong: bool = False
    presplit: bool = False
    q_staged: bool = False
    hh_chain: int = 2

    @property
    def block_m(self) -> int:
        return 128 if self.producer else 64

    @property
    def threads(self) -> int:
        return 384 if self.producer else 128


class DmmaFwdConfig(NamedTuple):
    """flash_fwd_dmma (``kernels_cu/flash_fwd_dmma.cu``, mma.sync m8n8k4 .f64, sm_80+): float64 on
    the FP64 tensor cores, the float64 forward's rows up to d128 (``cupyflash.kernels.dmma``).
    warps of 8 m_tiles query rows each (m_tiles 8-row m-tiles sharing each K and V fragment, their
    Q fragments in registers or, q_in_regs False, read from shared memory per k-step); block_n keys
    per K/V tile; min_blocks blocks per SM asked of ptxas; wide (sm_90, m_tiles 2): the products as
    m16n8k8 .f64, one for four m8n8k4 (the specialization is compiled for sm_90)."""

    block_n: int
    warps: int
    m_tiles: int = 1
    q_in_regs: bool = True
    min_blocks: int = 1
    wide: bool = False

    @property
    def block_m(self) -> int:
        return 8 * self.m_tiles * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps


def dmma_smem_bytes(dt: int, config: DmmaFwdConfig) -> int:
    """Q and K tiles of float64 rows padded to dt + 4, V's to dt + 2 (flash_fwd_dmma's LD, LD_V)."""
    return 8 * ((config.block_m + config.block_n) * (dt + 4) + config.block_n * (dt + 2))


class SimtTiles(NamedTuple):
    """flash_fwd_simt and the SIMT backward kernels: BLOCK_M query rows and BLOCK_N key rows per
    block, TPR lanes per tile row."""

    block_m: int
    block_n: int
    tpr: int


# --- the table --------------------------------------------------------------------------------

# Device classes, in the order device_class tests them.
SM90 = "sm_90"  # Hopper: the wgmma kernel
LARGE_SMEM = "large_smem"  # not sm_90, blocks may opt in to LARGE_SMEM_BYTES or more
PORTABLE = "portable"  # every other device (A100: 163 KiB, sm_86 / sm_89: 99 KiB), or unknown
# The SIMT family's tiles depend on the accumulator, not on the device.
ACC_FP32 = "fp32_acc"  # float16, bfloat16, float32 inputs
ACC_FP64 = "fp64_acc"

# (family, class, head-dim tile) -> tiles. A call's head dim is rounded up to the smallest tile
# that holds it (columns past it are zero in shared memory and never stored).
#
# Tensor cores, mma.sync: registers per thread are dominated by the fp32 accumulators, O is
# strips x D_TILE / 2 and S strips x BLOCK_N / 2 (strips = BLOCK_M / (16 warps)); every row
# compiles without spills for sm_80 and sm_90 (``python -m cupyflash compile-check``). D_TILE 128
# with BLOCK_N = 64 takes all 255 registers: there "one_lane" row state keeps it clear of spills.
# D_TILE 64 has registers to spare: "all_lanes" (one_lane cost 7% at bf16 16k) and Q held in
# registers for the whole block (tuner: 299.6 -> 324.5 TFLOP/s). PORTABLE fits an A100 (163 KiB
# per block, 164 per SM, min_blocks blocks each); LARGE_SMEM doubles BLOCK_N at d128 (96 KiB, two
# blocks per SM) and d256 (192 KiB), halving the barriers and rescales per key. On sm_86 / sm_89
# (99 KiB per block) PORTABLE d256 (128 KiB) and SIMT fp32 d256 (100.5 KiB) do not fit: the launch
# refuses them there with the bytes it needs (as the dispatch before plans did).
# Tensor cores, wgmma (sm_90): registers per thread are O D_TILE / 2, S BLOCK_N / 2 and P
# BLOCK_N / 4, so d256 keeps BLOCK_N at 64. Tuner, bf16, TFLOP/s at 16k / 2k, non-causal: d64
# 128x64 372 / 349 (128x128: 282 at 2k), d128 128x128 503 / 435 (128x64: 458 / 363), d256 538 / 475.
# SIMT: float64 tiles are smaller (twice the bytes per element, twice the registers per accumulator).
# Tensor cores, float32 (tf32): every tile is float32, twice the bytes of the 16-bit kernels', so
# BLOCK_N is what shared memory leaves: d64 96 KiB; d128 192 KiB; d256 192 KiB, Q alone 128 KiB
# with BLOCK_M 128. PORTABLE takes 96 KiB up to d128, which sm_86 / sm_89 (99 KiB) run as they ran
# the SIMT kernels it replaces, and 128 KiB at d256 (A100; sm_86 / sm_89 refuse it, as they refused
# SIMT's 100.5). Registers: O D_TILE / 2 and S BLOCK_N / 2 per thread with one strip per warp
# (perf log tf32-fwd-v1: d256 is at 255, and two variant kernels spill 8-52 bytes at sm_90).
FORWARD_TILES = {
    # perf log mma-fwd-v6
    ("mma", SM90, 64): WgmmaFwdConfig(128, 64),
    # perf log wgmma-fwd-ws-route: the producer kernel, three stages of 128 keys
    ("mma", SM90, 128): WgmmaFwdConfig(128, 128, producer=True, stages=3),
    ("mma", SM90, 256): WgmmaFwdConfig(128, 64),
    # perf log mma-fwd-v5
    ("mma", LARGE_SMEM, 64): FwdConfig(128, 64, 4, q_in_regs=True, min_blocks=2, row_state="all_lanes"),
    ("mma", LARGE_SMEM, 128): FwdConfig(128, 64, 4, q_in_regs=False, min_blocks=2),
    ("mma", LARGE_SMEM, 256): FwdConfig(128, 64, 8, q_in_regs=False),
    ("mma", PORTABLE, 64): FwdConfig(128, 64, 4, q_in_regs=True, min_blocks=2, row_state="all_lanes"),
    ("mma", PORTABLE, 128): FwdConfig(128, 32, 4, q_in_regs=False, min_blocks=2),
    ("mma", PORTABLE, 256): FwdConfig(128, 32, 8, q_in_regs=False),
    # perf log tf32-fwd-v1
    ("tf32", SM90, 64): Tf32FwdConfig(128, 64, 8),
    ("tf32", SM90, 128): Tf32FwdConfig(128, 64, 8),
    ("tf32", SM90, 256): Tf32FwdConfig(128, 16, 8),
    ("tf32", LARGE_SMEM, 64): Tf32FwdConfig(128, 64, 8),
    ("tf32", LARGE_SMEM, 128): Tf32FwdConfig(128, 64, 8),
    ("tf32", LARGE_SMEM, 256): Tf32FwdConfig(128, 16, 8),
    ("tf32", PORTABLE, 64): Tf32FwdConfig(128, 64, 8),
    ("tf32", PORTABLE, 128): Tf32FwdConfig(64, 32, 4),
    ("tf32", PORTABLE, 256): Tf32FwdConfig(64, 16, 4),
    # perf log dmma-fwd-v2: sm_90's own m16n8k8 .f64 ("wide"), warps of two 8-row m-tiles, Q read
    # from shared memory per k-step, two blocks of 4 warps per SM; 1.25-1.6x v1 on the H200. The
    # 8-warp wide layouts were as fast but spill 16-80 bytes in some variants.
    ("dmma", SM90, 16): DmmaFwdConfig(32, 4, 2, False, 2, True),  # 64 keys at d16 spill with dropout
    ("dmma", SM90, 32): DmmaFwdConfig(32, 4, 2, False, 2, True),
    ("dmma", SM90, 64): DmmaFwdConfig(32, 4, 2, False, 2, True),
    ("dmma", SM90, 128): DmmaFwdConfig(16, 4, 2, False, 2, True),
    # perf log dmma-fwd-v0, dmma-fwd-v1 (m8n8k4), every other arch. One block of 8 warps per SM
    # (204-222 registers a thread); shared memory 101 KiB at d64, 131.5 KiB at d128. PORTABLE halves
    # the key block (67.5 KiB; 65.75 KiB at d128 with 4 warps) for sm_86 / sm_89's 99 KiB, and so
    # does an A100 (163 KiB, below LARGE_SMEM), as its tf32 rows do; measured on the H200 only.
    **{("dmma", LARGE_SMEM, dt): tiles
       for dt, tiles in ((16, DmmaFwdConfig(64, 8)), (32, DmmaFwdConfig(64, 8)), (64, DmmaFwdConfig(64, 8)),
                         (128, DmmaFwdConfig(32, 8)))},
    ("dmma", PORTABLE, 16): DmmaFwdConfig(64, 8),
    ("dmma", PORTABLE, 32): DmmaFwdConfig(64, 8),
    ("dmma", PORTABLE, 64): DmmaFwdConfig(32, 8),
    ("dmma", PORTABLE, 128): DmmaFwdConfig(16, 4),
    # perf log simt-v1, simt-v2
    ("simt", ACC_FP32, 16): SimtTiles(64, 64, 4),
    ("simt", ACC_FP32, 32): SimtTiles(64, 64, 4),
    ("simt", ACC_FP32, 64): SimtTiles(64, 64, 4),
    ("simt", ACC_FP32, 128): SimtTiles(32, 32, 8),
    ("simt", ACC_FP32, 256): SimtTiles(32, 32, 8),
    ("simt", ACC_FP64, 16): SimtTiles(32, 32, 4),
    ("simt", ACC_FP64, 32): SimtTiles(32, 32, 4),
    ("simt", ACC_FP64, 64): SimtTiles(32, 32, 4),
    ("simt", ACC_FP64, 128): SimtTiles(16, 16, 8),
    ("simt", ACC_FP64, 256): SimtTiles(16, 16, 16),
}


# --- the plan ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ForwardPlan:
    """What a forward call launches: one block per ``block_m`` query rows of each (head, batch)."""

    family: str  # "mma" (tensor cores: mma.sync or wgmma, tf32 for float32) or "simt"
    device_class: str  # the FORWARD_TILES class of the row
    headdim: int  # the head dim the kernel sees (the mma family's is a multiple of 8)
    d_tile: int
    tiles: FwdConfig | WgmmaFwdConfig | Tf32FwdConfig | DmmaFwdConfig | SimtTiles
    spec: Specialization  # name, source, template instantiation, threads, shared memory
    # launched before spec where the tiles read key blocks split once (WgmmaTf32FwdConfig.presplit)
    split_kv: Specialization | None = None

    @property
    def kernel(self) -> str:
        return self.spec.source_file.removesuffix(".cu")

    @property
    def block_m(self) -> int:
        return self.tiles.block_m


def mma_headdim(headdim: int) -> int:
    """Head dimension the tensor-core kernels see: rounded up to a multiple of 8 (16-byte rows)."""
    return -(-headdim // 8) * 8


def tensor_core_supports(dtype, headdim: int) -> bool:
    """Whether the tensor-core forward runs ``dtype`` at exactly ``headdim`` (no padding): float16
    and bfloat16 (mma.sync, wgmma) and float32 (tf32), a head dim that is a multiple of 8 up to 256,
    and float64 (DMMA) up to 128."""
    try:
        name = dtype_name(dtype)
    except ValueError:
        return False
    if name not in ("float16", "bfloat16", "float32", "float64") or headdim % 8 or headdim < 8:
        return False
    return headdim <= (DMMA_D_TILES if name == "float64" else TENSOR_CORE_D_TILES)[-1]


def forward_family(dtype, headdim: int) -> str:
    """The family a forward call runs on a GPU unless the caller asks for one: tensor cores for
    float16, bfloat16 and float32 (the head dim padded to a multiple of 8) and float64 up to d128,
    SIMT for float64 past it."""
    return "mma" if tensor_core_supports(dtype, mma_headdim(headdim)) else "simt"


def _table_family(family: str, dtype) -> str:
    """The FORWARD_TILES family of a tensor-core call: "tf32" for float32, "dmma" for float64, "mma"
    otherwise."""
    if family != "mma":
        return family
    return {"float32": "tf32", "float64": "dmma"}.get(dtype_name(dtype), family)


def device_class(arch: str | None, smem_optin: int | None) -> str:
    """The tensor-core FORWARD_TILES class of a device (either number None: not known)."""
    if arch == "90":
        return SM90
    if smem_optin is not None and smem_optin >= LARGE_SMEM_BYTES:
        return LARGE_SMEM
    return PORTABLE


def plan_forward(arch: str | None, dtype, headdim: int, mask: Mask | bool, smem_optin: int | None,
                 family: str | None = None, headdim_v: int | None = None,
                 precision: str = DEFAULT_PRECISION, image_readers: int | None = None) -> ForwardPlan:
    """The forward kernel a call with this dtype, head dim and mask launches on a device of compute
    capability ``arch`` ("80", "90") whose blocks may opt in to ``smem_optin`` bytes of shared memory
    (None, None: a device not known; the portable rows). ``family`` ("mma", "simt") overrides the
    default family of forward_family; ``mask`` is a policy of cupyflash.masks or a causal flag.
    ``headdim`` is the wider of q's and v's head dims, which sets the tile; ``headdim_v`` v's, when
    it is its own: the wgmma kernel then takes v and o in a narrower tile (``v_tile``). ``precision``
    (cupyflash.precision) picks the float32 kernel's products; other dtypes ignore it.
    ``image_readers``: how many query blocks read each key block (plans.image_readers), for the
    rows that split the key blocks once for the grid (WGMMA_FLOAT32_PRESPLIT_FORWARD_TILES); None,
    a plan made without the problem's length, never takes those rows."""
    family = family or forward_family(dtype, headdim)
    if family == "mma":
        headdim = mma_headdim(headdim)
        where = device_class(arch, smem_optin)
    elif family == "simt":
        where = ACC_FP64 if is_float64(dtype) else ACC_FP32
    else:
        raise ValueError(f"cupyflash: unknown forward family {family!r} (known: mma, simt)")
    table = _table_family(family, dtype)
    dt = d_tile(headdim, _D_TILES[table])
    mask = as_mask(mask)
    own_v = family == "mma" and _own_v_tile(dt, headdim_v) is not None
    tiles = forward_tiles(table, where, dt, dtype, mask, arch, precision, own_v, image_readers)
    if takes_fast_modifiers(tiles):
        mask = with_fast_modifiers(mask, arch or "90", lambda m: [specialization_for(dtype, dt, m, tiles)])
    return _plan(dtype, headdim, mask, tiles, where, headdim_v, precision)


def takes_fast_modifiers(tiles) -> bool:
    """Whether the kernel of ``tiles`` computes a user modifier's fast math (FAST_MODS: the 16-bit
    producer forward, flash_fwd_wgmma_ws)."""
    return isinstance(tiles, WgmmaFwdConfig) and tiles.producer


def with_fast_modifiers(mask: Mask, arch: str, specs_of) -> Mask:
    """``mask`` with its user modifiers' fast-math struct (Modifiers.with_fast_math) where they
    have fast forms and ``specs_of(mask)``'s kernels compile so without spills (without_spills: the
    first where NVRTC is not there), else ``mask`` (perf log modifier-fast-math)."""
    user = mask.score.user
    if user is None or user.fast_math or not user.has_fast_forms:
        return mask
    fast = mask.with_score(replace(mask.score, user=user.with_fast_math()))
    return without_spills([fast, mask], arch, specs_of)


def image_readers(seqlen_q: int, group: int) -> int:
    """How many query blocks of 128 rows read each key block of a kv head: the query rows' blocks
    (a packed batch: its longest sequence's) times the query heads sharing the kv head."""
    return -(-seqlen_q // 128) * group


def _own_v_tile(dt: int, headdim_v: int | None) -> int | None:
    """v's head-dim tile where it is narrower than ``dt`` (the tensor-core tiles), else None."""
    if headdim_v is None:
        return None
    dvt = d_tile(mma_headdim(headdim_v), TENSOR_CORE_D_TILES)
    return dvt if dvt < dt else None


def v_tile(tiles, dt: int, headdim_v: int | None) -> int:
    """The head-dim tile of v and o: the smallest tensor-core tile that holds ``headdim_v`` where
    the kernel is the wgmma forward and that tile is narrower than ``dt`` (its O accumulators, V
    stages and P V products then that narrow); ``dt`` otherwise, every other kernel running v in
    q's tile."""
    if not isinstance(tiles, WgmmaFwdConfig) or tiles.producer:
        return dt
    return _own_v_tile(dt, headdim_v) or dt


def forward_tiles(family: str, where: str, dt: int, dtype, mask: Mask, arch: str | None,
                  precision: str = DEFAULT_PRECISION, own_v: bool = False, image_readers: int | None = None):
    """FORWARD_TILES' row, or with user modifiers the first of it and USER_FORWARD_FALLBACKS'
    that compiles without spills (``without_spills``; ``arch`` None: the class's own arch).
    ``own_v``: v's head dim has a narrower tile of its own (``v_tile``)."""
    candidates = forward_candidates(family, where, dt, mask, precision, own_v, image_readers)
    if len(candidates) == 1:
        return candidates[0]
    arch = arch or ("90" if where == SM90 else "80")
    return without_spills(candidates, arch, lambda t: [specialization_for(dtype, dt, mask, t, precision=precision)])


def forward_candidates(family: str, where: str, dt: int, mask: Mask, precision: str = DEFAULT_PRECISION,
                       own_v: bool = False, image_readers: int | None = None) -> list:
    """The tiles ``forward_tiles`` chooses from, in order: FORWARD_TILES' row (IEEE_FORWARD_TILES'
    for float32's three products), and with user modifiers USER_FORWARD_FALLBACKS' after it."""
    tiles = FORWARD_TILES[(family, where, dt)]
    if family == "tf32" and PRODUCTS[check_precision(precision)] == 3:
        tiles = IEEE_FORWARD_TILES.get((family, where, dt), tiles)
    if family == "tf32":
        tiles = WGMMA_FLOAT32_FORWARD_TILES.get((family, where, dt, check_precision(precision)), tiles)
        if image_readers is not None and image_readers >= PRESPLIT_MIN_IMAGE_READERS:
            tiles = WGMMA_FLOAT32_PRESPLIT_FORWARD_TILES.get((family, where, dt, check_precision(precision)), tiles)
    if mask.band == "local" and not producer_takes_window(tiles, mask, own_v):
        tiles = LOCAL_FORWARD_TILES.get((family, where, dt), tiles)
    if mask.packed:
        tiles = PACKED_FORWARD_TILES.get((family, where, dt), tiles)
    if mask.score.dropout:
        tiles = DROPOUT_FORWARD_TILES.get((family, where, dt), tiles)
    if mask.packed and mask.score.user is not None:
        tiles = PACKED_USER_FORWARD_TILES.get((family, where, dt), tiles)
    if isinstance(tiles, WgmmaFwdConfig) and tiles.producer and (mask.score.dropout or own_v):
        tiles = ONE_ROLE_FORWARD_TILES[(family, where, dt)]
    if mask.score.user is None or family != "mma":
        return [tiles]
    # (with v's own tile the row is the one-role 128 x 128 that the fallbacks start with: once)
    return list(dict.fromkeys([tiles, *USER_FORWARD_FALLBACKS.get((family, where, dt), ())]))


# Rows float32's three products ("ieee") replace: K and V split once per tile in shared memory by
# the threads that copied them (PRESPLIT), not by every warp for every fragment it reads; the lo
# tiles double K/V's shared memory, so d128 halves BLOCK_N. H200, 8k, 2 x 16 (d128) / 32 (d64)
# heads: 54.4 -> 61.4 TFLOP/s at d64, 56.1 -> 62.7 at d128, the same error (perf log
# tf32-fwd-v2). PORTABLE stays within sm_86 / sm_89's 99 KiB; d256 has no room for lo tiles.
# S's k-steps and O's key blocks summed apart (STEP_SUMS, FRESH_O): 0.74-1.08x standard float32
# attention's error where the tensor core's own accumulation gave 8-11x, at 0.87-0.90x the speed.
IEEE_FORWARD_TILES = {
    ("tf32", SM90, 64): Tf32FwdConfig(128, 64, 8, fresh_o=True, presplit=True, step_sums=True),
    ("tf32", SM90, 128): Tf32FwdConfig(128, 32, 8, fresh_o=True, presplit=True, step_sums=True),
    ("tf32", LARGE_SMEM, 64): Tf32FwdConfig(128, 64, 8, fresh_o=True, presplit=True, step_sums=True),
    ("tf32", LARGE_SMEM, 128): Tf32FwdConfig(128, 32, 8, fresh_o=True, presplit=True, step_sums=True),
}


# Rows float32 takes on sm_90's tf32 wgmma (tf32-wgmma-v2: a producer warpgroup stages and splits K
# and V for two consumer warpgroups of 64 query rows; head dims up to 64), per precision. "ieee"
# sums S's small products and each key block's P V apart (SUMS_APART): issue 18's accuracy bar as
# a distribution (tests/tf32_accuracy.py), 0.62-0.67x standard float32's error at 1k. d64, 1k-8k,
# TFLOP/s against the mma.sync row: H200 74-97 against 45-54 ("ieee"), 115-164 against 89-112
# ("tf32"); H100 74-96 against 46-56, 116-167 against 90-115 (perf log tf32-wgmma-route). Every
# mask class takes it (packed batches, dropout, user modifiers: the policy's key ranges are the
# block map's): one float32 kernel per problem size, so that a varlen batch's sequence and a
# mask_mod's causal mask give the dense call's bits (the first route, dense only, broke both).
#
# d128 (perf log tf32-wgmma-d128): Q split into registers spills there, so the consumers stage Q raw
# and split it a k-step at a time (q_staged); two stages of 32 keys and Q's tile fill 193 KiB, and
# the producer's own split spills at d128, so every d128 problem takes the split-once image.
WGMMA_FLOAT32_D128_FORWARD = WgmmaTf32FwdConfig(32, raw_stages=0, producer=True, stages=2, sums_apart=True,
                                                presplit=True, q_staged=True)
WGMMA_FLOAT32_FORWARD_TILES = {
    ("tf32", SM90, 64, "ieee"): WgmmaTf32FwdConfig(32, raw_stages=2, producer=True, stages=4, sums_apart=True),
    ("tf32", SM90, 64, "tf32"): WgmmaTf32FwdConfig(32, raw_stages=2, producer=True, stages=4),
    ("tf32", SM90, 128, "ieee"): WGMMA_FLOAT32_D128_FORWARD,
    ("tf32", SM90, 128, "tf32"): replace(WGMMA_FLOAT32_D128_FORWARD, sums_apart=False),
}

# Rows that replace WGMMA_FLOAT32_FORWARD_TILES' where each key block's split image (the split pass
# flash_fwd_split_kv_tf32, about the cost of reading K and V three times) is read by at least
# PRESPLIT_MIN_IMAGE_READERS query blocks (plans.image_readers). H100, d64, 32 heads (perf log
# tf32-fwd-split-once): at 8 readers (1k) 0.84-0.92x the producer forward ("ieee"), at 32 (4k)
# 1.01-1.04x, at 64 (8k) 1.11-1.12x; "tf32" 1.22-1.50x from 32.
WGMMA_FLOAT32_PRESPLIT_FORWARD_TILES = {
    ("tf32", SM90, 64, "ieee"): WgmmaTf32FwdConfig(32, raw_stages=0, producer=True, stages=4, sums_apart=True,
                                                   presplit=True),
    ("tf32", SM90, 64, "tf32"): WgmmaTf32FwdConfig(32, raw_stages=0, producer=True, stages=4, presplit=True),
    ("tf32", SM90, 128, "ieee"): WGMMA_FLOAT32_D128_FORWARD,
    ("tf32", SM90, 128, "tf32"): replace(WGMMA_FLOAT32_D128_FORWARD, sums_apart=False),
}
PRESPLIT_MIN_IMAGE_READERS = 32


# Rows a sliding window (the Local band) replaces. sm_90 d128: one warpgroup of 64 rows and 64-key
# stages (99 KiB, two CTAs an SM) wastes less of the band than 128 x 128 (a 64-row block visits
# 1088 keys for a window of 1024, a 128-row one 1152) and overlaps one CTA's prologue and epilogue
# with the other's walk. H200, 16k, 1 x 16 heads, window (1024, 0): 325.7 against 304.4 TFLOP/s
# over the band's pairs (perf log windows-tiles).
LOCAL_FORWARD_TILES = {
    ("mma", SM90, 128): WgmmaFwdConfig(64, 64),
}

# Since the producer kernel came (wgmma-fwd-ws-route) a wide window runs faster on the row's own
# tiles: its 128 x 128 blocks cost more at the band's edges and a tile more besides its blocks, but
# a block less a pair. H100, 16k, 1 x 16 heads, d128 bf16, window (w, 0), TFLOP/s over the band's
# pairs, 64 x 64 against the producer: w = 256 159.0 / 150.8, 512 241.8 / 240.3, 1024 324.0 / 339.3
# (324.5 / 340.3 in a second run), 2048 387.7 / 426.2, 4096 433.0 / 489.6 (perf log
# window-fwd-producer). So a band of this many keys a row or more takes the producer.
LOCAL_PRODUCER_MIN_KEYS = 1024


def producer_takes_window(tiles, mask: Mask, own_v: bool = False) -> bool:
    """Whether a window keeps its row's producer kernel rather than LOCAL_FORWARD_TILES': a band of
    LOCAL_PRODUCER_MIN_KEYS keys a row or more (or a side without bound), on a row whose producer
    kernel would run the call (not with dropout or v's own tile, which take
    ONE_ROLE_FORWARD_TILES), without user modifiers (their fallback lists start from the window's
    own tiles)."""
    keys = mask.band_keys()
    return (isinstance(tiles, WgmmaFwdConfig) and tiles.producer and not mask.score.dropout and not own_v
            and mask.score.user is None and (keys is None or keys >= LOCAL_PRODUCER_MIN_KEYS))


# softcap-fixed-max (perf log): a softcap forward can take the cap's bound a = c log2(e) as every
# row's maximum (online_softmax.cuh block_softmax): no row maximum to reduce, O and l never
# rescaled (the producer kernel's block loop 1,311 -> 1,095 instructions, sm_90a). P = 2^(z - a)
# then spans [2^(-2a), 1] rather than reaching 1 in every row. bfloat16 keeps float32's exponent
# range, so with 2a <= FIXED_MAX_LOG2_RANGE P >= 2^-96 and P V stays normal for every |v| >= 2^-30;
# float16's P (normal from 2^-14) would lose the small weights. Kernels that ask for it: the
# producer forward.
FIXED_MAX_LOG2_RANGE = 96.0
FIXED_MAX_KERNELS = ("flash_fwd_wgmma_ws.cu",)


def takes_fixed_max(spec: Specialization, dtype, mask: Mask, softcap: float) -> bool:
    """Whether a softcap forward launching ``spec`` on ``dtype`` with ``mask`` and cap ``softcap``
    takes the cap's bound as every row's maximum (Score.fixed_max): bfloat16, 2 c log2(e) <= 96
    (c up to 33.27), a kernel that asks for it, and softcap without ALiBi or user modifiers. (ALiBi
    keeps every score under the bound too, but can hold a whole row far below it: with seqlen_q >
    seqlen_k and no causal band a first row's nearest key is seqlen_q - seqlen_k away, so its
    weights would leave the range, and a negative slope would take them past 1.)"""
    score = mask.score
    return (dtype_name(dtype) == "bfloat16" and spec.source_file in FIXED_MAX_KERNELS
            and score.softcap and not score.alibi and score.user is None
            and 0.0 < softcap and 2.0 * softcap * float(np.log2(np.e)) <= FIXED_MAX_LOG2_RANGE)


def band_forms(mask: Mask) -> tuple:
    """The masks of one kind whose forward plans can differ by the run-time window alone: a Local
    kind as a narrow band (one key a row) and as it is; any other kind as it is. What lists every
    specialization a plan can launch (mma_fwd.specializations) walks these."""
    if mask.band != "local":
        return (mask,)
    return (replace(mask, left=0, right=0), mask)


# Rows that keep flash_fwd_wgmma where FORWARD_TILES' row is its producer kernel: dropout (its
# Philox words are integer work on the issue slots the other consumer's softmax needs: 1.50 ms in
# the one-role kernel against 1.53 in the producer's, 8k causal d128 on the H100, perf log
# wgmma-fwd-ws-v0) and v's own narrower tile (the producer kernel takes v in q's tile).
ONE_ROLE_FORWARD_TILES = {
    ("mma", SM90, 128): WgmmaFwdConfig(128, 128),
}


# Rows dropout replaces: its Philox words (dropout.cuh) take the LARGE_SMEM d128 tile past 255
# registers (32 bytes spilled at sm_80): PORTABLE's BLOCK_N 32 compiles clean.
DROPOUT_FORWARD_TILES = {
    ("mma", LARGE_SMEM, 128): FORWARD_TILES[("mma", PORTABLE, 128)],
}


# Rows a packed (varlen) batch replaces: its sequence's lengths and first rows live in registers
# (the dense kernels read them from the parameter bank), which takes the LARGE_SMEM d128 tile past
# 255 registers at sm_80 (80 bytes spilled; sm_90 compiles it clean, but sm_90 runs wgmma).
PACKED_FORWARD_TILES = {
    ("mma", LARGE_SMEM, 128): FORWARD_TILES[("mma", PORTABLE, 128)],
}

# Rows a packed batch with user modifiers replaces: float32 at d256, whose 8-warp row spills 96
# bytes at sm_90 with the compile check's modifiers (the sequence's lengths and the block map's
# bounds are live beside the modifier's code); PORTABLE's 4 warps of 64 rows do not.
PACKED_USER_FORWARD_TILES = {
    ("tf32", where, 256): FORWARD_TILES[("tf32", PORTABLE, 256)] for where in (SM90, LARGE_SMEM)
}

# Tiles a forward with user modifiers tries after the row's, in order (fewer S registers).
USER_FORWARD_FALLBACKS = {
    # d64: Q from shared memory rather than registers (the compile check's modifiers spill 8 bytes
    # at 255 registers with Q in registers at sm_80; 236 registers without)
    ("mma", LARGE_SMEM, 64): (FwdConfig(128, 64, 4, q_in_regs=False, min_blocks=2, row_state="all_lanes"),),
    ("mma", PORTABLE, 64): (FwdConfig(128, 64, 4, q_in_regs=False, min_blocks=2, row_state="all_lanes"),),
    # d128: the one-role kernel's 128 x 128 tiles (with v's own tile, the first), then 128 x 64
    ("mma", SM90, 128): (WgmmaFwdConfig(128, 128), WgmmaFwdConfig(128, 64)),
    ("mma", LARGE_SMEM, 128): (FwdConfig(128, 32, 4, q_in_regs=False, min_blocks=2),),
    ("mma", LARGE_SMEM, 256): (FwdConfig(128, 32, 8, q_in_regs=False),),
}


def without_spills(candidates: list, arch: str | None, specs_of):
    """The first of ``candidates`` whose specializations (``specs_of(candidate)``) ptxas compiles
    for ``arch`` without register spills, else the last; the first where the arch is not known or
    NVRTC is not there. For user modifiers, whose code the tables cannot know: each answer is
    cached per specialization name (which holds the modifier's hash), in memory and on disk
    (cupyflash.kernels.compile_check's cache)."""
    if arch is None or len(candidates) == 1:
        return candidates[0]
    for candidate in candidates:
        try:
            spilled = any(_spills(spec, arch) for spec in specs_of(candidate))
        except (RuntimeError, OSError):  # no NVRTC: take the row as it is
            return candidates[0]
        if not spilled:
            return candidate
    return candidates[-1]


_spill_answers: dict = {}


def _spills(spec: Specialization, arch: str) -> bool:
    target = spec.arch or arch
    key = (spec.name, target)
    if key not in _spill_answers:
        from .kernels import compile_check

        result = compile_check.check(target, [spec])[0]
        _spill_answers[key] = result.spill_bytes > 0 or result.stack_bytes > 0
    return _spill_answers[key]


def forward_plan(dtype, headdim: int, mask: Mask | bool, tiles, headdim_v: int | None = None,
                 precision: str = DEFAULT_PRECISION) -> ForwardPlan:
    """The plan that runs ``tiles`` (any FwdConfig, WgmmaFwdConfig, Tf32FwdConfig or SimtTiles: the
    tuner's and dev/'s, not only FORWARD_TILES') at exactly ``headdim`` (and ``headdim_v`` and
    ``precision``, plan_forward's)."""
    return _plan(dtype, headdim, as_mask(mask), tiles, "explicit", headdim_v, precision)


def _plan(dtype, headdim: int, mask: Mask, tiles, where: str, headdim_v: int | None = None,
          precision: str = DEFAULT_PRECISION) -> ForwardPlan:
    family = "simt" if isinstance(tiles, SimtTiles) else "mma"
    if family == "mma" and not tensor_core_supports(dtype, headdim):
        raise ValueError(f"cupyflash: mma forward does not support dtype {np.dtype(dtype)}, headdim {headdim}")
    table = _table_family(family, dtype)
    if family == "mma" and _TABLE_FAMILIES[type(tiles)] != table:
        raise ValueError(f"cupyflash: {type(tiles).__name__} does not run {np.dtype(dtype)} (float32 runs "
                         f"Tf32FwdConfig's kernel, float64 DmmaFwdConfig's, float16 / bfloat16 the others)")
    dt = d_tile(headdim, _D_TILES[table])
    split = (tf32_fwd_split_kv_spec(dt, mask, tiles, precision)
             if isinstance(tiles, WgmmaTf32FwdConfig) and tiles.presplit else None)
    return ForwardPlan(family, where, headdim, dt, tiles,
                       specialization_for(dtype, dt, mask, tiles, v_tile(tiles, dt, headdim_v), precision), split)


def simt_tiles(dtype, headdim: int) -> SimtTiles:
    """The SIMT family's tiles at ``headdim`` (its backward kernels run on the forward's)."""
    return FORWARD_TILES[("simt", ACC_FP64 if is_float64(dtype) else ACC_FP32, d_tile(headdim, SIMT_D_TILES))]


# --- specializations: the kernels' template arguments and launch configuration ----------------

_TABLE_FAMILIES = {FwdConfig: "mma", WgmmaFwdConfig: "mma", Tf32FwdConfig: "tf32", WgmmaTf32FwdConfig: "tf32",
                   DmmaFwdConfig: "dmma", SimtTiles: "simt"}
_D_TILES = {"mma": TENSOR_CORE_D_TILES, "tf32": TENSOR_CORE_D_TILES, "dmma": DMMA_D_TILES, "simt": SIMT_D_TILES}


def smem_bytes(dt: int, config: FwdConfig) -> int:
    """Dynamic shared memory of one flash_fwd_mma block: Q tile plus `stages` K and V tiles,
    16-bit elements, then the KvSource record (K and V head pointers and row strides, 32 bytes).
    Mirrors FwdSmemLayout in flash_fwd_mma.cu."""
    return 2 * dt * (config.block_m + 2 * config.stages * config.block_n) + 32


def wgmma_smem_bytes(dt: int, config: WgmmaFwdConfig, dvt: int | None = None) -> int:
    """Mirror of FwdWgmmaSmem<...>::BYTES (Q, two K stages of ``dt`` columns and three V stages
    of ``dvt``, dt by default), or with ``producer`` of FwdWgmmaWsSmem<...>::BYTES (Q, ``stages``
    K and V stages, a full and an empty barrier a stage and Q's), plus 1024 bytes to align the base
    for the 128-byte swizzle."""
    if config.producer:
        return 2 * dt * (config.block_m + 2 * config.stages * config.block_n) + 16 * config.stages + 8 + 1024
    dvt = dt if dvt is None else dvt
    return 2 * (dt * (config.block_m + 2 * config.block_n) + 3 * dvt * config.block_n) + 1024


def tf32_smem_bytes(dt: int, config: Tf32FwdConfig, precision: str = DEFAULT_PRECISION) -> int:
    """Dynamic shared memory of one flash_fwd_tf32 block: Q tile plus `stages` K and V tiles (and
    their lo tiles where ``presplit`` splits for three products), float32 elements. Mirrors
    Tf32FwdSmem in flash_fwd_tf32.cu."""
    tiles = 4 if config.presplit and PRODUCTS[check_precision(precision)] == 3 else 2
    return 4 * dt * (config.block_m + tiles * config.stages * config.block_n)


def tf32_wgmma_smem_bytes(dt: int, config: WgmmaTf32FwdConfig) -> int:
    """Mirror of FwdTf32WgmmaSmem<...>::BYTES (Q (hi only, O's staging tile, with Q in registers),
    K and V^T, each hi and lo, and the raw stages of K and V, float32 words), or with ``producer``
    of FwdTf32WgmmaWsSmem<...>::BYTES (the stages of K and V^T hi and lo, the raw stages, a full
    and an empty barrier a stage), plus 1024 bytes to align the base for the 128-byte swizzle."""
    if config.producer:  # the raw stages' region also stages O (128 rows): at least that large
        kv_tile = 4 * config.block_n * dt
        if config.q_staged:  # Q's raw rows (O's staging tile), then the raw stages alone
            return (config.stages * 4 * kv_tile + 128 * dt * 4 + config.raw_stages * 2 * kv_tile
                    + 16 * config.stages + 1024)
        raw = max(config.raw_stages * 2 * kv_tile, 128 * dt * 4)
        return config.stages * 4 * kv_tile + raw + 16 * config.stages + 1024
    q_tiles = 1 if config.q_registers else 2
    return 4 * dt * (q_tiles * config.block_m + 4 * config.block_n + 2 * config.raw_stages * config.block_n) + 1024


def tf32_fwd_split_kv_spec(dt: int, mask: Mask | bool, config: WgmmaTf32FwdConfig,
                           precision: str = DEFAULT_PRECISION) -> Specialization:
    """flash_fwd_split_kv_tf32 at head-dim tile ``dt``: each key block of config.block_n keys split
    once into the image the presplit producer copies (the mask's packing is all it takes from the
    mask; one product, "tf32", splits no lo tiles)."""
    products = PRODUCTS[check_precision(precision)]
    packed = as_mask(mask).packed
    return Specialization(f"flash_fwd_split_kv_tf32_{SHORT_NAMES['float32']}_hdim{dt}_bn{config.block_n}"
                          + ("_packed" if packed else "") + ("_tf32" if products == 1 else ""),
                          "flash_fwd_split_kv_tf32.cu",
                          f"cf::flash_fwd_split_kv_tf32<{dt}, {config.block_n}, {'true' if packed else 'false'}"
                          + (f", {products}>" if products != 3 else ">"),
                          128, 4 * 4 * config.block_n * dt + 1024, arch="90a")


def image_blocks(block: int, batch: int, seqlen: int, sequences: int | None = None) -> int:
    """Blocks a head of a split-once image holds (split_image.cuh's image_block order), in either
    direction: batch * ceil(seqlen / block) for a dense batch; for a packed one (``sequences`` of
    them, seqlen the total rows) seqlen // block + sequences slots, the last sequence's last slot
    below it."""
    return seqlen // block + sequences if sequences is not None else batch * -(-seqlen // block)


def kv_fwd_split_bytes(dt: int, block_n: int, batch: int, seqlen_k: int, nheads_kv: int,
                       sequences: int | None = None) -> int:
    """The forward's kv_split image's bytes (wgmma_tf32_fwd_steps.cuh's kv_fwd_image_offset): a block
    of Tf32FwdKeyBlockTiles (4 tiles of block_n x dt float32) per image block and kv head."""
    return image_blocks(block_n, batch, seqlen_k, sequences) * nheads_kv * 4 * 4 * block_n * dt


def _template_options(*values) -> str:
    """Trailing template arguments (bools as true / false, ints as written) up to the last one
    set: the defaults after it are left out, so that older specializations keep their names and
    expressions."""
    values = list(values)
    while values and not values[-1]:
        values.pop()
    return "".join(f", {str(v).lower() if isinstance(v, bool) else v}" for v in values)


def _tf32_options(config: Tf32FwdConfig) -> str:
    """The FRESH_O, PRESPLIT and STEP_SUMS template arguments up to the last one set."""
    return _template_options(config.fresh_o, config.presplit, config.step_sums)


def specialization_for(dtype, dt: int, mask: Mask | bool, tiles, dvt: int | None = None,
                       precision: str = DEFAULT_PRECISION) -> Specialization:
    """The specialization of the forward kernel that ``tiles`` configures, at head-dim tile ``dt``
    (and, for the wgmma kernel, v's tile ``dvt`` when narrower: plans.v_tile; for the float32
    kernel, ``precision``'s products)."""
    mask = as_mask(mask)
    name = dtype_name(dtype)
    c, ctype, short = tiles, CTYPES[name], SHORT_NAMES[name]
    if isinstance(c, SimtTiles):
        return _simt_spec("fwd", name, dt, mask, c)
    if isinstance(c, WgmmaFwdConfig) and c.producer:
        if dvt is not None and dvt != dt:
            raise ValueError("cupyflash: the wgmma producer kernel takes v's head dim in q's tile")
        return Specialization(f"flash_fwd_wgmma_ws_{short}_hdim{dt}_{mask.name}_bn{c.block_n}_s{c.stages}"
                              f"{'_pingpong' if c.pingpong else ''}",
                              "flash_fwd_wgmma_ws.cu",
                              f"cf::flash_fwd_wgmma_ws<{ctype}, {dt}, {mask.cpp}, {c.block_n}, {c.stages}, "
                              f"{'true' if c.pingpong else 'false'}>",
                              c.threads, wgmma_smem_bytes(dt, c), arch="90a")
    if isinstance(c, WgmmaFwdConfig):
        own_v = dvt is not None and dvt != dt  # the template's default otherwise: names unchanged
        return Specialization(f"flash_fwd_wgmma_{short}_hdim{dt}{f'v{dvt}' if own_v else ''}_{mask.name}"
                              f"_bm{c.block_m}_bn{c.block_n}",
                              "flash_fwd_wgmma.cu",
                              f"cf::flash_fwd_wgmma<{ctype}, {dt}, {mask.cpp}, {c.block_m}, {c.block_n}"
                              f"{f', {dvt}' if own_v else ''}>",
                              c.threads, wgmma_smem_bytes(dt, c, dvt), arch="90a")
    if isinstance(c, Tf32FwdConfig):
        precision = check_precision(precision)
        if PRODUCTS[precision] == 1 and c.step_sums:  # one product per k-step: nothing to sum apart
            c = replace(c, step_sums=False)
        return Specialization(
            f"flash_fwd_tf32_{short}_hdim{dt}_{mask.name}_bm{c.block_m}_bn{c.block_n}_w{c.warps}_s{c.stages}"
            f"_{precision}{'_fresh_o' if c.fresh_o else ''}{'_presplit' if c.presplit else ''}"
            f"{'_stepsums' if c.step_sums else ''}",
            "flash_fwd_tf32.cu",
            f"cf::flash_fwd_tf32<{dt}, {mask.cpp}, {c.block_m}, {c.block_n}, {c.warps}, {c.stages}, "
            f"{PRODUCTS[precision]}{_tf32_options(c)}>",
            c.threads, tf32_smem_bytes(dt, c, precision))
    if isinstance(c, WgmmaTf32FwdConfig):
        precision = check_precision(precision)
        if c.producer:
            if dt > (128 if c.q_staged else 64) or (c.raw_stages != 0 if c.presplit else c.raw_stages < 1) \
                    or c.stages < 2:
                raise ValueError(f"cupyflash: the tf32 wgmma producer kernel takes head dims up to 64 (128 with "
                                 f"q_staged), raw_stages >= 1 (0 with presplit) and stages >= 2, not d{dt} {c}")
            if dt > 64 and not c.presplit:  # its producer's split spills at d128 (flash_fwd_tf32_wgmma_ws.cu)
                raise ValueError(f"cupyflash: the tf32 wgmma producer kernel takes d{dt} with presplit only: {c}")
            if tf32_wgmma_smem_bytes(dt, c) > 227 * 1024:
                raise ValueError(f"cupyflash: the tf32 wgmma producer kernel's tiles take more than 227 KiB at "
                                 f"d{dt}: {c}")
            if c.hh_chain not in (2, 4) or (c.hh_chain != 2 and not (c.sums_apart and precision == "ieee")):
                raise ValueError(f"cupyflash: the tf32 wgmma producer kernel chains hi hi over 2 or 4 k-steps, 4 "
                                 f"with sums_apart and precision \"ieee\" only (the apart sums' chains): {c}")
            # HH_CHAIN's default (2) left out of the expression: the names and expressions before it
            hh_chain = 0 if c.hh_chain == 2 else c.hh_chain
            return Specialization(
                f"flash_fwd_tf32_wgmma_ws_{short}_hdim{dt}_{mask.name}_bm{c.block_m}_bn{c.block_n}_{precision}"
                f"_s{c.stages}_raw{c.raw_stages}{'_apart' if c.sums_apart else ''}"
                f"{'_pingpong' if c.pingpong else ''}{'_presplit' if c.presplit else ''}"
                f"{'_qstaged' if c.q_staged else ''}{f'_hh{c.hh_chain}' if hh_chain else ''}",
                "flash_fwd_tf32_wgmma_ws.cu",
                f"cf::flash_fwd_tf32_wgmma_ws<{dt}, {mask.cpp}, {c.block_n}, {PRODUCTS[precision]}, {c.stages}, "
                f"{c.raw_stages}{_template_options(c.sums_apart, c.pingpong, c.presplit, c.q_staged, hh_chain)}>",
                c.threads, tf32_wgmma_smem_bytes(dt, c), arch="90a")
        if c.hh_chain != 2:
            raise ValueError(f"cupyflash: hh_chain takes the tf32 wgmma producer kernel (producer=True), not {c}")
        if c.q_staged:
            raise ValueError(f"cupyflash: q_staged takes the tf32 wgmma producer kernel (producer=True), not {c}")
        if c.presplit:
            raise ValueError(f"cupyflash: presplit takes the tf32 wgmma producer kernel (producer=True), not {c}")
        if c.pingpong:
            raise ValueError(f"cupyflash: pingpong takes the tf32 wgmma producer kernel (producer=True), not {c}")
        # v1's options only where set: v0's names and expressions unchanged
        options = _template_options(c.raw_stages, c.q_registers, c.sums_apart)
        return Specialization(
            f"flash_fwd_tf32_wgmma_{short}_hdim{dt}_{mask.name}_bm{c.block_m}_bn{c.block_n}_{precision}"
            f"{f'_raw{c.raw_stages}' if c.raw_stages else ''}{'_qregs' if c.q_registers else ''}"
            f"{'_apart' if c.sums_apart else ''}",
            "flash_fwd_tf32_wgmma.cu",
            f"cf::flash_fwd_tf32_wgmma<{dt}, {mask.cpp}, {c.block_n}, {PRODUCTS[precision]}{options}>",
            c.threads, tf32_wgmma_smem_bytes(dt, c), arch="90a")
    if isinstance(c, DmmaFwdConfig):
        if name != "float64":
            raise TypeError(f"cupyflash: flash_fwd_dmma is float64 only, not {name}")
        # the template's defaults (m_tiles 1, Q in registers, one block per SM) add nothing to the
        # name or the expression: dmma-fwd-v1's names unchanged
        options = [str(c.m_tiles), "true" if c.q_in_regs else "false", str(c.min_blocks),
                   "true" if c.wide else "false"]
        while options and options[-1] == ["1", "true", "1", "false"][len(options) - 1]:
            options.pop()
        suffix = (f"{f'_mt{c.m_tiles}' if c.m_tiles != 1 else ''}{'' if c.q_in_regs else '_qsmem'}"
                  f"{f'_mb{c.min_blocks}' if c.min_blocks != 1 else ''}{'_wide' if c.wide else ''}")
        return Specialization(f"flash_fwd_dmma_{short}_hdim{dt}_{mask.name}_bm{c.block_m}_bn{c.block_n}_w{c.warps}{suffix}",
                              "flash_fwd_dmma.cu",
                              f"cf::flash_fwd_dmma<{dt}, {mask.cpp}, {c.block_n}, {c.warps}{''.join(', ' + o for o in options)}>",
                              c.threads, dmma_smem_bytes(dt, c), arch="90" if c.wide else "")
    if isinstance(c, FwdConfig):
        return Specialization(
            f"flash_fwd_mma_{short}_hdim{dt}_{mask.name}_bm{c.block_m}_bn{c.block_n}_w{c.warps}"
            f"_{'qreg' if c.q_in_regs else 'qsmem'}_s{c.stages}_mb{c.min_blocks}_{c.row_state}",
            "flash_fwd_mma.cu",
            f"cf::flash_fwd_mma<{ctype}, {dt}, {mask.cpp}, {c.block_m}, {c.block_n}, {c.warps}, "
            f"{'true' if c.q_in_regs else 'false'}, {c.stages}, {c.min_blocks}, {ROW_STATES[c.row_state]}>",
            c.threads, smem_bytes(dt, c))
    raise TypeError(f"cupyflash: not a forward tile configuration: {tiles!r}")


def simt_specialization(kind: str, dtype, headdim: int, mask: Mask | bool) -> Specialization:
    """One of the SIMT family's kernels, ``kind`` "fwd", "stats", "dkdv" or "dq", on its tiles."""
    return _simt_spec(kind, dtype_name(dtype), d_tile(headdim, SIMT_D_TILES), as_mask(mask),
                      simt_tiles(dtype, headdim))


def _simt_spec(kind: str, name: str, dt: int, mask: Mask, tiles: SimtTiles) -> Specialization:
    """Rows of the shared-memory tiles are padded by one element."""
    bm, bn, tpr = tiles
    ab = 8 if name == "float64" else 4  # accumulator bytes
    ld = dt + 1
    if kind == "fwd":
        smem = ab * (bm * ld + 2 * bn * ld + bm * (bn + 1))
        threads, fn = bm * tpr, "flash_fwd_simt"
    elif kind == "dkdv":
        smem = ab * (2 * bn * ld + 2 * bm * ld + 2 * bn * (bm + 1) + 4 * bm)
        threads, fn = bn * tpr, "flash_bwd_dkdv_simt"
    elif kind == "dq":
        smem = ab * (2 * bm * ld + 2 * bn * ld + bm * (bn + 1))
        threads, fn = bm * tpr, "flash_bwd_dq_simt"
    elif kind == "stats":  # flash_bwd_dq_simt's tiles without its dS tile
        smem = ab * (2 * bm * ld + 2 * bn * ld)
        threads, fn = bm * tpr, "flash_bwd_stats_simt"
    else:
        raise ValueError(kind)
    return Specialization(f"{fn}_{SHORT_NAMES[name]}_hdim{dt}_{mask.name}_bm{bm}_bn{bn}_tpr{tpr}", f"{fn}.cu",
                          f"cf::{fn}<{CTYPES[name]}, {dt}, {mask.cpp}, {bm}, {bn}, {tpr}>", threads, smem)

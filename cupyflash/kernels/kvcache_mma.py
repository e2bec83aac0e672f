"""The KV-cache forward on tensor cores (``kernels_cu/flash_fwd_kvcache_mma.cu``) and its split
combine (``kernels_cu/flash_fwd_combine.cu``): float16 / bfloat16, head dims multiples of 8 up
to 256, contiguous or paged caches of any page size, each sequence its own cached length.

A call is one launch of (m_blocks x num_splits, nheads_kv, batch) CTAs, m_blocks the 16 WARPS-row
blocks of the seqlen_q * group packed (query, head) rows of one kv head, and with num_splits > 1
one combine launch. ``plan`` picks the tiles and the split count from the shape and the device
(``num_splits_heuristic``, ``paged_num_splits_heuristic`` for paged caches); the caller may set
num_splits itself (flash-attn's argument).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from ._module import Specialization, launch
from .constants import CTYPES, SHORT_NAMES, TENSOR_CORE_D_TILES, d_tile
from .params import (CACHE_FWD_PARAMS, COMBINE_PARAMS, _set_scales, check_block_map, fast_divmod, pointer,
                     set_cache_rows, set_rows, set_variant)
from .mma_fwd import _check_layout
from .._dtypes import dtype_name, is_16bit
from ..masks import KINDS, VARIANT_KINDS, Mask
from ..plans import tensor_core_supports

__all__ = ["CacheTiles", "cache_tiles", "specialization", "combine_specialization", "specializations",
           "num_splits_heuristic", "paged_num_splits_heuristic", "split_layout", "supports", "forward", "smem_bytes", "MAX_SPLITS", "COMBINE_ROWS"]

MAX_SPLITS = 128  # flash_fwd_combine.cu's COMBINE_MAX_SPLITS (its lanes hold 4 splits each)
COMBINE_ROWS = 4  # flash_fwd_combine.cu's COMBINE_ROWS_PER_BLOCK


class CacheTiles(NamedTuple):
    row_warps: int  # 16-row strips: BLOCK_M = 16 row_warps
    key_warps: int  # warps per strip, each on block_n / key_warps keys of every tile
    block_n: int    # keys per tile
    stages: int     # K/V tiles in the ring (stages - 1 in flight)

    @property
    def block_m(self) -> int:
        return 16 * self.row_warps

    @property
    def threads(self) -> int:
        return 32 * self.row_warps * self.key_warps


# Decode (at most 16 packed rows): one strip, four warps on the keys of each 64-key tile. d128
# from the H200 sweep of docs/perf-log.md ("kvcache"): 1 x 4 warps with 64-key tiles and 3 stages
# (2 CTAs per SM) or 2 stages (3 per SM) within 3% of each other on every decode shape; one warp
# per CTA, the first version, 2% to 50% slower (paged caches most: the row lookups of a tile on 32
# threads instead of 128).
_DECODE_TILES = {64: CacheTiles(1, 4, 64, 4), 128: CacheTiles(1, 4, 64, 3), 256: CacheTiles(1, 4, 64, 2)}
# Many packed rows (chunked prefill, long speculation): four strips share each K/V tile.
_PREFILL_TILES = {64: CacheTiles(4, 1, 64, 3), 128: CacheTiles(4, 1, 64, 2), 256: CacheTiles(4, 1, 32, 2)}
# Decode with user modifiers: at d64 the float16 kernel of the compile check's modifiers spills 8
# bytes (96 registers) with four key warps, at sm_90 with 3 or 4 stages and at sm_80 with 2;
# two key warps of 32 keys each do not, at either arch.
_USER_DECODE_TILES = {64: CacheTiles(1, 2, 64, 4)}


def supports(dtype, headdim: int) -> bool:
    """float16 / bfloat16 with a head dim that is a multiple of 8, 8..256 (the cache is not padded):
    the 16-bit tensor-core forward's condition (plans.tensor_core_supports, which also admits
    float32: this kernel has no tf32 form yet, float32 caches take the dense forward)."""
    return is_16bit(dtype) and tensor_core_supports(dtype, headdim)


def cache_tiles(dt: int, packed_rows: int, mask: Mask | None = None) -> CacheTiles:
    """The tiles for head-dim tile ``dt`` and seqlen_q * group packed rows per kv head (and
    ``mask``'s user modifiers, where it has them)."""
    if packed_rows > 16:
        return _PREFILL_TILES[dt]
    user = mask is not None and mask.score.user is not None
    return _USER_DECODE_TILES.get(dt, _DECODE_TILES[dt]) if user else _DECODE_TILES[dt]


def smem_bytes(dt: int, tiles: CacheTiles, paged: bool = False) -> int:
    """CacheSmemLayout<...>::BYTES: the Q tile and STAGES K and V tiles, 16-bit; a paged cache's
    RowOffsetRing after them (two slots of a 16-byte offset pair per key of a tile, and STAGES slots
    of a 4-byte page id per key)."""
    ring = (2 * 16 + 4 * tiles.stages) * tiles.block_n
    return 2 * dt * (tiles.block_m + 2 * tiles.stages * tiles.block_n) + (ring if paged else 0)


def specialization(dtype, dt: int, mask: Mask, tiles: CacheTiles, paged: bool, split: bool) -> Specialization:
    name = dtype_name(dtype)
    t = tiles
    flag = {True: "true", False: "false"}
    return Specialization(
        f"flash_fwd_kvcache_mma_{SHORT_NAMES[name]}_hdim{dt}_{mask.name}_rw{t.row_warps}_kw{t.key_warps}"
        f"_bn{t.block_n}_s{t.stages}"
        f"_{'paged' if paged else 'rows'}_{'split' if split else 'whole'}",
        "flash_fwd_kvcache_mma.cu",
        f"cf::flash_fwd_kvcache_mma<{CTYPES[name]}, {dt}, {mask.cpp}, {t.row_warps}, {t.key_warps}, {t.block_n}, "
        f"{t.stages}, {flag[paged]}, {flag[split]}>",
        t.threads, smem_bytes(dt, t, paged))


def combine_specialization(dtype) -> Specialization:
    name = dtype_name(dtype)
    return Specialization(f"flash_fwd_combine_{SHORT_NAMES[name]}", "flash_fwd_combine.cu",
                          f"cf::flash_fwd_combine<{CTYPES[name]}>", 32 * COMBINE_ROWS, 0)


def specializations() -> list:
    """Every specialization a call can launch (the compile check builds them for sm_80 and sm_90)."""
    out = []
    for dtype in ("float16", "bfloat16"):
        for rows in (16, 17):  # decode, prefill
            for dt in _DECODE_TILES:
                for mask in (m for m in KINDS + VARIANT_KINDS if not m.score.dropout):  # no dropout in decoding
                    # user modifiers: the mask element by element, without a block map (its CTAs mix
                    # query heads, and a map is made for one dense problem)
                    mask = mask.with_score(mask.score.without_block_map)
                    tiles = cache_tiles(dt, rows, mask)
                    for paged in (False, True):
                        for split in (False, True):
                            out.append(specialization(dtype, dt, mask, tiles, paged, split))
        out.append(combine_specialization(dtype))
    return list(dict.fromkeys(out))


def split_layout(key_blocks: int, num_splits: int) -> tuple[int, int]:
    """(splits, key tiles per split) that a request for ``num_splits`` splits of ``key_blocks``
    key tiles runs as: whole tiles per split, as many splits as it takes to cover the tiles (fewer
    than asked where the tiles do not divide: 32 tiles in 31 splits are 16 splits of 2)."""
    key_blocks = max(1, int(key_blocks))
    wanted = max(1, min(int(num_splits), key_blocks, MAX_SPLITS))
    per_split = math.ceil(key_blocks / wanted)
    return math.ceil(key_blocks / per_split), per_split


def num_splits_heuristic(ctas: int, sms: int, key_blocks: int, max_splits: int = MAX_SPLITS) -> int:
    """Splits of the keys for ``ctas`` CTAs (m_blocks x nheads_kv x batch) on a device of ``sms``
    multiprocessors, with ``key_blocks`` key tiles in the longest sequence: the count whose CTAs
    come closest to one per SM (the fewer splits on a tie), among the counts that run as asked
    (split_layout's); no split for a grid that already has a CTA per SM.

    Why one per SM: each decode CTA keeps its stages of K and V tiles in flight, and one of them
    per SM already streams K+V at the device's bandwidth; more CTAs share their SMs and only add
    partial results to the combine. Measured on the H200 (132 SMs, bf16 d128, one query token,
    ``python -m cupyflash.bench.kvcache_decode --splits``): 1 x 32/8 heads at 128k keys, 16 splits
    (128 CTAs) 4.07 TB/s, 32 (256 CTAs, every slot of two per SM) 3.84; 8 x 32/8 at 32k, 2 splits
    (128 CTAs) 4.36, 4 (256) 4.26. The rule before this one filled the slots (two CTAs per SM) and
    was 3-6% slower there; paged caches keep it (paged_num_splits_heuristic) until measured."""
    if ctas <= 0 or key_blocks <= 1 or ctas >= sms:
        return 1
    limit = max(1, min(max_splits, key_blocks))
    candidates = sorted({split_layout(key_blocks, t)[0] for t in range(1, limit + 1)})
    return min(candidates, key=lambda s: (abs(ctas * s - sms), s))


def paged_num_splits_heuristic(ctas: int, slots: int, key_blocks: int, max_splits: int = MAX_SPLITS) -> int:
    """The split rule of paged caches, for ``ctas`` CTAs on a device that holds ``slots`` of them
    at once: the one all layouts had before num_splits_heuristic's sweep, which measured
    contiguous caches only (a paged cache's per-row page lookups may want the second CTA per SM
    to hide their latency; ``kvcache_decode --splits`` measures page 16 too, not yet run). The
    candidates are the split counts that can run (split_layout's, up to what fills the device
    four times over and one key tile per split); each is scored by how full its last wave is
    (waves / ceil(waves)), and of those within 95% of the best score the fewest splits win. A grid
    that fills the device in whole waves is not split. (85%, as flash-attn has it, left 12% of the
    H200 idle at 1 x 32/8 heads and 128k keys: 232 CTAs on 264 slots.)"""
    if ctas <= 0 or key_blocks <= 1:
        return 1
    limit = max(1, min(max_splits, key_blocks, math.ceil(4 * slots / ctas)))
    candidates = sorted({split_layout(key_blocks, t)[0] for t in range(1, limit + 1)})

    def efficiency(s: int) -> float:
        waves = ctas * s / slots
        return waves / math.ceil(waves)

    best = max(efficiency(s) for s in candidates)
    return next(s for s in candidates if efficiency(s) >= 0.95 * best)


@functools.lru_cache(maxsize=None)
def _slots(spec: Specialization, device: int) -> int:
    """CTAs of ``spec`` device ``device`` holds at once: per SM the fewest that its registers
    (the compiled kernel's, allocated per warp in units of 256), its shared memory (1 KiB of it
    reserved per block), its 2048 threads and 32 blocks allow, times the SMs."""
    import cupy

    from ._module import get_function

    attributes = cupy.cuda.Device(device).attributes
    warps = spec.threads // 32
    warp_regs = -(-get_function(spec).num_regs * 32 // 256) * 256
    by_regs = int(attributes["MaxRegistersPerMultiprocessor"]) // (warp_regs * warps)
    by_smem = int(attributes["MaxSharedMemoryPerMultiprocessor"]) // (spec.smem_bytes + 1024)
    per_sm = min(32, by_regs, by_smem, int(attributes["MaxThreadsPerMultiProcessor"]) // spec.threads)
    return int(attributes["MultiProcessorCount"]) * max(1, per_sm)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])


class CachePlan(NamedTuple):
    spec: Specialization
    tiles: CacheTiles
    grid: tuple
    num_splits: int
    split_keys: int


def plan(dtype, headdim: int, mask: Mask, *, batch: int, seqlen_q: int, group: int, nheads_kv: int,
         max_seqlen_k: int, paged: bool, num_splits: int = 0, tiles: CacheTiles | None = None) -> CachePlan:
    """Kernel, grid and split of one call (num_splits 0: the heuristic's choice; ``tiles``: other
    tiles than the table's, for tuning). Kept per device and arguments: a decode loop asks the
    same question every step, and the answer took about a tenth of a call's host time."""
    dt = d_tile(headdim, TENSOR_CORE_D_TILES)
    chosen = cache_tiles(dt, seqlen_q * group, mask) if tiles is None else tiles
    key_blocks = max(1, math.ceil(max_seqlen_k / chosen.block_n))  # all the plan needs of max_seqlen_k
    device = None
    if num_splits == 0:
        import cupy

        device = cupy.cuda.Device().id
    # the mask by its name (band, score, a modifier's hash): a call's Modifiers object is new each
    # call, and the plan depends only on the specialization it names
    key = (np.dtype(dtype), headdim, mask.name, batch, seqlen_q, group, nheads_kv, key_blocks, paged, num_splits,
           tiles, device)
    planned = _PLANS.get(key)
    if planned is None:
        if len(_PLANS) >= 4096:  # a long-running server's many shapes: start over rather than grow
            _PLANS.clear()
        planned = _PLANS[key] = _plan(dtype, headdim, mask, batch=batch, seqlen_q=seqlen_q, group=group,
                                      nheads_kv=nheads_kv, max_seqlen_k=max_seqlen_k, paged=paged,
                                      num_splits=num_splits, tiles=tiles)
    return planned


_PLANS: dict = {}


def _plan(dtype, headdim: int, mask: Mask, *, batch: int, seqlen_q: int, group: int, nheads_kv: int,
          max_seqlen_k: int, paged: bool, num_splits: int, tiles: CacheTiles | None) -> CachePlan:
    dt = d_tile(headdim, TENSOR_CORE_D_TILES)
    tiles = cache_tiles(dt, seqlen_q * group, mask) if tiles is None else tiles
    m_blocks = math.ceil(seqlen_q * group / tiles.block_m)
    key_blocks = max(1, math.ceil(max_seqlen_k / tiles.block_n))
    if num_splits == 0:
        import cupy

        device, ctas = cupy.cuda.Device().id, m_blocks * nheads_kv * batch
        if paged:
            probe = specialization(dtype, dt, mask, tiles, paged, True)
            num_splits = paged_num_splits_heuristic(ctas, _slots(probe, device), key_blocks)
        else:
            num_splits = num_splits_heuristic(ctas, _multiprocessors(device), key_blocks)
    num_splits, per_split = split_layout(key_blocks, num_splits)  # no split past the longest sequence
    split_keys = per_split * tiles.block_n
    split = num_splits > 1
    return CachePlan(specialization(dtype, dt, mask, tiles, paged, split), tiles,
                     (m_blocks * num_splits, nheads_kv, batch), num_splits, split_keys)


def forward(q, k_cache, v_cache, o, lse, *, seqlens_k, block_table, page_size: int, paged: bool, max_seqlen_k: int,
            softmax_scale: float, mask: Mask, variant=None, num_splits: int = 0, tiles: CacheTiles | None = None,
            row_pages: bool = False) -> int:
    """o (like q) and lse ((batch, nheads, seqlen_q) float32, C-contiguous) of q over the caches,
    on the current stream. ``seqlens_k`` (batch,) int32 and ``block_table`` (batch, n) int32 CuPy
    arrays (a contiguous cache: each sequence's row, one column, page_size its capacity);
    ``variant`` a scores.Variant with CuPy arrays (user modifiers without a block map: ``mask``'s
    score.without_block_map); ``tiles`` overrides the plan's (the tuner). ``row_pages``: the table's
    entries count cache rows, not cache batch entries (params.set_cache_rows). Returns the split count."""
    import cupy

    batch, seqlen_q, nheads, headdim = q.shape
    nheads_kv, headdim_v = k_cache.shape[2], v_cache.shape[3]
    if batch == 0 or seqlen_q == 0 or nheads == 0:
        return 0
    for a, what in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache"), (o, "o")):
        _check_layout(a, what)
    if lse.dtype != np.float32 or not lse.flags.c_contiguous or lse.shape != (batch, nheads, seqlen_q):
        raise ValueError("cupyflash: lse must be a C-contiguous float32 (batch, nheads, seqlen_q) array")
    for a, what in ((seqlens_k, "seqlens_k"), (block_table, "block_table")):
        if a.dtype != np.int32 or (a.shape[-1] > 1 and a.strides[-1] != 4):
            raise ValueError(f"cupyflash: {what} must be int32 with a contiguous last dimension")
    planned = plan(q.dtype, max(headdim, headdim_v), mask, batch=batch, seqlen_q=seqlen_q, group=nheads // nheads_kv,
                   nheads_kv=nheads_kv, max_seqlen_k=max_seqlen_k, paged=paged, num_splits=num_splits, tiles=tiles)

    check_block_map(mask, variant)
    params = np.zeros(1, CACHE_FWD_PARAMS)
    for name, a in (("q", q), ("o", o)):
        set_rows(params, name, a)
    set_cache_rows(params, k_cache, v_cache, row_pages)
    params["lse"] = pointer(lse)
    params["batch"], params["seqlen_q"], params["seqlen_k"] = batch, seqlen_q, max_seqlen_k
    params["nheads"], params["nheads_kv"], params["group"] = nheads, nheads_kv, nheads // nheads_kv
    params["headdim"], params["headdim_v"] = headdim, headdim_v
    params["window_left"], params["window_right"] = mask.window_args()
    _set_scales(params, softmax_scale)
    set_variant(params, variant)
    params["seqlens_k"], params["block_table"] = pointer(seqlens_k), pointer(block_table)
    params["block_table_stride"] = np.int64(block_table.strides[0] // 4 if block_table.shape[0] > 1 else 0)
    params["page"]["divisor"], params["page"]["multiplier"], params["page"]["shift"] = fast_divmod(page_size)
    params["num_splits"], params["split_keys"] = np.int32(planned.num_splits), np.int32(planned.split_keys)
    if planned.num_splits == 1:
        launch(planned.spec, planned.grid, (params,))
        return 1

    from ..testing import poison_enabled

    # NaN under testing.poisoned_outputs: a split that saw no key of a row leaves its o unwritten,
    # and the combine must not read it.
    empty = (lambda shape: cupy.full(shape, np.nan, np.float32)) if poison_enabled() else \
        (lambda shape: cupy.empty(shape, np.float32))
    o_partial = empty((planned.num_splits, batch, nheads, seqlen_q, headdim_v))
    lse_partial = empty((planned.num_splits, batch, nheads, seqlen_q))
    params["o_partial"], params["lse_partial"] = pointer(o_partial), pointer(lse_partial)
    launch(planned.spec, planned.grid, (params,))

    combine = np.zeros(1, COMBINE_PARAMS)
    combine["o_partial"], combine["lse_partial"] = pointer(o_partial), pointer(lse_partial)
    set_rows(combine, "o", o)
    combine["lse"] = pointer(lse)
    sink = None if variant is None else variant.sink
    combine["sink"] = pointer(sink)
    combine["num_splits"], combine["batch"], combine["seqlen_q"] = planned.num_splits, batch, seqlen_q
    combine["nheads"], combine["headdim"] = nheads, headdim_v
    launch(combine_specialization(q.dtype), (math.ceil(batch * nheads * seqlen_q / COMBINE_ROWS), 1, 1), (combine,))
    return planned.num_splits

"""Model of kernels_cu/wgmma_tf32_bwd_steps.cuh (perf log tf32-wgmma-bwd-v0): the float32 backward's
rows-times-rows products on split panel tiles (Tf32RowsTimesRows), the accumulator-times-tile
products (wgmma_tf32.cuh's tf32_acc_times_tile, the forward's O += P V) and the store of a
warpgroup's 64 accumulator rows. The products are emulated k-step by k-step from what the tensor
cores read (models/tf32.py tensor_core_reads) through the descriptors (models/wgmma_tf32.py), in
float64: a layout slip moves a value to another row or column and shows as an O(1) error, where the
split's own error is 2^-21 relative.
"""
from __future__ import annotations

import numpy as np

from .mirrors import mirrors
from .tf32 import split_tf32, tensor_core_reads
from .wgmma_tf32 import (p_as_a_registers, split_tf32_panels, split_tf32_panels_transposed, tf32_a_fragment_matrix,
                         tf32_k_step_desc, tf32_k_step_desc_after, tf32_operand)

STEPS = "wgmma_tf32_bwd_steps.cuh"
NTHREADS = 128


@mirrors(STEPS,
         "const u64 a_hi_desc = tf32_k_step_desc_after<A_ROWS>(tf32_k_step_desc<A_ROWS>(a_hi, 0), kk);",
         "const u64 b_hi_desc = tf32_k_step_desc_after<B_ROWS>(tf32_k_step_desc<B_ROWS>(b_hi, 0), kk);",
         "WgmmaTf32<B_ROWS>::ss(small, tf32_k_step_desc_after<A_ROWS>(tf32_k_step_desc<A_ROWS>(a_lo, 0), kk),",
         "tf32_k_step_desc_after<B_ROWS>(tf32_k_step_desc<B_ROWS>(b_lo, 0), kk), 1);",
         "WgmmaTf32<B_ROWS>::ss(hh, a_hi_desc, b_hi_desc, hh_accumulates);")
def rows_times_rows(smem, d_tile: int, a_rows: int, b_rows: int, a_hi: int, a_lo: int, b_hi: int,
                    b_lo: int) -> np.ndarray:
    """The a_rows x b_rows product the three ss wgmmas of every k-step form (lo hi + hi lo + hi
    hi), A and B read K-major through their descriptors."""
    out = np.zeros((a_rows, b_rows))
    for kk in range(d_tile // 8):
        def read(tile, rows):
            desc = tf32_k_step_desc_after(rows, tf32_k_step_desc(rows, tile, 0), kk)
            return tensor_core_reads(tf32_operand(smem, desc, rows))
        ah, al, bh, bl = read(a_hi, a_rows), read(a_lo, a_rows), read(b_hi, b_rows), read(b_lo, b_rows)
        out += al @ bh.T + ah @ bl.T + ah @ bh.T
    return out


@mirrors(STEPS,
         "static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 4;",
         "static constexpr u32 K = 0, KT = 2 * KV_TILE, V = 4 * KV_TILE, BYTES = 6 * KV_TILE;",
         "split_tf32_panels_both<BLOCK_N, D_TILE, NTHREADS, PRODUCTS>(tiles + T::K, tiles + T::K + T::KV_TILE,",
         "tiles + T::KT, tiles + T::KT + T::KV_TILE, k,",
         "split_tf32_panels<BLOCK_N, D_TILE, NTHREADS, PRODUCTS>(tiles + T::V, tiles + T::V + T::KV_TILE, v, keys_valid,")
def key_block_tiles(d_tile: int, block_n: int) -> dict:
    """Tf32KeyBlockTiles' offsets in bytes (each lo tile KV_TILE past its hi tile) and BYTES: the
    tiles split_key_block_tf32 fills, K and K^T from k (K^T with KEY_PAIRS), V from v."""
    kv_tile = block_n * d_tile * 4
    return {"KV_TILE": kv_tile, "K": 0, "KT": 2 * kv_tile, "V": 4 * kv_tile, "BYTES": 6 * kv_tile}


def split_key_block(smem, tiles: int, d_tile: int, block_n: int, threads: int, k, v, keys_valid: int, headdim: int,
                    headdim_v: int) -> None:
    """split_key_block_tf32 into the words of ``smem`` from byte ``tiles`` (models/wgmma_tf32.py's
    splits, three products)."""
    t = key_block_tiles(d_tile, block_n)
    for tile, x, hd, transposed in (("K", k, headdim, False), ("KT", k, headdim, True), ("V", v, headdim_v, False)):
        split = split_tf32_panels_transposed if transposed else split_tf32_panels
        split(3, smem, smem, tiles + t[tile], tiles + t[tile] + t["KV_TILE"], block_n, d_tile, threads, x, keys_valid,
              hd, **({"key_pairs": True} if transposed else {}))


@mirrors("split_image.cuh",
         "if constexpr (PACKED) return (i64)(begin / BLOCK + seq.index + j) * nheads + head;",
         "else return ((i64)seq.batch * nheads + head) * ((seqlen + BLOCK - 1) / BLOCK) + j;")
def image_block(packed: bool, block: int, index: int, batch: int, begin: int, seqlen: int, nheads: int, head: int,
                j: int) -> int:
    """image_block: which block of a split-once image holds block j of a sequence's head."""
    if packed:
        return (begin // block + index + j) * nheads + head
    return (batch * nheads + head) * (-(-seqlen // block)) + j


@mirrors(STEPS,
         "return image_block<PACKED, BLOCK_N>(seq, seq.k_begin, p.seqlen_k, p.nheads_kv, head_kv, j) *",
         "Tf32KeyBlockTiles<D_TILE, BLOCK_N>::BYTES;")
def kv_image_offset(packed: bool, d_tile: int, block_n: int, nheads_kv: int, seqlen_k: int, index: int, batch: int,
                    k_begin: int, head_kv: int, j: int) -> int:
    """Where key block j of a sequence's kv head lies in the kv_split image, in bytes."""
    return (image_block(packed, block_n, index, batch, k_begin, seqlen_k, nheads_kv, head_kv, j)
            * key_block_tiles(d_tile, block_n)["BYTES"])


STAT_SLOTS = 4  # dmma_bwd_steps.cuh's StatSlot: lse, delta, weight, dp_ref


@mirrors(STEPS,
         "static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 4;",
         "static constexpr u32 Q = 0, DO = 2 * Q_TILE, QT = 4 * Q_TILE, DOT = 6 * Q_TILE, STATS = 8 * Q_TILE;",
         "static constexpr u32 BYTES = STATS + STAT_SLOTS * BLOCK_M * 4;",
         "split_tf32_panels_both<BLOCK_M, D_TILE, NTHREADS, PRODUCTS>(tiles + T::Q, tiles + T::Q + T::Q_TILE,",
         "tiles + T::QT, tiles + T::QT + T::Q_TILE, q,",
         "split_tf32_panels_both<BLOCK_M, D_TILE, NTHREADS, PRODUCTS>(tiles + T::DO, tiles + T::DO + T::Q_TILE,",
         "tiles + T::DOT, tiles + T::DOT + T::Q_TILE, dout,")
def query_block_tiles(d_tile: int, block_m: int) -> dict:
    """Tf32QueryBlockTiles' offsets in bytes (each lo tile Q_TILE past its hi tile) and BYTES."""
    q_tile = block_m * d_tile * 4
    layout = {"Q_TILE": q_tile, "Q": 0, "DO": 2 * q_tile, "QT": 4 * q_tile, "DOT": 6 * q_tile, "STATS": 8 * q_tile}
    layout["BYTES"] = layout["STATS"] + STAT_SLOTS * block_m * 4
    return layout


@mirrors(STEPS,
         "row[STAT_LSE * BLOCK_M] = valid ? ldg(static_cast<const float*>(p.lse) + stat) : 0.f;",
         "row[STAT_DELTA * BLOCK_M] = valid ? ldg(static_cast<const float*>(p.delta) + stat) : 0.f;",
         "row[STAT_WEIGHT * BLOCK_M] = valid && weight != nullptr ? ldg(weight + stat) : 0.f;",
         "row[STAT_DP_REF * BLOCK_M] = valid && dp_ref != nullptr ? ldg(dp_ref + stat) : 0.f;")
def split_query_block(smem, tiles: int, d_tile: int, block_m: int, threads: int, q, dout, rows_valid: int,
                      headdim: int, headdim_v: int, stats=None) -> None:
    """split_query_block_tf32 into the words of ``smem`` from byte ``tiles`` (both slices natural
    and KEY_PAIRS-transposed, three products), then query_row_stats for rows < block_m from
    ``stats`` ([STAT_SLOTS][rows] float32: lse, delta, weight, dp_ref; None: zeros), zeros past
    rows_valid."""
    t = query_block_tiles(d_tile, block_m)
    for tile, x, hd in (("Q", q, headdim), ("DO", dout, headdim_v)):
        for name, transposed in ((tile, False), (tile + "T", True)):
            split = split_tf32_panels_transposed if transposed else split_tf32_panels
            split(3, smem, smem, tiles + t[name], tiles + t[name] + t["Q_TILE"], block_m, d_tile, threads, x,
                  rows_valid, hd, **({"key_pairs": True} if transposed else {}))
    words = np.zeros((STAT_SLOTS, block_m), np.float32)
    if stats is not None:
        valid = min(rows_valid, block_m)
        words[:, :valid] = stats[:, :valid]
    at = (tiles + t["STATS"]) // 4
    smem[at: at + words.size] = words.reshape(-1).view(np.uint32)


@mirrors(STEPS,
         "return image_block<PACKED, BLOCK_M>(seq, seq.q_begin, p.seqlen_q, p.nheads, head, i) *",
         "Tf32QueryBlockTiles<D_TILE, BLOCK_M>::BYTES;")
def q_image_offset(packed: bool, d_tile: int, block_m: int, nheads: int, seqlen_q: int, index: int, batch: int,
                   q_begin: int, head: int, i: int) -> int:
    """Where query block i of a sequence's query head lies in the q_split image, in bytes."""
    return (image_block(packed, block_m, index, batch, q_begin, seqlen_q, nheads, head, i)
            * query_block_tiles(d_tile, block_m)["BYTES"])


@mirrors("split_image.cuh",
         "for (int c = thread; c < static_cast<int>(BYTES / 16); c += NTHREADS) {",
         "ld_shared_v4(r, tiles + 16 * c);",
         "image[c] = make_uint4(r[0], r[1], r[2], r[3]);")
def store_image_block(image: np.ndarray, at: int, smem: np.ndarray, tiles: int, nbytes: int) -> None:
    """store_image_block: the block's bytes at byte ``tiles`` of shared memory, word for word, to
    byte ``at`` of the image (uint32 words; the 16-byte chunks' order across threads changes no word)."""
    image[at // 4: at // 4 + nbytes // 4] = smem[tiles // 4: tiles // 4 + nbytes // 4]


def acc_times_tile(smem, d_tile: int, k_cols: int, acc, b_hi: int, b_lo: int) -> np.ndarray:
    """tf32_acc_times_tile's product, 64 x d_tile: A = the accumulator values acc[thread, f, e] of
    a 64 x k_cols product, k-step f's registers relabelled (p_as_a_registers, whose mirrors are
    the helper's statements) and split, B = the KEY_PAIRS tile's k-step f, N = d_tile rows."""
    out = np.zeros((64, d_tile))
    for f in range(k_cols // 8):
        a_hi, a_lo = split_tf32(3, p_as_a_registers(acc[:, f, :]))
        ah, al = (tf32_a_fragment_matrix(tensor_core_reads(x)) for x in (a_hi, a_lo))
        bh = tensor_core_reads(tf32_operand(smem, tf32_k_step_desc_after(d_tile, tf32_k_step_desc(d_tile, b_hi, 0), f),
                                            d_tile))
        bl = tensor_core_reads(tf32_operand(smem, tf32_k_step_desc_after(d_tile, tf32_k_step_desc(d_tile, b_lo, 0), f),
                                            d_tile))
        out += al @ bh.T + ah @ bl.T + ah @ bh.T
    return out


@mirrors(STEPS,
         "const int row = 16 * warp + g + 8 * h;",
         "const int col = 8 * j + 2 * t;",
         "*reinterpret_cast<float2*>(out + col) = make_float2(acc[4 * j + 2 * h] * scale, acc[4 * j + 2 * h + 1] * scale);")
def store_acc_rows(acc_flat: np.ndarray, d_tile: int) -> np.ndarray:
    """The 64 x d_tile block store_acc_rows_f32 stores from acc_flat[thread, 4 j + 2 h + e]."""
    out = np.full((64, d_tile), np.nan)
    warp, lane = np.arange(NTHREADS) // 32, np.arange(NTHREADS) % 32
    g, t = lane // 4, lane % 4
    for h in range(2):
        row = 16 * warp + g + 8 * h
        for j in range(d_tile // 8):
            col = 8 * j + 2 * t
            out[row, col] = acc_flat[:, 4 * j + 2 * h]
            out[row, col + 1] = acc_flat[:, 4 * j + 2 * h + 1]
    return out


def split_into(layout: dict, d_tile: int, splits) -> np.ndarray:
    """Shared memory (one uint32 word a slot, from the aligned base; `layout` a kernel's offsets)
    after the given splits, as the kernels call wgmma_tf32.cuh's loaders (PRODUCTS 3): each
    (tile, rows, rows_valid, headdim, slice, transposed), into the tiles tile + "_HI" and
    tile + "_LO", transposed ones in KEY_PAIRS order."""
    smem = np.full(layout["BYTES"] // 4, 0xFFFFFFFF, np.uint32)
    for tile, rows, rows_valid, headdim, x, transposed in splits:
        split = split_tf32_panels_transposed if transposed else split_tf32_panels
        split(3, smem, smem, layout[tile + "_HI"], layout[tile + "_LO"], rows, d_tile, NTHREADS, x, rows_valid,
              headdim, **({"key_pairs": True} if transposed else {}))
    return smem


def accumulator_positions(cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of value v = 4 f + e of each thread's 64 x cols accumulator, as [thread, v]
    arrays: row 16 warp + g + 8 (e / 2), column 8 f + 2 t + e % 2 (g = lane / 4, t = lane % 4)."""
    warp, lane = np.arange(NTHREADS) // 32, np.arange(NTHREADS) % 32
    g, t = lane // 4, lane % 4
    rows = np.zeros((NTHREADS, cols // 2), int)
    columns = np.zeros_like(rows)
    for f in range(cols // 8):
        for e in range(4):
            rows[:, 4 * f + e] = 16 * warp + g + 8 * (e >> 1)
            columns[:, 4 * f + e] = 8 * f + 2 * t + (e & 1)
    return rows, columns


def fresh_operands(seed: int, rows: int, other_rows: int, rows_valid: int, other_valid: int, headdim: int,
                   headdim_v: int, d_tile: int = 64) -> tuple[list, list]:
    """Two slices of `rows` rows (K and V, or Q and dO) then two of `other_rows`, float32 with every
    mantissa bit in use, and their parts the zero-filled tiles hold in float64 (rows < the pair's
    valid count, columns < headdim for the first of a pair and headdim_v for the second)."""
    rng = np.random.default_rng(seed)
    slices = [rng.standard_normal((n, d_tile)).astype(np.float32) for n in (rows, rows, other_rows, other_rows)]
    valid = [valid_part(x, rv, hd) for x, rv, hd in zip(slices, (rows_valid, rows_valid, other_valid, other_valid),
                                                         (headdim, headdim_v, headdim, headdim_v))]
    return slices, valid


def emulate(kernel_model, block: int, cta_valid: int, block_valid: int, headdim: int, headdim_v: int, seed: int,
            d_tile: int = 64) -> tuple[dict, list]:
    """A kernel model's products() on one CTA block (kernel_model.CTA_ROWS rows: K and V, or Q and
    dO) and one walked block of `block` rows, of fresh operands, and the operands' valid parts in
    float64 (in that order: what the products must equal)."""
    slices, valid = fresh_operands(seed, kernel_model.CTA_ROWS, block, cta_valid, block_valid, headdim, headdim_v,
                                   d_tile)
    smem = kernel_model.load_tiles(d_tile, block, *slices, cta_valid, block_valid, headdim, headdim_v)
    return kernel_model.products(smem, d_tile, block), valid


def valid_part(x: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """x in float64 with rows >= rows and columns >= cols zeroed (what the zero-filled tiles hold)."""
    out = np.zeros(x.shape)
    out[:rows, :cols] = x[:rows, :cols]
    return out


def close(got: np.ndarray, want: np.ndarray) -> bool:
    """Within the three-product split's error (2^-21 relative per product), with room for sums."""
    return bool(np.abs(got - want).max() <= 2.0 ** -19 * (1 + np.abs(want).max()))



def split_grid(batch: int, seqlen: int, nheads: int, block: int, cu_seqlens=None):
    """The working CTAs of a split-once kernel's grid (flash_bwd_split_kv_tf32, _split_q_tf32):
    (packed, index, batch, begin, length, head, j, rows) for each sequence (dense: batch b; packed:
    sequence b of batch 0, from cu_seqlens), head and block j of the grid (ceil(seqlen / block)
    blocks, the longest sequence's when packed), less the blocks past a packed sequence's end (the
    kernels' early return); rows: the block's rows on the tensors' sequence axis."""
    packed = cu_seqlens is not None
    if packed:
        sequences = [(b, 0, int(cu_seqlens[b]), int(cu_seqlens[b + 1] - cu_seqlens[b]))
                     for b in range(len(cu_seqlens) - 1)]
        grid_blocks = -(-max([n for *_, n in sequences] + [0]) // block)
    else:
        sequences = [(b, b, 0, seqlen) for b in range(batch)]
        grid_blocks = -(-seqlen // block)
    for index, batch_of, begin, length in sequences:
        for head in range(nheads):
            for j in range(grid_blocks):
                r0 = j * block
                if packed and r0 >= length:
                    continue
                yield packed, index, batch_of, begin, length, head, j, slice(begin + r0, begin + min(r0 + block, length))


def split_key_blocks_into_image(block_n: int, nbytes: int, k, v, cu_seqlens_k, image_bytes: int, split, offset):
    """split_key_block_into_image run by every working CTA of the grid (split_grid): the block's
    rows (zeros past the sequence's end) split by ``split(smem, kb, vb, keys_valid)`` into a fresh
    shared buffer of ``nbytes``, its bytes stored at ``offset(packed, index, batch, begin, head,
    j)`` of the image (uint32 words, 0xFFFFFFFF where no CTA wrote). k, v: (batch, seqlen_k,
    nheads_kv, dim) float32; a packed batch is batch 1 with cu_seqlens_k."""
    batch, seqlen_k, nheads_kv = k.shape[:3]
    image = np.full(image_bytes // 4, 0xFFFFFFFF, np.uint32)
    for packed, index, batch_of, k_begin, length, head_kv, j, rows in split_grid(batch, seqlen_k, nheads_kv, block_n,
                                                                                 cu_seqlens_k):
        smem = np.full(nbytes // 4, 0xFFFFFFFF, np.uint32)
        kb, vb = (np.zeros((block_n, x.shape[3]), np.float32) for x in (k, v))
        kb[: rows.stop - rows.start] = k[batch_of, rows, head_kv]
        vb[: rows.stop - rows.start] = v[batch_of, rows, head_kv]
        split(smem, kb, vb, length - j * block_n)
        store_image_block(image, offset(packed, index, batch_of, k_begin, head_kv, j), smem, 0, nbytes)
    return image

@mirrors(STEPS,
         "constexpr int HALF = NV / 2;",
         "float* const handed = trade;",
         "float* const results = trade + NV * 128;",
         "const int mine0 = wg * HALF, theirs0 = HALF - mine0;",
         "for (int v = 0; v < HALF; ++v) handed[(theirs0 + v) * 128 + wg_tid] = wg == 0 ? x[HALF + v] : x[v];",
         "const float own = wg == 0 ? x[v] : x[HALF + v], other = handed[(mine0 + v) * 128 + wg_tid];",
         "a[v] = wg == 0 ? own : other;",
         "b[v] = wg == 0 ? other : own;",
         "step(a, b, wg * (NV / 8));",
         "results[(mine0 + v) * 128 + wg_tid] = a[v];",
         "if constexpr (BOTH) results[(NV + mine0 + v) * 128 + wg_tid] = b[v];",
         "first[v] = results[v * 128 + wg_tid];",
         "if constexpr (BOTH) second[v] = results[(NV + v) * 128 + wg_tid];")
def pair_element_steps(x: list, step, both: bool) -> list:
    """pair_element_steps for one thread index of both warpgroups: x[wg] the warpgroup's NV values
    (0: warpgroup 0's product, 1: warpgroup 1's); step(a, b, f0) -> (a, b) on a half's values.
    Returns [(first, second)] of each warpgroup (second None without BOTH); the two phases run one
    after the other as the barriers order them, the trade a dict of written slots (a read of a slot
    no one wrote raises KeyError)."""
    nv = len(x[0])
    half = nv // 2
    handed, results = {}, {}
    for wg in (0, 1):
        mine0, theirs0 = wg * half, half - wg * half
        for v in range(half):
            handed[theirs0 + v] = x[wg][half + v] if wg == 0 else x[wg][v]
    out = []
    staged = []
    for wg in (0, 1):
        mine0 = wg * half
        a, b = [], []
        for v in range(half):
            own = x[wg][v] if wg == 0 else x[wg][half + v]
            other = handed[mine0 + v]
            a.append(own if wg == 0 else other)
            b.append(other if wg == 0 else own)
        a, b = step(a, b, wg * (nv // 8))
        staged.append((mine0, a, b))
    for mine0, a, b in staged:
        for v in range(half):
            results[mine0 + v] = a[v]
            if both:
                results[nv + mine0 + v] = b[v]
    for wg in (0, 1):
        first = [results[v] for v in range(nv)]
        second = [results[nv + v] for v in range(nv)] if both else None
        out.append((first, second))
    return out


__all__ = ["STEPS", "split_into", "pair_element_steps", "rows_times_rows", "acc_times_tile", "store_acc_rows", "accumulator_positions", "fresh_operands", "emulate",
           "valid_part", "close", "split_grid", "image_block", "store_image_block",
           "split_key_blocks_into_image"]


@mirrors(STEPS,
         "constexpr int LINES = D_TILE * 4 / 128;",
         "const int line = thread % LINES, row = thread / LINES % BLOCK_M;",
         "const bool is_q = thread < BLOCK_M * LINES;",
         "const float* const at = (is_q ? q + row * p.q.row_stride : dout + row * p.dout.row_stride) + 32 * line;",
         "if (row < rows_valid && 32 * line < (is_q ? p.headdim : p.headdim_v)) asm volatile(\"prefetch.global.L1 [%0];\" ::\"l\"(at));",
         "if (thread < 4 && rows_valid > 0) {",
         "const float* const slot = static_cast<const float*>(thread < 2 ? p.lse : p.delta);",
         "const int stat_row = thread % 2 == 0 ? 0 : min(rows_valid, BLOCK_M) - 1;")
def prefetched_lines(block_m: int, d_tile: int, nthreads: int, rows_valid: int, headdim: int,
                     headdim_v: int) -> list[tuple[str, int, int]]:
    """prefetch_query_block_l1's lines, (tensor, row, first float of the line), one a thread: a
    row's 128-byte lines of D_TILE floats, Q's rows then dO's, only rows < rows_valid and lines
    that start inside the head dim; then (slot, row, 0) for the first and the last valid row's
    lse and delta (threads 0-3; weight and dp_ref, rarer, not: more spilled at sm_90a)."""
    lines = d_tile * 4 // 128
    out = []
    for thread in range(nthreads):
        line, row = thread % lines, thread // lines % block_m
        is_q = thread < block_m * lines
        if row < rows_valid and 32 * line < (headdim if is_q else headdim_v):
            out.append(("q" if is_q else "do", row, 32 * line))
        if thread < 4 and rows_valid > 0:
            stat_row = 0 if thread % 2 == 0 else min(rows_valid, block_m) - 1
            out.append(("lse" if thread < 2 else "delta", stat_row, 0))
    return out

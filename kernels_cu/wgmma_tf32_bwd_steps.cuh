// The float32 backward's tile steps on tf32 wgmma (sm_90a), shared by flash_bwd_dkdv_tf32_wgmma.cu
// and flash_bwd_dq_tf32_wgmma.cu (docs/perf-log.md tf32-wgmma-bwd-v0): the rows-times-rows
// products S = Q K^T / dP = dO V^T (and their transposes) from split panel tiles, the dQ kernels'
// rows and element step, and the store of a warpgroup's 64 accumulator rows. The
// accumulator-times-tile products (dV, dK, dQ) are wgmma_tf32.cuh's tf32_acc_times_tile, the
// forward's O += P V.
#pragma once

#include "common.cuh"
#include "dmma_bwd_steps.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"
#include "split_image.cuh"
#include "wgmma_tf32.cuh"

namespace cf {

// One k-step of A B^T for tf32_product_sums: A of A_ROWS rows (64, wgmma's M) and B of B_ROWS rows
// (wgmma's N), both K-major panel tiles in shared memory, hi and lo; the small products (lo hi,
// hi lo; PRODUCTS 3) into `small`, starting at k-step 0, and hi hi into `hh`. S^T = K Q^T in the
// dK/dV kernel (A = K, B = Q), S = Q K^T in the dQ kernel (A = Q, B = K), and dP's likewise.
template <int A_ROWS, int B_ROWS, int PRODUCTS = 3>
struct Tf32RowsTimesRows {
    u32 a_hi, a_lo, b_hi, b_lo;  // tiles
    __device__ __forceinline__ void operator()(int kk, float (&small)[B_ROWS / 2], float (&hh)[B_ROWS / 2],
                                               int hh_accumulates) const {
        // (each tile's descriptor the same expression at every kk: computed once, advanced a k-step)
        const u64 a_hi_desc = tf32_k_step_desc_after<A_ROWS>(tf32_k_step_desc<A_ROWS>(a_hi, 0), kk);
        const u64 b_hi_desc = tf32_k_step_desc_after<B_ROWS>(tf32_k_step_desc<B_ROWS>(b_hi, 0), kk);
        if constexpr (Tf32Operand<PRODUCTS>::SPLIT) {
            WgmmaTf32<B_ROWS>::ss(small, tf32_k_step_desc_after<A_ROWS>(tf32_k_step_desc<A_ROWS>(a_lo, 0), kk),
                                  b_hi_desc, kk > 0);
            WgmmaTf32<B_ROWS>::ss(small, a_hi_desc,
                                  tf32_k_step_desc_after<B_ROWS>(tf32_k_step_desc<B_ROWS>(b_lo, 0), kk), 1);
        }
        WgmmaTf32<B_ROWS>::ss(hh, a_hi_desc, b_hi_desc, hh_accumulates);
    }
};

// S and dP (the dK/dV kernel: S^T and dP^T) of a block, one product after the other (each
// PRODUCTS tf32 products a k-step, apart with APART: tf32_product_sums), both waited for.
template <int K_STEPS, bool APART, int A_ROWS, int B_ROWS, int PRODUCTS>
__device__ __forceinline__ void tf32_scores_and_dp(float (&s)[B_ROWS / 2], float (&dp)[B_ROWS / 2],
                                                   const Tf32RowsTimesRows<A_ROWS, B_ROWS, PRODUCTS>& s_tiles,
                                                   const Tf32RowsTimesRows<A_ROWS, B_ROWS, PRODUCTS>& dp_tiles) {
    constexpr bool SPLIT = Tf32Operand<PRODUCTS>::SPLIT;
    tf32_product_sums<B_ROWS / 2, K_STEPS, SPLIT, APART>(s, s_tiles, NoTurns());
    tf32_product_sums<B_ROWS / 2, K_STEPS, SPLIT, APART>(dp, dp_tiles, NoTurns());
}

// A key block's K and V split for flash_bwd_dq_tf32_wgmma_ws's (and _pair's) products, in bytes
// from a 1024-byte aligned base (the swizzle's atom): K (hi, then lo) K-major for S = Q K^T, K^T
// (KEY_PAIRS) for dQ += dS K, V for dP = dO V^T. The same bytes are one stage of that kernel's
// ring and one block of the image flash_bwd_split_kv_tf32 writes (BwdParams' kv_split), so a
// stage may be filled by the split itself or by one bulk copy of the image.
template <int D_TILE, int BLOCK_N>
struct Tf32KeyBlockTiles {
    static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 4;
    static constexpr u32 K = 0, KT = 2 * KV_TILE, V = 4 * KV_TILE, BYTES = 6 * KV_TILE;
};

// Splits keys [0, keys_valid) of K and V (read through `k` and `v`, tf32_panels' sources) into
// Tf32KeyBlockTiles at `tiles`, spread over NTHREADS threads; the rest zero-filled.
template <int D_TILE, int BLOCK_N, int NTHREADS, int PRODUCTS, class Source>
__device__ __forceinline__ void split_key_block_tf32(u32 tiles, const Source& k, const Source& v, int keys_valid,
                                                     int headdim, int headdim_v, int thread) {
    typedef Tf32KeyBlockTiles<D_TILE, BLOCK_N> T;
    split_tf32_panels_both<BLOCK_N, D_TILE, NTHREADS, PRODUCTS>(tiles + T::K, tiles + T::K + T::KV_TILE,
                                                                tiles + T::KT, tiles + T::KT + T::KV_TILE, k,
                                                                keys_valid, headdim, thread);
    split_tf32_panels<BLOCK_N, D_TILE, NTHREADS, PRODUCTS>(tiles + T::V, tiles + T::V + T::KV_TILE, v, keys_valid,
                                                           headdim_v, thread);
}

// A dQ kernel's key blocks (flash_bwd_dq_tf32_wgmma, _pair): its kv head's K and V rows, the
// walk's blocks of the CTA's BLOCK_M query rows from m0 (first .. end, KeyBlockRange), and their
// raw rows RAW_STAGES blocks ahead (Tf32RawStages; 0: the split reads global memory). copy_first()
// before the walk; land(j, split) for block j: split(k_source, v_source) into the tiles between
// the barriers that make it safe, the tiles whole for wgmma on return, the copies ahead issued.
template <int BLOCK_N, int BLOCK_M, int D_TILE, int NTHREADS, int RAW_STAGES>
struct Tf32KeyBlocks {
    const BwdParams& p;
    const float* __restrict__ k_rows;
    const float* __restrict__ v_rows;
    int first, end, seqlen_k, thread;
    Tf32RawStages<BLOCK_N, D_TILE, NTHREADS, RAW_STAGES> stages;

    template <class Mask>
    __device__ __forceinline__ Tf32KeyBlocks(const BwdParams& p_, const SequenceRows& seq, const Mask& mask,
                                             int head_kv, int m0, u32 raw, int thread_)
        : p(p_), k_rows(p_.k.row<const float>(seq.batch, seq.k_begin, head_kv)),
          v_rows(p_.v.row<const float>(seq.batch, seq.k_begin, head_kv)), seqlen_k(seq.seqlen_k), thread(thread_),
          stages{raw} {
        const KeyBlockRange<BLOCK_N> keys(mask, m0, BLOCK_M);
        first = keys.first, end = keys.end;
    }

    __device__ __forceinline__ void copy(int j) const {
        stages.copy(j, j < end, j * BLOCK_N, k_rows, p.k.row_stride, p.headdim, v_rows, p.v.row_stride, p.headdim_v,
                    seqlen_k, thread);
    }
    __device__ __forceinline__ void copy_first() const {
        stages.copy_first(first, [&](int j) { copy(j); });
    }
    template <class Split>
    __device__ __forceinline__ void land(int j, const Split& split) const {
        const int n0 = j * BLOCK_N;
        stages.land(j, GlobalRows{k_rows + n0 * p.k.row_stride, p.k.row_stride},
                    GlobalRows{v_rows + n0 * p.v.row_stride, p.v.row_stride}, split, [&](int ahead) { copy(ahead); });
    }
};

// Where key block j of sequence `seq`'s kv head `head_kv` lies in the kv_split image, in bytes
// (blocks of Tf32KeyBlockTiles' BYTES; image_block's order).
template <bool PACKED, int D_TILE, int BLOCK_N>
__device__ __forceinline__ i64 kv_image_offset(const BwdParams& p, const SequenceRows& seq, int head_kv, int j) {
    return image_block<PACKED, BLOCK_N>(seq, seq.k_begin, p.seqlen_k, p.nheads_kv, head_kv, j) *
           Tf32KeyBlockTiles<D_TILE, BLOCK_N>::BYTES;
}

// A query block's Q and dO split for flash_bwd_dkdv_tf32_wgmma_ws's products, with its rows'
// statistics, in bytes from a 1024-byte aligned base: Q, dO (hi, then lo; K-major) for S^T = K Q^T
// and dP^T = V dO^T, Q^T and dO^T (KEY_PAIRS) for dK += dS^T Q and dV += P^T dO, then
// [STAT_SLOTS][BLOCK_M] floats (StatSlot's order). The same bytes are one stage of that kernel's
// ring and one block of the image flash_bwd_split_q_tf32 writes (BwdParams' q_split).
template <int D_TILE, int BLOCK_M>
struct Tf32QueryBlockTiles {
    static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 4;
    static constexpr u32 Q = 0, DO = 2 * Q_TILE, QT = 4 * Q_TILE, DOT = 6 * Q_TILE, STATS = 8 * Q_TILE;
    static constexpr u32 BYTES = STATS + STAT_SLOTS * BLOCK_M * 4;
};

// Splits rows [0, rows_valid) of Q and dO (read through `q` and `dout`) into Tf32QueryBlockTiles
// at `tiles`, spread over NTHREADS threads; the rest zero-filled.
template <int D_TILE, int BLOCK_M, int NTHREADS, int PRODUCTS, class Source>
__device__ __forceinline__ void split_query_block_tf32(u32 tiles, const Source& q, const Source& dout, int rows_valid,
                                                       int headdim, int headdim_v, int thread) {
    typedef Tf32QueryBlockTiles<D_TILE, BLOCK_M> T;
    split_tf32_panels_both<BLOCK_M, D_TILE, NTHREADS, PRODUCTS>(tiles + T::Q, tiles + T::Q + T::Q_TILE,
                                                                tiles + T::QT, tiles + T::QT + T::Q_TILE, q,
                                                                rows_valid, headdim, thread);
    split_tf32_panels_both<BLOCK_M, D_TILE, NTHREADS, PRODUCTS>(tiles + T::DO, tiles + T::DO + T::Q_TILE,
                                                                tiles + T::DOT, tiles + T::DOT + T::Q_TILE, dout,
                                                                rows_valid, headdim_v, thread);
}

// The next query block's Q and dO rows (rows < rows_valid, columns < the head dims) into L1, one
// 128-byte line a thread (prefetch.global.L1: no register, no shared memory), and its rows' lse
// and delta (stat0: the first row's index; the lines of the first and the last row, threads 0-3;
// weight and dp_ref, rarer, not: with them ptxas spilled 32-104 bytes at sm_90a). For the pair's
// dK/dV kernel with PREFETCH, whose split reads global memory (perf log tf32-pair-prefetch: its
// shared memory has no room for a raw stage).
template <int BLOCK_M, int D_TILE, int NTHREADS>
__device__ __forceinline__ void prefetch_query_block_l1(const BwdParams& p, const float* q, const float* dout,
                                                        int rows_valid, i64 stat0, int thread) {
    constexpr int LINES = D_TILE * 4 / 128;  // a row's lines
    static_assert(2 * BLOCK_M * LINES == NTHREADS, "one line a thread: Q's rows, then dO's");
    const int line = thread % LINES, row = thread / LINES % BLOCK_M;
    const bool is_q = thread < BLOCK_M * LINES;
    const float* const at = (is_q ? q + row * p.q.row_stride : dout + row * p.dout.row_stride) + 32 * line;
    if (row < rows_valid && 32 * line < (is_q ? p.headdim : p.headdim_v)) asm volatile("prefetch.global.L1 [%0];" ::"l"(at));
    if (thread < 4 && rows_valid > 0) {
        const float* const slot = static_cast<const float*>(thread < 2 ? p.lse : p.delta);
        const int stat_row = thread % 2 == 0 ? 0 : min(rows_valid, BLOCK_M) - 1;
        asm volatile("prefetch.global.L1 [%0];" ::"l"(slot + stat0 + stat_row));
    }
}

// Row r (< BLOCK_M) of a query block's statistics into `stats` ([STAT_SLOTS][BLOCK_M] floats), from
// the call's buffers at the row's index `stat`: zeros past the end and where the call has none.
template <int BLOCK_M>
__device__ __forceinline__ void query_row_stats(float* stats, const BwdParams& p, i64 stat, bool valid, int r) {
    const float* const weight = static_cast<const float*>(p.weight);
    const float* const dp_ref = static_cast<const float*>(p.dp_ref);
    float* const row = stats + r;
    row[STAT_LSE * BLOCK_M] = valid ? ldg(static_cast<const float*>(p.lse) + stat) : 0.f;
    row[STAT_DELTA * BLOCK_M] = valid ? ldg(static_cast<const float*>(p.delta) + stat) : 0.f;
    row[STAT_WEIGHT * BLOCK_M] = valid && weight != nullptr ? ldg(weight + stat) : 0.f;
    row[STAT_DP_REF * BLOCK_M] = valid && dp_ref != nullptr ? ldg(dp_ref + stat) : 0.f;
}

// Where query block i of sequence `seq`'s query head `head` lies in the q_split image, in bytes
// (blocks of Tf32QueryBlockTiles' BYTES; image_block's order, as kv_image_offset places key blocks).
template <bool PACKED, int D_TILE, int BLOCK_M>
__device__ __forceinline__ i64 q_image_offset(const BwdParams& p, const SequenceRows& seq, int head, int i) {
    return image_block<PACKED, BLOCK_M>(seq, seq.q_begin, p.seqlen_q, p.nheads, head, i) *
           Tf32QueryBlockTiles<D_TILE, BLOCK_M>::BYTES;
}

// One query block's tiles in a dK/dV kernel: K and V (64 rows), the block's Q and dO (natural,
// K-major) and Q^T and dO^T (KEY_PAIRS), each the hi tile's address, its lo tile right after it.
struct Tf32DkdvTiles {
    u32 k, v, q, dout, qt, dot;
};

// Step 4 of a query block in the dK/dV kernels, for the warpgroup values of the 64 keys n0..: S^T
// and dP^T (in s and ds) into P^T (times dropout's keep mask) in s and dS^T in ds, by the float32
// element step (dmma_bwd_steps.cuh's score_entry / ds_entry) from the block's row statistics
// (stats: [STAT_SLOTS][BLOCK_M] floats, StatSlot's order). Value 4 f + e of a thread is key row
// 16 warp + g + 8 (e / 2), query 8 f + 2 t + e % 2 (warp: within the warpgroup). Two copies, with
// and without the element mask and a user mask's predicate: a block the mask policy holds whole
// (partial() false) needs neither. One copy (the masked one) where the policy hides nothing inside
// the sequences. NF column blocks of 8 queries from block f0 (all of them by default; the pair
// kernel's warpgroups take half each, s and ds then that half's values).
template <int BLOCK_M, int NF = BLOCK_M / 8, class Mask>
__device__ __forceinline__ void tf32_dkdv_element_step(float (&s)[NF * 4], float (&ds)[NF * 4], const float* stats,
                                                       const BwdParams& p, const SequenceRows& seq, const Mask& mask,
                                                       int head, int m0, int n0, int warp, int lane, int f0 = 0) {
    constexpr int BLOCK_N = 64;
    const int g = lane / 4, t = lane % 4;
    const int seqlen_q = seq.seqlen_q;
    const float scale_log2 = scale_log2_in<float>(p), scale = scale_in<float>(p), to_log2 = p.lse_to_log2;
    const float drop_scale = DropoutOf<Mask>::ENABLED ? dropout_scale_in<float>(p) : 1.f;
    const bool has_weight = p.weight != nullptr, has_dp_ref = p.dp_ref != nullptr;
    const ScoreOf<Mask, float> score(score_problem<Mask>(p, seq), seq.index, head, scale);
    const DropoutOf<Mask> dropout(p, seq.index, head);
    auto element_step = [&](auto partial) {
#pragma unroll
        for (int f = 0; f < NF; ++f)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int qi = 8 * (f0 + f) + 2 * t + (e & 1), q_row = m0 + qi;
                const int key = n0 + 16 * warp + g + 8 * (e >> 1);
                // lse = -inf marks a row with no visible key: P = 0, as a row past the end
                const float top = q_row < seqlen_q ? stats[STAT_LSE * BLOCK_M + qi] * to_log2 : neg_inf<float>();
                const float row_weight = has_weight ? stats[STAT_WEIGHT * BLOCK_M + qi] : 1.f;
                const float row_dp_ref = has_dp_ref ? stats[STAT_DP_REF * BLOCK_M + qi] : 0.f;
                const float row_delta = stats[STAT_DELTA * BLOCK_M + qi];
                const int v = 4 * f + e;
                const auto x = score_entry(s[v], ds[v], q_row, key, top == neg_inf<float>(), mask, score, dropout,
                                           drop_scale, partial);
                const float p_ij = x.hidden ? 0.f : recomputed_p_exact(x.s, scale_log2, top, row_weight);
                s[v] = x.kept ? p_ij : 0.f;
                ds[v] = ds_entry<Mask>(x, p_ij, row_dp_ref, row_delta);
            }
    };
    // The pair's halves (NF < BLOCK_M / 8) under dropout: one copy, the masked one, on every block.
    // With both copies beside Philox's words ptxas spilled 120-176 bytes at sm_90a (causal, window);
    // with one, none, and the element test costs a few instructions beside the generator's.
    if constexpr (DropoutOf<Mask>::ENABLED && NF < BLOCK_M / 8)
        element_step(Flag<true>());
    else
        masked_or_not(!hides_inside_sequences<Mask>() || mask.partial(m0, BLOCK_M, n0, BLOCK_N), element_step);
}

// Steps 2-6 of a query block in the dK/dV kernels (flash_bwd_dkdv_tf32_wgmma and its producer /
// consumer form _ws), for the warpgroup that owns the 64 keys n0..: S^T = K Q^T and dP^T = V dO^T;
// P^T and dS^T by tf32_dkdv_element_step; dV += P^T dO and dK += dS^T Q, each waited for before the
// next is split (the registers of one product's split operands at a time). dS^T is left in ds for
// the caller (the fused dQ's operand).
template <int D_TILE, int BLOCK_M, int PRODUCTS, bool SUMS_APART, class Mask>
__device__ __forceinline__ void tf32_dkdv_query_block(float (&dk_acc)[D_TILE / 2], float (&dv_acc)[D_TILE / 2],
                                                      float (&ds)[BLOCK_M / 2], const Tf32DkdvTiles& tiles,
                                                      const float* stats, const BwdParams& p,
                                                      const SequenceRows& seq, const Mask& mask, int head, int m0,
                                                      int n0, int warp, int lane) {
    constexpr int BLOCK_N = 64;
    constexpr u32 KV_TILE = BLOCK_N * D_TILE * 4, Q_TILE = BLOCK_M * D_TILE * 4;

    // Steps 2-3: S^T and dP^T, PRODUCTS tf32 products a k-step.
    float s[BLOCK_M / 2];
    tf32_scores_and_dp<D_TILE / 8, SUMS_APART>(
        s, ds, Tf32RowsTimesRows<BLOCK_N, BLOCK_M, PRODUCTS>{tiles.k, tiles.k + KV_TILE, tiles.q, tiles.q + Q_TILE},
        {tiles.v, tiles.v + KV_TILE, tiles.dout, tiles.dout + Q_TILE});

    // Step 4: P^T into s, dS^T into ds.
    tf32_dkdv_element_step<BLOCK_M>(s, ds, stats, p, seq, mask, head, m0, n0, warp, lane);

    // Steps 5-6: dV += P^T dO, dK += dS^T Q.
    tf32_acc_times_tile<D_TILE, BLOCK_M / 8, PRODUCTS, SUMS_APART>(dv_acc, s, tiles.dot, tiles.dot + Q_TILE,
                                                                 NoTurns());
    tf32_acc_times_tile<D_TILE, BLOCK_M / 8, PRODUCTS, SUMS_APART>(dk_acc, ds, tiles.qt, tiles.qt + Q_TILE,
                                                                 NoTurns());
}

// The pair kernels' role product (flash_bwd_dkdv_tf32_wgmma_pair: S^T = K Q^T or dP^T = V dO^T;
// flash_bwd_dq_tf32_wgmma_pair: S = Q K^T or dP = dO V^T): A = the warpgroup's 64 rows staged raw
// and split a k-step at a time (StagedQ, tf32_product_sums' PREPARE), B = B_ROWS rows of a K-major
// tile pair (b_hi, its lo tile at b_lo) over D_TILE columns; into x, waited for.
template <int D_TILE, int B_ROWS, int PRODUCTS, bool APART>
__device__ __forceinline__ void tf32_staged_times_rows(float (&x)[B_ROWS / 2], const StagedQ<D_TILE, PRODUCTS>& a,
                                                       u32 b_hi, u32 b_lo) {
    constexpr bool SPLIT = Tf32Operand<PRODUCTS>::SPLIT;
    const u64 b_hi_desc = tf32_k_step_desc<B_ROWS>(b_hi, 0), b_lo_desc = tf32_k_step_desc<B_ROWS>(b_lo, 0);
    u32 a_hi[4][4], a_lo[4][4];  // tf32_product_sums' four A slots
    auto prepare = [&](int kk) { a.split(kk, a_hi[kk & 3], a_lo[kk & 3]); };
    auto issue = [&](int kk, float(&small)[B_ROWS / 2], float(&hh)[B_ROWS / 2], int hh_accumulates) {
        const u64 b_hi_kk = tf32_k_step_desc_after<B_ROWS>(b_hi_desc, kk);
        if constexpr (SPLIT) {
            WgmmaTf32<B_ROWS>::rs(small, a_lo[kk & 3], b_hi_kk, kk > 0);
            WgmmaTf32<B_ROWS>::rs(small, a_hi[kk & 3], tf32_k_step_desc_after<B_ROWS>(b_lo_desc, kk), 1);
        }
        WgmmaTf32<B_ROWS>::rs(hh, a_hi[kk & 3], b_hi_kk, hh_accumulates);
    };
    tf32_product_sums<B_ROWS / 2, D_TILE / 8, SPLIT, APART, true>(x, issue, NoTurns(), prepare);
}

// The pair kernels' trade and element step. Warpgroup 0 holds its role product x (S^T or S),
// warpgroup 1 its own (dP^T or dP); thread i of either holds the same accumulator positions.
// Warpgroup h runs the element step on its half of the values only (NV / 2 values from h NV / 2:
// NV / 8 column blocks from block h NV / 8), step(a, b, f0) turning that half's inputs a (warpgroup
// 0's product) and b (warpgroup 1's) into its results in place. A first trade hands each warpgroup
// the other's product on its half, a second each one's results to the other: on return `first`
// (a's results: P^T, or the dQ kernel's dS) and with BOTH `second` (b's: dS^T) are whole in both.
// The trade's shared memory: [BOTH ? 3 : 2][NV][128] floats, value v of thread i at [v][i] (a
// warp's 32 accesses of one value are 32 banks); the caller's barriers before and after hold its
// accesses. (Each warpgroup reads back its own half too: taking it from its registers instead, a
// branch per warpgroup, cost 20-37 more instructions a block in the loop, not fewer.)
template <int NV, bool BOTH, class Step>
__device__ __forceinline__ void pair_element_steps(const float (&x)[NV], float (&first)[NV], float (&second)[NV],
                                                   float* trade, int wg, int wg_tid, const Step& step) {
    constexpr int HALF = NV / 2;
    float* const handed = trade;              // [NV][128]: each product on the other warpgroup's half
    float* const results = trade + NV * 128;  // [2][NV][128]: first's, second's
    const int mine0 = wg * HALF, theirs0 = HALF - mine0;  // this warpgroup's half, the other's
#pragma unroll
    for (int v = 0; v < HALF; ++v) handed[(theirs0 + v) * 128 + wg_tid] = wg == 0 ? x[HALF + v] : x[v];
    __syncthreads();
    float a[HALF], b[HALF];
#pragma unroll
    for (int v = 0; v < HALF; ++v) {
        const float own = wg == 0 ? x[v] : x[HALF + v], other = handed[(mine0 + v) * 128 + wg_tid];
        a[v] = wg == 0 ? own : other;
        b[v] = wg == 0 ? other : own;
    }
    step(a, b, wg * (NV / 8));
#pragma unroll
    for (int v = 0; v < HALF; ++v) {
        results[(mine0 + v) * 128 + wg_tid] = a[v];
        if constexpr (BOTH) results[(NV + mine0 + v) * 128 + wg_tid] = b[v];
    }
    __syncthreads();
#pragma unroll
    for (int v = 0; v < NV; ++v) {
        first[v] = results[v * 128 + wg_tid];
        if constexpr (BOTH) second[v] = results[(NV + v) * 128 + wg_tid];
    }
}

// The dQ kernels' query side (flash_bwd_dq_tf32_wgmma and its producer form): a thread's two
// rows of the CTA's 64 (16 warp + g + 8 h, warp within the warpgroup) with their statistics in
// registers, and the element step that turns a key block's S and dP into dS in place. Value
// 4 f + e of a thread is row h = e / 2 of its two, key 8 f + 2 t + e % 2 of the block.
struct Tf32DqRows {
    int q_row[2];
    RowStats<float> stats[2];
    float delta[2];

    template <class Params>
    __device__ __forceinline__ Tf32DqRows(const Params& p, const SequenceRows& seq, int head, int m0, int seqlen_q,
                                          int warp, int g) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            q_row[h] = m0 + 16 * warp + g + 8 * h;
            const bool valid = q_row[h] < seqlen_q;
            const i64 stat = seq.stat(p, head, valid ? q_row[h] : 0);
            stats[h] = valid ? row_stats<float>(p, stat) : no_row_stats<float>();
            delta[h] = valid ? ldg(static_cast<const float*>(p.delta) + stat) : 0.f;
        }
    }

    // `partial`: the mask policy's partial() of the block; a whole one takes no element test. NF
    // column blocks of 8 keys from block f0 (all by default; the pair kernel's warpgroups take half
    // each, s and dp then that half's values).
    template <int BLOCK_N, int NF = BLOCK_N / 8, class Mask, class Score, class Dropout>
    __device__ __forceinline__ void ds_in_place(float (&s)[NF * 4], const float (&dp)[NF * 4], int n0, int t,
                                                const Mask& mask, const Score& score, const Dropout& dropout,
                                                float drop_scale, float scale_log2, bool partial, int f0 = 0) const {
        auto element_step = [&](auto partial_) {
#pragma unroll
            for (int f = 0; f < NF; ++f)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int h = e >> 1, key = n0 + 8 * (f0 + f) + 2 * t + (e & 1), v = 4 * f + e;
                    const auto x = score_entry(s[v], dp[v], q_row[h], key, stats[h].top == neg_inf<float>(), mask,
                                               score, dropout, drop_scale, partial_);
                    const float p_ij = recomputed_p_exact(x.s, scale_log2, stats[h].top, stats[h].weight);
                    s[v] = ds_entry<Mask>(x, p_ij, stats[h].dp_ref, delta[h]);
                }
        };
        masked_or_not(!hides_inside_sequences<Mask>() || partial, element_step);
    }
};

// A warpgroup's 64 x D_TILE accumulator (value 4 j + 2 h + e of a thread: row 16 warp + g + 8 h,
// column 8 j + 2 t + e) times `scale`, stored as float32 pairs to rows row0 + r < rows_valid
// (row_at(r): the row's first element) and columns < columns (a multiple of 4: a pair is
// stored whole or not at all).
template <int D_TILE, class RowAt>
__device__ __forceinline__ void store_acc_rows_f32(const float (&acc)[D_TILE / 2], float scale, int rows_valid,
                                                   int columns, const RowAt& row_at, int warp, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = 16 * warp + g + 8 * h;
        if (row >= rows_valid) continue;
        float* const out = row_at(row);
#pragma unroll
        for (int j = 0; j < D_TILE / 8; ++j) {
            const int col = 8 * j + 2 * t;
            if (col < columns)
                *reinterpret_cast<float2*>(out + col) =
                    make_float2(acc[4 * j + 2 * h] * scale, acc[4 * j + 2 * h + 1] * scale);
        }
    }
}

}  // namespace cf

// The float64 backward's tile steps on the FP64 tensor cores (dmma.cuh), written once for its three
// kernels (flash_bwd_dkdv_dmma, flash_bwd_dq_dmma, flash_bwd_stats_dmma; issue 18).
//
// Accumulator layout. A warp's products are c[n][mt][e]: row g + 8 mt of its rows (M_TILES 8-row
// m-tiles), column 8 n + 2t + e. S and dP of the dQ and statistics kernels have the warp's query
// rows as rows and the key block as columns; S^T and dP^T of the dK/dV kernel the warp's keys as
// rows and the query block as columns. Each next product sums over those columns with the
// accumulator as its A fragment (dmma_k8's C -> A order): dQ += dS K, dV += P^T dO, dK += dS^T Q,
// and P, dS never leave their lanes.
//
// Why one S step: statistics="recomputed" (flash_bwd_stats_dmma) must find the very scores and dP
// the gradient kernels form, to the bit (flash_bwd_stats_simt.cu says why). Its kernel and the dQ
// kernel form them with dmma_rows_times_rows on the same tiles; the dK/dV kernel forms the
// transposes with the same function, K Q^T for Q K^T: each entry is the same products (a q_d k_d
// is k_d q_d) summed over the same k in the same order, one product shape (dmma_k8's WIDE) per
// plan. score_entry is the one element step all three take.
#pragma once

#include "block_walk.cuh"
#include "common.cuh"
#include "dmma.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"
#include "tf32.cuh"

namespace cf {

// C[n] = A B_n^T over DIM columns, C in the accumulator layout: A's rows g + 8 mt at a_frag + 8 mt LD
// (a_frag: row g, column t of an LD-strided tile), B's rows 8 n + g at b_frag + 8 n LD (the same
// offsets). C starts at zero.
template <int DIM, int N_TILES, int LD, int M_TILES, bool WIDE, bool TRANSPOSED = false>
__device__ __forceinline__ void dmma_rows_times_rows(double (&c)[N_TILES][M_TILES][2], const double* a_frag,
                                                     const double* b_frag) {
#pragma unroll
    for (int n = 0; n < N_TILES; ++n)
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) c[n][mt][0] = c[n][mt][1] = 0.0;
#pragma unroll
    for (int ks = 0; ks < DIM / 8; ++ks) {
        double a[M_TILES][2];
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) a[mt][0] = a_frag[8 * mt * LD + 8 * ks], a[mt][1] = a_frag[8 * mt * LD + 8 * ks + 4];
#pragma unroll
        for (int n = 0; n < N_TILES; ++n)
            dmma_k8<WIDE, M_TILES>(c[n], a, b_frag[8 * n * LD + 8 * ks], b_frag[8 * n * LD + 8 * ks + 4]);
    }
}

// C[dn] += P B over the N_TILES * 8 columns of P (accumulator layout): B's rows 8 n + 2t and
// 8 n + 2t + 1 at b_rows + 8 n LD and + LD (b_rows: row 2t, column g of an LD-strided tile), C's
// columns 8 dn + 2t + e of DIM.
template <int DIM, int N_TILES, int LD, int M_TILES, bool WIDE>
__device__ __forceinline__ void dmma_acc_times_rows(double (&c)[DIM / 8][M_TILES][2],
                                                    const double (&pm)[N_TILES][M_TILES][2], const double* b_rows) {
#pragma unroll
    for (int n = 0; n < N_TILES; ++n)
#pragma unroll
        for (int dn = 0; dn < DIM / 8; ++dn)
            dmma_k8<WIDE, M_TILES>(c[dn], pm[n], b_rows[8 * n * LD + 8 * dn], b_rows[8 * n * LD + LD + 8 * dn]);
}

// The same two steps on float32 (experiment: the float32 backward on these kernels): each
// product as three tf32 products of split operands, each k-step's three summed apart and added
// with one rounding (tf32.cuh's mma_tf32, STEP_SUMS: "ieee" accuracy), in m16n8k8's layout,
// which is m16n8k8 .f64's: two 8-row m-tiles, k-halves t and t + 4 (M_TILES 2 only).
//
// TRANSPOSED (the dK/dV kernel's S^T = K Q^T, dP^T = V dO^T): the two small products in the order
// of the query-side kernels' S = Q K^T (q_lo k_hi, then q_hi k_lo, there a_lo b_hi then a_hi b_lo),
// so that every entry is the same sum of the same products in the same order: the tensor core's
// accumulation truncates, and another order could change S's last bit, which statistics
// "recomputed" needs to the bit. (One .f64 product per k-step has no such order: TRANSPOSED is
// accepted there and changes nothing.)
template <int DIM, int N_TILES, int LD, int M_TILES, bool WIDE, bool TRANSPOSED = false>
__device__ __forceinline__ void dmma_rows_times_rows(float (&c)[N_TILES][M_TILES][2], const float* a_frag,
                                                     const float* b_frag) {
    static_assert(M_TILES == 2, "m16n8k8 .tf32 takes two 8-row m-tiles");
#pragma unroll
    for (int n = 0; n < N_TILES; ++n) c[n][0][0] = c[n][0][1] = c[n][1][0] = c[n][1][1] = 0.f;
    // rolled: unrolled, ptxas overlaps the k-steps' separate sums and spills (tf32.cuh, STEP_SUMS)
#pragma unroll 1
    for (int ks = 0; ks < DIM / 8; ++ks) {
        u32 a_hi[4], a_lo[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)  // a0..a3 = (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4)
            split_tf32<3>(a_frag[8 * (i % 2) * LD + 8 * ks + 4 * (i / 2)], a_hi[i], a_lo[i]);
#pragma unroll
        for (int n = 0; n < N_TILES; ++n) {
            u32 b_hi0, b_lo0, b_hi1, b_lo1;
            split_tf32<3>(b_frag[8 * n * LD + 8 * ks], b_hi0, b_lo0);
            split_tf32<3>(b_frag[8 * n * LD + 8 * ks + 4], b_hi1, b_lo1);
            // mma_tf32<3, STEP_SUMS>'s step, its two small products in the query-side order
            float step[4] = {0.f, 0.f, 0.f, 0.f};
            if constexpr (TRANSPOSED) {
                mma_1688_tf32(step, a_hi, b_lo0, b_lo1);
                mma_1688_tf32(step, a_lo, b_hi0, b_hi1);
            } else {
                mma_1688_tf32(step, a_lo, b_hi0, b_hi1);
                mma_1688_tf32(step, a_hi, b_lo0, b_lo1);
            }
            mma_1688_tf32(step, a_hi, b_hi0, b_hi1);
            float(&acc)[4] = reinterpret_cast<float(&)[4]>(c[n]);
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[e] = __fadd_rn(acc[e], step[e]);
        }
    }
}

template <int DIM, int N_TILES, int LD, int M_TILES, bool WIDE>
__device__ __forceinline__ void dmma_acc_times_rows(float (&c)[DIM / 8][M_TILES][2],
                                                    const float (&pm)[N_TILES][M_TILES][2], const float* b_rows) {
    static_assert(M_TILES == 2, "m16n8k8 .tf32 takes two 8-row m-tiles");
#pragma unroll
    for (int n = 0; n < N_TILES; ++n) {
        u32 a_hi[4], a_lo[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) split_tf32<3>(pm[n][i % 2][i / 2], a_hi[i], a_lo[i]);
#pragma unroll
        for (int dn = 0; dn < DIM / 8; ++dn) {
            u32 b_hi0, b_lo0, b_hi1, b_lo1;
            split_tf32<3>(b_rows[8 * n * LD + 8 * dn], b_hi0, b_lo0);
            split_tf32<3>(b_rows[8 * n * LD + LD + 8 * dn], b_hi1, b_lo1);
            mma_tf32<3, true>(reinterpret_cast<float(&)[4]>(c[dn]), a_hi, a_lo, b_hi0, b_hi1, b_lo0, b_lo1);
        }
    }
}

// The CTA of the two query-side kernels (flash_bwd_dq_dmma, flash_bwd_stats_dmma): BLOCK_M =
// 8 M_TILES NWARPS query rows of one head, each warp WARP_ROWS of them; the block's Q and dO rows
// stay in shared memory for the whole walk, and each key block's K and V come in by cp.async into
// the stage the previous block does not read, while that block computes. Rows are padded by 4
// elements (LD = D_TILE + 4, 4 mod 16 doubles): S's fragments read rows g, columns t, whose eight
// rows then start 8 banks apart (every half-warp's 16 doubles in distinct banks, as
// flash_fwd_dmma's Q and K); dQ's B fragments read K's rows 2t, columns g: a 2-way conflict per
// half-warp there. A kernel leaves at once where past_end(), then walk()s the key blocks.
template <int D_TILE, class Mask, int BLOCK_N, int NWARPS, int M_TILES, bool WIDE, typename A>
struct DmmaQueryCta {
    static constexpr int WARP_ROWS = 8 * M_TILES, BLOCK_M = WARP_ROWS * NWARPS, NTHREADS = NWARPS * 32;
    static constexpr int N_TILES = BLOCK_N / 8, LD = D_TILE + 4;
    static constexpr unsigned SMEM_BYTES = sizeof(A) * (2 * BLOCK_M * LD + 4 * BLOCK_N * LD);
    static_assert(D_TILE % 8 == 0 && BLOCK_N % 8 == 0, "m8n8k4 tiles");
    static_assert(!WIDE || M_TILES == 2, "m16n8k8 takes two 8-row m-tiles");
    static_assert(sizeof(A) == 8 || M_TILES == 2, "m16n8k8 .tf32 takes two 8-row m-tiles");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    static_assert(!WIDE || sizeof(A) == 4, "m16n8k8 .f64 needs sm_90");
#endif

    A* q_tile;    // [BLOCK_M][LD]
    A* do_tile;   // [BLOCK_M][LD]
    A* kv_tiles;  // [2 stages][K, V][BLOCK_N][LD]
    SequenceRows seq;
    A scale_log2, scale;
    Mask mask;
    int m0, head, head_kv;
    int g, t, w0;  // the lane's fragment row and column; the warp's first row in the block

    __device__ __forceinline__ DmmaQueryCta(const BwdParams& p, unsigned char* smem)
        : q_tile(reinterpret_cast<A*>(smem)),
          do_tile(q_tile + BLOCK_M * LD),
          kv_tiles(do_tile + BLOCK_M * LD),
          seq(cta_sequence<Mask>(p, blockIdx.z)),
          scale_log2(scale_log2_in<A>(p)),
          scale(scale_in<A>(p)),
          mask(cta_mask<Mask, CtaRows::QUERIES>(p, seq.index, seq.seqlen_q, seq.seqlen_k)),
          m0(Mask::query_block(blockIdx.x, gridDim.x) * BLOCK_M),
          head(blockIdx.y),
          head_kv(head / p.group),
          g(threadIdx.x % 32 / 4),
          t(threadIdx.x % 32 % 4),
          w0(threadIdx.x / 32 * WARP_ROWS) {}

    // A block past a shorter (packed) sequence's end: the kernel leaves at once.
    __device__ __forceinline__ bool past_end() const { return Mask::PACKED && m0 >= seq.seqlen_q; }

    // The walk: the first key block's K and V and the block's Q and dO rows copied (one commit
    // group), rows(), which reads what the kernel needs of its rows while they land, then per key
    // block visit(n0, k_tile, s, dp) with S = Q K^T and dP = dO V^T of the block in the
    // accumulator layout (its V tile follows k_tile); every copy waited for at the end (Q and
    // dO's too, where no key block was walked).
    template <class Rows, class Visit>
    __device__ __forceinline__ void walk(const BwdParams& p, Rows rows, Visit visit) const {
        const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
        const A* __restrict__ k_base = p.k.row<const A>(seq.batch, seq.k_begin, head_kv);
        const A* __restrict__ v_base = p.v.row<const A>(seq.batch, seq.k_begin, head_kv);
        const KeyBlockRange<BLOCK_N> keys(mask, m0, BLOCK_M);
        const int n_begin = keys.first * BLOCK_N, n_end = keys.n_end;
        auto load_kv = [&](int n0, int stage) {
            A* k_stage = kv_tiles + 2 * stage * BLOCK_N * LD;
            cp_async_rows_scalar<BLOCK_N, D_TILE, LD, NTHREADS>(k_stage, k_base, n0, seqlen_k, p.headdim,
                                                                p.k.row_stride);
            cp_async_rows_scalar<BLOCK_N, D_TILE, LD, NTHREADS>(k_stage + BLOCK_N * LD, v_base, n0, seqlen_k,
                                                                p.headdim_v, p.v.row_stride);
        };
        if (n_begin < n_end) load_kv(n_begin, 0);
        cp_async_rows_scalar<BLOCK_M, D_TILE, LD, NTHREADS>(q_tile, p.q.row<const A>(seq.batch, seq.q_begin, head), m0,
                                                            seqlen_q, p.headdim, p.q.row_stride);
        cp_async_rows_scalar<BLOCK_M, D_TILE, LD, NTHREADS>(do_tile, p.dout.row<const A>(seq.batch, seq.q_begin, head),
                                                            m0, seqlen_q, p.headdim_v, p.dout.row_stride);
        cp_async_commit();
        rows();

        int stage = 0;
        for (int n0 = n_begin; n0 < n_end; n0 += BLOCK_N, stage ^= 1) {
            // this block's K and V (and, the first time, Q and dO) have landed, and every warp is
            // done with the previous block's stage: the next block may overwrite it
            cp_async_wait<0>();
            __syncthreads();
            if (n0 + BLOCK_N < n_end) {
                load_kv(n0 + BLOCK_N, stage ^ 1);
                cp_async_commit();
            }
            const A* k_tile = kv_tiles + 2 * stage * BLOCK_N * LD;
            const A* v_tile = k_tile + BLOCK_N * LD;
            A s[N_TILES][M_TILES][2], dp[N_TILES][M_TILES][2];
            dmma_rows_times_rows<D_TILE, N_TILES, LD, M_TILES, WIDE>(s, q_tile + (w0 + g) * LD + t,
                                                                     k_tile + g * LD + t);
            dmma_rows_times_rows<D_TILE, N_TILES, LD, M_TILES, WIDE>(dp, do_tile + (w0 + g) * LD + t,
                                                                     v_tile + g * LD + t);
            visit(n0, k_tile, s, dp);
        }
        cp_async_wait<0>();
    }
};

// The row statistics of a query block as the dK/dV kernels copy them to shared memory, a row of
// BLOCK_M values each (raw: lse in the params' unit, the weight and dp_ref only where the call
// has them): flash_bwd_dkdv_dmma, flash_bwd_dkdv_tf32_wgmma.
enum StatSlot { STAT_LSE = 0, STAT_DELTA = 1, STAT_WEIGHT = 2, STAT_DP_REF = 3, STAT_SLOTS = 4 };

// Query row i of a block (its statistics at index `stat`) into such a block at `dst` (the row's
// word of slot 0; slots slot_bytes apart), by cp.async: zeros past the end (!valid), and where
// the call has no weight or dp_ref.
template <typename A>
__device__ __forceinline__ void cp_async_row_stats(u32 dst, u32 slot_bytes, const A* lse, const A* delta,
                                                   const A* weight, const A* dp_ref, i64 stat, bool valid) {
    cp_async_scalar(dst + STAT_LSE * slot_bytes, lse + stat, valid);
    cp_async_scalar(dst + STAT_DELTA * slot_bytes, delta + stat, valid);
    cp_async_scalar(dst + STAT_WEIGHT * slot_bytes, weight != nullptr ? weight + stat : lse + stat,
                    valid && weight != nullptr);
    cp_async_scalar(dst + STAT_DP_REF * slot_bytes, dp_ref != nullptr ? dp_ref + stat : lse + stat,
                    valid && dp_ref != nullptr);
}

// One entry of S and dP (raw units: the unit is the scale) after the policies, as every float64
// backward kernel takes it: the score policy's transform and ds'/ds (unset without a derivative),
// whether the mask hides the key (or the row sees none: row_sees_nothing), whether dropout keeps
// it, and dP times Z / (1 - p) (0 where dropped: dropout.cuh). Flag<false> for an entry of a
// block the mask policy holds whole (partial() false): no element test, no predicate.
template <typename A>
struct ScoreEntry {
    A s, dp, dsds;
    bool hidden, kept;
};

template <class Mask, typename A, bool PARTIAL = true>
__device__ __forceinline__ ScoreEntry<A> score_entry(A s, A dp, int q_row, int key, bool row_sees_nothing,
                                                     const Mask& mask, const ScoreOf<Mask, A>& score,
                                                     const DropoutOf<Mask>& dropout, A drop_scale,
                                                     Flag<PARTIAL> = {}) {
    ScoreEntry<A> x;
    x.hidden = row_sees_nothing || (PARTIAL && mask.hides(q_row, key));
    x.s = score.transform(s, score.origin(q_row, key, PARTIAL), 0, 0, x.dsds);
    x.kept = !DropoutOf<Mask>::ENABLED || dropout.keep(q_row, key);
    x.dp = !DropoutOf<Mask>::ENABLED ? dp : x.kept ? dp * drop_scale : A(0);
    return x;
}

// dS of an entry from P and its row's statistics: 0 where hidden, times ds'/ds with a derivative.
template <class Mask, typename A>
__device__ __forceinline__ A ds_entry(const ScoreEntry<A>& x, A p_ij, A dp_ref, A delta) {
    const A ds = ds_of(p_ij, x.dp, dp_ref, delta);
    return x.hidden ? A(0) : Mask::Score::HAS_GRAD ? ds * x.dsds : ds;
}

}  // namespace cf

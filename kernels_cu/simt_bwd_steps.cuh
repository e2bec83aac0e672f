// The SIMT backward's tile step that more than one of its kernels takes, and the CTA of its two
// query-side kernels, written once so that they agree to the bit: flash_bwd_stats_simt's row
// statistics must be those of the very scores and dP that flash_bwd_dq_simt (this step) and
// flash_bwd_dkdv_simt (its transpose) form.
//
// Why the bits matter: with recomputed statistics (backward_plans, statistics="recomputed") a
// one-hot row has top = its key's score and dp_ref = its key's dP exactly and weight = 1, so the
// backward's P = 2^(x - top) weight = 1 and dS = P ((dP - dp_ref) - D') = -D', the other keys'
// small sum (0 where their weights underflow), where D from the saved o leaves eps |dO| |V|. flash_bwd_dkdv_simt forms the same values in its transposed
// step: row_dots over d = 0, 1, ... (fma(k_d, q_d) is fma(q_d, k_d)), the same score transform,
// recomputed_p_exact and dropout scale.
#pragma once

#include "block_walk.cuh"
#include "common.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"

namespace cf {

// S and dP of row `q_row` against the keys n0 + lane_in_row + TPR j of the tile, j < N: q and dO
// rows of LD-strided shared tiles, k and v tiles of BLOCK_N rows with the same stride. For each
// key, visit(j, s, dp, dsds, hidden) receives the score after the score policy's transform (raw
// units: the scale), dP = dO_i . V_j (times Z_ij / (1 - p) under dropout, 0 where dropped),
// ds'/ds of the policy (unset without a derivative) and whether the mask hides the key (or the
// row sees none: row_sees_nothing). One key at a time, so that a kernel holds no per-key arrays
// beyond S and dP (flash_bwd_dq_simt's dropout kernels spilled with four).
template <int D_TILE, int TPR, int LD, int N, class Mask, typename A, class Visit>
__device__ __forceinline__ void simt_row_tile(const A* q_row_tile, const A* do_row_tile, const A* k_tile,
                                              const A* v_tile, int lane_in_row, int q_row, int n0,
                                              bool row_sees_nothing, const Mask& mask,
                                              const ScoreOf<Mask, A>& score, const DropoutOf<Mask>& dropout,
                                              A drop_scale, Visit&& visit) {
    // Dropout's keep bits first, while S and dP hold no registers (the generator's temporaries on
    // top of both arrays spilled flash_bwd_dq_simt at 128 registers).
    static_assert(N <= 32, "one keep bit per key in a word");
    unsigned keep_bits = 0u;
    if constexpr (DropoutOf<Mask>::ENABLED) {
#pragma unroll
        for (int j = 0; j < N; ++j) keep_bits |= unsigned(dropout.keep(q_row, n0 + lane_in_row + TPR * j)) << j;
    }
    A s[N], dp[N];
    row_dots<D_TILE>(s, q_row_tile, k_tile + lane_in_row * LD, TPR * LD);
    row_dots<D_TILE>(dp, do_row_tile, v_tile + lane_in_row * LD, TPR * LD);
#pragma unroll
    for (int j = 0; j < N; ++j) {
        const int key = n0 + lane_in_row + TPR * j;
        const bool hidden = row_sees_nothing || mask.hides(q_row, key);
        A dsds;
        const A s_ij = score.transform(s[j], score.origin(q_row, key), 0, 0, dsds);
        // Dropout (dropout.cuh): dS = P (Z dP / (1 - p) - D).
        const A dp_ij = !DropoutOf<Mask>::ENABLED ? dp[j] : ((keep_bits >> j) & 1u) ? dp[j] * drop_scale : A(0);
        visit(j, s_ij, dp_ij, dsds, hidden);
    }
}

// The CTA of the two query-side SIMT kernels (flash_bwd_dq_simt, flash_bwd_stats_simt): query
// block m0 of head blockIdx.y, TPR lanes a row (row, lane_in_row); its Q and dO rows stay in
// shared memory for the whole walk over the key blocks that some of its rows see, whose K and V
// come in one block at a time. Tiles of LD = D_TILE + 1 elements a row (the pad keeps column
// walks free of bank conflicts), q, dO, K, V in that order from the shared memory's start; a
// kernel's own tiles follow at TILES_BYTES. A kernel leaves at once where past_end(), then
// walk()s the key blocks.
template <typename T, int D_TILE, class Mask, int BLOCK_M, int BLOCK_N, int TPR>
struct SimtQueryCta {
    typedef typename acc_of<T>::type A;
    static constexpr int NTHREADS = BLOCK_M * TPR, S_PER_LANE = BLOCK_N / TPR, LD = D_TILE + 1;
    static constexpr unsigned TILES_BYTES = sizeof(A) * (2 * BLOCK_M * LD + 2 * BLOCK_N * LD);
    static_assert(BLOCK_N % TPR == 0 && D_TILE % TPR == 0 && 32 % TPR == 0, "row group shape");

    A* q_tile;   // [BLOCK_M][LD]
    A* do_tile;  // [BLOCK_M][LD]
    A* k_tile;   // [BLOCK_N][LD]
    A* v_tile;   // [BLOCK_N][LD]
    SequenceRows seq;
    A scale_log2, scale;
    Mask mask;
    int head, head_kv, m0;
    int row, lane_in_row, q_row;  // the thread's row of the block, its lane in the row group, the row's query
    ScoreOf<Mask, A> score;       // raw scores: the unit is the scale
    DropoutOf<Mask> dropout;
    A drop_scale;

    __device__ __forceinline__ SimtQueryCta(const BwdParams& p, unsigned char* smem)
        : q_tile(reinterpret_cast<A*>(smem)),
          do_tile(q_tile + BLOCK_M * LD),
          k_tile(do_tile + BLOCK_M * LD),
          v_tile(k_tile + BLOCK_N * LD),
          seq(cta_sequence<Mask>(p, blockIdx.z)),
          scale_log2(scale_log2_in<A>(p)),
          scale(scale_in<A>(p)),
          mask(cta_mask<Mask, CtaRows::QUERIES>(p, seq.index, seq.seqlen_q, seq.seqlen_k)),
          head(blockIdx.y),
          head_kv(blockIdx.y / p.group),
          m0(Mask::query_block(blockIdx.x, gridDim.x) * BLOCK_M),
          row(threadIdx.x / TPR),
          lane_in_row(threadIdx.x % TPR),
          q_row(m0 + threadIdx.x / TPR),
          score(score_problem<Mask>(p, seq), seq.index, blockIdx.y, scale),
          dropout(p, seq.index, blockIdx.y),
          drop_scale(DropoutOf<Mask>::ENABLED ? dropout_scale_in<A>(p) : A(1)) {}

    // A block past a shorter (packed) sequence's end: the kernel leaves at once.
    __device__ __forceinline__ bool past_end() const { return Mask::PACKED && m0 >= seq.seqlen_q; }

    // The walk: the block's Q and dO rows copied in, rows() (what the kernel reads of its rows
    // meanwhile), then per key block n0, once K and V are in and every thread is past the block
    // before (its tiles, and any tile of the kernel's that a row group reads), visit(n0).
    template <class Rows, class Visit>
    __device__ __forceinline__ void walk(const BwdParams& p, Rows rows, Visit visit) const {
        const int batch = seq.batch, seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
        load_tile<BLOCK_M, D_TILE, NTHREADS>(q_tile, p.q.row<const T>(batch, seq.q_begin, head), m0, seqlen_q,
                                             p.headdim, p.q.row_stride, A(1));
        load_tile<BLOCK_M, D_TILE, NTHREADS>(do_tile, p.dout.row<const T>(batch, seq.q_begin, head), m0, seqlen_q,
                                             p.headdim_v, p.dout.row_stride, A(1));
        rows();
        const T* __restrict__ k_base = p.k.row<const T>(batch, seq.k_begin, head_kv);
        const T* __restrict__ v_base = p.v.row<const T>(batch, seq.k_begin, head_kv);
        const KeyBlockRange<BLOCK_N> keys(mask, m0, BLOCK_M);
        const int n_begin = keys.first * BLOCK_N, n_end = keys.n_end;
        for (int n0 = n_begin; n0 < n_end; n0 += BLOCK_N) {
            __syncthreads();  // the previous block's tiles fully consumed
            load_tile<BLOCK_N, D_TILE, NTHREADS>(k_tile, k_base, n0, seqlen_k, p.headdim, p.k.row_stride, A(1));
            load_tile<BLOCK_N, D_TILE, NTHREADS>(v_tile, v_base, n0, seqlen_k, p.headdim_v, p.v.row_stride, A(1));
            __syncthreads();
            visit(n0);
        }
    }

    // simt_row_tile of the thread's row against key block n0 (in the K and V tiles).
    template <class Entry>
    __device__ __forceinline__ void row_tile(int n0, bool row_sees_nothing, Entry&& entry) const {
        simt_row_tile<D_TILE, TPR, LD, S_PER_LANE>(q_tile + row * LD, do_tile + row * LD, k_tile, v_tile,
                                                   lane_in_row, q_row, n0, row_sees_nothing, mask, score, dropout,
                                                   drop_scale, entry);
    }
};

}  // namespace cf

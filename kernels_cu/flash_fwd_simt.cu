// flash_fwd_simt: exact attention forward on CUDA cores, every dtype (float16, bfloat16, float32,
// float64), any head dimension up to D_TILE.
//
// One block owns BLOCK_M query rows of one (batch, head). Each row is shared by TPR consecutive
// lanes ("a row group"): a lane holds BLOCK_N / TPR scores and D_TILE / TPR output columns of its
// row. The block walks the key blocks j = 0, 1, ... keeping for every row the running maximum m and
// running sum l of the online softmax, so S and P never leave the chip.
#include "block_walk.cuh"
#include "common.cuh"
#include "mask.cuh"
#include "params.cuh"

namespace cf {

template <typename T, int D_TILE, class Mask, int BLOCK_M, int BLOCK_N, int TPR>
__global__ void __launch_bounds__(BLOCK_M * TPR, 2)
flash_fwd_simt(const __grid_constant__ FwdParams p) {
    typedef typename acc_of<T>::type A;
    constexpr int NTHREADS = BLOCK_M * TPR;
    constexpr int S_PER_LANE = BLOCK_N / TPR;
    constexpr int O_PER_LANE = D_TILE / TPR;
    constexpr int LD = D_TILE + 1;
    static_assert(BLOCK_N % TPR == 0 && D_TILE % TPR == 0 && 32 % TPR == 0, "row group shape");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* q_tile = reinterpret_cast<A*>(smem_raw);   // [BLOCK_M][LD], pre-scaled by scale_log2
    A* k_tile = q_tile + BLOCK_M * LD;              // [BLOCK_N][LD]
    A* v_tile = k_tile + BLOCK_N * LD;              // [BLOCK_N][LD]
    A* p_tile = v_tile + BLOCK_N * LD;              // [BLOCK_M][BLOCK_N + 1]
    constexpr unsigned SMEM_BYTES = sizeof(A) * (BLOCK_M * LD + 2 * BLOCK_N * LD + BLOCK_M * (BLOCK_N + 1));
    if (dynamic_smem_bytes() < SMEM_BYTES) __trap();

    const Log2ForwardCta<Mask, A> cta(p, BLOCK_M);
    if (cta.past_end()) return;
    const SequenceRows& seq = cta.seq;
    const Mask& mask = cta.mask;
    const auto& score = cta.score;
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, headdim = p.headdim;
    const A scale_log2 = cta.scale_log2;
    const int head = cta.head, head_kv = cta.head_kv, batch = seq.batch, m0 = cta.m0;
    const int row = threadIdx.x / TPR, lane_in_row = threadIdx.x % TPR;
    const int q_row = m0 + row;

    const T* __restrict__ q_base = p.q.row<const T>(batch, seq.q_begin, head);
    const T* __restrict__ k_base = p.k.row<const T>(batch, seq.k_begin, head_kv);
    const T* __restrict__ v_base = p.v.row<const T>(batch, seq.k_begin, head_kv);

    // load Q tile (scaled, so scores come out in log2 units)
    load_tile<BLOCK_M, D_TILE, NTHREADS>(q_tile, q_base, m0, seqlen_q, headdim, p.q.row_stride, scale_log2);

    const KeyBlockRange<BLOCK_N> keys(mask, m0, BLOCK_M);
    const int n_begin = keys.first * BLOCK_N, n_end = keys.n_end;

    A m_i = neg_inf<A>(), l_i = A(0);
    const DropoutOf<Mask> dropout(p, seq.index, head);
    A o_acc[O_PER_LANE];
#pragma unroll
    for (int j = 0; j < O_PER_LANE; ++j) o_acc[j] = A(0);

    for (int n0 = n_begin; n0 < n_end; n0 += BLOCK_N) {
        __syncthreads();  // previous K/V/P tiles fully consumed
        load_tile<BLOCK_N, D_TILE, NTHREADS>(k_tile, k_base, n0, seqlen_k, headdim, p.k.row_stride, A(1));
        load_tile<BLOCK_N, D_TILE, NTHREADS>(v_tile, v_base, n0, seqlen_k, p.headdim_v, p.v.row_stride, A(1));
        __syncthreads();

        // S_ij = Q_i K_j^T (log2 units), masked past the end and outside the mask
        A s[S_PER_LANE];
        row_dots<D_TILE>(s, q_tile + row * LD, k_tile + lane_in_row * LD, TPR * LD);
        A row_max = neg_inf<A>();
#pragma unroll
        for (int j = 0; j < S_PER_LANE; ++j) {
            const int key = n0 + lane_in_row + TPR * j;
            if constexpr (!ScoreOf<Mask, A>::IDENTITY) s[j] = score.transform(s[j], score.origin(q_row, key), 0, 0);
            if (mask.hides(q_row, key)) s[j] = neg_inf<A>();
            row_max = max_(row_max, s[j]);
        }
        row_max = group_max<TPR>(row_max);

        // online softmax: m_new = max(m_old, rowmax(S)); rescale = exp2(m_old - m_new).
        // A row with every key masked so far keeps m = -inf; subtracting 0 instead keeps
        // exp2(-inf - base) = 0 rather than NaN.
        const A m_new = max_(m_i, row_max);
        const A base = m_new == neg_inf<A>() ? A(0) : m_new;
        const A rescale = exp2_(m_i - base);
        A row_sum = A(0);
#pragma unroll
        for (int j = 0; j < S_PER_LANE; ++j) {
            const A p_ij = exp2_(s[j] - base);
            row_sum += p_ij;
            // Dropout after the row sum: l and lse stay the softmax's (dropout.cuh).
            const bool dropped = DropoutOf<Mask>::ENABLED && !dropout.keep(q_row, n0 + lane_in_row + TPR * j);
            p_tile[row * (BLOCK_N + 1) + lane_in_row + TPR * j] = dropped ? A(0) : p_ij;
        }
        row_sum = group_sum<TPR>(row_sum);
        l_i = l_i * rescale + row_sum;
        m_i = m_new;
        // P rows are written and read only by their own row group, which sits inside one warp.
        __syncwarp();

        // O_i = rescale * O_i + P_ij V_j
#pragma unroll
        for (int j = 0; j < O_PER_LANE; ++j) o_acc[j] *= rescale;
        const int n_valid = min(BLOCK_N, seqlen_k - n0);
        for (int n = 0; n < n_valid; ++n) {
            const A p_ij = p_tile[row * (BLOCK_N + 1) + n];
#pragma unroll
            for (int j = 0; j < O_PER_LANE; ++j) o_acc[j] += p_ij * v_tile[n * LD + lane_in_row + TPR * j];
        }
    }

    // store O = O_i / l_i and lse = (m_i + log2 l_i) ln 2; rows that saw no key give 0 and -inf
    if (q_row < seqlen_q) {
        A inv_l, lse_row;
        if constexpr (Mask::Score::HAS_SINK) {
            finish_row_with_sink(m_i, l_i, sink_log2<Mask, A>(p, head), inv_l, lse_row);
        } else {
            const A ln2 = A(0.6931471805599453094172321);
            inv_l = l_i > A(0) ? A(1) / l_i : A(0);
            lse_row = l_i > A(0) ? (m_i + log2_(l_i)) * ln2 : neg_inf<A>();
        }
        if constexpr (DropoutOf<Mask>::ENABLED) inv_l *= dropout_scale_in<A>(p);
        T* o_row = p.o.row<T>(batch, seq.q_begin + q_row, head);
#pragma unroll
        for (int j = 0; j < O_PER_LANE; ++j) {
            const int col = lane_in_row + TPR * j;
            if (col < p.headdim_v) store_as(o_row + col, o_acc[j] * inv_l);
        }
        if (lane_in_row == 0) static_cast<A*>(p.lse)[seq.stat(p, head, q_row)] = lse_row;
    }
}

}  // namespace cf

// flash_bwd_stats_simt: the SIMT backward's row statistics recomputed from q, k, v and dO
// (statistics="recomputed", backward_plans): lse_i in log2 units and D_i = sum_j P_ij dP_ij, in
// place of the saved lse and of D = rowsum(dO * O) (flash_bwd_preprocess.cu). lse is written as
// the row's top score and its weight 1 / sum (P = 2^(x - top) weight), and D as D - ref, ref the
// dP of the row's top key (BwdParams).
//
// Why: D from the saved o cancels the backward's own dP only to rounding, and at a saturated
// softmax (a row one-hot to float32's precision) that residue, times scale and |K|, is the whole
// of dq and dk, many times their true size, where standard attention's
// dS = P (dP - sum_j P_ij dP_ij) is exactly 0. The saved lse has a second flaw at large scores:
// its natural-log round trip moves the row maximum's exponent by ulps of |lse|, so P of the
// maximum is not 1. Here both come from the scores and dP of the kernels that use them, to the bit
// (simt_bwd_steps.cuh): one walk over the row's key blocks with an online maximum, as the forward
// takes, and D summed with the same rescaling, so a one-hot row gets top = its key's score,
// weight = 1, ref = its key's dP and D - ref = sum over the other keys (0 where their weights
// underflow, and without a sink). The gradient kernels then read neither the saved o nor lse
// (the sink's gradient, scores.sink_grad, still does); ring attention, whose o and lse are the
// whole sequence's, keeps statistics="saved".
//
// One block per query block, the tiles and row groups of flash_bwd_dq_simt (TPR lanes a row).
#include "common.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "simt_bwd_steps.cuh"

namespace cf {

template <typename T, int D_TILE, class Mask, int BLOCK_M, int BLOCK_N, int TPR>
__global__ void __launch_bounds__(BLOCK_M * TPR, 2)
flash_bwd_stats_simt(const __grid_constant__ BwdParams p) {
    typedef typename acc_of<T>::type A;
    constexpr int NTHREADS = BLOCK_M * TPR;
    constexpr int S_PER_LANE = BLOCK_N / TPR;
    constexpr int LD = D_TILE + 1;
    static_assert(BLOCK_N % TPR == 0 && D_TILE % TPR == 0 && 32 % TPR == 0, "row group shape");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    A* q_tile = reinterpret_cast<A*>(smem_raw);  // [BLOCK_M][LD]
    A* do_tile = q_tile + BLOCK_M * LD;            // [BLOCK_M][LD]
    A* k_tile = do_tile + BLOCK_M * LD;            // [BLOCK_N][LD]
    A* v_tile = k_tile + BLOCK_N * LD;             // [BLOCK_N][LD]
    constexpr unsigned SMEM_BYTES = sizeof(A) * (2 * BLOCK_M * LD + 2 * BLOCK_N * LD);
    if (dynamic_smem_bytes() < SMEM_BYTES) __trap();

    const SequenceRows seq = cta_sequence<Mask>(p, blockIdx.z);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    const A scale_log2 = scale_log2_in<A>(p), scale = scale_in<A>(p);
    const Mask mask = cta_mask<Mask>(p, seq.index, seqlen_q, seqlen_k);
    const int m_block = Mask::query_block(blockIdx.x, gridDim.x);
    const int head = blockIdx.y, batch = seq.batch;
    const int head_kv = head / p.group;
    const ScoreOf<Mask, A> score(score_problem<Mask>(p, seq), seq.index, head, scale);
    const int m0 = m_block * BLOCK_M;
    if (Mask::PACKED && m0 >= seqlen_q) return;  // past a shorter sequence's end
    const int row = threadIdx.x / TPR, lane_in_row = threadIdx.x % TPR;
    const int q_row = m0 + row;

    load_tile<BLOCK_M, D_TILE, NTHREADS>(q_tile, p.q.row<const T>(batch, seq.q_begin, head), m0, seqlen_q,
                                         p.headdim, p.q.row_stride, A(1));
    load_tile<BLOCK_M, D_TILE, NTHREADS>(do_tile, p.dout.row<const T>(batch, seq.q_begin, head), m0, seqlen_q,
                                         p.headdim_v, p.dout.row_stride, A(1));
    const T* __restrict__ k_base = p.k.row<const T>(batch, seq.k_begin, head_kv);
    const T* __restrict__ v_base = p.v.row<const T>(batch, seq.k_begin, head_kv);
    const int n_begin = mask.key_begin(m0) / BLOCK_N * BLOCK_N;
    const int n_end = mask.key_end(m0, BLOCK_M);

    const DropoutOf<Mask> dropout(p, seq.index, head);
    const A drop_scale = DropoutOf<Mask>::ENABLED ? dropout_scale_in<A>(p) : A(1);
    // The row's running maximum m (log2 units), sum l = sum_j 2^(x_j - m) and
    // w = sum_j 2^(x_j - m) (dP_j - ref), ref the dP of the key at the maximum: each lane over its
    // own keys until the end (maximum and ref are merged per tile, so every lane rescales and
    // shifts alike). D = sum_j P_j dP_j is kept as D' = D - ref, its part that does not cancel:
    // the gradient kernels form dP_j - D as (dP_j - ref) - D', exact 0 - D' at the maximum's key,
    // where dP_j - D would lose the small D' to a rounding of |dP| (RowStats, softmax_bwd.cuh).
    A m_i = neg_inf<A>(), l_i = A(0), w_i = A(0), ref = A(0);

    for (int n0 = n_begin; n0 < n_end; n0 += BLOCK_N) {
        __syncthreads();  // previous K/V tiles fully consumed
        load_tile<BLOCK_N, D_TILE, NTHREADS>(k_tile, k_base, n0, seqlen_k, p.headdim, p.k.row_stride, A(1));
        load_tile<BLOCK_N, D_TILE, NTHREADS>(v_tile, v_base, n0, seqlen_k, p.headdim_v, p.v.row_stride, A(1));
        __syncthreads();

        // the scores in log2 units (-inf where hidden) and dP; the tile's maximum and its key's
        // dP over the row group (ties: the larger dP, so every lane of the group ends with the
        // same pair)
        A x[S_PER_LANE], dp[S_PER_LANE];
        A tile_max = neg_inf<A>(), tile_ref = A(0);
        simt_row_tile<D_TILE, TPR, LD, S_PER_LANE>(
            q_tile + row * LD, do_tile + row * LD, k_tile, v_tile, lane_in_row, q_row, n0, false, mask, score, dropout,
            drop_scale, [&](int j, A s_ij, A dp_ij, A, bool hidden) {
                x[j] = hidden ? neg_inf<A>() : log2_score(s_ij, scale_log2);
                dp[j] = dp_ij;
                if (!hidden && (x[j] > tile_max || (x[j] == tile_max && dp_ij > tile_ref))) tile_max = x[j], tile_ref = dp_ij;
            });
#pragma unroll
        for (int offset = TPR / 2; offset > 0; offset /= 2) {
            const A other_max = __shfl_xor_sync(0xffffffffu, tile_max, offset);
            const A other_ref = __shfl_xor_sync(0xffffffffu, tile_ref, offset);
            if (other_max > tile_max || (other_max == tile_max && other_ref > tile_ref))
                tile_max = other_max, tile_ref = other_ref;
        }
        const A m_new = max_(m_i, tile_max);
        const A ref_new = tile_max > m_i ? tile_ref : ref;
        // A row that has seen no key keeps m = -inf: subtracting 0 keeps 2^(-inf) = 0, not NaN.
        const A base = m_new == neg_inf<A>() ? A(0) : m_new;
        const A rescale = exp2_(m_i - base);
        w_i = (ref_new == ref ? w_i : w_i + l_i * (ref - ref_new)) * rescale;
        l_i *= rescale;
        ref = ref_new;
#pragma unroll
        for (int j = 0; j < S_PER_LANE; ++j) {
            const A e = exp2_(x[j] - base);
            l_i += e;
            // a hidden key adds nothing, whatever its dP (a non-finite V there must not leak)
            w_i += x[j] == neg_inf<A>() ? A(0) : e * (dp[j] - ref);
        }
        m_i = m_new;
    }
    l_i = group_sum<TPR>(l_i);
    w_i = group_sum<TPR>(w_i);

    if (q_row < seqlen_q && lane_in_row == 0) {
        // P_j = 2^(x_j - m) o_factor, o_factor = 1 / l without a sink (the forward's factor of O).
        // The sink is read at run time: the backward's policies carry none (masks.py's
        // Mask.backward: a saved lse holds it), and this kernel forms the row's sum itself.
        const float* sink = p.variant.sink;
        const A sink2 = sink != nullptr ? A(ldg(sink + head)) * A(1.4426950408889634074) : neg_inf<A>();
        A o_factor, top_with_sink, log2_sum;
        finish_row_log2(m_i, l_i, sink2, o_factor, top_with_sink, log2_sum);
        // D - ref = sum_j P_j (dP_j - ref) - ref P_sink: the sink's weight has no dP. P_sink from
        // the sink's own exponent against the row's top (<= 0), not 2^(sink - m) o_factor: a sink
        // far above every score overflows that factor to inf while o_factor flushes to 0 (NaN).
        const A sink_share =
            sink != nullptr && top_with_sink != neg_inf<A>() ? exp2_((sink2 - top_with_sink) - log2_sum) : A(0);
        const i64 stat = seq.stat(StatDims{p.nheads, p.seqlen_q}, head, q_row);
        static_cast<A*>(p.delta)[stat] = w_i * o_factor - ref * sink_share;
        // params' lse, weight and dp_ref are this call's own buffers in this mode (kernels/simt.py)
        const_cast<A*>(static_cast<const A*>(p.lse))[stat] = m_i;
        const_cast<A*>(static_cast<const A*>(p.weight))[stat] = o_factor;
        const_cast<A*>(static_cast<const A*>(p.dp_ref))[stat] = ref;
    }
}

}  // namespace cf

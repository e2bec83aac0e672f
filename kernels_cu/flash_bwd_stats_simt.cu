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
    typedef SimtQueryCta<T, D_TILE, Mask, BLOCK_M, BLOCK_N, TPR> Cta;  // flash_bwd_dq_simt's CTA
    typedef typename Cta::A A;
    constexpr int S_PER_LANE = Cta::S_PER_LANE;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    const Cta cta(p, smem_raw);
    if (dynamic_smem_bytes() < Cta::TILES_BYTES) __trap();
    if (cta.past_end()) return;
    const int lane_in_row = cta.lane_in_row, q_row = cta.q_row, head = cta.head;

    // The row's running maximum m (log2 units), sum l = sum_j 2^(x_j - m) and
    // w = sum_j 2^(x_j - m) (dP_j - ref), ref the dP of the key at the maximum: each lane over its
    // own keys until the end (maximum and ref are merged per tile, so every lane rescales and
    // shifts alike). D = sum_j P_j dP_j is kept as D' = D - ref, its part that does not cancel:
    // the gradient kernels form dP_j - D as (dP_j - ref) - D', exact 0 - D' at the maximum's key,
    // where dP_j - D would lose the small D' to a rounding of |dP| (RowStats, softmax_bwd.cuh).
    A m_i = neg_inf<A>(), l_i = A(0), w_i = A(0), ref = A(0);

    cta.walk(p, [] {}, [&](int n0) {
        // the scores in log2 units (-inf where hidden) and dP; the tile's maximum and its key's
        // dP over the row group (ties: the larger dP, so every lane of the group ends with the
        // same pair)
        A x[S_PER_LANE], dp[S_PER_LANE];
        A tile_max = neg_inf<A>(), tile_ref = A(0);
        cta.row_tile(n0, false, [&](int j, A s_ij, A dp_ij, A, bool hidden) {
            x[j] = hidden ? neg_inf<A>() : log2_score(s_ij, cta.scale_log2);
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
    });
    l_i = group_sum<TPR>(l_i);
    w_i = group_sum<TPR>(w_i);

    if (q_row < cta.seq.seqlen_q && lane_in_row == 0) {
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
        const i64 stat = cta.seq.stat(StatDims{p.nheads, p.seqlen_q}, head, q_row);
        static_cast<A*>(p.delta)[stat] = w_i * o_factor - ref * sink_share;
        // params' lse, weight and dp_ref are this call's own buffers in this mode (kernels/simt.py)
        const_cast<A*>(static_cast<const A*>(p.lse))[stat] = m_i;
        const_cast<A*>(static_cast<const A*>(p.weight))[stat] = o_factor;
        const_cast<A*>(static_cast<const A*>(p.dp_ref))[stat] = ref;
    }
}

}  // namespace cf

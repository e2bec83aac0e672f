// flash_bwd_stats_dmma: the float64 backward's row statistics recomputed on the FP64 tensor cores
// (statistics="recomputed", backward_plans' "dmma" plans): what flash_bwd_stats_simt.cu computes
// for the SIMT kernels, and why, here from the S and dP of flash_bwd_dq_dmma's own step
// (dmma_bwd_steps.cuh) on its tiles, so that a one-hot row finds its key's score and dP to the bit.
//
// Per key block: S and dP, the row's maximum (in log2 units) and its key's dP merged over the quad
// that holds the row (lanes 4g .. 4g + 3; ties: the larger dP, so the four lanes agree), then each
// lane's running sum l and w = sum_j 2^(x_j - m) (dP_j - ref) over its own keys, rescaled and
// shifted as the maximum moves; the quad's sums at the end.
#include "common.cuh"
#include "dmma_bwd_steps.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"

namespace cf {

template <int D_TILE, class Mask, int BLOCK_N, int NWARPS, int M_TILES = 2, bool WIDE = false,
          typename T = double>
__global__ void __launch_bounds__(NWARPS * 32, 1)
flash_bwd_stats_dmma(const __grid_constant__ BwdParams p) {
    typedef T A;  // double: DMMA; float: three tf32 products (experiment)
    typedef DmmaQueryCta<D_TILE, Mask, BLOCK_N, NWARPS, M_TILES, WIDE, A> Cta;  // flash_bwd_dq_dmma's CTA
    constexpr int N_TILES = Cta::N_TILES;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    if (dynamic_smem_bytes() < Cta::SMEM_BYTES) __trap();
    const Cta cta(p, smem_raw);
    if (cta.past_end()) return;
    const int head = cta.head, t = cta.t;
    const ScoreOf<Mask, A> score(score_problem<Mask>(p, cta.seq), cta.seq.index, head, cta.scale);
    const DropoutOf<Mask> dropout(p, cta.seq.index, head);
    const A drop_scale = DropoutOf<Mask>::ENABLED ? dropout_scale_in<A>(p) : A(1);

    int q_row[M_TILES];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) q_row[mt] = cta.m0 + cta.w0 + 8 * mt + cta.g;
    // per row: the running maximum m (log2 units), this lane's sums l and w, ref (flash_bwd_stats_simt)
    A m_i[M_TILES], l_i[M_TILES], w_i[M_TILES], ref[M_TILES];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) m_i[mt] = neg_inf<A>(), l_i[mt] = w_i[mt] = ref[mt] = A(0);

    cta.walk(p, [] {}, [&](int n0, const A*, A(&s)[N_TILES][M_TILES][2], A(&dp)[N_TILES][M_TILES][2]) {
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
            // the scores in log2 units (-inf where hidden, into s) and dP (into dp); the tile's
            // maximum and its key's dP
            A tile_max = neg_inf<A>(), tile_ref = A(0);
#pragma unroll
            for (int n = 0; n < N_TILES; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const auto x = score_entry(s[n][mt][e], dp[n][mt][e], q_row[mt], n0 + 8 * n + 2 * t + e,
                                               false, cta.mask, score, dropout, drop_scale);
                    s[n][mt][e] = x.hidden ? neg_inf<A>() : log2_score(x.s, cta.scale_log2);
                    dp[n][mt][e] = x.dp;
                    if (!x.hidden && (s[n][mt][e] > tile_max || (s[n][mt][e] == tile_max && x.dp > tile_ref)))
                        tile_max = s[n][mt][e], tile_ref = x.dp;
                }
#pragma unroll
            for (int offset = 2; offset > 0; offset /= 2) {
                const A other_max = __shfl_xor_sync(0xffffffffu, tile_max, offset);
                const A other_ref = __shfl_xor_sync(0xffffffffu, tile_ref, offset);
                if (other_max > tile_max || (other_max == tile_max && other_ref > tile_ref))
                    tile_max = other_max, tile_ref = other_ref;
            }
            const A m_new = max_(m_i[mt], tile_max);
            const A ref_new = tile_max > m_i[mt] ? tile_ref : ref[mt];
            // A row that has seen no key keeps m = -inf: subtracting 0 keeps 2^(-inf) = 0, not NaN.
            const A base = m_new == neg_inf<A>() ? A(0) : m_new;
            const A rescale = exp2_(m_i[mt] - base);
            w_i[mt] = (ref_new == ref[mt] ? w_i[mt] : w_i[mt] + l_i[mt] * (ref[mt] - ref_new)) * rescale;
            l_i[mt] *= rescale;
            ref[mt] = ref_new;
#pragma unroll
            for (int n = 0; n < N_TILES; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const A x = s[n][mt][e];
                    const A w = exp2_(x - base);
                    l_i[mt] += w;
                    // a hidden key adds nothing, whatever its dP (a non-finite V there must not leak)
                    w_i[mt] += x == neg_inf<A>() ? A(0) : w * (dp[n][mt][e] - ref[mt]);
                }
            m_i[mt] = m_new;
        }
    });

    // The sink is read at run time (flash_bwd_stats_simt says why).
    const float* sink = p.variant.sink;
    const A sink2 = sink != nullptr ? A(ldg(sink + head)) * A(1.4426950408889634074) : neg_inf<A>();
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
        const A l_row = group_sum<4>(l_i[mt]);
        const A w_row = group_sum<4>(w_i[mt]);
        if (q_row[mt] >= cta.seq.seqlen_q || t != 0) continue;
        A o_factor, top_with_sink, log2_sum;
        finish_row_log2(m_i[mt], l_row, sink2, o_factor, top_with_sink, log2_sum);
        const A sink_share =
            sink != nullptr && top_with_sink != neg_inf<A>() ? exp2_((sink2 - top_with_sink) - log2_sum) : A(0);
        const i64 stat = cta.seq.stat(p, head, q_row[mt]);
        // params' lse, weight and dp_ref are this call's own buffers in this mode (kernels/simt.py)
        static_cast<A*>(p.delta)[stat] = w_row * o_factor - ref[mt] * sink_share;
        const_cast<A*>(static_cast<const A*>(p.lse))[stat] = m_i[mt];
        const_cast<A*>(static_cast<const A*>(p.weight))[stat] = o_factor;
        const_cast<A*>(static_cast<const A*>(p.dp_ref))[stat] = ref[mt];
    }
}

}  // namespace cf

// flash_bwd_dq_mma_v2: v2 dQ, ROW_GROUPS 16-row query groups per warp; v1 is flash_bwd_dq_mma
// (flash_bwd_dq_mma.cu; the family: mma_bwd_layouts.cuh).
//
// v1's warp owns 16 query rows, so each K_j / V_j B fragment it loads feeds 2 mma, and every warp
// of the CTA reads all of K_j and V_j: 0.58 ldmatrix.x4 per mma at head dim 128, which is what
// bounds it (shared-memory pipe ~80 % busy, tensor pipe < 50 %). Here a warp owns ROW_GROUPS = 2
// groups of 16 rows, so a B fragment feeds 2 * ROW_GROUPS mma; the register cost (twice the dQ
// accumulator) is paid for with a narrower key block (BLOCK_N = 32 at head dim 128). Head dim
// 128: 80 ldmatrix.x4 per 192 mma (0.42); head dim 64 (BLOCK_N = 64): 64 per 192 (0.33).
#include "common.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "mma_bwd.cuh"
#include "mma_bwd_layouts.cuh"
#include "mma_bwd_query_cta.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"

namespace cf {

// v1's layout plus the rows' lse (log2 units, lse_base_log2) and D: read from shared memory when
// needed instead of being held in 8 registers for the whole kernel (the margin to spilling).
template <int D_TILE, int BLOCK_M, int BLOCK_N>
struct DqSmemV2 : DqSmem<D_TILE, BLOCK_M, BLOCK_N> {
    typedef DqSmem<D_TILE, BLOCK_M, BLOCK_N> V1;
    static constexpr u32 LSE = V1::BYTES;             // float [BLOCK_M]
    static constexpr u32 DELTA = LSE + BLOCK_M * 4;   // float [BLOCK_M]
    static constexpr u32 BYTES = DELTA + BLOCK_M * 4;
};

template <typename T, int D_TILE, class Mask, int BLOCK_M, int BLOCK_N, int NWARPS, int ROW_GROUPS>
__global__ void __launch_bounds__(NWARPS * 32, 1)
flash_bwd_dq_mma_v2(const __grid_constant__ BwdParams p) {
    typedef DqSmemV2<D_TILE, BLOCK_M, BLOCK_N> L;
    constexpr int NTHREADS = NWARPS * 32;
    constexpr int G = ROW_GROUPS;
    constexpr int WARP_ROWS = 16 * G;
    constexpr int DP_COLS = D_TILE >= 128 ? 16 : BLOCK_N;
    static_assert(BLOCK_M == WARP_ROWS * NWARPS, "16 * ROW_GROUPS query rows per warp");
    static_assert(BLOCK_N % 16 == 0 && D_TILE % 16 == 0, "m16n8k16 tiles");
    static_assert(L::BYTES <= 227 * 1024, "shared memory");

    extern __shared__ __align__(128) unsigned char smem[];
    if (dynamic_smem_bytes() < L::BYTES) __trap();
    typedef MmaQueryCta<T, L, Mask, BLOCK_M, BLOCK_N, D_TILE, NTHREADS> Cta;
    const SequenceRows seq = cta_sequence<Mask>(p, blockIdx.z);
    if (Cta::past_end(seq)) return;
    const Cta cta(p, smem, seq);
    const u32 s_q = cta.base + L::Q, s_do = cta.base + L::DO;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int row0 = WARP_ROWS * warp;  // this warp's query rows within the block
    const int seqlen_q = cta.seqlen_q, m0 = cta.m0, head = cta.head;
    // The scales converted here from the doubles by cvt.rn (one F2F each, rounded as NumPy rounds
    // the float fields, so the values are the same): with the float fields read instead, ptxas's
    // allocation of the causal d128 instance on sm_90 spills 24 bytes at 254 registers; this way
    // it takes 247 and none (an allocation accident at the 255 limit, not a cost of the fields).
    const float scale_log2 = f32_rn(p.scale_log2_f64), scale = f32_rn(p.scale_f64);
    const Mask& mask = cta.mask;
    const ScoreOf<Mask, float, Tanh::EXP_RCP> score(score_problem<Mask>(p, seq), seq.index, head, scale);

    cta.load_rows_and_first(p, tid);

    // Row statistics (by ldg: bwd_args in mma_bwd.cuh), made visible by the first iteration's barrier.
    float* s_lse = reinterpret_cast<float*>(smem + L::LSE);
    float* s_delta = reinterpret_cast<float*>(smem + L::DELTA);
    for (int r = tid; r < BLOCK_M; r += NTHREADS) {
        const int m = m0 + r;
        const i64 stat = seq.stat(p, head, m);
        s_lse[r] = m < seqlen_q ? lse_base_log2(ldg(cta.lse + stat)) : 0.f;
        s_delta[r] = m < seqlen_q ? ldg(cta.delta + stat) : 0.f;
    }
    // This lane's accumulator rows within the block: group g, half h is lane_row + 16 g + 8 h.
    const int lane_row = row0 + lane / 4;

    float dq_acc[G][D_TILE / 8][4];
#pragma unroll
    for (int g = 0; g < G; ++g) zero(dq_acc[g]);
    const DropoutOf<Mask> dropout(p, seq.index, head);
    const float drop_scale = DropoutOf<Mask>::kept_scale(p);

    for (int j = cta.keys.first; j < cta.keys.end; ++j) {
        cta.land_and_prefetch(p, j, tid);
        const int n0 = j * BLOCK_N;
        const u32 s_k = cta.k_tile(j), s_v = cta.v_tile(j);

        // Step 1: S = Q_i K_j^T for this warp's 16 G query rows, turned into P = exp2(S scale
        // log2(e) - lse log2(e)) in place. The window's left bound (from the policy's origin: query
        // m0 + lane_row, key n0 + 2 (lane % 4)) selects P to 0 here, where dP is not live yet, and
        // step 2 tells those entries by P == 0: the d128 kernel has no registers to spare there.
        const bool partial = mask.band_partial(m0, BLOCK_M, n0, BLOCK_N);  // at its register limit: no skipping
        const typename Mask::Origin origin = mask.origin(m0 + lane_row, n0 + 2 * (lane % 4));
        // The score policy's transform first (score.cuh); P is read only by dS here, so with a
        // derivative it is kept as P ds'/ds.
        const auto score_origin = score.origin(m0 + lane_row, n0 + 2 * (lane % 4));
        float s_acc[G][BLOCK_N / 8][4];
#pragma unroll
        for (int g = 0; g < G; ++g) zero(s_acc[g]);
        mma_ABt_groups<T, G, BLOCK_N, D_TILE, D_TILE, D_TILE>(s_acc, s_q, row0, s_k, 0, lane);
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int f = 0; f < BLOCK_N / 8; ++f)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float dsds;
                    float p = recomputed_p(score, s_acc[g][f][e], score_origin, 16 * g + 8 * (e >> 1), 8 * f + (e & 1),
                                           dsds, scale_log2, s_lse[lane_row + 16 * g + 8 * (e >> 1)]);
                    if constexpr (Mask::Score::HAS_GRAD) p *= dsds;
                    const bool hidden_left =
                        partial && mask.hidden_left(origin, 16 * g + 8 * (e >> 1), 8 * f + (e & 1));
                    s_acc[g][f][e] = hidden_left ? 0.f : p;
                }

        // Step 2: dP = dO_i V_j^T and dS = P o (dP - D), in slices of DP_COLS keys: at head dim 128
        // a full-width dP next to P and dQ spills (the dO fragments are reloaded per slice).
        // Hidden entries are selected to 0 (a non-finite score or dP there must not leak).
        // Row m sees the keys n < n_lim (none past the last query), as far as the left bound goes.
        int n_lim[G][2];
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int m = m0 + lane_row + 16 * g + 8 * half;
                n_lim[g][half] = m < seqlen_q ? mask.row_key_end(m) : 0;
            }
        u32 ds_frag[G][BLOCK_N / 16][4];
#pragma unroll
        for (int c0 = 0; c0 < BLOCK_N; c0 += DP_COLS) {
            float dp_acc[G][DP_COLS / 8][4];
#pragma unroll
            for (int g = 0; g < G; ++g) zero(dp_acc[g]);
            // Row offsets that are multiples of 8 keep the swizzle phase: V rows c0.. are a tile.
            mma_ABt_groups<T, G, DP_COLS, D_TILE, D_TILE, D_TILE>(dp_acc, s_do, row0,
                                                                  s_v + c0 * (D_TILE * 2), 0, lane);
            if constexpr (DropoutOf<Mask>::ENABLED)  // Z dP / (1 - p) (dropout.cuh)
#pragma unroll
                for (int g = 0; g < G; ++g)
                    for_s_frags(dp_acc[g], dropout, m0 + lane_row + 16 * g, n0 + c0 + 2 * (lane % 4),
                                ScaleKept{drop_scale});
#pragma unroll
            for (int g = 0; g < G; ++g) {
#pragma unroll
                for (int f = 0; f < DP_COLS / 8; ++f) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float ds = s_acc[g][c0 / 8 + f][e] *
                                         (dp_acc[g][f][e] - s_delta[lane_row + 16 * g + 8 * (e >> 1)]);
                        const int n = n0 + c0 + 8 * f + 2 * (lane % 4) + (e & 1);
                        const bool hidden = partial && (n >= n_lim[g][e >> 1] ||
                                                        (Mask::HAS_LEFT && s_acc[g][c0 / 8 + f][e] == 0.f));
                        dp_acc[g][f][e] = hidden ? 0.f : ds;
                    }
                }
                auto& ds_slice = *reinterpret_cast<u32 (*)[DP_COLS / 16][4]>(&ds_frag[g][c0 / 16]);
                pack_a_frags<T, DP_COLS>(ds_slice, dp_acc[g]);
            }
        }

        // Step 3: dQ_i += dS K_j.
        mma_AB_regs_groups<T, G, D_TILE, BLOCK_N, D_TILE>(dq_acc, ds_frag, s_k, 0, lane);
    }

    // Epilogue: as in v1, staged through this warp's own rows of the Q tile.
    cta.end_walk();
#pragma unroll
    for (int g = 0; g < G; ++g) stage_acc<T, D_TILE, D_TILE>(s_q, row0 + 16 * g, 0, dq_acc[g], scale, lane);
    cta.store_dq<WARP_ROWS>(row0, lane);
}

}  // namespace cf

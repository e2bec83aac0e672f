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
    const u32 base = smem_u32(smem);
    const u32 s_q = base + L::Q, s_do = base + L::DO;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int row0 = WARP_ROWS * warp;  // this warp's query rows within the block
    // The run-time arguments, read once here (bwd_args in mma_bwd.cuh says why).
    const SequenceRows seq = cta_sequence<Mask>(p, blockIdx.z);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, headdim = p.headdim;
    // The scales converted here from the doubles by cvt.rn (one F2F each, rounded as NumPy rounds
    // the float fields, so the values are the same): with the float fields read instead, ptxas's
    // allocation of the causal d128 instance on sm_90 spills 24 bytes at 254 registers; this way
    // it takes 247 and none (an allocation accident at the 255 limit, not a cost of the fields).
    const float scale_log2 = f32_rn(p.scale_log2_f64), scale = f32_rn(p.scale_f64);
    const TensorRows q = p.q, k = p.k, v = p.v, dout = p.dout, dq = p.dq;
    const float* __restrict__ lse = static_cast<const float*>(p.lse);
    const float* __restrict__ delta = static_cast<const float*>(p.delta);
    const Mask mask = cta_mask<Mask>(p, seq.index, seqlen_q, seqlen_k);
    const int m0 = Mask::query_block(blockIdx.x, gridDim.x) * BLOCK_M;
    if (Mask::PACKED && m0 >= seqlen_q) return;  // past a shorter sequence's end
    const int head = blockIdx.y, batch = seq.batch, head_kv = head / p.group;
    const ScoreOf<Mask, float, true> score(score_problem<Mask>(p, seq), seq.index, head, scale);

    // Key blocks [j_begin, j_end) hold the keys some existing row of the block sees (mask.cuh);
    // K_j and V_j sit in stage j % 2, whichever block the walk starts at.
    const int j_begin = mask.key_begin(m0) / BLOCK_N;
    const int j_end = (mask.key_end(m0, min(BLOCK_M, seqlen_q - m0)) + BLOCK_N - 1) / BLOCK_N;

    // The key-block addresses are recomputed from the run-time arguments (p: constant bank) at each
    // load: held across the loop, they are what tips the main loop into spilling.
    auto load_key_block = [&](int j, int stage) {
        const int n0 = j * BLOCK_N;
        cp_async_tile<BLOCK_N, D_TILE, NTHREADS>(base + L::K + stage * L::KV_TILE,
                                                 p.k.row<const T>(batch, seq.k_begin + n0, head_kv),
                                                 seqlen_k - n0, headdim, p.k.row_stride, tid);
        cp_async_tile<BLOCK_N, D_TILE, NTHREADS>(base + L::V + stage * L::KV_TILE,
                                                 p.v.row<const T>(batch, seq.k_begin + n0, head_kv),
                                                 seqlen_k - n0, p.headdim_v, p.v.row_stride, tid);
    };

    cp_async_tile<BLOCK_M, D_TILE, NTHREADS>(s_q, q.row<const T>(batch, seq.q_begin + m0, head), seqlen_q - m0,
                                             headdim, q.row_stride, tid);
    cp_async_tile<BLOCK_M, D_TILE, NTHREADS>(s_do, dout.row<const T>(batch, seq.q_begin + m0, head), seqlen_q - m0,
                                             p.headdim_v, dout.row_stride, tid);
    if (j_begin < j_end) load_key_block(j_begin, j_begin & 1);
    cp_async_commit();

    // Row statistics (by ldg: bwd_args in mma_bwd.cuh), made visible by the first iteration's barrier.
    float* s_lse = reinterpret_cast<float*>(smem + L::LSE);
    float* s_delta = reinterpret_cast<float*>(smem + L::DELTA);
    for (int r = tid; r < BLOCK_M; r += NTHREADS) {
        const int m = m0 + r;
        const i64 stat = seq.stat(p, head, m);
        s_lse[r] = m < seqlen_q ? lse_base_log2(ldg(lse + stat)) : 0.f;
        s_delta[r] = m < seqlen_q ? ldg(delta + stat) : 0.f;
    }
    // This lane's accumulator rows within the block: group g, half h is lane_row + 16 g + 8 h.
    const int lane_row = row0 + lane / 4;

    float dq_acc[G][D_TILE / 8][4];
#pragma unroll
    for (int g = 0; g < G; ++g) zero(dq_acc[g]);
    const DropoutOf<Mask> dropout(p, seq.index, head);
    const float drop_scale = DropoutOf<Mask>::kept_scale(p);

    for (int j = j_begin; j < j_end; ++j) {
        const int stage = j & 1;
        // Lands block j; all warps are done with block j - 1, whose stage the next load reuses.
        cp_async_wait<0>();
        __syncthreads();
        if (j + 1 < j_end) load_key_block(j + 1, stage ^ 1);
        cp_async_commit();

        const int n0 = j * BLOCK_N;
        const u32 s_k = base + L::K + stage * L::KV_TILE, s_v = base + L::V + stage * L::KV_TILE;

        // Step 1: S = Q_i K_j^T for this warp's 16 G query rows, turned into P = exp2(S scale
        // log2(e) - lse log2(e)) in place. The window's left bound (from the policy's origin: query
        // m0 + lane_row, key n0 + 2 (lane % 4)) selects P to 0 here, where dP is not live yet, and
        // step 2 tells those entries by P == 0: the d128 kernel has no registers to spare there.
        const bool partial = mask.partial(m0, BLOCK_M, n0, BLOCK_N);
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
                    const float s_ij = score.transform(s_acc[g][f][e], score_origin, 16 * g + 8 * (e >> 1),
                                                       8 * f + (e & 1), dsds);
                    float p = recomputed_p(s_ij, scale_log2, s_lse[lane_row + 16 * g + 8 * (e >> 1)]);
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
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int g = 0; g < G; ++g) stage_acc<T, D_TILE, D_TILE>(s_q, row0 + 16 * g, 0, dq_acc[g], scale, lane);
    __syncwarp();
    T* dq_rows = dq.row<T>(batch, seq.q_begin + m0 + row0, head);
    store_tile<WARP_ROWS, D_TILE, 32>(dq_rows, s_q + tile_offset<D_TILE>(row0, 0), seqlen_q - m0 - row0,
                                      headdim, dq.row_stride, lane);
}

}  // namespace cf

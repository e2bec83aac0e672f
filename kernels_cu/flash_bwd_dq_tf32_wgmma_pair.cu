// flash_bwd_dq_tf32_wgmma_pair: dQ of the float32 backward at head-dim tile 128 on tf32 wgmma
// (sm_90a), the query side of flash_bwd_dkdv_tf32_wgmma_pair.cu: docs/perf-log.md
// tf32-wgmma-bwd-pair (backward_plans.TF32_WGMMA_BACKWARD_ROUTE at the d128 tile,
// Tf32WgmmaBwdConfig(dq_pair=True); other configurations through dmma.backward(config=...)).
//
// flash_bwd_dq_tf32_wgmma keeps Q and dO split (128 KiB at d128) beside a key block's K, K^T and V
// (96 KiB at 32 keys), and one warpgroup's dQ is 64 registers a thread before the apart sums:
// it does not widen to d128. Here a CTA is two warpgroups over the same 64 query rows:
//   warpgroup 0: S  = Q K^T     A = Q from its raw rows, split a k-step at a time (StagedQ)
//   warpgroup 1: dP = dO V^T    A = dO likewise; B = the key block's K or V tiles (hi, lo)
//   both:        S and dP traded through shared memory, dS by the element step
//                (Tf32DqRows::ds_in_place) of each on half the values, traded back
//                (pair_element_steps): both then hold all of dS
//   warpgroup h: dQ_h += dS K_h over head-dim columns 64 h .. 64 h + 63 (B = rows 64 h .. of the
//                key block's K^T tiles, KEY_PAIRS)
// Each thread holds its half of dQ (32), S or dP, then dS (16). Q and dO stay raw (32 KiB each);
// one stage of a key block's six tiles (96 KiB), RAW_STAGES raw K and V blocks copied ahead by
// cp.async (32 KiB each) and the trade (16 KiB): 209 KiB at RAW_STAGES 1.
#include "block_walk.cuh"
#include "common.cuh"
#include "dmma_bwd_steps.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"
#include "wgmma_tf32.cuh"
#include "wgmma_tf32_bwd_steps.cuh"

namespace cf {

// Shared memory in bytes from a 1024-byte aligned base (backward_plans.tf32_wgmma_smem_bytes
// mirrors BYTES and adds the alignment slack): Q and dO raw (64 rows each, StagedQ's layout); the
// key block's Tf32KeyBlockTiles (K, K^T, V, hi and lo); RAW_STAGES stages of raw K and V rows
// (StagedRows); then the trade (pair_element_steps' [2][16][128] floats: dS the one result).
template <int D_TILE, int BLOCK_N, int RAW_STAGES>
struct DqTf32PairSmem {
    static constexpr int BLOCK_M = 64;
    static constexpr u32 RAW_TILE = BLOCK_M * D_TILE * 4, KV_TILE = BLOCK_N * D_TILE * 4;
    static constexpr u32 Q_RAW = 0, DO_RAW = RAW_TILE;
    typedef Tf32KeyBlockTiles<D_TILE, BLOCK_N> Tiles;
    static constexpr u32 STAGE = 2 * RAW_TILE;
    static constexpr u32 RAW = STAGE + (Tiles::BYTES + 1023) / 1024 * 1024;  // [RAW_STAGES][K, V]
    static constexpr u32 TRADE = RAW + RAW_STAGES * 2 * KV_TILE;
    static constexpr u32 TRADE_VALUES = BLOCK_N / 2 * 128;  // a warpgroup's accumulator values
    static constexpr u32 BYTES = TRADE + 2 * TRADE_VALUES * 4;  // pair_element_steps' [2][NV][128] (dS only)
};

template <int D_TILE, class Mask, int BLOCK_N, int RAW_STAGES, bool SUMS_APART, int PRODUCTS = 3>
__global__ void __launch_bounds__(256, 1)
flash_bwd_dq_tf32_wgmma_pair(const __grid_constant__ BwdParams p) {
    typedef DqTf32PairSmem<D_TILE, BLOCK_N, RAW_STAGES> L;
    typedef typename L::Tiles T;
    constexpr int BLOCK_M = L::BLOCK_M, SV = BLOCK_N / 2, HALF = D_TILE / 2, NTHREADS = 256;
    constexpr bool SPLIT = Tf32Operand<PRODUCTS>::SPLIT, APART = SPLIT && SUMS_APART;
    static_assert(D_TILE == 128 && BLOCK_N == 32,
                  "a head-dim half of 64 columns a warpgroup; one 32-column panel of keys (the K^T tiles' rows "
                  "64 h .. start a panel row)");
    static_assert(!SUMS_APART || SPLIT, "apart sums are the split products'");
    static_assert(L::BYTES + 1024 <= 227 * 1024, "shared memory");

    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);
    unsigned char* const smem = smem_raw + (base - smem_u32(smem_raw));
    float* const smem_f = reinterpret_cast<float*>(smem);

    const SequenceRows seq = cta_sequence<Mask>(p, blockIdx.z);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, batch = seq.batch;
    const int m0 = Mask::query_block(blockIdx.x, gridDim.x) * BLOCK_M;
    if (Mask::PACKED && m0 >= seqlen_q) return;  // past a shorter sequence's end
    const Mask mask = cta_mask<Mask, CtaRows::QUERIES>(p, seq.index, seqlen_q, seqlen_k);
    const int head = blockIdx.y, head_kv = head / p.group;
    const float scale_log2 = scale_log2_in<float>(p), scale = scale_in<float>(p);
    const float drop_scale = DropoutOf<Mask>::ENABLED ? dropout_scale_in<float>(p) : 1.f;
    const ScoreOf<Mask, float> score(score_problem<Mask>(p, seq), seq.index, head, scale);
    const DropoutOf<Mask> dropout(p, seq.index, head);
    const int tid = threadIdx.x, wg = tid / 128, wg_tid = tid % 128, warp = wg_tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;  // the accumulators' row and column pair
    const bool s_role = wg == 0;           // warpgroup 0 forms S, warpgroup 1 dP

    // The role's A operand, Q or dO, raw: each warp its own 16 rows, which only it reads.
    unsigned char* const a_rows = smem + (s_role ? L::Q_RAW : L::DO_RAW);
    if (s_role)
        stage_q_rows<D_TILE>(a_rows, p.q.row<const float>(batch, seq.q_begin + m0, head), seqlen_q - m0, p.headdim,
                             p.q.row_stride, 16 * warp, lane);
    else
        stage_q_rows<D_TILE>(a_rows, p.dout.row<const float>(batch, seq.q_begin + m0, head), seqlen_q - m0,
                             p.headdim_v, p.dout.row_stride, 16 * warp, lane);
    const StagedQ<D_TILE, PRODUCTS> a_staged(a_rows, 16 * warp, lane);
    const Tf32DqRows rows(p, seq, head, m0, seqlen_q, warp, g);  // this thread's two rows and their statistics

    // The walk's key blocks and their raw K and V rows (RAW_STAGES ahead, or read by the split itself).
    const Tf32KeyBlocks<BLOCK_N, BLOCK_M, D_TILE, NTHREADS, RAW_STAGES> blocks(p, seq, mask, head_kv, m0, base + L::RAW,
                                                                             tid);
    blocks.copy_first();

    const u32 stage = base + L::STAGE;
    const u32 b_tile = stage + (s_role ? T::K : T::V);  // the role's B: K or V, hi then lo
    float* const trade = smem_f + L::TRADE / 4;
    const u32 half_rows = wg * HALF * 128;  // rows 64 wg .. of the K^T tiles: 128 bytes a row

    float dq_acc[HALF / 2];  // this warpgroup's head-dim half
#pragma unroll
    for (int e = 0; e < HALF / 2; ++e) dq_acc[e] = 0.f;

    for (int j = blocks.first; j < blocks.end; ++j) {
        const int n0 = j * BLOCK_N;
        // Step 1: K and V split into their three tile pairs by both warpgroups (Tf32RawStages::land:
        // its barrier before, both warpgroups done with the block before, its products waited for
        // and the trade read; the tiles whole for wgmma after).
        blocks.land(j, [&](const auto& k_src, const auto& v_src) {
            split_key_block_tf32<D_TILE, BLOCK_N, NTHREADS, PRODUCTS>(stage, k_src, v_src, seqlen_k - n0, p.headdim,
                                                                     p.headdim_v, tid);
        });

        // Step 2: the role's product, S = Q K^T or dP = dO V^T, A split a k-step at a time.
        float x[SV];
        tf32_staged_times_rows<D_TILE, BLOCK_N, PRODUCTS, APART>(x, a_staged, b_tile, b_tile + T::KV_TILE);

        // Steps 3-4: the trade and dS = P (dP - D) into s, each warpgroup on half the values
        // (pair_element_steps).
        float s[SV], dp[SV];
        const bool partial = mask.partial(m0, BLOCK_M, n0, BLOCK_N);
        pair_element_steps<SV, false>(x, s, dp, trade, wg, wg_tid, [&](float(&a)[SV / 2], float(&b)[SV / 2], int f0) {
            rows.ds_in_place<BLOCK_N, BLOCK_N / 16>(a, b, n0, t, mask, score, dropout, drop_scale, scale_log2, partial,
                                                    f0);
        });

        // Step 5 on this warpgroup's head-dim half: dQ_h += dS K_h.
        tf32_acc_times_tile<HALF, BLOCK_N / 8, PRODUCTS, APART>(dq_acc, s, stage + T::KT + half_rows,
                                                              stage + T::KT + T::KV_TILE + half_rows, NoTurns());
    }
    cp_async_wait<0>();  // the empty groups past the walk's end

    const int column0 = HALF * wg;
    store_acc_rows_f32<HALF>(
        dq_acc, scale, seqlen_q - m0, p.headdim - column0,
        [&](int r) { return p.dq.row<float>(batch, seq.q_begin + m0 + r, head) + column0; }, warp, lane);
}

}  // namespace cf

// flash_bwd_dkdv_tf32_wgmma_pair: dK and dV of the float32 backward at head-dim tile 128 on tf32
// wgmma (sm_90a): docs/perf-log.md tf32-wgmma-bwd-pair. backward_plans.TF32_WGMMA_BACKWARD_ROUTE
// runs it at the d128 tile (Tf32WgmmaBwdConfig(pair=True), beside flash_bwd_dq_tf32_wgmma_pair);
// dmma.backward(config=...) runs other configurations.
//
// At d128 one warpgroup cannot hold its 64 keys' dK and dV (128 registers a thread, 64 more for a
// block's fresh sums), and K, V, Q, dO, Q^T and dO^T split (hi, lo) do not fit in shared memory
// (256 KiB at 32 queries a block): the d64 kernels do not widen. Here a CTA is two warpgroups over
// the same 64 keys, one role each for the products that reduce over the head dim, then one half of
// the head dim each for the products that reduce over the queries:
//   warpgroup 0: S^T  = K Q^T    A = K from its raw rows, split a k-step at a time (StagedQ)
//   warpgroup 1: dP^T = V dO^T   A = V likewise; B = the query block's Q or dO tiles (hi, lo)
//   both:        S^T and dP^T traded through shared memory (thread i of one warpgroup holds the
//                (key, query) pairs thread i of the other does), the element step
//                (tf32_dkdv_element_step) by each on half the values, and P^T and dS^T traded
//                back (pair_element_steps): both then hold all of them
//   warpgroup h: dV_h += P^T dO_h, dK_h += dS^T Q_h over head-dim columns 64 h .. 64 h + 63
//                (B = rows 64 h .. of the query block's dO^T and Q^T tiles, KEY_PAIRS)
// Each thread holds dK and dV for its half (32 + 32), S^T or dP^T, then P^T and dS^T (16 + 16),
// and the apart sums' extra chains. K and V stay raw (32 KiB each), as the forward stages Q at
// d128 (tf32-wgmma-d128); the query block's eight tiles (128 KiB) and the trade's three value
// planes (24 KiB) fill the rest: 218 KiB, one stage, so the split of a query block (both
// warpgroups, from global memory) and its products take turns. PREFETCH (perf log
// tf32-pair-prefetch): the next block's rows and statistics are asked into L1 as this block's
// products start, so that its split waits on L1 rather than L2 (a raw stage by cp.async, which
// would not wait at all, spilled: dev/experiments/tf32_pair_raw_ahead.patch). Same products as the
// d64 kernels' (seven a block pair with the dQ kernel's); S^T and dP^T each formed once, each
// element step value once.
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
// mirrors BYTES and adds the alignment slack): K and V raw (64 rows each, StagedQ's layout); the
// query block's Tf32QueryBlockTiles (Q, dO, Q^T, dO^T, hi and lo, and its row statistics), padded
// to 1024 bytes; then the trade (pair_element_steps' [3][16][128] floats).
template <int D_TILE, int BLOCK_M>
struct BwdTf32PairSmem {
    static constexpr int BLOCK_N = 64;
    static constexpr u32 RAW_TILE = BLOCK_N * D_TILE * 4;
    static constexpr u32 K_RAW = 0, V_RAW = RAW_TILE;
    typedef Tf32QueryBlockTiles<D_TILE, BLOCK_M> Tiles;
    static constexpr u32 STAGE = 2 * RAW_TILE;
    static constexpr u32 TRADE = STAGE + (Tiles::BYTES + 1023) / 1024 * 1024;
    static constexpr u32 TRADE_VALUES = BLOCK_M / 2 * 128;  // a warpgroup's accumulator values
    static constexpr u32 BYTES = TRADE + 3 * TRADE_VALUES * 4;  // pair_element_steps' [3][NV][128]
};

template <int D_TILE, class Mask, int BLOCK_M, bool SUMS_APART, int PRODUCTS = 3, bool PREFETCH = false>
__global__ void __launch_bounds__(256, 1)
flash_bwd_dkdv_tf32_wgmma_pair(const __grid_constant__ BwdParams p) {
    typedef BwdTf32PairSmem<D_TILE, BLOCK_M> L;
    typedef typename L::Tiles T;
    constexpr int BLOCK_N = L::BLOCK_N, SV = BLOCK_M / 2, HALF = D_TILE / 2;
    constexpr bool SPLIT = Tf32Operand<PRODUCTS>::SPLIT, APART = SPLIT && SUMS_APART;
    static_assert(D_TILE == 128 && BLOCK_M == 32,
                  "a head-dim half of 64 columns a warpgroup; one 32-column panel of queries (the tiles' "
                  "transposed rows 64 h .. start a panel row)");
    static_assert(!SUMS_APART || SPLIT, "apart sums are the split products'");
    static_assert(L::BYTES + 1024 <= 227 * 1024, "shared memory");

    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);
    unsigned char* const smem = smem_raw + (base - smem_u32(smem_raw));
    float* const smem_f = reinterpret_cast<float*>(smem);

    const SequenceRows seq = cta_sequence<Mask>(p, blockIdx.z);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    const int n0 = blockIdx.x * BLOCK_N, head_kv = blockIdx.y, batch = seq.batch;
    // Past a shorter sequence's end (the whole CTA). A sequence without queries still stores dK = dV = 0.
    if (Mask::PACKED && n0 >= seqlen_k) return;
    const Mask mask = cta_mask<Mask, CtaRows::KEYS>(p, seq.index, seqlen_q, seqlen_k);
    const QueryBlockWalk<BLOCK_M, false> walk(mask, n0, BLOCK_N, p.group);
    const int tid = threadIdx.x, wg = tid / 128, wg_tid = tid % 128, warp = wg_tid / 32, lane = tid % 32;
    const bool s_role = wg == 0;  // warpgroup 0 forms S^T, warpgroup 1 dP^T

    // The role's A operand, K or V, raw: each warp its own 16 rows, which only it reads.
    unsigned char* const a_rows = smem + (s_role ? L::K_RAW : L::V_RAW);
    if (s_role)
        stage_q_rows<D_TILE>(a_rows, p.k.row<const float>(batch, seq.k_begin + n0, head_kv), seqlen_k - n0,
                             p.headdim, p.k.row_stride, 16 * warp, lane);
    else
        stage_q_rows<D_TILE>(a_rows, p.v.row<const float>(batch, seq.k_begin + n0, head_kv), seqlen_k - n0,
                             p.headdim_v, p.v.row_stride, 16 * warp, lane);
    const StagedQ<D_TILE, PRODUCTS> a_staged(a_rows, 16 * warp, lane);

    const u32 stage = base + L::STAGE;
    const u32 b_tile = stage + (s_role ? T::Q : T::DO);  // the role's B: Q or dO, hi then lo
    float* const stats = smem_f + (L::STAGE + T::STATS) / 4;
    float* const trade = smem_f + L::TRADE / 4;
    const u32 half_rows = wg * HALF * 128;  // rows 64 wg .. of a transposed tile: 128 bytes a row

    float dk_acc[HALF / 2], dv_acc[HALF / 2];  // this warpgroup's head-dim half
#pragma unroll
    for (int e = 0; e < HALF / 2; ++e) dk_acc[e] = dv_acc[e] = 0.f;
    for (int it = 0; it < walk.iters; ++it) {
        const int m0 = walk.block(it) * BLOCK_M, head = walk.head(head_kv, it);

        // Step 1: the query block's Q and dO split into the stage by both warpgroups, its rows'
        // statistics beside them. The barrier before: both warpgroups are done with the block before
        // (its products waited for, the trade read).
        __syncthreads();
        split_query_block_tf32<D_TILE, BLOCK_M, 256, PRODUCTS>(
            stage, GlobalRows{p.q.row<const float>(batch, seq.q_begin + m0, head), p.q.row_stride},
            GlobalRows{p.dout.row<const float>(batch, seq.q_begin + m0, head), p.dout.row_stride}, seqlen_q - m0,
            p.headdim, p.headdim_v, tid);
        if (tid < BLOCK_M) {
            const bool valid = m0 + tid < seqlen_q;
            query_row_stats<BLOCK_M>(stats, p, seq.stat(p, head, valid ? m0 + tid : 0), valid, tid);
        }
        fence_proxy_async_shared();  // the tiles, to the async proxy that wgmma reads with
        __syncthreads();
        if constexpr (PREFETCH) {
            if (it + 1 < walk.iters) {
                const int next_m0 = walk.block(it + 1) * BLOCK_M, next_head = walk.head(head_kv, it + 1);
                prefetch_query_block_l1<BLOCK_M, D_TILE, 256>(
                    p, p.q.row<const float>(batch, seq.q_begin + next_m0, next_head),
                    p.dout.row<const float>(batch, seq.q_begin + next_m0, next_head), seqlen_q - next_m0,
                    seq.stat(p, next_head, next_m0), tid);
            }
        }

        // Step 2: the role's product, S^T = K Q^T or dP^T = V dO^T, A split a k-step at a time.
        float x[SV];
        tf32_staged_times_rows<D_TILE, BLOCK_M, PRODUCTS, APART>(x, a_staged, b_tile, b_tile + T::Q_TILE);

        // Steps 3-4: the trade and the element step, P^T into s and dS^T into ds, each warpgroup on
        // half the values (pair_element_steps).
        float s[SV], ds[SV];
        pair_element_steps<SV, true>(x, s, ds, trade, wg, wg_tid, [&](float(&a)[SV / 2], float(&b)[SV / 2], int f0) {
            tf32_dkdv_element_step<BLOCK_M, BLOCK_M / 16>(a, b, stats, p, seq, mask, head, m0, n0, warp, lane, f0);
        });

        // Steps 5-6 on this warpgroup's head-dim half: dV_h += P^T dO_h, dK_h += dS^T Q_h.
        tf32_acc_times_tile<HALF, BLOCK_M / 8, PRODUCTS, APART>(dv_acc, s, stage + T::DOT + half_rows,
                                                              stage + T::DOT + T::Q_TILE + half_rows, NoTurns());
        tf32_acc_times_tile<HALF, BLOCK_M / 8, PRODUCTS, APART>(dk_acc, ds, stage + T::QT + half_rows,
                                                              stage + T::QT + T::Q_TILE + half_rows, NoTurns());
    }

    // Epilogue: dK = scale dS^T Q summed, dV (times 1 / (1 - p) under dropout), each warpgroup its
    // half of the columns.
    const int keys_valid = seqlen_k - n0, column0 = HALF * wg;
    const float scale = scale_in<float>(p);
    const float drop_scale = DropoutOf<Mask>::ENABLED ? dropout_scale_in<float>(p) : 1.f;
    store_acc_rows_f32<HALF>(
        dk_acc, scale, keys_valid, p.headdim - column0,
        [&](int r) { return p.dk.row<float>(batch, seq.k_begin + n0 + r, head_kv) + column0; }, warp, lane);
    store_acc_rows_f32<HALF>(
        dv_acc, drop_scale, keys_valid, p.headdim_v - column0,
        [&](int r) { return p.dv.row<float>(batch, seq.k_begin + n0 + r, head_kv) + column0; }, warp, lane);
}

}  // namespace cf

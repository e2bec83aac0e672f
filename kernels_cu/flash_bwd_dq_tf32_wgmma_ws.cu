// flash_bwd_dq_tf32_wgmma_ws: flash_bwd_dq_tf32_wgmma with a producer warpgroup (sm_90a):
// docs/perf-log.md tf32-wgmma-dq-ws. The float32 route's dQ kernel with one consumer
// (backward_plans.TF32_WGMMA_BACKWARD_ROUTE); two consumers are a candidate
// (Tf32WgmmaBwdConfig(dq_consumers=2) through dmma.backward(config=...)), measured no faster.
//
// The single warpgroup of flash_bwd_dq_tf32_wgmma splits each key block (K twice, natural and
// transposed, and V, each hi and lo), runs its three products and its element step in series,
// and holds about half of the routed float32 backward's time (perf log tf32-wgmma-bwd-route's
// estimate). As flash_bwd_dkdv_tf32_wgmma_ws does for the query side, a CTA here is two
// warpgroups over the same 64 query rows:
//   warpgroup 0, the producer: cp.async copies each key block's raw K and V rows RAW_STAGES
//       blocks ahead into staging tiles, splits them into one of STAGES stages of wgmma tiles
//       (K, K^T, V; hi and lo) and says so on the stage's full barrier;
//   warpgroup 1, the consumer: per key block it waits on the stage's full barrier, forms S and
//       dP, the element step and dQ += dS K (every product waited for), and arrives on the
//       stage's empty barrier; dQ is its registers, stored at the end.
// Q and dO are split by the first two warpgroups before the roles split (the last CTA-wide
// barrier). The barrier protocol is StageRing's (mbarrier.cuh), as in the dK/dV producer kernel;
// the producer's own barrier is named barrier 1. No register reallocation.
//
// CONSUMERS 2: a second consumer warpgroup takes the odd key blocks (consumer c the blocks
// i = c, c + 2, ...), each into its own dQ of the same 64 rows; at the end consumer 1 hands its
// dQ to consumer 0 through shared memory (named barrier 2) and consumer 0 adds it, in that one
// order, and stores. Why: one consumer warpgroup is one warp a scheduler, and its step is a
// chain of dependent products, waits and the element step at about 0.35 instructions a clock
// (perf log tf32-wgmma-dq-ws, the SASS count); a second warp a scheduler runs in its gaps. The
// stage ring is unchanged: each stage use is one phase of its barriers, whichever consumer it is.
//
// PRESPLIT (a candidate: Tf32WgmmaBwdConfig(dq_presplit=True); perf log tf32-split-once): the
// key blocks come split already, once for the grid, by flash_bwd_split_kv_tf32 (BwdParams'
// kv_split image, Tf32KeyBlockTiles' bytes). The producer is then one thread: per key block it
// waits for the stage to be empty, arrives on its full barrier expecting the block's bytes, and
// has the TMA unit copy them in (cp.async.bulk); the phase completes when they have landed, in
// the async proxy that wgmma reads with. No raw stages (RAW_STAGES 0), no split in this kernel
// but Q's and dO's.
#include "block_walk.cuh"
#include "common.cuh"
#include "dmma_bwd_steps.cuh"
#include "mask.cuh"
#include "mbarrier.cuh"
#include "mma.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"
#include "wgmma_tf32.cuh"
#include "wgmma_tf32_bwd_steps.cuh"

namespace cf {

// Shared memory in bytes from a 1024-byte aligned base (backward_plans.tf32_wgmma_smem_bytes
// mirrors BYTES and adds the alignment slack): Q and dO (hi, lo; 64 rows, K-major); STAGES
// stages, each a key block's K, K^T and V (hi, lo), padded to 1024 bytes so that every stage's
// tiles stay aligned for the swizzle; RAW_STAGES raw K and V tiles (StagedRows); a full and an
// empty barrier a stage.
template <int D_TILE, int BLOCK_N, int STAGES, int RAW_STAGES>
struct DqTf32WgmmaWsSmem {
    static constexpr int BLOCK_M = 64;
    static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 4, KV_TILE = BLOCK_N * D_TILE * 4;
    static constexpr u32 Q_HI = 0, DO_HI = 2 * Q_TILE;
    typedef Tf32KeyBlockTiles<D_TILE, BLOCK_N> Tiles;
    static constexpr u32 K = Tiles::K, KT = Tiles::KT, V = Tiles::V;  // in a stage
    static constexpr u32 STAGE = (6 * KV_TILE + 1023) / 1024 * 1024;
    static constexpr u32 STAGE0 = 4 * Q_TILE;
    static constexpr u32 RAW = STAGE0 + STAGES * STAGE;
    static constexpr u32 FULL = RAW + RAW_STAGES * 2 * KV_TILE, EMPTY = FULL + 8 * STAGES;
    static constexpr u32 BYTES = EMPTY + 8 * STAGES;
};

template <int D_TILE, class Mask, int BLOCK_N, int STAGES, int RAW_STAGES, bool SUMS_APART, int PRODUCTS = 3,
          int CONSUMERS = 1, bool PRESPLIT = false>
__global__ void __launch_bounds__(128 + 128 * CONSUMERS, 1)
flash_bwd_dq_tf32_wgmma_ws(const __grid_constant__ BwdParams p) {
    typedef DqTf32WgmmaWsSmem<D_TILE, BLOCK_N, STAGES, RAW_STAGES> L;
    constexpr int BLOCK_M = L::BLOCK_M, SV = BLOCK_N / 2;
    static_assert(CONSUMERS == 1 || CONSUMERS == 2, "one or two consumer warpgroups");
    // consumer 1's dQ passes through the stages (all consumed by then)
    static_assert(CONSUMERS == 1 || STAGES * L::STAGE >= BLOCK_M * D_TILE * 4, "the hand-over's room");
    static_assert(BLOCK_N % 32 == 0 && BLOCK_N <= 64 && D_TILE % 32 == 0 && D_TILE <= 128,
                  "whole tf32 panels; S's width is wgmma's N");
    static_assert(STAGES >= 2 && (PRESPLIT ? RAW_STAGES == 0 : RAW_STAGES >= 1), "stages");
    static_assert(!SUMS_APART || Tf32Operand<PRODUCTS>::SPLIT, "apart sums are the split products'");
    static_assert(L::BYTES + 1024 <= 227 * 1024, "shared memory");

    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);

    const SequenceRows seq = cta_sequence<Mask>(p, blockIdx.z);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, batch = seq.batch;
    const int m0 = Mask::query_block(blockIdx.x, gridDim.x) * BLOCK_M;
    if (Mask::PACKED && m0 >= seqlen_q) return;  // past a shorter sequence's end: the whole CTA
    const Mask mask = cta_mask<Mask, CtaRows::QUERIES>(p, seq.index, seqlen_q, seqlen_k);
    const int head = blockIdx.y, head_kv = head / p.group;
    // PRESPLIT copies each block's image, so an empty key range walks no block (KeyBlockRange)
    const KeyBlockRange<BLOCK_N, PRESPLIT> keys(mask, m0, BLOCK_M);
    const int j_begin = keys.first, j_end = keys.end, n_blocks = keys.blocks;
    const int tid = threadIdx.x, wg = tid / 128, wg_tid = tid % 128, warp = wg_tid / 32, lane = tid % 32;

    if (tid < 256) {  // the split's rows are dealt to 256 threads (a multiple of its row step)
        split_tf32_panels<BLOCK_M, D_TILE, 256, PRODUCTS>(
            base + L::Q_HI, base + L::Q_HI + L::Q_TILE,
            GlobalRows{p.q.row<const float>(batch, seq.q_begin + m0, head), p.q.row_stride}, seqlen_q - m0, p.headdim,
            tid);
        split_tf32_panels<BLOCK_M, D_TILE, 256, PRODUCTS>(
            base + L::DO_HI, base + L::DO_HI + L::Q_TILE,
            GlobalRows{p.dout.row<const float>(batch, seq.q_begin + m0, head), p.dout.row_stride}, seqlen_q - m0,
            p.headdim_v, tid);
    }
    const StageRing<STAGES> ring{base + L::FULL, base + L::EMPTY};
    ring.init(PRESPLIT ? 1 : 128, 128);  // the producer's threads (PRESPLIT: its one), a consumer's
    fence_proxy_async_shared();  // Q and dO's stores, to the async proxy that wgmma reads with
    __syncthreads();             // the last CTA-wide barrier: the roles split here

    auto stage_of = [&](int i) { return L::STAGE0 + (i % STAGES) * L::STAGE; };
    if (wg == 0) {
        if constexpr (PRESPLIT) {
            // ---- producer: one thread, a bulk copy of each key block's split image ----
            if (wg_tid != 0) return;
            const unsigned char* const image = static_cast<const unsigned char*>(p.kv_split);
            for (int i = 0; i < n_blocks; ++i) {
                const i64 block = kv_image_offset<Mask::PACKED, D_TILE, BLOCK_N>(p, seq, head_kv, j_begin + i);
                ring.wait_empty(i);  // the consumer is done with the stage (its products waited for)
                mbarrier_arrive_expect_tx(ring.full_barrier(i), L::Tiles::BYTES);
                cp_async_bulk_to_shared(base + stage_of(i), image + block, L::Tiles::BYTES, ring.full_barrier(i));
            }
            return;
        } else {
            // ---- producer ----
            const float* __restrict__ k_rows = p.k.row<const float>(batch, seq.k_begin, head_kv);
            const float* __restrict__ v_rows = p.v.row<const float>(batch, seq.k_begin, head_kv);
            const i64 k_ss = p.k.row_stride, v_ss = p.v.row_stride;
            const Tf32RawStages<BLOCK_N, D_TILE, 128, RAW_STAGES> raw{base + L::RAW};
            auto copy_raw = [&](int j) {  // key block j's raw rows (nothing past the walk's end)
                raw.copy(j, j < j_end, j * BLOCK_N, k_rows, k_ss, p.headdim, v_rows, v_ss, p.headdim_v, seqlen_k,
                         wg_tid);
            };
            raw.copy_first(j_begin, copy_raw);
            for (int i = 0; i < n_blocks; ++i) {
                const int j = j_begin + i, n0 = j * BLOCK_N;
                const u32 stage = base + stage_of(i), staged = raw.stage(j);
                cp_async_wait<RAW_STAGES - 1>();
                named_barrier_sync(1, 128);  // block j's raw rows have landed, every producer thread's
                ring.wait_empty(i);          // the consumer is done with the stage
                split_key_block_tf32<D_TILE, BLOCK_N, 128, PRODUCTS>(stage, StagedRows<D_TILE>{staged},
                                                                     StagedRows<D_TILE>{staged + raw.TILE},
                                                                     seqlen_k - n0, p.headdim, p.headdim_v, wg_tid);
                fence_proxy_async_shared();  // the tiles, to the async proxy that wgmma reads with
                ring.arrive_full(i);
                named_barrier_sync(1, 128);  // every producer thread is done reading the raw tiles
                copy_raw(j + RAW_STAGES);
            }
            cp_async_wait<0>();  // the empty groups past the walk's end
            return;
        }
    }

    // ---- consumers: the 64 query rows' dQ, consumer c over key blocks c, c + CONSUMERS, ... ----
    const int consumer = wg - 1;
    const float scale_log2 = scale_log2_in<float>(p), scale = scale_in<float>(p);
    const float drop_scale = DropoutOf<Mask>::ENABLED ? dropout_scale_in<float>(p) : 1.f;
    const ScoreOf<Mask, float> score(score_problem<Mask>(p, seq), seq.index, head, scale);
    const DropoutOf<Mask> dropout(p, seq.index, head);
    const int g = lane / 4, t = lane % 4;  // the accumulators' row and column pair
    const Tf32DqRows rows(p, seq, head, m0, seqlen_q, warp, g);  // this thread's two rows and their statistics

    float dq_acc[D_TILE / 2];
#pragma unroll
    for (int e = 0; e < D_TILE / 2; ++e) dq_acc[e] = 0.f;
    for (int i = consumer; i < n_blocks; i += CONSUMERS) {
        const int n0 = (j_begin + i) * BLOCK_N;
        const u32 stage = base + stage_of(i);
        ring.wait_full(i);
        // S = Q K^T and dP = dO V^T, three products a k-step.
        float s[SV], dp[SV];
        tf32_scores_and_dp<D_TILE / 8, SUMS_APART>(s, dp,
            Tf32RowsTimesRows<BLOCK_M, BLOCK_N, PRODUCTS>{base + L::Q_HI, base + L::Q_HI + L::Q_TILE, stage + L::K,
                                                          stage + L::K + L::KV_TILE},
            {base + L::DO_HI, base + L::DO_HI + L::Q_TILE, stage + L::V, stage + L::V + L::KV_TILE});
        // dS = P (dP - D) into s (Tf32DqRows: each value at its row and key).
        rows.ds_in_place<BLOCK_N>(s, dp, n0, t, mask, score, dropout, drop_scale, scale_log2,
                                  mask.partial(m0, BLOCK_M, n0, BLOCK_N));
        // dQ += dS K, waited for: the stage is the producer's again after it.
        tf32_acc_times_tile<D_TILE, BLOCK_N / 8, PRODUCTS, SUMS_APART>(dq_acc, s, stage + L::KT,
                                                                     stage + L::KT + L::KV_TILE, NoTurns());
        ring.arrive_empty(i);
    }
    if constexpr (CONSUMERS == 2) {
        // consumer 1's dQ to consumer 0, value-major (thread t's value e at e * 128 + t: no bank
        // conflicts), over the stages once both are done with them (every product waited for;
        // the producer writes no stage past the last block); consumer 0 adds it to its own, in
        // that one order, then stores
        float* const handover = reinterpret_cast<float*>(smem_raw + (base - smem_u32(smem_raw)) + L::STAGE0);
        named_barrier_sync(2, 256);  // both consumers past their last block's products
        if (consumer == 1) {
#pragma unroll
            for (int e = 0; e < D_TILE / 2; ++e) handover[e * 128 + wg_tid] = dq_acc[e];
        }
        named_barrier_sync(2, 256);  // consumer 1's dQ written
        if (consumer == 1) return;
#pragma unroll
        for (int e = 0; e < D_TILE / 2; ++e) dq_acc[e] += handover[e * 128 + wg_tid];
    }

    store_acc_rows_f32<D_TILE>(dq_acc, scale, seqlen_q - m0, p.headdim,
                               [&](int r) { return p.dq.row<float>(batch, seq.q_begin + m0 + r, head); }, warp, lane);
}

}  // namespace cf

// flash_bwd_dkdv_tf32_wgmma_ws: flash_bwd_dkdv_tf32_wgmma with a producer warpgroup (sm_90a), a
// candidate: docs/perf-log.md tf32-wgmma-bwd-v1. Not a row of any plan
// (backward_plans.Tf32WgmmaBwdConfig(producer=True) through dmma.backward(config=...)).
//
// tf32-wgmma-bwd-v0's one warpgroup runs a query block's split (Q and dO into eight tiles, hi and
// lo, natural and transposed), its four products and its element step in series: the split alone
// is about as long as the products (the card's count). Here a CTA is two warpgroups over the same
// 64 keys:
//   warpgroup 0, the producer: cp.async copies each query block's raw Q and dO rows RAW_STAGES
//       blocks ahead into staging tiles, splits them into one of STAGES stages of wgmma tiles with
//       the block's row statistics beside them, and says so on the stage's full barrier;
//   warpgroup 1, the consumer: per query block it waits on the stage's full barrier, runs
//       tf32_dkdv_query_block (wgmma_tf32_bwd_steps.cuh: S^T, dP^T, P^T and dS^T, dV and dK, all
//       waited for) and arrives on the stage's empty barrier, which the producer waits on before it
//       writes that stage again; dK and dV are its registers, stored at the end.
// K and V are split by both warpgroups before the roles split (the last CTA-wide barrier). The
// barrier protocol is flash_fwd_tf32_wgmma_ws.cu's (mbarrier.cuh: the producer waits on a stage's
// empty barrier with parity ((use & 1) ^ 1), so its first use of every stage finds it free). No
// register reallocation: at 256 threads each may hold 255. dQ: flash_bwd_dq_tf32_wgmma_ws (the
// route's), flash_bwd_dq_tf32_wgmma or the tf32x3 experiment's kernel; the fused atomic dQ does
// not fit here (K^T and dS beside two stages: 242 KiB at 32 queries).
//
// PRESPLIT (a candidate: Tf32WgmmaBwdConfig(presplit=True, raw_stages=0); perf log
// tf32-split-once-dkdv): the query blocks come split already, with their statistics, once for the
// grid, by flash_bwd_split_q_tf32 (BwdParams' q_split image, Tf32QueryBlockTiles' bytes). The
// producer is then one thread: per query block it waits for the stage to be empty, arrives on its
// full barrier expecting the block's bytes, and has the TMA unit copy them in (cp.async.bulk), as
// flash_bwd_dq_tf32_wgmma_ws's PRESPLIT producer does with key blocks. No raw stages.
#include "block_walk.cuh"
#include "common.cuh"
#include "cta_timeline.cuh"
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
// mirrors BYTES and adds the alignment slack): K and V (hi, lo; 64 rows); STAGES stages, each a
// query block's Q, dO, Q^T and dO^T (hi, lo) and then its row statistics ([STAT_SLOTS][BLOCK_M]
// floats), padded to 1024 bytes so that every stage's tiles stay aligned for the swizzle;
// RAW_STAGES raw Q and dO tiles (StagedRows); a full and an empty barrier a stage.
template <int D_TILE, int BLOCK_M, int STAGES, int RAW_STAGES>
struct BwdTf32WgmmaWsSmem {
    static constexpr int BLOCK_N = 64;
    static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 4, Q_TILE = BLOCK_M * D_TILE * 4;
    static constexpr u32 K_HI = 0, V_HI = 2 * KV_TILE;
    typedef Tf32QueryBlockTiles<D_TILE, BLOCK_M> Tiles;
    // in a stage
    static constexpr u32 Q = Tiles::Q, DO = Tiles::DO, QT = Tiles::QT, DOT = Tiles::DOT, STATS = Tiles::STATS;
    static constexpr u32 STAGE = (Tiles::BYTES + 1023) / 1024 * 1024;
    static constexpr u32 STAGE0 = 4 * KV_TILE;
    static constexpr u32 RAW = STAGE0 + STAGES * STAGE;
    static constexpr u32 FULL = RAW + RAW_STAGES * 2 * Q_TILE, EMPTY = FULL + 8 * STAGES;
    static constexpr u32 BYTES = EMPTY + 8 * STAGES;
};

template <int D_TILE, class Mask, int BLOCK_M, int STAGES, int RAW_STAGES, bool SUMS_APART, int PRODUCTS = 3,
          bool PRESPLIT = false>
__global__ void __launch_bounds__(256, 1)
flash_bwd_dkdv_tf32_wgmma_ws(const __grid_constant__ BwdParams p) {
    typedef BwdTf32WgmmaWsSmem<D_TILE, BLOCK_M, STAGES, RAW_STAGES> L;
    constexpr int BLOCK_N = L::BLOCK_N, SV = BLOCK_M / 2;
    static_assert(BLOCK_M % 32 == 0 && BLOCK_M <= 64 && D_TILE % 32 == 0 && D_TILE <= 128,
                  "whole tf32 panels; S^T's width is wgmma's N");
    static_assert(STAGES >= 2 && (PRESPLIT ? RAW_STAGES == 0 : RAW_STAGES >= 1), "stages");
    static_assert(!SUMS_APART || Tf32Operand<PRODUCTS>::SPLIT, "apart sums are the split products'");
    static_assert(L::BYTES + 1024 <= 227 * 1024, "shared memory");
    // first, so that a CTA's setup counts in its prologue; the consumer's first thread records
    cta_timeline(MARK_ENTRY, threadIdx.x == 128);  // (dev/cta_timeline.py)

    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);
    float* const smem_f = reinterpret_cast<float*>(smem_raw + (base - smem_u32(smem_raw)));

    const SequenceRows seq = cta_sequence<Mask>(p, blockIdx.z);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    const int n0 = blockIdx.x * BLOCK_N, head_kv = blockIdx.y, batch = seq.batch;
    // Past a shorter sequence's end (the whole CTA). A sequence without queries still stores dK = dV = 0.
    if (Mask::PACKED && n0 >= seqlen_k) return;
    const Mask mask = cta_mask<Mask, CtaRows::KEYS>(p, seq.index, seqlen_q, seqlen_k);
    // PRESPLIT copies each block's image, so an empty query range walks no block (SKIP_EMPTY)
    const QueryBlockWalk<BLOCK_M, PRESPLIT> walk(mask, n0, BLOCK_N, p.group);
    const int tid = threadIdx.x, wg = tid / 128, wg_tid = tid % 128, warp = wg_tid / 32, lane = tid % 32;

    const GlobalRows k_global{p.k.row<const float>(batch, seq.k_begin + n0, head_kv), p.k.row_stride};
    const GlobalRows v_global{p.v.row<const float>(batch, seq.k_begin + n0, head_kv), p.v.row_stride};
    split_tf32_panels<BLOCK_N, D_TILE, 256, PRODUCTS>(base + L::K_HI, base + L::K_HI + L::KV_TILE, k_global,
                                                      seqlen_k - n0, p.headdim, tid);
    split_tf32_panels<BLOCK_N, D_TILE, 256, PRODUCTS>(base + L::V_HI, base + L::V_HI + L::KV_TILE, v_global,
                                                      seqlen_k - n0, p.headdim_v, tid);
    const StageRing<STAGES> ring{base + L::FULL, base + L::EMPTY};
    ring.init(PRESPLIT ? 1 : 128, 128);  // the producer's threads (PRESPLIT: its one), the consumer's
    fence_proxy_async_shared();  // K and V's stores, to the async proxy that wgmma reads with
    __syncthreads();             // the last CTA-wide barrier: the roles split here

    auto stage_of = [&](int it) { return L::STAGE0 + (it % STAGES) * L::STAGE; };
    if (wg == 0) {
        if constexpr (PRESPLIT) {
            // ---- producer: one thread, a bulk copy of each query block's split image ----
            if (wg_tid != 0) return;
            const unsigned char* const image = static_cast<const unsigned char*>(p.q_split);
            for (int it = 0; it < walk.iters; ++it) {
                const i64 block = q_image_offset<Mask::PACKED, D_TILE, BLOCK_M>(p, seq, walk.head(head_kv, it),
                                                                                walk.block(it));
                ring.wait_empty(it);  // the consumer is done with the stage (its products waited for)
                mbarrier_arrive_expect_tx(ring.full_barrier(it), L::Tiles::BYTES);
                cp_async_bulk_to_shared(base + stage_of(it), image + block, L::Tiles::BYTES, ring.full_barrier(it));
            }
            return;
        } else {
            // ---- producer ----
            const Tf32RawStages<BLOCK_M, D_TILE, 128, RAW_STAGES> raw{base + L::RAW};
            auto copy_raw = [&](int it) {
                const bool valid_it = it < walk.iters;
                // (past the walk's end nothing is copied, and block(it) would divide by its 0 blocks)
                const int m0 = valid_it ? walk.block(it) * BLOCK_M : 0, head = valid_it ? walk.head(head_kv, it) : 0;
                raw.copy(it, valid_it, m0, p.q.row<const float>(batch, seq.q_begin, head), p.q.row_stride, p.headdim,
                         p.dout.row<const float>(batch, seq.q_begin, head), p.dout.row_stride, p.headdim_v, seqlen_q,
                         wg_tid);
            };
            raw.copy_first(0, copy_raw);
            for (int it = 0; it < walk.iters; ++it) {
                const int m0 = walk.block(it) * BLOCK_M, head = walk.head(head_kv, it);
                const u32 stage = base + stage_of(it), staged = raw.stage(it);
                cp_async_wait<RAW_STAGES - 1>();
                named_barrier_sync(1, 128);  // block it's raw rows have landed, every producer thread's
                ring.wait_empty(it);         // the consumer is done with the stage
                split_query_block_tf32<D_TILE, BLOCK_M, 128, PRODUCTS>(stage, StagedRows<D_TILE>{staged},
                                                                       StagedRows<D_TILE>{staged + raw.TILE},
                                                                       seqlen_q - m0, p.headdim, p.headdim_v, wg_tid);
                if (wg_tid < BLOCK_M) {  // the rows' statistics
                    const bool valid = m0 + wg_tid < seqlen_q;
                    query_row_stats<BLOCK_M>(smem_f + (stage_of(it) + L::STATS) / 4, p,
                                             seq.stat(p, head, valid ? m0 + wg_tid : 0), valid, wg_tid);
                }
                fence_proxy_async_shared();  // the tiles, to the async proxy that wgmma reads with
                ring.arrive_full(it);
                named_barrier_sync(1, 128);  // every producer thread is done reading the raw tiles
                copy_raw(it + RAW_STAGES);
            }
            cp_async_wait<0>();  // the empty groups past the walk's end
            return;
        }
    }

    // ---- consumer: the 64 keys' dK and dV ----
    float dk_acc[D_TILE / 2], dv_acc[D_TILE / 2];
#pragma unroll
    for (int e = 0; e < D_TILE / 2; ++e) dk_acc[e] = dv_acc[e] = 0.f;
    for (int it = 0; it < walk.iters; ++it) {
        const int m0 = walk.block(it) * BLOCK_M, head = walk.head(head_kv, it);
        const u32 stage = base + stage_of(it);
        ring.wait_full(it);
        if (it == 0) cta_timeline(MARK_FIRST_STEP, tid == 128);
        float ds[SV];
        tf32_dkdv_query_block<D_TILE, BLOCK_M, PRODUCTS, SUMS_APART>(
            dk_acc, dv_acc, ds, Tf32DkdvTiles{base + L::K_HI, base + L::V_HI, stage + L::Q, stage + L::DO,
                                              stage + L::QT, stage + L::DOT},
            smem_f + (stage_of(it) + L::STATS) / 4, p, seq, mask, head, m0, n0, warp, lane);
        ring.arrive_empty(it);  // its products were waited for
    }
    cta_timeline(MARK_WALKED, tid == 128, walk.iters);

    // Epilogue: dK = scale dS^T Q summed, dV (times 1 / (1 - p) under dropout).
    const int keys_valid = seqlen_k - n0;
    const float scale = scale_in<float>(p);
    const float drop_scale = DropoutOf<Mask>::ENABLED ? dropout_scale_in<float>(p) : 1.f;
    store_acc_rows_f32<D_TILE>(dk_acc, scale, keys_valid, p.headdim,
                               [&](int r) { return p.dk.row<float>(batch, seq.k_begin + n0 + r, head_kv); }, warp, lane);
    store_acc_rows_f32<D_TILE>(dv_acc, drop_scale, keys_valid, p.headdim_v,
                               [&](int r) { return p.dv.row<float>(batch, seq.k_begin + n0 + r, head_kv); }, warp, lane);
    cta_timeline(MARK_EXIT, tid == 128);
}

}  // namespace cf

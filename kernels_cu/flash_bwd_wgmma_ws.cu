// flash_bwd_wgmma_ws: flash_bwd_wgmma's dK/dV (no dQ: DqAdd::none, the deterministic backward's
// first kernel; dQ by flash_bwd_dq_wgmma) with a producer warpgroup (sm_90a; fp16 / bf16, head-dim
// tiles 64 and 128). docs/perf-log.md wgmma-bwd-ws-v0, wgmma-bwd-ws-route (v13's dK/dV kernel).
//
// flash_bwd_wgmma keeps its two warpgroups in step: every thread copies part of each query block,
// and a CTA barrier at the top of every step waits for all of them, so both warpgroups run their
// element steps (P^T, dS^T) at the same time while the tensor cores sit idle, then both issue
// their products (counted on an H100, 8k causal d128: a step of 8,192 scores takes about 4,000
// clocks, its products 2,048 and one sub-partition's issue about 1,800: the two in series). Here
// a CTA is three warpgroups over the same BLOCK_N = 128 keys:
//   warpgroup 0, the producer: cp.async copies K_j and V_j once, then each query block's Q_i, dO_i,
//       lse_i and D_i into one of STAGES stages, STAGES - 1 blocks ahead; when a block's copies
//       have landed it fences them to the async proxy and arrives on the stage's full barrier; it
//       waits on the stage's empty barrier before copying into it again;
//   warpgroups 1 and 2, the consumers: 64 keys each, flash_bwd_wgmma's steps 1-4 and 6-7 on the
//       stage, then a release of it on the empty barrier once dV and dK have read it.
// PINGPONG: the consumers take turns at issuing (named barriers 2 and 3), twice a step: S^T and
// dP^T, then dV and dK, so that one consumer's products run while the other forms P^T and dS^T.
// Every score, weight and product is the one flash_bwd_wgmma forms, in the same order: dK and dV
// are bitwise those of flash_bwd_wgmma<..., DqAdd::none> on the same tiles.
#include "block_walk.cuh"
#include "common.cuh"
#include "cp_async_ring.cuh"
#include "cta_timeline.cuh"
#include "mask.cuh"
#include "mbarrier.cuh"
#include "mma.cuh"
#include "mma_bwd.cuh"
#include "mma_bwd_layouts.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"
#include "wgmma.cuh"
#include "wgmma_bwd.cuh"

namespace cf {

// Shared memory from a 1024-byte aligned base (backward_plans.wgmma_ws_smem_bytes mirrors BYTES and
// adds the alignment slack): K and V (128-byte-swizzled panel tiles, flash_bwd_wgmma's layout);
// STAGES stages of Q and of dO; the dS^T tile (a score policy's derivative waits there between
// steps 3 and 4, at each thread's own words, as in flash_bwd_wgmma); STAGES slots of lse and of D;
// the stages' full and empty barriers.
template <int D_TILE, int BLOCK_M, int STAGES>
struct BwdWgmmaWsSmem {
    static constexpr int BLOCK_N = 128;
    static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 2;
    static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 2;
    static constexpr u32 KV_PANEL = BLOCK_N * 128;
    static constexpr u32 Q_PANEL = BLOCK_M * 128;
    static constexpr u32 K = 0;
    static constexpr u32 V = K + KV_TILE;
    static constexpr u32 Q = V + KV_TILE;             // [STAGES]
    static constexpr u32 DO = Q + STAGES * Q_TILE;    // [STAGES]
    static constexpr u32 DST = DO + STAGES * Q_TILE;
    static constexpr u32 LSE = DST + BLOCK_N * BLOCK_M * 2;  // float [STAGES][BLOCK_M]
    static constexpr u32 DELTA = LSE + STAGES * BLOCK_M * 4;
    static constexpr u32 FULL = DELTA + STAGES * BLOCK_M * 4, EMPTY = FULL + 8 * STAGES;
    static constexpr u32 BYTES = EMPTY + 8 * STAGES;
};

template <typename T, int D_TILE, class Mask, int BLOCK_M, int STAGES, bool PINGPONG>
__global__ void __launch_bounds__(384, 1)
flash_bwd_wgmma_ws(const __grid_constant__ BwdParams p) {
    typedef BwdWgmmaWsSmem<D_TILE, BLOCK_M, STAGES> L;
    constexpr int BLOCK_N = L::BLOCK_N;
    constexpr int SJ = BLOCK_M / 8;   // 8-column blocks of S^T, dP^T per thread
    constexpr int DJ = D_TILE / 8;    // ... of dK, dV
    constexpr int QK = BLOCK_M / 16;  // k-steps of dV, dK (over queries)
    // The producer's copies are WgmmaKeyBlock's, by its 128 threads (NTHREADS of the copies).
    typedef WgmmaKeyBlock<T, Mask, L, BLOCK_M, BLOCK_N, D_TILE, 128, false> KeyBlock;
    // setmaxnreg moves registers within the launch allocation (384 threads x 168): the producer
    // keeps 40 (its copies' addresses spill 52 bytes at 24), each consumer takes 232
    // (flash_bwd_wgmma's d128 step holds 222).
    constexpr int LAUNCH_REGISTERS = 65536 / 384 / 8 * 8;
    constexpr int PRODUCER_REGISTERS = 40, CONSUMER_REGISTERS = 232;
    static_assert(128 * PRODUCER_REGISTERS + 256 * CONSUMER_REGISTERS <= 384 * LAUNCH_REGISTERS, "registers");
    // (a consumer holds S^T and dP^T, BLOCK_M / 2 registers each, beside dK and dV: past 128 queries
    // they cannot fit its 232)
    static_assert((BLOCK_M == 64 || BLOCK_M == 128) && (D_TILE == 64 || D_TILE == 128),
                  "query blocks of 64 or 128 rows, head-dim tiles 64 and 128");
    static_assert(STAGES >= 2, "stages");
    static_assert(L::BYTES + 1024 <= 227 * 1024, "shared memory");
    cta_timeline(MARK_ENTRY, threadIdx.x == 128);  // first: a CTA's setup is its prologue (dev/cta_timeline.py)

    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);
    unsigned char* const smem = smem_raw + (base - smem_u32(smem_raw));
    const u32 s_k = base + L::K, s_v = base + L::V, s_dst = base + L::DST;

    const SequenceRows seq = cta_sequence_uniform<Mask>(p, blockIdx.z);
    const WgmmaBwdArgs<T> args = wgmma_bwd_args<T>(p);
    const int tid = threadIdx.x, wg = tid / 128;
    const KeyBlockCoords<BLOCK_N> key_block_at(seq);
    // Past a shorter sequence's end: the whole CTA leaves before the mask, the walk and the copies.
    if (KeyBlock::past_end(key_block_at, seq)) return;
    const KeyBlock key_block(p, seq, key_block_at, args.group);
    const int iters = key_block.walk.iters;

    const StageRing<STAGES> ring{base + L::FULL, base + L::EMPTY};
    ring.init(128, 256);  // the producer's threads, the consumers'
    __syncthreads();      // the last CTA-wide barrier: the roles split here

    if (wg == 0) {
        // ---- producer ----
        warpgroup_registers_dec<PRODUCER_REGISTERS>();
        if (iters == 0) return;  // the consumers store dK = dV = 0 and read nothing
        auto load_query_block = [&](int it, int stage) { key_block.load_query_block(it, stage, args, base, seq, tid); };
        // Group 0 holds K, V and query block 0 (committed by load_key_block_and_first)
        key_block.load_key_block_and_first(p, seq, s_k, s_v, args, tid, load_query_block);
        produce_blocks(ring, iters, 1, [&](int i) { load_query_block(i, i % STAGES); }, [](int) {});
        return;
    }

    // ---- consumers: warpgroup 1 keys 0-63 of the block, warpgroup 2 keys 64-127 ----
    warpgroup_registers_inc<CONSUMER_REGISTERS>();
    const int cwg = wg - 1;
    float dk_acc[DJ][4], dv_acc[DJ][4];
    zero(dk_acc);
    zero(dv_acc);

    // PINGPONG: warpgroup 1 has the first turn; warpgroup 2 lets it go, and warpgroup 1 waits once
    // more at the end, so that every arrival on a barrier is met by its bar.sync.
    const ConsumerTurns<PINGPONG> turns{2u + cwg, 2u + (1 - cwg)};
    if (cwg == 1) turns.pass();
    for (int it = 0; it < iters; ++it) {
        // the thread's lane and warp read again each step: held across the loop, they spill the
        // derivative's or dropout's step
        const int t = thread_index_uncached(), warp_in_wg = (t / 32) % 4, lane = t % 32;
        const int stage = it % STAGES;
        ring.wait_full(it);
        if (it == 0) cta_timeline(MARK_FIRST_STEP, tid == 128);

        const int head = key_block.head(it);
        const int m_block = key_block.query_block(it), m0 = m_block * BLOCK_M;
        const u32 s_q = base + L::Q + stage * L::Q_TILE, s_do = base + L::DO + stage * L::Q_TILE;
        const float* s_lse = reinterpret_cast<const float*>(smem + L::LSE) + stage * BLOCK_M;
        const float* s_delta = reinterpret_cast<const float*>(smem + L::DELTA) + stage * BLOCK_M;
        const bool partial = key_block.mask.partial(m0, BLOCK_M, key_block.n0, BLOCK_N);
        const ScoreOf<Mask, float, Tanh::EXP_RCP, true> score(score_problem<Mask>(p, seq), seq.index, head, args.scale);

        // Steps 1-2: S^T = K_g Q^T and dP^T = V_g dO^T (flash_bwd_wgmma's), in this consumer's turn.
        float s_acc[SJ][4], dp_acc[SJ][4];
        turns.wait();
        wgmma_fence();
        issue_st_dpt<T, L, BLOCK_M, D_TILE>(s_acc, dp_acc, s_k, s_v, s_q, s_do, cwg);
        turns.pass();
        wgmma_wait<1>();
        pin_registers(reinterpret_cast<float(&)[SJ * 4]>(s_acc));

        // Steps 3-4: P^T, then dS^T = P^T o (dP^T - D), packed as dV's and dK's A fragments
        // (wgmma_bwd.cuh's probabilities_and_ds_t, flash_bwd_wgmma's steps 3-4).
        const int key_row = 64 * cwg + 16 * warp_in_wg + lane / 4;  // within the block
        u32 p_frag[QK][4], ds_frag[QK][4];
        probabilities_and_ds_t<T, Mask, BLOCK_M, BLOCK_N>(p_frag, ds_frag, s_acc, dp_acc, key_block, score, partial, m0,
                                                          key_row, s_lse, s_delta, s_dst, args.scale_log2, p,
                                                          seq.index, head, lane);

        // Steps 6-7: dV_g += P^T dO, dK_g += dS^T Q, in this consumer's turn; once they are done the
        // stage goes back to the producer.
        turns.wait();
        wgmma_fence();
        issue_dv_dk<T, L, D_TILE>(dv_acc, dk_acc, p_frag, ds_frag, s_do, s_q);
        turns.pass();
        wgmma_wait<0>();
        pin_registers(reinterpret_cast<float(&)[DJ * 4]>(dv_acc));
        pin_registers(reinterpret_cast<float(&)[DJ * 4]>(dk_acc));
        ring.arrive_empty(it);
    }
    if (cwg == 0) turns.wait();
    cta_timeline(MARK_WALKED, tid == 128, iters);

    // Epilogue (flash_bwd_wgmma's): dK = scale dS^T Q summed, and dV (times dropout's 1 / (1 - p)),
    // staged through the K and V tiles for 16-byte row stores. Both consumers are past their last
    // reads of K and V (the last step's S^T and dP^T) before either stages over them (named
    // barrier 4; with the turns it is already so, without them it is not). Then each consumer
    // stores the 64 key rows it staged itself, after a barrier of its own warpgroup (5 or 6): no
    // shared word passes from one consumer to the other (with a 256-thread barrier between the
    // staging and the store, compute-sanitizer's racecheck reported each staged word, docs/perf-log.md
    // wgmma-bwd-ws-epilogue).
    const int warp_in_wg = (tid / 32) % 4, lane = tid % 32;
    const int row0 = 64 * cwg, warp_row0 = row0 + 16 * warp_in_wg;
    const float dv_scale = DropoutOf<Mask>::kept_scale(p);  // 1 / (1 - p)
    named_barrier_sync(4, 256);
    stage_acc<T, D_TILE, D_TILE>(s_k, warp_row0, 0, dk_acc, args.scale, lane);
    stage_acc<T, D_TILE, D_TILE>(s_v, warp_row0, 0, dv_acc, dv_scale, lane);
    named_barrier_sync(5 + cwg, 128);
    store_key_block_grads<T, 64, D_TILE, 128>(p.dk, p.dv, s_k + row0 * D_TILE * 2, s_v + row0 * D_TILE * 2, seq,
                                              key_block.head_kv, key_block.n0 + row0, seq.seqlen_k, args.headdim,
                                              args.headdim_v, tid % 128);
    cta_timeline(MARK_EXIT, tid == 128);
}

}  // namespace cf

// flash_bwd_dq_wgmma_ws: flash_bwd_dq_wgmma's dQ with a producer warpgroup (sm_90a; fp16 / bf16,
// head-dim tiles 64 and 128). docs/perf-log.md wgmma-bwd-ws-v0, wgmma-bwd-ws-route (v13's dQ kernel).
//
// flash_bwd_dq_wgmma keeps its two warpgroups in step the way flash_fwd_wgmma did (every thread
// copies part of each key block, a CTA barrier at the top of every block), so both form P and dS
// at the same time while the tensor cores wait. Here a CTA is three warpgroups over BLOCK_M = 128
// query rows of one (batch, head), flash_fwd_wgmma_ws's split:
//   warpgroup 0, the producer: cp.async copies Q_i and dO_i once, then each key block's K_j and
//       V_j into one of STAGES stages, STAGES - 1 blocks ahead, arriving on the stage's full
//       barrier once they have landed and waiting on its empty barrier before refilling it;
//   warpgroups 1 and 2, the consumers: 64 query rows each, flash_bwd_dq_wgmma's steps on the stage
//       (S and dP, P and dS, dQ += dS K_j), then a release of it once dS K_j has read it.
// PINGPONG: the consumers take turns at issuing (named barriers 2 and 3), twice a block: S and dP,
// then dS K_j. Every score, weight and product is the one flash_bwd_dq_wgmma forms, in the same
// order: dQ is bitwise flash_bwd_dq_wgmma's (K_STAGES 2) on the same tiles.
#include "block_walk.cuh"
#include "common.cuh"
#include "cp_async_ring.cuh"
#include "cta_timeline.cuh"
#include "mask.cuh"
#include "mbarrier.cuh"
#include "mma.cuh"
#include "mma_bwd.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"
#include "wgmma.cuh"
#include "wgmma_bwd.cuh"

namespace cf {

// Shared memory from a 1024-byte aligned base (backward_plans.dq_wgmma_ws_smem_bytes mirrors BYTES
// and adds the alignment slack): Q and dO (flash_bwd_dq_wgmma's panel tiles), STAGES stages of K
// and of V, then the stages' full and empty barriers.
template <int D_TILE, int BLOCK_N, int STAGES>
struct DqWgmmaWsSmem {
    static constexpr int BLOCK_M = 128;
    static constexpr u32 Q_PANEL = BLOCK_M * 128, KV_PANEL = BLOCK_N * 128;
    static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 2, KV_TILE = BLOCK_N * D_TILE * 2;
    static constexpr u32 Q = 0;
    static constexpr u32 DO = Q + Q_TILE;
    static constexpr u32 K = DO + Q_TILE;            // [STAGES]
    static constexpr u32 V = K + STAGES * KV_TILE;   // [STAGES]
    static constexpr u32 FULL = V + STAGES * KV_TILE, EMPTY = FULL + 8 * STAGES;
    static constexpr u32 BYTES = EMPTY + 8 * STAGES;
};

template <typename T, int D_TILE, class Mask, int BLOCK_N, int STAGES, bool PINGPONG>
__global__ void __launch_bounds__(384, 1)
flash_bwd_dq_wgmma_ws(const __grid_constant__ BwdParams p) {
    typedef DqWgmmaWsSmem<D_TILE, BLOCK_N, STAGES> L;
    constexpr int BLOCK_M = L::BLOCK_M, N_FRAGS = BLOCK_N / 8, D_FRAGS = D_TILE / 8;
    // setmaxnreg within the launch allocation (384 threads x 168): the producer keeps 40, each
    // consumer takes 232 (flash_bwd_wgmma_ws's split).
    constexpr int LAUNCH_REGISTERS = 65536 / 384 / 8 * 8;
    constexpr int PRODUCER_REGISTERS = 40, CONSUMER_REGISTERS = 232;
    static_assert(128 * PRODUCER_REGISTERS + 256 * CONSUMER_REGISTERS <= 384 * LAUNCH_REGISTERS, "registers");
    // (a consumer holds S and dP, BLOCK_N / 2 registers each, beside dQ: past 128 keys they cannot
    // fit its 232)
    static_assert(BLOCK_N % 16 == 0 && BLOCK_N <= 128 && (D_TILE == 64 || D_TILE == 128),
                  "16-key k-steps up to 128 keys, head-dim tiles 64 and 128");
    static_assert(STAGES >= 2, "stages");
    static_assert(L::BYTES + 1024 <= 227 * 1024, "shared memory");
    cta_timeline(MARK_ENTRY, threadIdx.x == 128);  // first: a CTA's setup is its prologue (dev/cta_timeline.py)

    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);
    const u32 s_q = base + L::Q, s_do = base + L::DO;

    const SequenceRows seq = cta_sequence_uniform<Mask>(p, blockIdx.z);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    const int head = blockIdx.y, batch = seq.batch, head_kv = head / p.group;
    const Mask mask = cta_mask<Mask, CtaRows::QUERIES>(p, seq.index, seqlen_q, seqlen_k);
    const int m0 = Mask::query_block(blockIdx.x, gridDim.x) * BLOCK_M;
    if (Mask::PACKED && m0 >= seqlen_q) return;  // past a shorter sequence's end: the whole CTA
    // Key blocks [j_begin, ceil(n_end / BLOCK_N)) hold the keys some row of the block sees; walk
    // block i is key block j_begin + i, in stage i % STAGES.
    const KeyBlockRange<BLOCK_N> keys(mask, m0, BLOCK_M);
    const int j_begin = keys.first, n_end = keys.n_end;
    const int n_blocks = max(0, (n_end + BLOCK_N - 1) / BLOCK_N - j_begin);
    const int tid = threadIdx.x, wg = tid / 128;

    const StageRing<STAGES> ring{base + L::FULL, base + L::EMPTY};
    ring.init(128, 256);  // the producer's threads, the consumers'
    __syncthreads();      // the last CTA-wide barrier: the roles split here

    if (wg == 0) {
        // ---- producer ----
        warpgroup_registers_dec<PRODUCER_REGISTERS>();
        if (n_blocks == 0) return;  // the consumers store dQ = 0 through the Q tile, which stays unwritten
        const T* __restrict__ k_rows = p.k.row<const T>(batch, seq.k_begin, head_kv);
        const T* __restrict__ v_rows = p.v.row<const T>(batch, seq.k_begin, head_kv);
        const i64 k_ss = p.k.row_stride, v_ss = p.v.row_stride;
        auto copy_block = [&](int i) {  // walk block i into stage i % STAGES
            const int n0 = (j_begin + i) * BLOCK_N;
            const u32 stage = (i % STAGES) * L::KV_TILE;
            cp_async_panels<BLOCK_N, D_TILE, 128>(base + L::K + stage, k_rows + n0 * k_ss, seqlen_k - n0, p.headdim,
                                                  k_ss, tid);
            cp_async_panels<BLOCK_N, D_TILE, 128>(base + L::V + stage, v_rows + n0 * v_ss, seqlen_k - n0,
                                                  p.headdim_v, v_ss, tid);
        };
        cp_async_panels<BLOCK_M, D_TILE, 128>(s_q, p.q.row<const T>(batch, seq.q_begin + m0, head), seqlen_q - m0,
                                              p.headdim, p.q.row_stride, tid);
        cp_async_panels<BLOCK_M, D_TILE, 128>(s_do, p.dout.row<const T>(batch, seq.q_begin + m0, head),
                                              seqlen_q - m0, p.headdim_v, p.dout.row_stride, tid);
        // Group 0 holds Q, dO and block 0
        produce_blocks(ring, n_blocks, 0, copy_block, [](int) {});
        return;
    }

    // ---- consumers: warpgroup 1 rows 0-63, warpgroup 2 rows 64-127 ----
    warpgroup_registers_inc<CONSUMER_REGISTERS>();
    const int cwg = wg - 1, ctid = tid - 128, cwarp = ctid / 32, lane = tid % 32;
    const StatDims stat_dims{p.nheads, p.seqlen_q};
    const float scale_log2 = p.scale_log2, scale = p.scale;
    const float* __restrict__ lse = static_cast<const float*>(p.lse);
    const float* __restrict__ delta = static_cast<const float*>(p.delta);
    // softcap's reciprocals as flash_bwd_dq_wgmma takes them (score.cuh's exp_form_rcp)
    constexpr Tanh TANH = D_TILE == 128 ? Tanh::EXP_NEWTON : Tanh::EXP_RCP;
    const ScoreOf<Mask, float, TANH, true> score(score_problem<Mask>(p, seq), seq.index, head, scale);

    // This thread's two rows (accumulator halves h = 0, 1): lse (log2 units) and D, for the block
    // (wgmma_bwd.cuh's load_row_statistics).
    const int row_lo = m0 + 16 * cwarp + lane / 4;
    const DropoutOf<Mask> dropout(p, seq.index, head);
    float base_log2[2], delta_row[2];
    load_row_statistics(base_log2, delta_row, seq, stat_dims, head, row_lo, seqlen_q, lse, delta);

    float dq_acc[D_FRAGS][4];
    zero(dq_acc);
    // PINGPONG: warpgroup 1 has the first turn; warpgroup 2 lets it go, and warpgroup 1 waits once
    // more at the end, so that every arrival on a barrier is met by its bar.sync.
    const ConsumerTurns<PINGPONG> turns{2u + cwg, 2u + (1 - cwg)};
    if (cwg == 1) turns.pass();
    for (int i = 0; i < n_blocks; ++i) {
        const int j = j_begin + i, n0 = j * BLOCK_N;
        const u32 k_tile = base + L::K + (i % STAGES) * L::KV_TILE;
        const u32 v_tile = base + L::V + (i % STAGES) * L::KV_TILE;
        ring.wait_full(i);
        if (i == 0) cta_timeline(MARK_FIRST_STEP, tid == 128);

        // Steps 1-2: S = Q K_j^T and dP = dO V_j^T (flash_bwd_dq_wgmma's), in this consumer's turn.
        float s_acc[N_FRAGS][4], dp_acc[N_FRAGS][4];
        turns.wait();
        wgmma_fence();
        issue_s_dp<T, BLOCK_N, D_TILE, L::Q_PANEL, L::KV_PANEL>(s_acc, dp_acc, s_q + cwg * 64 * 128,
                                                               s_do + cwg * 64 * 128, k_tile, v_tile);
        turns.pass();
        wgmma_wait<1>();
        pin_registers(reinterpret_cast<float(&)[N_FRAGS * 4]>(s_acc));

        // Steps 3-4: P, then dS = P o (dP - D), packed as dS K_j's A fragments (wgmma_bwd.cuh's
        // probabilities_and_ds_dq, flash_bwd_dq_wgmma's steps 3-4).
        u32 ds_frag[BLOCK_N / 16][4];
        probabilities_and_ds_dq<T, BLOCK_M, BLOCK_N>(ds_frag, s_acc, dp_acc, mask, score, dropout, p, m0, n0, row_lo,
                                                     scale_log2, base_log2, delta_row, lane);

        // Step 5: dQ += dS K_j (wgmma_bwd.cuh's issue_ds_k), in this consumer's turn; once it is
        // done the stage goes back.
        turns.wait();
        wgmma_fence();
        issue_ds_k<T, D_TILE, BLOCK_N, L::KV_PANEL>(dq_acc, ds_frag, k_tile);
        turns.pass();
        wgmma_wait<0>();
        pin_registers(reinterpret_cast<float(&)[D_FRAGS * 4]>(dq_acc));
        ring.arrive_empty(i);
    }
    if (cwg == 0) turns.wait();
    cta_timeline(MARK_WALKED, tid == 128, n_blocks);

    // Epilogue (flash_bwd_dq_wgmma's): dQ = scale dS K staged through the Q tile for 16-byte row
    // stores. The staging rows span the tile's 64-column panels, so past d64 a consumer's rows hold
    // Q the other one reads: both are past their last S (named barrier 4) before either stages.
    // Then each consumer stores its own 64 rows after a barrier of its warpgroup (5 or 6), so no
    // shared word passes between the consumers (flash_bwd_wgmma_ws's epilogue).
    named_barrier_sync(4, 256);
    stage_acc<T, D_TILE, D_TILE>(s_q, 16 * cwarp, 0, dq_acc, scale, lane);
    named_barrier_sync(5 + cwg, 128);
    const int row0 = 64 * cwg;
    store_tile<64, D_TILE, 128>(p.dq.row<T>(batch, seq.q_begin + m0 + row0, head), s_q + row0 * D_TILE * 2,
                                seqlen_q - m0 - row0, p.headdim, p.dq.row_stride, tid % 128);
    cta_timeline(MARK_EXIT, tid == 128);
}

}  // namespace cf

// flash_fwd_wgmma_ws: the 16-bit forward on wgmma with a producer warpgroup (sm_90a; fp16 / bf16,
// head dims up to D_TILE = 64, 128 or 256, v's in q's tile): a candidate, docs/perf-log.md
// wgmma-fwd-ws-v0. The work split and the per-block steps are flash_fwd_wgmma.cu's; what changes
// is who waits for whom.
//
// flash_fwd_wgmma keeps its two warpgroups in step: every thread copies part of each key block and
// a CTA barrier at the top of every block waits for all of them, so both warpgroups run their
// softmax at the same time and the tensor cores sit idle through it (perf log wgmma-fwd-overlap:
// ptxas will not let one warpgroup's own products run under its exponentials either). Here a CTA
// is three warpgroups over BLOCK_M = 128 query rows of one (batch, head):
//   warpgroup 0, the producer: cp.async copies Q once and each key block's K and V into one of
//       STAGES stages, STAGES - 1 blocks ahead; when a block's copies have landed it fences them
//       to the async proxy (wgmma reads through it) and arrives on the stage's full barrier; it
//       waits on the stage's empty barrier before copying into it again;
//   warpgroups 1 and 2, the consumers: 64 query rows each. Per key block j: wait for its stage,
//       issue S_j = Q K_j^T and P_{j-1} V_{j-1} (PINGPONG: in turns with the other consumer, on
//       two named barriers), wait for both, release block j - 1's stage, then the online softmax
//       of block j (O rescaled: nothing is running on it), P_j packed for the next block's P V.
// With the turns, one consumer's products are issued (and run) while the other does its softmax.
// The producer gives back registers (setmaxnreg) so that the consumers can hold S, O and P.
#include "block_walk.cuh"
#include "common.cuh"
#include "cp_async_ring.cuh"
#include "cta_timeline.cuh"
#include "mbarrier.cuh"
#include "mma.cuh"
#include "online_softmax.cuh"
#include "params.cuh"
#include "wgmma.cuh"

namespace cf {

// Shared memory from a 1024-byte aligned base (cupyflash/plans.py wgmma_smem_bytes mirrors BYTES
// and adds the alignment slack): Q, STAGES stages of K and of V (128-byte-swizzled panel tiles,
// flash_fwd_wgmma's layout), then the stages' full and empty barriers and Q's.
template <int D_TILE, int BLOCK_N, int STAGES>
struct FwdWgmmaWsSmem {
    static constexpr int BLOCK_M = 128;
    static constexpr u32 Q_PANEL = BLOCK_M * 128, KV_PANEL = BLOCK_N * 128;
    static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 2;
    static constexpr u32 Q = 0;
    static constexpr u32 K = Q + BLOCK_M * D_TILE * 2;
    static constexpr u32 V = K + STAGES * KV_TILE;
    static constexpr u32 FULL = V + STAGES * KV_TILE, EMPTY = FULL + 8 * STAGES, Q_FULL = EMPTY + 8 * STAGES;
    static constexpr u32 BYTES = Q_FULL + 8;
};

template <typename T, int D_TILE, class Mask, int BLOCK_N, int STAGES, bool PINGPONG>
__global__ void __launch_bounds__(384, 1)
flash_fwd_wgmma_ws(const __grid_constant__ FwdParams p) {
    typedef FwdWgmmaWsSmem<D_TILE, BLOCK_N, STAGES> L;
    constexpr int BLOCK_M = L::BLOCK_M, N_FRAGS = BLOCK_N / 8, D_FRAGS = D_TILE / 8;
    // setmaxnreg moves registers within the launch allocation (384 threads x 168): the producer
    // keeps 24, each consumer takes 240 (128 x 24 + 256 x 240 = 384 x 168).
    constexpr int LAUNCH_REGISTERS = 65536 / 384 / 8 * 8;
    constexpr int PRODUCER_REGISTERS = 24, CONSUMER_REGISTERS = 240;
    static_assert(128 * PRODUCER_REGISTERS + 256 * CONSUMER_REGISTERS <= 384 * LAUNCH_REGISTERS, "registers");
    static_assert(BLOCK_N % 64 == 0 && BLOCK_N <= 256 && D_TILE % 64 == 0, "64-row/column panels");
    static_assert(STAGES >= 2, "stages");
    static_assert(L::BYTES + 1024 <= 227 * 1024, "shared memory");
    // first, so that a CTA's setup counts in its prologue; the first consumer thread records
    cta_timeline(MARK_ENTRY, threadIdx.x == 128);  // (dev/cta_timeline.py)

    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);
    const u32 q_tile = base + L::Q;

    const SequenceRows seq = cta_sequence<Mask>(p, blockIdx.z);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    const int head = blockIdx.y, head_kv = head / p.group;
    const Mask mask = cta_mask<Mask, CtaRows::QUERIES>(p, seq.index, seqlen_q, seqlen_k);
    const int m0 = Mask::query_block(blockIdx.x, gridDim.x) * BLOCK_M;
    if (Mask::PACKED && m0 >= seqlen_q) return;  // past a shorter sequence's end: the whole CTA
    // NoMask: the literal 0, as flash_fwd_wgmma's (which says why).
    const KeyBlockRange<BLOCK_N> keys(mask, m0, BLOCK_M);
    const int j_begin = Mask::HAS_LEFT || Mask::HAS_RIGHT || Mask::HAS_BLOCK_MAP ? keys.first : 0;
    const int n_blocks = keys.blocks;
    const int tid = threadIdx.x, wg = tid / 128, lane = tid % 32;

    const StageRing<STAGES> ring{base + L::FULL, base + L::EMPTY};
    ring.init(128, 256);  // the producer's threads, the consumers'
    if (tid == 0) {
        mbarrier_init(base + L::Q_FULL, 128);
        mbarrier_init_fence();
    }
    __syncthreads();  // the last CTA-wide barrier: the roles split here

    if (wg == 0) {
        // ---- producer ----
        warpgroup_registers_dec<PRODUCER_REGISTERS>();
        if (n_blocks == 0) return;  // the consumers store O = 0 through the Q tile, which stays unwritten
        const int ptid = tid;
        const T* __restrict__ k_rows = p.k.row<const T>(seq.batch, seq.k_begin, head_kv);
        const T* __restrict__ v_rows = p.v.row<const T>(seq.batch, seq.k_begin, head_kv);
        const i64 k_ss = p.k.row_stride, v_ss = p.v.row_stride;
        auto copy_block = [&](int i) {  // walk block i (key block j_begin + i) into stage i % STAGES
            const int n0 = (j_begin + i) * BLOCK_N;
            const u32 stage = (i % STAGES) * L::KV_TILE;
            cp_async_panels<BLOCK_N, D_TILE, 128>(base + L::K + stage, k_rows + n0 * k_ss, seqlen_k - n0, p.headdim,
                                                  k_ss, ptid);
            cp_async_panels<BLOCK_N, D_TILE, 128>(base + L::V + stage, v_rows + n0 * v_ss, seqlen_k - n0,
                                                  p.headdim_v, v_ss, ptid);
        };
        cp_async_panels<BLOCK_M, D_TILE, 128>(q_tile, p.q.row<const T>(seq.batch, seq.q_begin + m0, head),
                                              seqlen_q - m0, p.headdim, p.q.row_stride, ptid);
        // Group 0 holds Q and block 0
        produce_blocks(ring, n_blocks, 0, copy_block, [&](int i) {
            if (i == 0) mbarrier_arrive(base + L::Q_FULL);
        });
        return;
    }

    // ---- consumers: warpgroup 1 rows 0-63, warpgroup 2 rows 64-127 ----
    warpgroup_registers_inc<CONSUMER_REGISTERS>();
    const int cwg = wg - 1;
    const int strip_row0 = 64 * cwg + 16 * ((tid / 32) % 4);  // the warp's 16 rows within the block
    // softcap's reciprocal on the FMA pipe (score.cuh, EXP_NEWTON), its three MUFU operations a
    // score bounding this loop's softmax; not at d256, whose products (0.25 clock a score an SM)
    // outlast them (0.19)
    const ScoreOf<Mask, float, D_TILE <= 128 ? Tanh::EXP_NEWTON : Tanh::EXP_RCP, true> score(
        score_problem<Mask>(p, seq), seq.index, blockIdx.y, p.scale);
    const DropoutOf<Mask> dropout(p, seq.index, head);
    const float scale_log2 = p.scale_log2;

    float o_acc[1][D_FRAGS][4];
    zero_acc(o_acc);
    RowStats<RowState::ALL_LANES, 1> row_stats;
    // O is staged through the Q tile as rows of D_TILE columns (store_o); Q's tile is 64-column
    // panels of all 128 rows, so past d64 a warpgroup's staging rows hold Q the other one reads
    // (see the barrier before the last store)
    auto store = [&]() {
        store_o<T, D_TILE, Mask::Score::HAS_SINK, Mask::Score::FIXED_MAX>(
            o_acc, row_stats, q_tile, strip_row0, m0, seqlen_q, p.headdim_v,
            p.o.row<T>(seq.batch, seq.q_begin + m0, head), p.o.row_stride,
            static_cast<float*>(p.lse) + seq.stat(p, head, m0), lane, sink_log2<Mask, float>(p, head));
    };
    if (n_blocks == 0) {  // rows that see no key: O = 0, lse = -inf
        store();
        return;
    }

    // PINGPONG: the consumers take turns at issuing their products (named barriers 2 and 3);
    // warpgroup 1 has the first turn, and waits once more at the end for warpgroup 2's last pass,
    // so that every arrival on a barrier is met by its bar.sync.
    const ConsumerTurns<PINGPONG> turns{2u + cwg, 2u + (1 - cwg)};
    if (cwg == 1) turns.pass();
    u32 p_frag[1][N_FRAGS / 2][4];  // P of the previous block, the A operand of its P V
    auto issue_pv = [&](int i) {    // O += P V of walk block i, from p_frag; the caller commits
        wgmma_p_times_v<T, D_TILE, BLOCK_N, L::KV_PANEL>(reinterpret_cast<float(&)[D_FRAGS * 4]>(o_acc), p_frag[0],
                                                         base + L::V + (i % STAGES) * L::KV_TILE);
    };
    // Walk block i (key block j_begin + i); WITH_PV: P V of block i - 1 issued beside its S (the
    // first block has none: its own copy of the steps, so that no branch joins between the issues
    // and the wait, where ptxas would add an empty product).
    auto block = [&](int i, auto with_pv) {
        constexpr bool WITH_PV = decltype(with_pv)::value;
        const int j = j_begin + i, n0 = j * BLOCK_N;
        ring.wait_full(i);
        if constexpr (!WITH_PV) cta_timeline(MARK_FIRST_STEP, tid == 128);  // block 0's copy of the steps
        float s[1][N_FRAGS][4];
        turns.wait();
        wgmma_fence();
        wgmma_rows_times_rows<T, BLOCK_N, D_TILE, L::Q_PANEL, L::KV_PANEL>(
            reinterpret_cast<float(&)[N_FRAGS * 4]>(s), q_tile + cwg * 64 * 128, base + L::K + (i % STAGES) * L::KV_TILE);
        if constexpr (WITH_PV) issue_pv(i - 1);
        wgmma_commit();
        turns.pass();
        wgmma_wait<0>();  // S_j, and P V of block j - 1: O may be rescaled, p_frag rewritten
        pin_registers(reinterpret_cast<float(&)[N_FRAGS * 4]>(s));
        pin_registers(reinterpret_cast<float(&)[D_FRAGS * 4]>(o_acc));
        if constexpr (WITH_PV) ring.arrive_empty(i - 1);  // block j - 1's K and V are no longer read

        block_softmax<T>(s, o_acc, p_frag, row_stats, scale_log2, mask.keys_partial(m0, BLOCK_M, n0, BLOCK_N), mask,
                         score, m0 + strip_row0, n0, lane);
        if constexpr (DropoutOf<Mask>::ENABLED)  // after the row sums: l and lse stay the softmax's
            drop_packed_p<DropoutOf<Mask>, 1, N_FRAGS>(p_frag, dropout, m0 + strip_row0 + lane / 4, n0 + 2 * (lane % 4));
    };
    mbarrier_wait(base + L::Q_FULL, 0);
    block(0, Flag<false>());
    for (int i = 1; i < n_blocks; ++i) block(i, Flag<true>());
    turns.wait();  // the last block's P V, in turn too
    wgmma_fence();
    issue_pv(n_blocks - 1);
    wgmma_commit();
    turns.pass();
    if (cwg == 0) turns.wait();
    wgmma_wait<0>();
    pin_registers(reinterpret_cast<float(&)[D_FRAGS * 4]>(o_acc));
    cta_timeline(MARK_WALKED, tid == 128, n_blocks);
    // (the last stage needs no release: the producer has copied its last block)
    // Both consumers past their last S = Q K^T before either stages O over Q (named barrier 4)
    named_barrier_sync(4, 256);

    if constexpr (DropoutOf<Mask>::ENABLED) scale_acc(o_acc, p.variant.dropout.scale);
    store();
    cta_timeline(MARK_EXIT, tid == 128);
}

}  // namespace cf

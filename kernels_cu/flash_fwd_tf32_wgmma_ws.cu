// flash_fwd_tf32_wgmma_ws: the float32 forward on tf32 wgmma with a producer warpgroup (sm_90a):
// docs/perf-log.md tf32-wgmma-v2. sm_90's float32 row at head dims up to 128 (d128: Q_STAGED), for
// every mask, packed batch, dropout and user modifier (plans.WGMMA_FLOAT32_FORWARD_TILES,
// tf32-wgmma-route, tf32-wgmma-d128).
//
// tf32-wgmma-v1 left every block a chain within its one warpgroup (split, S, softmax, P V), the
// tensor cores idle through the split unless the SM's other CTA filled them. Here a CTA is three
// warpgroups over BLOCK_M = 128 query rows of one (batch, head):
//   warpgroup 0, the producer: cp.async copies each key block's raw K and V rows RAW_STAGES blocks
//       ahead into staging tiles, then splits them (hi, lo; V transposed in KEY_PAIRS order) into
//       one of STAGES stages of wgmma tiles, and says so on the stage's full barrier;
//   warpgroups 1 and 2, the consumers: 64 query rows each, Q split once into registers; per block
//       they wait on the stage's full barrier, run wgmma_tf32_fwd_steps.cuh's block (S, the online
//       softmax, P V) and arrive on its empty barrier, which the producer waits on before it
//       writes that stage again.
// The producer gives back registers it does not need (setmaxnreg) so that the consumers hold Q's
// 64 registers, O, S and P. No __syncthreads after the roles split: the producer's own steps sync
// on a named barrier of its 128 threads, and a consumer's epilogue stages O through its warps'
// own rows of a raw staging tile (idle by then: the producer has split the last block).
// PRESPLIT (perf log tf32-fwd-split-once): flash_fwd_split_kv_tf32 has split every key block once
// for the grid (FwdParams' kv_split), and the producer is one thread that fills a stage with one
// bulk copy of its bytes, whose arrival completes the stage's full barrier; no raw stages, the
// region kept for O's staging.
// Q_STAGED (perf log tf32-wgmma-d128; the d128 rows): Q split once into registers is 16 D_TILE / 8
// of a consumer's registers, which spill at d128, so each consumer warp copies its rows of Q raw
// into a Q tile of its own (StagedQ) and splits each k-step's A fragments from it as S needs
// them; the Q tile stages O in the epilogue, and the raw region holds raw stages only.
// HH_CHAIN (a candidate, perf log tf32-hh-chain-4): S's hi hi chains of 4 k-steps, not 2.
#include "block_walk.cuh"
#include "common.cuh"
#include "mbarrier.cuh"
#include "mma.cuh"
#include "online_softmax.cuh"
#include "params.cuh"
#include "tf32_fwd_steps.cuh"
#include "wgmma_tf32.cuh"
#include "wgmma_tf32_fwd_steps.cuh"

namespace cf {

// Shared memory from a 1024-byte aligned base (cupyflash/plans.py tf32_wgmma_smem_bytes adds the
// alignment slack): STAGES stages of K hi, K lo, V^T hi, V^T lo (KV_TILE bytes each:
// Tf32FwdKeyBlockTiles), RAW_STAGES staging tiles of raw K and V rows, then the full and empty
// barriers (8 bytes each). The raw tiles stage O in the epilogue (BLOCK_M rows of D_TILE float32):
// the region is at least that large (with no raw stages, PRESPLIT, it is O's alone). Q_STAGED: Q's
// raw rows (BLOCK_M x D_TILE float32) after the stages, O's staging tile, and the raw region only
// the raw stages.
template <int D_TILE, int BLOCK_N, int STAGES, int RAW_STAGES, bool Q_STAGED = false>
struct FwdTf32WgmmaWsSmem {
    static constexpr int BLOCK_M = 128;
    typedef Tf32FwdKeyBlockTiles<D_TILE, BLOCK_N> Tiles;
    static constexpr u32 KV_TILE = Tiles::KV_TILE, STAGE = Tiles::BYTES;
    static constexpr u32 K_HI = Tiles::K_HI, K_LO = Tiles::K_LO, V_HI = Tiles::V_HI, V_LO = Tiles::V_LO;
    static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 4;
    static constexpr u32 Q = STAGES * STAGE, RAW = Q + (Q_STAGED ? Q_TILE : 0u);
    static constexpr u32 RAW_BYTES = Q_STAGED || RAW_STAGES * 2 * KV_TILE > Q_TILE ? RAW_STAGES * 2 * KV_TILE : Q_TILE;
    static constexpr u32 O_STAGING = Q_STAGED ? Q : RAW;
    static constexpr u32 FULL = RAW + RAW_BYTES, EMPTY = FULL + 8 * STAGES;
    static constexpr u32 BYTES = EMPTY + 8 * STAGES;
};

template <int D_TILE, class Mask, int BLOCK_N, int PRODUCTS, int STAGES, int RAW_STAGES, bool SUMS_APART = false,
          bool PINGPONG = false, bool PRESPLIT = false, bool Q_STAGED = false, int HH_CHAIN = 2>
__global__ void __launch_bounds__(384, 1)
flash_fwd_tf32_wgmma_ws(const __grid_constant__ FwdParams p) {
    typedef FwdTf32WgmmaWsSmem<D_TILE, BLOCK_N, STAGES, RAW_STAGES, Q_STAGED> L;
    constexpr int BLOCK_M = L::BLOCK_M, D_FRAGS = D_TILE / 8;
    // setmaxnreg moves registers within the CTA's launch allocation (384 threads x 168): the
    // consumers' raise waits until the producer's release covers it, so the two must fit in it
    // (128 x 104 + 256 x 200 = 384 x 168); the producer's unrolled split spills below about 88.
    constexpr int LAUNCH_REGISTERS = 65536 / 384 / 8 * 8;
    // PRESPLIT's producer is one thread's bulk copies: the d128 consumers (Q_STAGED) take what it
    // leaves (128 x 40 + 256 x 232; at 200 they spill 196 bytes). A producer that splits d128
    // blocks spills below 104 (184 bytes at 88), so d128 takes PRESPLIT (plans: the spec).
    constexpr int PRODUCER_REGISTERS = PRESPLIT && D_TILE > 64 ? 40 : 104;
    constexpr int CONSUMER_REGISTERS = (LAUNCH_REGISTERS * 384 - 128 * PRODUCER_REGISTERS) / 256 / 8 * 8;
    static_assert(128 * PRODUCER_REGISTERS + 256 * CONSUMER_REGISTERS <= 384 * LAUNCH_REGISTERS, "registers");
    constexpr bool SPLIT = Tf32Operand<PRODUCTS>::SPLIT;
    // Q in registers: 16 D_TILE / 8 of a consumer's 200 (at d128 they spill, tf32-wgmma-v1): Q_STAGED
    static_assert(BLOCK_N % 32 == 0 && BLOCK_N <= 256 && D_TILE % 32 == 0 && D_TILE <= (Q_STAGED ? 128 : 64),
                  "whole tf32 panels");
    static_assert(STAGES >= 2 && (PRESPLIT ? RAW_STAGES == 0 : RAW_STAGES >= 1), "stages");
    static_assert(L::BYTES + 1024 <= 227 * 1024, "shared memory");

    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);

    const SequenceRows seq = cta_sequence<Mask>(p, blockIdx.z);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    const Mask mask = cta_mask<Mask, CtaRows::QUERIES>(p, seq.index, seqlen_q, seqlen_k);
    const int m0 = Mask::query_block(blockIdx.x, gridDim.x) * BLOCK_M;
    if (Mask::PACKED && m0 >= seqlen_q) return;  // past a shorter sequence's end: the whole CTA
    // PRESPLIT copies each block's image, so an empty key range walks no block (SKIP_EMPTY: a packed
    // batch's block map can point a short sequence's empty range past its end, block_walk.cuh)
    const KeyBlockRange<BLOCK_N, PRESPLIT> keys(mask, m0, BLOCK_M);
    const int j_begin = keys.first, j_end = keys.end;
    const int head = blockIdx.y, head_kv = head / p.group;
    const int tid = threadIdx.x, wg = tid / 128, lane = tid % 32;

    const StageRing<STAGES> ring{base + L::FULL, base + L::EMPTY};
    ring.init(PRESPLIT ? 1 : 128, 256);  // the producer's threads (PRESPLIT: its one), the consumers'
    __syncthreads();  // the last CTA-wide barrier: the roles split here

    if (wg == 0) {
        // ---- producer ----
        warpgroup_registers_dec<PRODUCER_REGISTERS>();  // every warp of the warpgroup (.aligned)
        if constexpr (PRESPLIT) {
            // one thread: a bulk copy of each key block's split image into its stage
            if (tid != 0) return;
            const unsigned char* const image = static_cast<const unsigned char*>(p.kv_split);
            for (int j = j_begin; j < j_end; ++j) {
                const int i = j - j_begin;
                const i64 block = kv_fwd_image_offset<Mask::PACKED, D_TILE, BLOCK_N>(p, seq, head_kv, j);
                ring.wait_empty(i);  // the consumers are done with the stage
                mbarrier_arrive_expect_tx(ring.full_barrier(i), L::STAGE);
                cp_async_bulk_to_shared(base + (i % STAGES) * L::STAGE, image + block, L::STAGE, ring.full_barrier(i));
            }
            return;
        }
        const float* __restrict__ k_rows = p.k.row<const float>(seq.batch, seq.k_begin, head_kv);
        const float* __restrict__ v_rows = p.v.row<const float>(seq.batch, seq.k_begin, head_kv);
        const i64 k_ss = p.k.row_stride, v_ss = p.v.row_stride;
        // The raw K and V of the walk's block i (key block j_begin + i) into staging tile
        // i % RAW_STAGES (Tf32RawStages::copy: one commit group, empty past the end).
        const Tf32RawStages<BLOCK_N, D_TILE, 128, RAW_STAGES> raw_stages{base + L::RAW};
        auto stage_raw = [&](int i) {
            raw_stages.copy(i, j_begin + i < j_end, (j_begin + i) * BLOCK_N, k_rows, k_ss, p.headdim, v_rows, v_ss,
                            p.headdim_v, seqlen_k, tid);
        };
        raw_stages.copy_first(0, stage_raw);
        for (int j = j_begin; j < j_end; ++j) {
            const int i = j - j_begin, n0 = j * BLOCK_N;
            const u32 stage = base + (i % STAGES) * L::STAGE;
            const u32 raw = raw_stages.stage(i);
            cp_async_wait<RAW_STAGES - 1>();
            named_barrier_sync(1, 128);  // block j's raw rows have landed, every producer thread's
            ring.wait_empty(i);          // the consumers are done with the stage
            split_key_block_fwd_tf32<D_TILE, BLOCK_N, 128, PRODUCTS>(stage, StagedRows<D_TILE>{raw},
                                                                     StagedRows<D_TILE>{raw + raw_stages.TILE},
                                                                     seqlen_k - n0, p.headdim, p.headdim_v, tid);
            fence_proxy_async_shared();  // the stores, to the async proxy that wgmma reads with
            ring.arrive_full(i);
            named_barrier_sync(1, 128);  // every producer thread is done reading the raw tile
            stage_raw(i + RAW_STAGES);
        }
        return;
    }

    // ---- consumers: warpgroup 1 rows 0-63, warpgroup 2 rows 64-127 ----
    warpgroup_registers_inc<CONSUMER_REGISTERS>();
    const int strip_row0 = 64 * (wg - 1) + 16 * ((tid / 32) % 4);
    constexpr Tanh TANH = SPLIT ? Tanh::ACCURATE : Tanh::RATIONAL;
    const ScoreOf<Mask, float, TANH> score(score_problem<Mask>(p, seq), seq.index, blockIdx.y, p.scale);
    const float* __restrict__ q_rows = p.q.row<const float>(seq.batch, seq.q_begin + m0, head);
    constexpr int Q_FRAGS = Q_STAGED ? 1 : D_TILE / 8;
    u32 q_hi[Q_FRAGS][4], q_lo[Q_FRAGS][4];
    unsigned char* const q_tile = smem_raw + (base - smem_u32(smem_raw)) + L::Q;
    typedef typename QStagingOf<Q_STAGED, D_TILE, PRODUCTS>::type QStaging;
    const QStaging q_staged(q_tile, strip_row0, lane);
    if constexpr (Q_STAGED) {
        stage_q_rows<D_TILE>(q_tile, q_rows, seqlen_q - m0, p.headdim, p.q.row_stride, strip_row0, lane);
    } else {
        load_q_fragments<D_TILE, PRODUCTS>(q_hi, q_lo, q_rows, seqlen_q - m0, p.headdim, p.q.row_stride, strip_row0,
                                           lane);
    }

    float o_acc[1][D_FRAGS][4];
    zero_acc(o_acc);
    RowStats<RowState::ALL_LANES, 1> row_stats;
    const DropoutOf<Mask> dropout(p, seq.index, head);

    // PINGPONG: the consumers take turns at issuing their products (named barriers 2 and 3,
    // ConsumerTurns); warpgroup 1 has the first turn, and waits once more at the end for
    // warpgroup 2's last pass, so that every arrival on a barrier is met by its bar.sync.
    const ConsumerTurns<PINGPONG> turns{2u + (wg - 1), 2u + (2 - wg)};
    if (wg == 2) turns.pass();
    for (int j = j_begin; j < j_end; ++j) {
        const int i = j - j_begin;
        const u32 stage = base + (i % STAGES) * L::STAGE;
        ring.wait_full(i);
        tf32_wgmma_forward_block<D_TILE, BLOCK_M, BLOCK_N, PRODUCTS, !Q_STAGED, SUMS_APART, HH_CHAIN>(
            o_acc, row_stats, q_hi, q_lo, 0u, 0u, stage + L::K_HI, stage + L::K_LO, stage + L::V_HI, stage + L::V_LO,
            mask, score, dropout, p.scale_log2, m0, j * BLOCK_N, strip_row0, lane, turns, q_staged);
        ring.arrive_empty(i);  // its products were waited for
    }
    if (wg == 1) turns.wait();

    if constexpr (DropoutOf<Mask>::ENABLED) scale_acc(o_acc, p.variant.dropout.scale);
    // Q_STAGED: O is staged over the warp's own rows of Q's tile, which other lanes of the warp read
    // in the last block's split. Those reads fed wgmmas the warp has waited for (.sync.aligned), so
    // they are done; the warp barrier says so to racecheck, which does not count wgmma's
    // convergence as one (its WAR report on the staged form, perf log tf32-staged-q-syncwarp).
    if constexpr (Q_STAGED) __syncwarp();
    store_o<float, D_TILE, Mask::Score::HAS_SINK>(
        o_acc, row_stats, base + L::O_STAGING, strip_row0, m0, seqlen_q, p.headdim_v,
        p.o.row<float>(seq.batch, seq.q_begin + m0, head), p.o.row_stride,
        static_cast<float*>(p.lse) + seq.stat(p, head, m0), lane, sink_log2<Mask, float>(p, head));
}

}  // namespace cf

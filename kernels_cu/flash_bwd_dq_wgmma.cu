// flash_bwd_dq_wgmma: dQ of the attention backward on Hopper warpgroup MMA (wgmma, sm_90a;
// fp16/bf16), deterministic by construction: one CTA owns a block of query rows and sums their
// dQ over every key block in registers, so no two CTAs ever add into the same dQ element.
//
// The forward's work split (flash_fwd_wgmma.cu): one CTA per (query block i, head, batch), a
// warpgroup per 64 query rows, Q_i and dO_i resident in shared memory, lse_i and D_i in
// registers; the CTA walks the key blocks j of its kv head:
//   S  = Q_i K_j^T       wgmma m64 x BLOCK_N, A = Q (K-major), B = K_j (K-major)
//   dP = dO_i V_j^T      same shape, A = dO, B = V_j; issued right after S
//   P  = exp2(S scale log2(e) - lse log2(e)),  dS = P o (dP - D)        (registers)
//   dQ += dS K_j         wgmma m64 x D_TILE, A = dS from registers, B = K_j (MN-major)
// S and dP are recomputed here (the dK/dV kernel computes them as well): three products per block
// pair on top of the dK/dV kernel's four, in exchange for no dQ accumulation buffer, no atomics
// and no reductions through L2 (docs/perf-log.md, mma-bwd-v10). dQ = scale dS K is written once.
//
// K_{j+1}, V_{j+1} are copied while block j computes; V, read only by dP (waited for inside the
// block), has two stages. K has K_STAGES: with 2 (the default, measured faster), dS K_j is waited
// for before the barrier at the top of block j + 1, whose copies refill K_j's stage; with 3 it is
// left running into block j + 1 (its wait comes with S_{j+1}'s), as the forward leaves P V_j, and
// K_j's stage outlives that barrier. ptxas serializes the wgmma of the 3-stage variant at head
// dims 64 and 128 (C7515), so it is a tuner candidate at 256 only.
#include "block_walk.cuh"
#include "common.cuh"
#include "cta_timeline.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "mma_bwd.cuh"
#include "wgmma.cuh"
#include "wgmma_bwd.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"

namespace cf {

// Shared memory from a 1024-byte aligned base; cupyflash/kernels/mma_bwd.py (dq_wgmma_smem_bytes)
// mirrors BYTES and adds the alignment slack.
template <int D_TILE, int BLOCK_M, int BLOCK_N, int K_STAGES>
struct DqWgmmaSmem {
    static constexpr int V_STAGES = 2;
    static constexpr u32 Q_PANEL = BLOCK_M * 128, KV_PANEL = BLOCK_N * 128;
    static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 2, KV_TILE = BLOCK_N * D_TILE * 2;
    static constexpr u32 Q = 0;
    static constexpr u32 DO = Q + Q_TILE;
    static constexpr u32 K = DO + Q_TILE;
    static constexpr u32 V = K + K_STAGES * KV_TILE;
    static constexpr u32 BYTES = V + V_STAGES * KV_TILE;
};

// K_STAGES: 2 waits for dS K_j before the next barrier, 3 leaves it running across (above).
template <typename T, int D_TILE, class Mask, int BLOCK_M, int BLOCK_N, int K_STAGES>
__global__ void __launch_bounds__(BLOCK_M / 64 * 128, 1)
flash_bwd_dq_wgmma(const __grid_constant__ BwdParams p) {
    typedef DqWgmmaSmem<D_TILE, BLOCK_M, BLOCK_N, K_STAGES> L;
    constexpr int NWG = BLOCK_M / 64, NTHREADS = NWG * 128;
    constexpr int N_FRAGS = BLOCK_N / 8, D_FRAGS = D_TILE / 8;
    constexpr bool DQ_ACROSS_BARRIER = K_STAGES >= 3;
    static_assert(BLOCK_M % 64 == 0 && BLOCK_N % 16 == 0 && D_TILE % 64 == 0, "64-row panels, 16-key k-steps");
    static_assert(K_STAGES == 2 || K_STAGES == 3, "two or three K stages");
    static_assert(L::BYTES + 1024 <= 227 * 1024, "shared memory");
    cta_timeline(MARK_ENTRY, threadIdx.x == 0);  // first: a CTA's setup is its prologue (dev/cta_timeline.py)

    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);
    const u32 s_q = base + L::Q, s_do = base + L::DO;

    const SequenceRows seq = cta_sequence_uniform<Mask>(p, blockIdx.z);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    const StatDims stat_dims{p.nheads, p.seqlen_q};
    const int headdim = p.headdim;
    const float scale_log2 = p.scale_log2, scale = p.scale;
    const float* __restrict__ lse = static_cast<const float*>(p.lse);
    const float* __restrict__ delta = static_cast<const float*>(p.delta);
    const i64 k_ss = p.k.row_stride, v_ss = p.v.row_stride;

    const int head = blockIdx.y, batch = seq.batch, head_kv = head / p.group;
    const Mask mask = cta_mask<Mask, CtaRows::QUERIES>(p, seq.index, seqlen_q, seqlen_k);
    // softcap's reciprocals three of four on the FMA pipe at d128 (score.cuh's exp_form_rcp, by
    // fragment f): with S, dP and dQ a block, three MUFU operations a score take as long as the
    // products (perf log softcap-bwd-dq-newton; d64, where they take twice as long, is unmeasured)
    constexpr Tanh TANH = D_TILE == 128 ? Tanh::EXP_NEWTON : Tanh::EXP_RCP;
    const ScoreOf<Mask, float, TANH> score(score_problem<Mask>(p, seq), seq.index, head, scale);
    const int m0 = Mask::query_block(blockIdx.x, gridDim.x) * BLOCK_M;
    if (Mask::PACKED && m0 >= seqlen_q) return;  // past a shorter sequence's end
    // Key blocks [j_begin, ceil(n_end / BLOCK_N)) hold the keys some row of the block sees; K_j
    // and V_j sit in the stages of the absolute index j, whichever block the walk starts at.
    const KeyBlockRange<BLOCK_N> keys(mask, m0, BLOCK_M);
    const int j_begin = keys.first, n_end = keys.n_end;
    const int tid = threadIdx.x, wg = tid / 128, warp = tid / 32, lane = tid % 32;

    const T* __restrict__ k_rows = p.k.row<const T>(batch, seq.k_begin, head_kv);
    const T* __restrict__ v_rows = p.v.row<const T>(batch, seq.k_begin, head_kv);
    auto load_kv_block = [&](int j) {
        const int n0 = j * BLOCK_N;
        cp_async_panels<BLOCK_N, D_TILE, NTHREADS>(base + L::K + (j % K_STAGES) * L::KV_TILE,
                                                   k_rows + n0 * k_ss, seqlen_k - n0, headdim, k_ss, tid);
        cp_async_panels<BLOCK_N, D_TILE, NTHREADS>(base + L::V + (j % L::V_STAGES) * L::KV_TILE,
                                                   v_rows + n0 * v_ss, seqlen_k - n0, p.headdim_v, v_ss, tid);
    };
    cp_async_panels<BLOCK_M, D_TILE, NTHREADS>(s_q, p.q.row<const T>(batch, seq.q_begin + m0, head), seqlen_q - m0,
                                               headdim, p.q.row_stride, tid);
    cp_async_panels<BLOCK_M, D_TILE, NTHREADS>(s_do, p.dout.row<const T>(batch, seq.q_begin + m0, head),
                                               seqlen_q - m0, p.headdim_v, p.dout.row_stride, tid);
    if (j_begin * BLOCK_N < n_end) load_kv_block(j_begin);
    cp_async_commit();

    // This thread's two rows (accumulator halves h = 0, 1): lse (log2 units) and D, for the block
    // (wgmma_bwd.cuh's load_row_statistics).
    const int row_lo = m0 + 16 * warp + lane / 4;
    const DropoutOf<Mask> dropout(p, seq.index, head);
    float base_log2[2], delta_row[2];
    load_row_statistics(base_log2, delta_row, seq, stat_dims, head, row_lo, seqlen_q, lse, delta);

    float dq_acc[D_FRAGS][4];
    zero(dq_acc);
    for (int j = j_begin; j * BLOCK_N < n_end; ++j) {
        // Block j's copies land; the proxy fence hands them to wgmma; after the barrier every
        // warpgroup is past dP_{j-1} and (K_STAGES 3) dS K_{j-2}, whose stages the next copies
        // refill.
        cp_async_wait<0>();
        fence_proxy_async_shared();
        __syncthreads();
        if (j == j_begin) cta_timeline(MARK_FIRST_STEP, tid == 0);
        if ((j + 1) * BLOCK_N < n_end) load_kv_block(j + 1);
        cp_async_commit();

        const int n0 = j * BLOCK_N;
        const u32 k_tile = base + L::K + (j % K_STAGES) * L::KV_TILE;
        const u32 v_tile = base + L::V + (j % L::V_STAGES) * L::KV_TILE;

        // Steps 1-2: S = Q K_j^T and dP = dO V_j^T, issued back to back (K-major operands).
        float s_acc[N_FRAGS][4], dp_acc[N_FRAGS][4];
        wgmma_fence();
        issue_s_dp<T, BLOCK_N, D_TILE, L::Q_PANEL, L::KV_PANEL>(s_acc, dp_acc, s_q + wg * 64 * 128, s_do + wg * 64 * 128,
                                                               k_tile, v_tile);
        wgmma_wait<1>();  // S_j, and dS K_{j-1}: its A fragments may be overwritten below
        pin_registers(reinterpret_cast<float(&)[N_FRAGS * 4]>(s_acc));
        pin_registers(reinterpret_cast<float(&)[D_FRAGS * 4]>(dq_acc));

        // Steps 3-4: P, then dS = P o (dP - D), packed as the A fragments of dS K_j (wgmma_bwd.cuh's
        // probabilities_and_ds_dq).
        u32 ds_frag[BLOCK_N / 16][4];
        probabilities_and_ds_dq<T, BLOCK_M, BLOCK_N>(ds_frag, s_acc, dp_acc, mask, score, dropout, p, m0, n0, row_lo,
                                                     scale_log2, base_log2, delta_row, lane);

        // Step 5: dQ += dS K_j (wgmma_bwd.cuh's issue_ds_k).
        wgmma_fence();
        issue_ds_k<T, D_TILE, BLOCK_N, L::KV_PANEL>(dq_acc, ds_frag, k_tile);
        if constexpr (!DQ_ACROSS_BARRIER) {
            wgmma_wait<0>();
            pin_registers(reinterpret_cast<float(&)[D_FRAGS * 4]>(dq_acc));
        }
    }
    wgmma_wait<0>();
    pin_registers(reinterpret_cast<float(&)[D_FRAGS * 4]>(dq_acc));
    cta_timeline(MARK_WALKED, tid == 0, max(0, (n_end + BLOCK_N - 1) / BLOCK_N - j_begin));

    // Epilogue: dQ = scale dS K, staged through the Q tile (free once every warpgroup has walked:
    // S's products read it to the last block) for 16-byte row stores of the rows below seqlen_q, as
    // the mma.sync dQ kernel stores them. Straight from the accumulators, a warp's 4-byte stores
    // went to 8 rows at a time (perf log bwd-epilogue-staged).
    cp_async_wait<0>();
    __syncthreads();
    stage_acc<T, D_TILE, D_TILE>(s_q, 16 * warp, 0, dq_acc, scale, lane);
    __syncthreads();
    store_tile<BLOCK_M, D_TILE, NTHREADS>(p.dq.row<T>(batch, seq.q_begin + m0, head), s_q, seqlen_q - m0, headdim,
                                          p.dq.row_stride, tid);
    cta_timeline(MARK_EXIT, tid == 0);
}

}  // namespace cf

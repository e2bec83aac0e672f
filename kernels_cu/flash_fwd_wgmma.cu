// flash_fwd_wgmma: exact attention forward on Hopper warpgroup MMA (wgmma, sm_90a; fp16/bf16),
// head dimension up to D_TILE (64, 128 or 256), and v's (o's) up to DV_TILE <= D_TILE (D_TILE
// unless v has a narrower head dim of its own: DeepSeek MLA's 192 / 128 runs D_TILE 256 for
// S = Q K^T and DV_TILE 128 for O = P V, not 256 for both).
//
// flash_fwd_mma.cu's work split with a warpgroup (4 warps) per 64 query rows: one CTA owns
// BLOCK_M = 64 NWG rows of one (batch, head) and walks the key blocks of its kv head.
//   S = Q K_j^T      wgmma m64 x BLOCK_N, A = the warpgroup's Q rows, B = K_j (both K-major, in
//                    shared memory)
//   online softmax   on the accumulators, whose layout per warp is mma.sync's: online_softmax.cuh
//   O += P V_j       wgmma m64 x DV_TILE, A = P from registers, B = V_j (MN-major)
// Every shared tile is a 128-byte-swizzled panel tile (wgmma.cuh). P V_j is left running while the
// next block starts (its wait comes with S_{j+1}'s), so V_j must outlive the barrier at the top of
// block j + 1: V has three stages and K two. At the top of block j the stages of K_{j-1} and
// V_{j-2} are free in every warpgroup (their products were waited for before the barrier), and
// K_{j+1}, V_{j+1} are copied into them while block j computes.
#include "block_walk.cuh"
#include "common.cuh"
#include "cta_timeline.cuh"
#include "mma.cuh"
#include "online_softmax.cuh"
#include "params.cuh"
#include "wgmma.cuh"

namespace cf {

// Shared memory from a 1024-byte aligned base; cupyflash/plans.py (wgmma_smem_bytes)
// mirrors BYTES and adds the alignment slack. Q is reused to stage O in the epilogue (DV_TILE
// <= D_TILE columns). A K stage is KV_TILE bytes, a V stage V_TILE (KV_TILE when DV_TILE = D_TILE).
template <int D_TILE, int BLOCK_M, int BLOCK_N, int DV_TILE = D_TILE>
struct FwdWgmmaSmem {
    static constexpr int K_STAGES = 2, V_STAGES = 3;
    static constexpr u32 Q_PANEL = BLOCK_M * 128, KV_PANEL = BLOCK_N * 128;
    static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 2;
    static constexpr u32 V_TILE = BLOCK_N * DV_TILE * 2;
    static constexpr u32 Q = 0;
    static constexpr u32 K = Q + BLOCK_M * D_TILE * 2;
    static constexpr u32 V = K + K_STAGES * KV_TILE;
    static constexpr u32 BYTES = V + V_STAGES * V_TILE;
};

template <typename T, int D_TILE, class Mask, int BLOCK_M, int BLOCK_N, int DV_TILE = D_TILE>
__global__ void __launch_bounds__(BLOCK_M / 64 * 128, 1)
flash_fwd_wgmma(const __grid_constant__ FwdParams p) {
    typedef FwdWgmmaSmem<D_TILE, BLOCK_M, BLOCK_N, DV_TILE> L;
    constexpr int NWG = BLOCK_M / 64, NTHREADS = NWG * 128;
    constexpr int N_FRAGS = BLOCK_N / 8, D_FRAGS = DV_TILE / 8;  // D_FRAGS: of O
    static_assert(BLOCK_M % 64 == 0 && BLOCK_N % 64 == 0 && D_TILE % 64 == 0, "64-row/column panels");
    static_assert(DV_TILE % 64 == 0 && DV_TILE <= D_TILE, "O: 64-column panels, staged in the Q tile");
    static_assert(L::BYTES + 1024 <= 227 * 1024, "shared memory");
    cta_timeline(MARK_ENTRY, threadIdx.x == 0);  // first: a CTA's setup is its prologue (dev/cta_timeline.py)

    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);
    const u32 q_tile = base + L::Q;

    const SequenceRows seq = cta_sequence<Mask>(p, blockIdx.z);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, headdim = p.headdim;
    const float scale_log2 = p.scale_log2;
    const int head = blockIdx.y, batch = seq.batch, head_kv = head / p.group;
    const Mask mask = cta_mask<Mask, CtaRows::QUERIES>(p, seq.index, seqlen_q, seqlen_k);
    const ScoreOf<Mask, float, Tanh::EXP_RCP> score(score_problem<Mask>(p, seq), seq.index, blockIdx.y, p.scale);
    const int m0 = Mask::query_block(blockIdx.x, gridDim.x) * BLOCK_M;
    if (Mask::PACKED && m0 >= seqlen_q) return;  // past a shorter sequence's end
    // Key blocks [j_begin, ceil(n_end / BLOCK_N)) hold the keys some row of the block sees.
    // NoMask: the literal 0, not keys.first, whose mask.key_begin call folds to 0 only after
    // inlining. With the call NVRTC emitted another loop (other PTX, an 8-11% slower d128 forward
    // on an H200); with the literal its PTX is the pre-policy kernel's. Causal and Local keep the
    // form measured with the policy.
    const KeyBlockRange<BLOCK_N> keys(mask, m0, BLOCK_M);
    const int j_begin = Mask::HAS_LEFT || Mask::HAS_RIGHT || Mask::HAS_BLOCK_MAP ? keys.first : 0;
    const int n_end = keys.n_end;
    const int tid = threadIdx.x, wg = tid / 128, warp = tid / 32, lane = tid % 32;
    const int strip_row0 = 16 * warp;  // the warp's 16 rows within the block

    const T* __restrict__ k_rows = p.k.row<const T>(batch, seq.k_begin, head_kv);
    const T* __restrict__ v_rows = p.v.row<const T>(batch, seq.k_begin, head_kv);
    const i64 k_ss = p.k.row_stride, v_ss = p.v.row_stride;
    auto load_kv_block = [&](int j) {
        const int n0 = j * BLOCK_N;
        cp_async_panels<BLOCK_N, D_TILE, NTHREADS>(base + L::K + (j % L::K_STAGES) * L::KV_TILE,
                                                   k_rows + n0 * k_ss, seqlen_k - n0, headdim, k_ss, tid);
        cp_async_panels<BLOCK_N, DV_TILE, NTHREADS>(base + L::V + (j % L::V_STAGES) * L::V_TILE,
                                                    v_rows + n0 * v_ss, seqlen_k - n0, p.headdim_v, v_ss, tid);
    };

    cp_async_panels<BLOCK_M, D_TILE, NTHREADS>(q_tile, p.q.row<const T>(batch, seq.q_begin + m0, head), seqlen_q - m0,
                                               headdim, p.q.row_stride, tid);
    // Stages are those of absolute block indices (K_j in j % 2, V_j in j % 3), so the pipeline is
    // the same whichever block the walk starts at.
    if (j_begin * BLOCK_N < n_end) load_kv_block(j_begin);
    cp_async_commit();

    float o_acc[1][D_FRAGS][4];
#pragma unroll
    for (int f = 0; f < D_FRAGS; ++f) o_acc[0][f][0] = o_acc[0][f][1] = o_acc[0][f][2] = o_acc[0][f][3] = 0.f;
    RowStats<RowState::ALL_LANES, 1> row_stats;
    const DropoutOf<Mask> dropout(p, seq.index, head);
    auto store = [&]() {
        store_o<T, DV_TILE, Mask::Score::HAS_SINK>(
            o_acc, row_stats, q_tile, strip_row0, m0, seqlen_q, p.headdim_v, p.o.row<T>(batch, seq.q_begin + m0, head),
            p.o.row_stride, static_cast<float*>(p.lse) + seq.stat(p, head, m0), lane,
            sink_log2<Mask, float>(p, head));
    };
    if (j_begin * BLOCK_N >= n_end) {  // rows that see no key: O = 0, lse = -inf
        cp_async_wait<0>();
        __syncthreads();
        store();
        return;
    }

    for (int j = j_begin; j * BLOCK_N < n_end; ++j) {
        // Block j's copies land; the proxy fence hands them to wgmma; after the barrier every
        // warpgroup is past S_{j-1} and P V_{j-2}, whose stages the next copies refill.
        cp_async_wait<0>();
        fence_proxy_async_shared();
        __syncthreads();
        if (j == j_begin) cta_timeline(MARK_FIRST_STEP, tid == 0);
        if ((j + 1) * BLOCK_N < n_end) load_kv_block(j + 1);
        cp_async_commit();

        const u32 k_tile = base + L::K + (j % L::K_STAGES) * L::KV_TILE;
        const u32 v_tile = base + L::V + (j % L::V_STAGES) * L::V_TILE;
        float s[1][N_FRAGS][4];
        wgmma_fence();
        wgmma_rows_times_rows<T, BLOCK_N, D_TILE, L::Q_PANEL, L::KV_PANEL>(
            reinterpret_cast<float(&)[N_FRAGS * 4]>(s), q_tile + wg * 64 * 128, k_tile);
        wgmma_commit();
        wgmma_wait<0>();  // S_j, and P V_{j-1}: O may be rescaled
        pin_registers(reinterpret_cast<float(&)[N_FRAGS * 4]>(s));
        pin_registers(reinterpret_cast<float(&)[D_FRAGS * 4]>(o_acc));

        const int n0 = j * BLOCK_N;
        scale_and_mask(s, scale_log2, mask.keys_partial(m0, BLOCK_M, n0, BLOCK_N), mask, score, m0 + strip_row0,
                       n0, lane);
        float m_new[1][2];
        row_max(m_new, s, row_stats, lane);
        softmax_rescale(s, o_acc, row_stats, m_new, lane);
        u32 p_frag[1][N_FRAGS / 2][4];
        pack_p<T>(p_frag, s);
        if constexpr (DropoutOf<Mask>::ENABLED)  // after the row sums: l and lse stay the softmax's
            drop_packed_p<DropoutOf<Mask>, 1, N_FRAGS>(p_frag, dropout, m0 + strip_row0 + lane / 4, n0 + 2 * (lane % 4));

        wgmma_fence();
        wgmma_p_times_v<T, DV_TILE, BLOCK_N, L::KV_PANEL>(reinterpret_cast<float(&)[D_FRAGS * 4]>(o_acc), p_frag[0],
                                                          v_tile);
        wgmma_commit();
    }
    wgmma_wait<0>();
    pin_registers(reinterpret_cast<float(&)[D_FRAGS * 4]>(o_acc));
    cta_timeline(MARK_WALKED, tid == 0, keys.blocks);

    if constexpr (DropoutOf<Mask>::ENABLED) scale_acc(o_acc, p.variant.dropout.scale);

    // Q is reused to stage O: every warpgroup must be done reading it.
    cp_async_wait<0>();
    __syncthreads();
    store();
    cta_timeline(MARK_EXIT, tid == 0);
}

}  // namespace cf

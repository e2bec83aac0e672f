// flash_bwd_fused_mma: attention backward on tensor cores in one kernel (fp16/bf16, sm_80 and
// sm_90). dK, dV and dQ from one recomputation of S and dP per (query block, key block) pair:
// five matrix products where the two-kernel deterministic path (mma_bwd_layouts.cuh) needs seven.
//
// One CTA per (key block j, kv head, batch) keeps K_j and V_j in shared memory and walks every
// query block i of every query head of its GQA group (Q_i, dO_i, lse_i, D_i double-buffered by
// cp.async), accumulating dK_j, dV_j in registers. Each step's dQ_i contribution dS_ij K_j is
// added to a float32 dq_accum by red.global.add; flash_bwd_dq_convert scales and converts it.
//
// The adds to one dQ_i come from every key block that sees query block i. Float addition does not
// associate, so their order decides the bits of dQ. With DqAdd::ordered (DQ_ORDERED below) the
// order is fixed: key block j adds after key blocks 0..j-1 (always exactly the ones before it: a
// key block that sees query block i makes every earlier key block see it too), waiting on a
// per-(batch, head, query block) counter that each of them raises by NWARPS. The protocol is laid out so that nobody waits in
// steady state (on an H200 it still runs 15-20% slower than the unordered adds: the acquire loads,
// the fences and the pipeline fill; docs/perf-log.md, mma-bwd-v4):
//   * every CTA walks its query blocks from the last to the first, so all CTAs of a (batch, head)
//     reach a query block at about the same time, causal or not (walking forward, key block j
//     would reach block i ahead of key block j - 1 under a causal mask and wait for it);
//   * a CTA waits only on CTAs with smaller blockIdx.x, launched before it, so a waiter never
//     holds an SM that the CTA it waits for still needs (no deadlock, and the heaviest causal
//     CTAs still start first);
//   * the counter is read (acquire) at the top of the iteration and needed only before the dQ
//     product, and a block is released one product into the next iteration, when its adds have
//     reached L2: the release's fence then finds nothing in flight. The next query block's
//     cp.async prefetch is issued after the release for the same reason.
// EAGER_RELEASE: release right after the adds, prefetch first (measured slower: the fence then
// waits for the adds in flight).
// With DqAdd::atomic the adds land in whatever order the CTAs reach them (query blocks walked
// forward: under a causal mask the CTAs then start on different blocks and contend less).
//
// Warp tiles (the FlashAttention-2 backward's, with S computed transposed):
//   S^T = K_j Q_i^T, dP^T = V_j dO_i^T, dV += P^T dO, dK += dS^T Q:
//       WARPS_N x WARPS_D warps; warp (wn, wd) owns key rows KN wn.. (KN = BLOCK_N / WARPS_N,
//       KN / 16 row groups), query columns SQ wd.. of S^T and dP^T (SQ = BLOCK_M / WARPS_D) and
//       head-dim columns DW wd.. of dK and dV (DW = D_TILE / WARPS_D).
//   dQ_i += dS K_j: DQ_WARPS_M x (NWARPS / DQ_WARPS_M) warps over (query rows, head-dim columns).
// S_UNROLL: k-steps of S^T and dP^T unrolled (fewer: fewer registers, see mma_ABt_groups).
// Every warp tile is at least 32 rows tall, so each fragment read from shared memory feeds two or
// more mma per 16 x 16 operand (the 16-row warps of flash_bwd_dkdv_mma feed one to two). P^T and
// dS^T go through shared memory (16-bit, swizzled), since the products after them need rows or
// columns that other warps computed.
#include "common.cuh"
#include "block_walk.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "mma_bwd.cuh"
#include "mma_bwd_layouts.cuh"
#include "dq_add.cuh"
#include "dq_order.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"

namespace cf {

// ---------------------------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------------------------

// Shared-memory layout in bytes; cupyflash/backward_plans.py (fused_smem_bytes) mirrors BYTES.
template <int D_TILE, int BLOCK_M, int BLOCK_N>
struct FusedSmem {
    static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 2;
    static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 2;
    static constexpr u32 P_TILE = BLOCK_N * BLOCK_M * 2;
    static constexpr u32 K = 0;
    static constexpr u32 V = K + KV_TILE;
    static constexpr u32 Q = V + KV_TILE;       // [2 stages]
    static constexpr u32 DO = Q + 2 * Q_TILE;   // [2 stages]
    static constexpr u32 PT = DO + 2 * Q_TILE;  // P^T [BLOCK_N][BLOCK_M], 16-bit
    static constexpr u32 DST = PT + P_TILE;     // dS^T [BLOCK_N][BLOCK_M], 16-bit
    static constexpr u32 LSE = DST + P_TILE;    // float [2 stages][BLOCK_M]
    static constexpr u32 DELTA = LSE + 2 * BLOCK_M * 4;
    static constexpr u32 BYTES = DELTA + 2 * BLOCK_M * 4;
};

template <typename T, int D_TILE, class Mask, int BLOCK_M, int BLOCK_N, int WARPS_N, int WARPS_D,
          int DQ_WARPS_M, int S_UNROLL, DqAdd DQ_ADD, bool EAGER_RELEASE = false, bool P_PACKED = false>
__global__ void __launch_bounds__(WARPS_N * WARPS_D * 32, 1)
flash_bwd_fused_mma(const __grid_constant__ BwdParams p) {
    static_assert(DQ_ADD == DqAdd::atomic || DQ_ADD == DqAdd::ordered, "float32 dQ adds, in any or key-block order");
    // The ordered adds' counters are laid out per dense (batch, head, query block).
    static_assert(!Mask::PACKED || DQ_ADD == DqAdd::none || DQ_ADD == DqAdd::atomic,
                  "a packed batch adds dQ by atomics");
    constexpr bool DQ_ORDERED = DQ_ADD == DqAdd::ordered;
    typedef FusedSmem<D_TILE, BLOCK_M, BLOCK_N> L;
    constexpr int NWARPS = WARPS_N * WARPS_D;
    constexpr int NTHREADS = NWARPS * 32;
    constexpr int KN = BLOCK_N / WARPS_N, KG = KN / 16;  // key rows, 16-row groups per warp
    constexpr int SQ = BLOCK_M / WARPS_D;                 // S^T, dP^T query columns per warp
    constexpr int DW = D_TILE / WARPS_D;                  // dK, dV head-dim columns per warp
    constexpr int DQ_WARPS_D = NWARPS / DQ_WARPS_M;
    constexpr int QM = BLOCK_M / DQ_WARPS_M, QG = QM / 16;  // dQ query rows, row groups per warp
    constexpr int DQW = D_TILE / DQ_WARPS_D;                // dQ head-dim columns per warp
    constexpr int DQ_PASS = DQW < 32 ? DQW : 32;             // ... computed this many at a time
    static_assert(KN % 16 == 0 && SQ % 16 == 0 && DW % 16 == 0 && QM % 16 == 0 && DQW % 16 == 0,
                  "m16n8k16 warp tiles");
    static_assert(NWARPS % DQ_WARPS_M == 0, "dQ warp grid");
    static_assert(WARPS_N * KN == BLOCK_N && WARPS_D * SQ == BLOCK_M && WARPS_D * DW == D_TILE &&
                  DQ_WARPS_M * QM == BLOCK_M && DQ_WARPS_D * DQW == D_TILE && DQW % DQ_PASS == 0,
                  "warp tiles cover each block exactly once");
    static_assert(BLOCK_M % 64 == 0, "P^T and dS^T rows of at least 128 bytes (swizzle)");
    static_assert(L::BYTES <= 227 * 1024, "shared memory");

    extern __shared__ __align__(128) unsigned char smem[];
    if (dynamic_smem_bytes() < L::BYTES) __trap();
    const u32 base = smem_u32(smem);
    const u32 s_k = base + L::K, s_v = base + L::V, s_pt = base + L::PT, s_dst = base + L::DST;

    const int tid = threadIdx.x;

    const int n_block = blockIdx.x, n0 = n_block * BLOCK_N, head_kv = blockIdx.y;
    const SequenceRows seq = cta_sequence<Mask>(p, blockIdx.z);
    const int batch = seq.batch;
    // The run-time arguments, read once here (bwd_args in mma_bwd.cuh says why).
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, nheads = p.nheads, group = p.group;
    const int headdim = p.headdim;
    const int query_cols = max(headdim, p.headdim_v);  // of the Q and dO tiles (cp_async_query_block)
    const StatDims stat_dims{nheads, p.seqlen_q};
    // Past a shorter sequence's end. A sequence without queries still stores dK = dV = 0 below.
    if (Mask::PACKED && n0 >= seqlen_k) return;
    const float scale_log2 = p.scale_log2, scale = p.scale;
    const float drop_scale = DropoutOf<Mask>::kept_scale(p);  // 1 / (1 - p)
    const TensorRows q = p.q, k = p.k, v = p.v, dout = p.dout, dk = p.dk, dv = p.dv, dq_accum = p.dq_accum;
    const float* __restrict__ lse = static_cast<const float*>(p.lse);
    const float* __restrict__ delta = static_cast<const float*>(p.delta);
    int* __restrict__ const dq_semaphore = p.dq_semaphore;  // DQ_ORDERED only (null otherwise)
    const Mask mask = cta_mask<Mask, CtaRows::KEYS>(p, seq.index, seqlen_q, seqlen_k);

    // The query blocks that see some key of this block, for each query head of the group
    // (block_walk.cuh); the others are never loaded.
    const QueryBlockWalk<BLOCK_M> walk(mask, n0, BLOCK_N, group);
    const int q_blocks = (seqlen_q + BLOCK_M - 1) / BLOCK_M;  // the counters' stride (dense only)
    // The ordered adds wait for key blocks 0..j-1, which a left bound would skip.
    static_assert(!DQ_ORDERED || !(Mask::HAS_LEFT || Mask::HAS_BLOCK_MAP),
                  "ordered dQ adds need every earlier key block to visit");

    // Iteration it -> query block; DQ_ORDERED walks each head's blocks from the last to the first.
    auto m_block_of = [&](int it) { return DQ_ORDERED ? walk.block_down_from(walk.end - 1, it) : walk.block(it); };
    auto load_query_block = [&](int it, int stage) {
        cp_async_query_block<T, L, BLOCK_M, D_TILE, NTHREADS>(base, stage, q, dout, lse, delta, seq, stat_dims,
                                                              walk.head(head_kv, it), m_block_of(it) * BLOCK_M,
                                                              seqlen_q, query_cols, tid);
    };

    // Prologue: K_j, V_j and the first query block in one group.
    cp_async_key_block<T, BLOCK_N, D_TILE, NTHREADS>(s_k, s_v, k, v, seq, head_kv, n0,
                                                     seqlen_k, headdim, p.headdim_v, tid);
    if (walk.iters > 0) load_query_block(0, 0);
    cp_async_commit();

    float dk_acc[KG][DW / 8][4], dv_acc[KG][DW / 8][4];
#pragma unroll
    for (int g = 0; g < KG; ++g) {
        zero(dk_acc[g]);
        zero(dv_acc[g]);
    }

    constexpr bool DEFERRED_RELEASE = DQ_ORDERED && !EAGER_RELEASE;
    int* pending_release = nullptr;  // DQ_ORDERED: counter of the query block added last, not yet released
    for (int it = 0; it < walk.iters; ++it) {
        const int stage = it & 1;
        // The wait lands this block's copies; the barrier makes every thread's copies visible and
        // guarantees that all warps are done with iteration it - 1 (stage ^ 1, P^T and dS^T).
        cp_async_wait<0>();
        __syncthreads();
        if constexpr (!DEFERRED_RELEASE) {
            if (it + 1 < walk.iters) load_query_block(it + 1, stage ^ 1);
            cp_async_commit();
        }

        const int head = walk.head(head_kv, it);
        const int m_block = m_block_of(it), m0 = m_block * BLOCK_M;
        int* const sem = dq_semaphore + ((i64)batch * nheads + head) * q_blocks + m_block;
        int sem_seen = 0;  // DQ_ORDERED: the counter, read early so its latency hides behind steps 1-7
        if constexpr (DQ_ORDERED) sem_seen = ld_acquire_gpu(sem);
        const u32 s_q = base + L::Q + stage * L::Q_TILE, s_do = base + L::DO + stage * L::Q_TILE;
        const float* s_lse = reinterpret_cast<const float*>(smem + L::LSE) + stage * BLOCK_M;
        const float* s_delta = reinterpret_cast<const float*>(smem + L::DELTA) + stage * BLOCK_M;
        const bool partial = mask.partial(m0, BLOCK_M, n0, BLOCK_N);

        // This thread's place in the warp tiles, re-derived every iteration (see
        // thread_index_uncached): held across the loop, the addresses built from it would spill.
        const int warp = thread_index_uncached() / 32, lane = thread_index_uncached() % 32;
        const int key_row0 = KN * (warp / WARPS_D);  // this warp's key rows within the block
        const int q_col0 = SQ * (warp % WARPS_D);    // its S^T query columns
        const int d_col0 = DW * (warp % WARPS_D);    // its dK, dV columns
        const int dq_row0 = QM * (warp % DQ_WARPS_M), dq_col0 = DQW * (warp / DQ_WARPS_M);

        // Step 1: S^T = K_j Q^T on this warp's key rows and query columns.
        float s_acc[KG][SQ / 8][4];
#pragma unroll
        for (int g = 0; g < KG; ++g) zero(s_acc[g]);
        mma_ABt_groups<T, KG, SQ, D_TILE, D_TILE, D_TILE, S_UNROLL>(s_acc, s_k, key_row0,
                                                                    s_q + q_col0 * (D_TILE * 2), 0, lane);

        // The previous query block's release, one product after its adds were issued (they have
        // reached L2 by now), then the prefetch: issued before the release, its copies would be in
        // flight and the release's fence would wait for them.
        if constexpr (DEFERRED_RELEASE) {
            release_dq_block(pending_release, lane);
            pending_release = nullptr;
            if (it + 1 < walk.iters) load_query_block(it + 1, stage ^ 1);
            cp_async_commit();
        }

        // Step 2: P^T = exp2(S^T scale log2(e) - lse log2(e)), lse per column (query). Hidden
        // entries are set to 0 by selection, not multiplication, so a non-finite score cannot leak;
        // blocks inside the mask run an instance without the test (masked_or_not, mma_bwd.cuh).
        // Element (g, j, e) is key key0 + 16 g + 8 (e / 2), query query0 + 8 j + e % 2; the mask
        // compares compile-time offsets against the per-thread values of the policy's origin.
        // The score policy's transform first (score.cuh), its derivative kept for step 5.
        const int key0 = n0 + key_row0 + lane / 4, query0 = m0 + q_col0 + 2 * (lane % 4);
        const typename Mask::Origin origin = mask.origin(query0, key0);
        const ScoreOf<Mask, float, Tanh::EXP_RCP> score(score_problem<Mask>(p, seq), seq.index, head, scale);
        const auto score_origin = score.origin(query0, key0, partial);
        ScoreGrads<Mask::Score::HAS_GRAD, KG * SQ / 2> grads;
#pragma unroll
        for (int j = 0; j < SQ / 8; ++j) {
            const float2 lse2 = *reinterpret_cast<const float2*>(s_lse + q_col0 + 8 * j + 2 * (lane % 4));
            const float base_log2[2] = {lse_base_log2(lse2.x), lse_base_log2(lse2.y)};
#pragma unroll
            for (int g = 0; g < KG; ++g) {
                masked_or_not(partial, [&](auto masked) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key_off = 16 * g + 8 * (e >> 1), query_off = 8 * j + (e & 1);
                        const bool hidden = mask.hidden(origin, query_off, key_off);
                        float dsds;
                        const float p = recomputed_p(score, s_acc[g][j][e], score_origin, query_off, key_off, dsds,
                                                     scale_log2, base_log2[e & 1]);
                        grads.put((g * (SQ / 8) + j) * 4 + e, dsds);
                        s_acc[g][j][e] = masked.value && hidden ? 0.f : p;
                    }
                });
            }
        }
        // Dropout (dropout.cuh): a dropped weight keeps its magnitude for dS and loses its sign.
        if constexpr (DropoutOf<Mask>::ENABLED) {
            const DropoutOf<Mask> dropout(p, seq.index, head);
#pragma unroll
            for (int g = 0; g < KG; ++g) for_st_frags(s_acc[g], dropout, key0 + 16 * g, query0, MarkDropped{});
        }

        // Step 3: P^T to shared memory (dV needs all BLOCK_M query columns of its key rows). With
        // P_PACKED the 16-bit P^T is also what step 5 reads: the float32 one dies here, which frees
        // KN * SQ / 64 registers while dP^T is accumulated.
        u32 p_packed[KG][SQ / 8][2];
#pragma unroll
        for (int g = 0; g < KG; ++g) {
            pack_c_frags<T, SQ>(p_packed[g], s_acc[g]);
            if constexpr (DropoutOf<Mask>::ENABLED) {  // dV's P^T: the kept weights
                u32 kept[SQ / 8][2];
#pragma unroll
                for (int j = 0; j < SQ / 8; ++j) kept[j][0] = p_packed[g][j][0], kept[j][1] = p_packed[g][j][1];
                relu_frags<T>(kept);
                stage_packed<SQ, BLOCK_M>(s_pt, key_row0 + 16 * g, q_col0, kept, lane);
            } else {
                stage_packed<SQ, BLOCK_M>(s_pt, key_row0 + 16 * g, q_col0, p_packed[g], lane);
            }
        }

        // Step 4: dP^T = V_j dO^T.
        float dp_acc[KG][SQ / 8][4];
#pragma unroll
        for (int g = 0; g < KG; ++g) zero(dp_acc[g]);
        mma_ABt_groups<T, KG, SQ, D_TILE, D_TILE, D_TILE, S_UNROLL>(dp_acc, s_v, key_row0,
                                                                    s_do + q_col0 * (D_TILE * 2), 0, lane);

        // Step 5: dS^T = P^T o (dP^T - D), D per column, to shared memory for dK (all query
        // columns) and dQ (all key rows). Where P^T is 0 (hidden, or underflowed) dS^T is set to 0
        // by selection: a non-finite dP^T there (an inf or NaN in a hidden key's V row) must not
        // turn 0 * dP^T into NaN. Testing P^T instead of the mask saves the mask's registers.
#pragma unroll
        for (int j = 0; j < SQ / 8; ++j) {
            const float2 d2 = *reinterpret_cast<const float2*>(s_delta + q_col0 + 8 * j + 2 * (lane % 4));
#pragma unroll
            for (int g = 0; g < KG; ++g) {
                const float2 lo = unpack2<T>(p_packed[g][j][0]), hi = unpack2<T>(p_packed[g][j][1]);
                const float p16[4] = {lo.x, lo.y, hi.x, hi.y};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float p = P_PACKED ? p16[e] : s_acc[g][j][e], d = (e & 1) ? d2.y : d2.x;
                    const float ds = DropoutOf<Mask>::ENABLED ? dropped_ds(p, dp_acc[g][j][e], d, drop_scale)
                                                              : p * (dp_acc[g][j][e] - d);
                    dp_acc[g][j][e] = p == 0.f ? 0.f : ds * grads.get((g * (SQ / 8) + j) * 4 + e);
                }
            }
        }
#pragma unroll
        for (int g = 0; g < KG; ++g) stage_acc<T, SQ, BLOCK_M>(s_dst, key_row0 + 16 * g, q_col0, dp_acc[g], 1.f, lane);
        __syncthreads();  // P^T and dS^T complete

        // Step 6: dV_j += P^T dO, step 7: dK_j += dS^T Q, on this warp's key rows and head-dim columns.
        mma_AB_groups<T, KG, DW, BLOCK_M, BLOCK_M, D_TILE>(dv_acc, s_pt, key_row0, s_do, d_col0, lane);
        mma_AB_groups<T, KG, DW, BLOCK_M, BLOCK_M, D_TILE>(dk_acc, s_dst, key_row0, s_q, d_col0, lane);

        // Step 8 (ordered): wait for this query block's turn: until all NWARPS warps of key blocks
        // 0..n_block-1 have released it.
        if constexpr (DQ_ORDERED) wait_dq_turn(sem, sem_seen, n_block * NWARPS);

        // Step 9: dQ_i += dS K_j (dS read as the transpose of dS^T) on this warp's query rows and
        // head-dim columns, added to dq_accum; in passes of at most 32 columns (registers: dK, dV
        // are live throughout).
        float* dqa = dq_accum.row<float>(batch, seq.q_begin, head);  // float32 rows (panel stride 64)
        const i64 dqa_ss = dq_accum.row_stride;
#pragma unroll 1
        for (int pass_col0 = dq_col0; pass_col0 < dq_col0 + DQW; pass_col0 += DQ_PASS) {
            float dq_acc[QG][DQ_PASS / 8][4];
#pragma unroll
            for (int g = 0; g < QG; ++g) zero(dq_acc[g]);
            mma_AtB_groups<T, QG, DQ_PASS, BLOCK_N, BLOCK_M, D_TILE>(dq_acc, s_dst, dq_row0, s_k, pass_col0, lane);
#pragma unroll
            for (int g = 0; g < QG; ++g) {
                const int m_lo = m0 + dq_row0 + 16 * g + lane / 4, m_hi = m_lo + 8;
#pragma unroll
                for (int j = 0; j < DQ_PASS / 8; ++j) {
                    const int col = pass_col0 + 8 * j + 2 * (lane % 4);
                    if (col < headdim) {
                        if (m_lo < seqlen_q) red_add_f32x2(dqa + m_lo * dqa_ss + col, dq_acc[g][j][0], dq_acc[g][j][1]);
                        if (m_hi < seqlen_q) red_add_f32x2(dqa + m_hi * dqa_ss + col, dq_acc[g][j][2], dq_acc[g][j][3]);
                    }
                }
            }
        }
        if constexpr (DEFERRED_RELEASE) pending_release = sem;
        if constexpr (DQ_ORDERED && EAGER_RELEASE) release_dq_block(sem, lane);
    }
    if constexpr (DEFERRED_RELEASE) release_dq_block(pending_release, thread_index_uncached() % 32);

    // Epilogue: dK = scale dS^T Q summed, dV; staged through the K and V tiles for 16-byte stores.
    cp_async_wait<0>();
    __syncthreads();
    const int warp = tid / 32, lane = tid % 32;
    const int key_row0 = KN * (warp / WARPS_D), d_col0 = DW * (warp % WARPS_D);
#pragma unroll
    for (int g = 0; g < KG; ++g) {
        stage_acc<T, DW, D_TILE>(s_k, key_row0 + 16 * g, d_col0, dk_acc[g], scale, lane);
        stage_acc<T, DW, D_TILE>(s_v, key_row0 + 16 * g, d_col0, dv_acc[g], drop_scale, lane);
    }
    __syncthreads();
    store_key_block_grads<T, BLOCK_N, D_TILE, NTHREADS>(dk, dv, s_k, s_v, seq, head_kv, n0,
                                                        seqlen_k, headdim, p.headdim_v, tid);
}

}  // namespace cf

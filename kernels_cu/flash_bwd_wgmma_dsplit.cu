// flash_bwd_wgmma_dsplit: attention backward on warpgroup MMA (wgmma, sm_90a; fp16/bf16) for wide
// heads (D_TILE 256), where one warpgroup cannot hold dK and dV for its key rows (64 x 256 each
// would be 256 registers per thread).
//
// flash_bwd_wgmma.cu's loop (one CTA per key block j, every query block i of the GQA group, dQ by
// float32 adds, in any order or in key-block order: DQ_ADD atomic or ordered; none leaves dQ to
// flash_bwd_dq_wgmma.cu), with two warpgroups that share the block's BLOCK_N = 64 key rows and
// split the work differently:
//   warpgroup 0: S^T = K_j Q_i^T, P^T                 warpgroup 1: dP^T = V_j dO_i^T
//                P^T -> shared memory  --barrier-->                dS^T = P^T o (dP^T - D) -> shared
//   both, warpgroup g on head-dim half g (columns 128g..128g+127):
//     dV_g += P^T dO_g    (A = P^T from shared memory, K-major; B = dO, MN-major)
//     dK_g += dS^T Q_g    (A = dS^T; B = Q)
//     dQ_g  = dS K_g      (A = dS, the MN-major view of dS^T; B = K, MN-major) -> dq_accum
// S^T and dP^T (64 x 64 over 256 columns each) are equal work, so the two warpgroups stay in step;
// each thread holds 64 + 64 dK/dV accumulators, 32 for S^T or dP^T and 64 for its dQ half.
// Shared memory: K, V (32 KiB each), two stages of Q and dO (32 KiB each), P^T and dS^T (8 KiB
// each): 208 KiB, sm_90 only.
#include "block_walk.cuh"
#include "common.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "mma_bwd.cuh"
#include "mma_bwd_layouts.cuh"
#include "wgmma.cuh"
#include "dq_order.cuh"
#include "dq_add.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"
#include "wgmma_bwd.cuh"

namespace cf {

// flash_bwd_wgmma_dsplit's stash word of two elements: a kept one's ds'/ds in float16 (as
// without dropout), a dropped one's dS^T in T; unstash reads half c back by its keep factor.
template <typename T>
__device__ __forceinline__ unsigned stash_pair(float a, float b, float keep_a, float keep_b) {
    const unsigned as_half = pack2<half_t>(a, b), as_t = pack2<T>(a, b);
    const unsigned lo = (keep_a != 0.f ? as_half : as_t) & 0xFFFFu, hi = (keep_b != 0.f ? as_half : as_t) & 0xFFFF0000u;
    return lo | hi;
}
template <typename T>
__device__ __forceinline__ float unstash(unsigned word, int c, float keep) {
    const float2 h = unpack2<half_t>(word), t = unpack2<T>(word);
    return keep != 0.f ? (c ? h.y : h.x) : (c ? t.y : t.x);
}


template <int D_TILE, int BLOCK_M, int BLOCK_N>
struct DsplitSmem {
    static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 2;
    static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 2;
    static constexpr u32 KV_PANEL = BLOCK_N * 128;
    static constexpr u32 Q_PANEL = BLOCK_M * 128;
    static constexpr u32 K = 0;
    static constexpr u32 V = K + KV_TILE;
    static constexpr u32 Q = V + KV_TILE;       // [2 stages]
    static constexpr u32 DO = Q + 2 * Q_TILE;   // [2 stages]
    static constexpr u32 PT = DO + 2 * Q_TILE;  // P^T [BLOCK_N][BLOCK_M], one panel
    static constexpr u32 DST = PT + BLOCK_N * BLOCK_M * 2;
    static constexpr u32 LSE = DST + BLOCK_N * BLOCK_M * 2;  // float [2 stages][BLOCK_M]
    static constexpr u32 DELTA = LSE + 2 * BLOCK_M * 4;
    static constexpr u32 BYTES = DELTA + 2 * BLOCK_M * 4;
};

template <typename T, int D_TILE, class Mask, int BLOCK_M, int BLOCK_N, DqAdd DQ_ADD>
__global__ void __launch_bounds__(256, 1)
flash_bwd_wgmma_dsplit(const __grid_constant__ BwdParams p) {
    typedef DsplitSmem<D_TILE, BLOCK_M, BLOCK_N> L;
    constexpr int NTHREADS = 256, NWARPS = 8;
    constexpr int HALF = D_TILE / 2;   // head-dim columns per warpgroup
    constexpr int SJ = BLOCK_M / 8;    // 8-column blocks of S^T, dP^T
    constexpr int HJ = HALF / 8;       // ... of a dK, dV or dQ half
    constexpr bool ORDERED = DQ_ADD == DqAdd::ordered;
    constexpr bool WITH_DQ = DQ_ADD != DqAdd::none;  // none: dK and dV only (flash_bwd_dq_wgmma.cu)
    typedef WgmmaKeyBlock<T, Mask, L, BLOCK_M, BLOCK_N, D_TILE, NTHREADS, ORDERED> KeyBlock;
    typedef typename KeyBlock::Walk Walk;
    static_assert(DQ_ADD != DqAdd::fixed && DQ_ADD != DqAdd::fixed_panels,
                  "fixed-point dQ needs a staging tile, and there is no room for one here");
    static_assert(BLOCK_N == 64 && BLOCK_M == 64, "one 64-row wgmma per product and warpgroup");
    // The ordered adds' counters are laid out per dense query block.
    static_assert(!Mask::PACKED || DQ_ADD == DqAdd::none || DQ_ADD == DqAdd::atomic,
                  "a packed batch adds dQ by atomics or not at all");
    static_assert(D_TILE == 256, "the head-dim halves are 128 columns: two panels");
    static_assert(L::BYTES + 1024 <= 227 * 1024, "shared memory");

    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);
    unsigned char* const smem = smem_raw + (base - smem_u32(smem_raw));
    const u32 s_k = base + L::K, s_v = base + L::V, s_pt = base + L::PT, s_dst = base + L::DST;

    const SequenceRows seq = cta_sequence<Mask>(p, blockIdx.z);
    const WgmmaBwdArgs<T> args = wgmma_bwd_args<T>(p);

    const int tid = threadIdx.x;
    const KeyBlockCoords<BLOCK_N> key_block_at(seq);
    // Past a shorter sequence's end: leave before the mask, the walk and the copies.
    if (KeyBlock::past_end(key_block_at, seq)) return;
    const KeyBlock key_block(p, seq, key_block_at, args.group);
    auto load_query_block = [&](int it, int stage) { key_block.load_query_block(it, stage, args, base, seq, tid); };
    key_block.load_key_block_and_first(p, seq, s_k, s_v, args, tid, load_query_block);

    const int wg = tid / 128, warp_in_wg = (tid / 32) % 4, lane = tid % 32;
    const int key_row = 16 * warp_in_wg + lane / 4;  // this thread's S^T / dP^T rows: key_row, +8
    float dk_acc[HJ][4], dv_acc[HJ][4];
    zero(dk_acc);
    zero(dv_acc);

    int* pending_release = nullptr;
    for (int it = 0; it < key_block.walk.iters; ++it) {
        const int stage = it & 1;
        Walk::land(it, stage, key_block.walk.iters, load_query_block);

        const int head = key_block.head(it);
        const int m_block = key_block.query_block(it), m0 = m_block * BLOCK_M;
        int* const sem = args.dq_semaphore + ((i64)key_block.batch * args.nheads + head) * key_block.q_blocks + m_block;
        int sem_seen = 0;
        if constexpr (ORDERED) sem_seen = ld_acquire_gpu(sem);
        const u32 s_q = base + L::Q + stage * L::Q_TILE, s_do = base + L::DO + stage * L::Q_TILE;
        const float* s_lse = reinterpret_cast<const float*>(smem + L::LSE) + stage * BLOCK_M;
        const float* s_delta = reinterpret_cast<const float*>(smem + L::DELTA) + stage * BLOCK_M;
        const bool partial = key_block.mask.partial(m0, BLOCK_M, key_block.n0, BLOCK_N);
        const ScoreOf<Mask, float, Tanh::EXP_RCP> score(score_problem<Mask>(p, seq), seq.index, head, args.scale);

        // Step 1: warpgroup 0 S^T = K Q^T, warpgroup 1 dP^T = V dO^T (K-major, 16 k-steps).
        float acc[SJ][4];
        {
            const u32 a_tile = wg == 0 ? s_k : s_v, b_tile = wg == 0 ? s_q : s_do;
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D_TILE / 16; ++kk)
                Wgmma<T, BLOCK_M>::template ss<0, 0>(
                    reinterpret_cast<float(&)[SJ * 4]>(acc),
                    smem_desc(a_tile + (kk / 4) * L::KV_PANEL + (kk % 4) * 32, 16, 1024),
                    smem_desc(b_tile + (kk / 4) * L::Q_PANEL + (kk % 4) * 32, 16, 1024), kk > 0);
            wgmma_commit();
        }
        // while step 1 runs
        Walk::release_and_prefetch(pending_release, lane, it, stage, key_block.walk.iters, load_query_block);
        wgmma_wait<0>();
        pin_registers(reinterpret_cast<float(&)[SJ * 4]>(acc));

        // Element (j, e) of acc is key n0 + key_row + 8 (e / 2), query m0 + 8 j + 2 (lane % 4) + e % 2;
        // its 16-bit pair (e = 0, 1 or 2, 3) is word lane % 4 of chunk j of rows key_row, key_row + 8.
        auto pair_addr = [&](u32 tile, int j, int h) {
            return tile + panel_offset<BLOCK_N>(key_row + 8 * h, j) + 4 * (lane % 4);
        };
        if (wg == 0) {
            // Step 2 (warpgroup 0): P^T = exp2(S^T scale log2(e) - lse log2(e)), 0 where hidden.
            // The score policy's transform first (score.cuh); with a derivative, warpgroup 0 hands
            // it to warpgroup 1 in float16 through the dS^T tile, the same thread's words there,
            // which step 4 reads before it overwrites them with dS^T (the previous iteration's
            // readers of the tile were waited for before this iteration's first barrier).
            const int key0 = key_block.n0 + key_row, query0 = m0 + 2 * (lane % 4);
            const typename Mask::Origin origin = key_block.mask.origin(query0, key0);
            const auto score_origin = score.origin(query0, key0, partial);
            float keep[SJ][4];  // dropout: Z, 1 kept, 0 dropped
            if constexpr (DropoutOf<Mask>::ENABLED) keep_factors(keep, DropoutOf<Mask>(p, seq.index, head), key0, query0);
#pragma unroll
            for (int j = 0; j < SJ; ++j) {
                const float2 lse2 = *reinterpret_cast<const float2*>(s_lse + 8 * j + 2 * (lane % 4));
                const float base_log2[2] = {lse_base_log2(lse2.x), lse_base_log2(lse2.y)};
                // Two copies, with and without the element mask (a block inside the mask needs none): the
                // split the compiler made itself while the shape came as kernel arguments, and no longer
                // makes with it read from BwdParams.
                float dsds[4];  // HAS_GRAD only
                auto probabilities = [&](auto masked) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float no_grad;  // ds'/ds of a policy without one (1), not kept
                        const float p_ij = recomputed_p(score, acc[j][e], score_origin, 8 * j + (e & 1), 8 * (e >> 1),
                                                        Mask::Score::HAS_GRAD ? dsds[e] : no_grad, args.scale_log2,
                                                        base_log2[e & 1]);
                        const int key_off = 8 * (e >> 1), query_off = 8 * j + (e & 1);
                        const bool hidden = key_block.mask.hidden(origin, query_off, key_off);
                        acc[j][e] = decltype(masked)::value && hidden ? 0.f : p_ij;
                    }
                };
                if (partial)
                    probabilities(Flag<true>());
                else
                    probabilities(Flag<false>());
                if constexpr (DropoutOf<Mask>::ENABLED) {
                    // Dropout (dropout.cuh): P^T gets the kept weights (dV); a dropped weight's dS^T,
                    // -P D (ds'/ds), is known here, and goes to warpgroup 1 in T through the stash
                    // words (a kept one's stash holds ds'/ds as without dropout; warpgroup 1
                    // finds the keep bits itself).
                    const float2 d2 = *reinterpret_cast<const float2*>(s_delta + 8 * j + 2 * (lane % 4));
                    float stash[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float g = Mask::Score::HAS_GRAD ? dsds[e] : 1.f;
                        stash[e] = keep[j][e] != 0.f ? g : -acc[j][e] * ((e & 1) ? d2.y : d2.x) * g;
                        acc[j][e] *= keep[j][e];
                    }
                    st_shared_b32(pair_addr(s_pt, j, 0), pack2<T>(acc[j][0], acc[j][1]));
                    st_shared_b32(pair_addr(s_pt, j, 1), pack2<T>(acc[j][2], acc[j][3]));
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        st_shared_b32(pair_addr(s_dst, j, h), stash_pair<T>(stash[2 * h], stash[2 * h + 1],
                                                                            keep[j][2 * h], keep[j][2 * h + 1]));
                    continue;
                }
                st_shared_b32(pair_addr(s_pt, j, 0), pack2<T>(acc[j][0], acc[j][1]));
                st_shared_b32(pair_addr(s_pt, j, 1), pack2<T>(acc[j][2], acc[j][3]));
                if constexpr (Mask::Score::HAS_GRAD) {
                    st_shared_b32(pair_addr(s_dst, j, 0), pack2<half_t>(dsds[0], dsds[1]));
                    st_shared_b32(pair_addr(s_dst, j, 1), pack2<half_t>(dsds[2], dsds[3]));
                }
            }
        }
        fence_proxy_async_shared();
        __syncthreads();  // P^T complete

        // Step 3: dV_g += P^T dO_g (both warpgroups; K-major A from shared memory, 4 k-steps).
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BLOCK_M / 16; ++kk)
            Wgmma<T, HALF>::template ss<0, 1>(reinterpret_cast<float(&)[HJ * 4]>(dv_acc),
                                              smem_desc(s_pt + kk * 32, 16, 1024),
                                              smem_desc(s_do + 2 * wg * L::Q_PANEL + kk * 2048, L::Q_PANEL, 1024), 1);
        wgmma_commit();

        if (wg == 1) {
            // Step 4 (warpgroup 1): dS^T = P^T o (dP^T - D) from the 16-bit P^T (0 where P^T is 0,
            // by selection: a non-finite dP^T of a hidden key must not become NaN).
            float keep[SJ][4];  // dropout: Z, the same bits as warpgroup 0's
            if constexpr (DropoutOf<Mask>::ENABLED)
                keep_factors(keep, DropoutOf<Mask>(p, seq.index, head), key_block.n0 + key_row, m0 + 2 * (lane % 4));
#pragma unroll
            for (int j = 0; j < SJ; ++j) {
                if constexpr (DropoutOf<Mask>::ENABLED) {
                    // Kept: P (Z dP / (1 - p) - D) (ds'/ds); dropped: warpgroup 0's dS^T.
                    const float2 d2 = *reinterpret_cast<const float2*>(s_delta + 8 * j + 2 * (lane % 4));
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        u32 p2, st2;
                        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(p2) : "r"(pair_addr(s_pt, j, h)));
                        st2 = ld_shared_b32(pair_addr(s_dst, j, h));
                        const float2 pk = unpack2<T>(p2);
                        const float pp[2] = {pk.x, pk.y};
#pragma unroll
                        for (int c = 0; c < 2; ++c) {
                            const int e = 2 * h + c;
                            const float stash = unstash<T>(st2, c, keep[j][e]);
                            const float g = Mask::Score::HAS_GRAD ? stash : 1.f;
                            acc[j][e] = keep[j][e] == 0.f ? stash
                                        : pp[c] == 0.f    ? 0.f
                                                          : pp[c] * (acc[j][e] * p.variant.dropout.scale - ((e & 1) ? d2.y : d2.x)) * g;
                        }
                    }
                    st_shared_b32(pair_addr(s_dst, j, 0), pack2<T>(acc[j][0], acc[j][1]));
                    st_shared_b32(pair_addr(s_dst, j, 1), pack2<T>(acc[j][2], acc[j][3]));
                    continue;
                }
                const float2 d2 = *reinterpret_cast<const float2*>(s_delta + 8 * j + 2 * (lane % 4));
                u32 p2[2];
                asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(p2[0]) : "r"(pair_addr(s_pt, j, 0)));
                asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(p2[1]) : "r"(pair_addr(s_pt, j, 1)));
                const float2 lo = unpack2<T>(p2[0]), hi = unpack2<T>(p2[1]);
                const float p16[4] = {lo.x, lo.y, hi.x, hi.y};
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    acc[j][e] = p16[e] == 0.f ? 0.f : p16[e] * (acc[j][e] - ((e & 1) ? d2.y : d2.x));
                if constexpr (Mask::Score::HAS_GRAD) {
                    const float2 g_lo = unpack2<half_t>(ld_shared_b32(pair_addr(s_dst, j, 0)));
                    const float2 g_hi = unpack2<half_t>(ld_shared_b32(pair_addr(s_dst, j, 1)));
                    acc[j][0] *= g_lo.x, acc[j][1] *= g_lo.y, acc[j][2] *= g_hi.x, acc[j][3] *= g_hi.y;
                }
                st_shared_b32(pair_addr(s_dst, j, 0), pack2<T>(acc[j][0], acc[j][1]));
                st_shared_b32(pair_addr(s_dst, j, 1), pack2<T>(acc[j][2], acc[j][3]));
            }
        }
        fence_proxy_async_shared();
        __syncthreads();  // dS^T complete

        // Step 5: dK_g += dS^T Q_g.
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BLOCK_M / 16; ++kk)
            Wgmma<T, HALF>::template ss<0, 1>(reinterpret_cast<float(&)[HJ * 4]>(dk_acc),
                                              smem_desc(s_dst + kk * 32, 16, 1024),
                                              smem_desc(s_q + 2 * wg * L::Q_PANEL + kk * 2048, L::Q_PANEL, 1024), 1);
        wgmma_commit();

        if constexpr (!WITH_DQ) {
            wgmma_wait<0>();
            pin_registers(reinterpret_cast<float(&)[HJ * 4]>(dv_acc));
            pin_registers(reinterpret_cast<float(&)[HJ * 4]>(dk_acc));
            continue;
        }

        // Step 6: dQ_g = dS K_g (A: MN-major view of dS^T, 16-key k-steps of 2048 bytes; B: K, MN-major).
        float dq_acc[HJ][4];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk)
            Wgmma<T, HALF>::template ss<1, 1>(reinterpret_cast<float(&)[HJ * 4]>(dq_acc),
                                              smem_desc(s_dst + kk * 2048, L::KV_PANEL, 1024),
                                              smem_desc(s_k + 2 * wg * L::KV_PANEL + kk * 2048, L::KV_PANEL, 1024),
                                              kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
        pin_registers(reinterpret_cast<float(&)[HJ * 4]>(dq_acc));
        pin_registers(reinterpret_cast<float(&)[HJ * 4]>(dv_acc));
        pin_registers(reinterpret_cast<float(&)[HJ * 4]>(dk_acc));
        if constexpr (ORDERED) wait_dq_turn(sem, sem_seen, key_block.n_block * NWARPS);
        const int m_lo = m0 + 16 * warp_in_wg + lane / 4, m_hi = m_lo + 8;
        float* const dqa = static_cast<float*>(args.dq_accum) + (i64)key_block.batch * args.dqa_sb +
                           (i64)head * args.dqa_sh + (i64)seq.q_begin * args.dqa_ss;
#pragma unroll
        for (int j = 0; j < HJ; ++j) {
            const int col = HALF * wg + 8 * j + 2 * (lane % 4);
            if (col < args.headdim) {
                if (m_lo < seq.seqlen_q) red_add_f32x2(dqa + m_lo * args.dqa_ss + col, dq_acc[j][0], dq_acc[j][1]);
                if (m_hi < seq.seqlen_q) red_add_f32x2(dqa + m_hi * args.dqa_ss + col, dq_acc[j][2], dq_acc[j][3]);
            }
        }
        if constexpr (ORDERED) pending_release = sem;
    }
    Walk::end(pending_release, lane);

    // Epilogue: this warpgroup's head-dim half of dK (scaled) and dV staged into the K and V tiles
    // (free once both warpgroups have walked: S^T reads all of K), then 16-byte row stores, as
    // flash_bwd_wgmma stores its own (perf log bwd-epilogue-staged).
    const float drop_scale = DropoutOf<Mask>::kept_scale(p);  // 1 / (1 - p)
    __syncthreads();
    stage_acc<T, HALF, D_TILE>(s_k, 16 * warp_in_wg, HALF * wg, dk_acc, args.scale, lane);
    stage_acc<T, HALF, D_TILE>(s_v, 16 * warp_in_wg, HALF * wg, dv_acc, drop_scale, lane);
    __syncthreads();
    store_key_block_grads<T, BLOCK_N, D_TILE, NTHREADS>(p.dk, p.dv, s_k, s_v, seq, key_block.head_kv, key_block.n0,
                                                        seq.seqlen_k, args.headdim, args.headdim_v, tid);
}

}  // namespace cf

// flash_bwd_wgmma: attention backward on Hopper warpgroup MMA (wgmma, sm_90a; fp16/bf16).
//
// The work split of flash_bwd_fused_mma.cu, on warpgroups: one CTA per (key block j, kv head,
// batch) keeps K_j and V_j in shared memory, walks every query block i of every query head of its
// GQA group (Q_i, dO_i, lse_i, D_i double-buffered by cp.async) and accumulates dK_j, dV_j in
// registers; each step's dQ_i contribution dS_ij K_j is added to dq_accum as DQ_ADD says
// (dq_add.cuh; flash_bwd_dq_convert or flash_bwd_dq_convert_fixed scales and converts it): float32
// by red.global.add in any order (atomic); float32 in ascending key-block order (ordered), through
// flash_bwd_fused_mma.cu's per-query-block counters and protocol (query blocks walked last to
// first, the counter read early, each warp's release deferred into the next iteration, behind the
// issue of its S^T and dP^T); or int64 fixed point by bulk reductions from a shared staging tile
// (fixed), exact in any order; or the same int64 adds into a panel-major dq_accum, one bulk
// reduction of 8 KiB per warp (fixed_panels). The last three give bitwise reproducible dQ; with
// none the kernel computes dK and dV only (no dS^T tile, no dQ), and flash_bwd_dq_wgmma.cu
// computes dQ.
//
// Warpgroup g owns key rows 64g..64g+63 of the block (wgmma's M is 64):
//   S^T  = K_g Q^T      (64 x BLOCK_M; A = K, B = Q, both K-major from shared memory)
//   dP^T = V_g dO^T     (same shape)
//   P^T  = exp2(S^T scale log2(e) - lse log2(e)),  dS^T = P^T o (dP^T - D)   (registers)
//   dV_g += P^T dO      (64 x D; A = P^T from registers, B = dO, MN-major)
//   dK_g += dS^T Q      (64 x D; A = dS^T from registers, B = Q, MN-major)
//   dQ   += dS K_j      (BLOCK_M x D over all BLOCK_N keys: dS^T goes through shared memory;
//                        A = dS read as the MN-major transpose of dS^T, B = K, MN-major; the
//                        64 x 64 output panels are dealt out to the warpgroups)
// Every operand read from shared memory is a 128-byte-swizzled panel tile (wgmma.cuh), the only
// layout both orientations of wgmma accept, so no tile is stored twice. The S^T and dP^T products
// are issued back to back and P^T is computed while dP^T is still running; dV and dK run while
// dS^T is stored and the warpgroups meet at the barrier before dQ.
#include "block_walk.cuh"
#include "common.cuh"
#include "cta_timeline.cuh"
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

// Shared-memory layout in bytes from a 1024-byte aligned base; cupyflash/kernels/mma_bwd.py
// (wgmma_smem_bytes) mirrors BYTES and adds the alignment slack.
template <int D_TILE, int BLOCK_M, int BLOCK_N, DqAdd DQ_ADD>
struct WgmmaSmem {
    static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 2;
    static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 2;
    static constexpr u32 KV_PANEL = BLOCK_N * 128;  // bytes of one 64-column panel
    static constexpr u32 Q_PANEL = BLOCK_M * 128;
    static constexpr u32 DS_PANEL = BLOCK_N * 128;  // dS^T [BLOCK_N][BLOCK_M]: BLOCK_M / 64 panels
    static constexpr u32 K = 0;
    static constexpr u32 V = K + KV_TILE;
    static constexpr u32 Q = V + KV_TILE;       // [2 stages]
    static constexpr u32 DO = Q + 2 * Q_TILE;   // [2 stages]
    static constexpr u32 DST = DO + 2 * Q_TILE;
    static constexpr u32 LSE = DST + BLOCK_N * BLOCK_M * 2;  // float [2 stages][BLOCK_M]
    static constexpr u32 DELTA = LSE + 2 * BLOCK_M * 4;
    // Fixed point: int64 staging rows, [BLOCK_N / 64 warpgroups][64 rows], DQ_STAGE_ROW bytes
    // apart (fixed) or 512 (fixed_panels: a warp's 16 rows are one contiguous bulk source).
    static constexpr u32 STAGE_ROW = DQ_ADD == DqAdd::fixed ? DQ_STAGE_ROW : DQ_ADD == DqAdd::fixed_panels ? 512 : 0;
    static constexpr u32 DQ_STAGE = DELTA + 2 * BLOCK_M * 4;
    static constexpr u32 BYTES = DQ_STAGE + BLOCK_N / 64 * 64 * STAGE_ROW;
};

template <typename T, int D_TILE, class Mask, int BLOCK_M, int BLOCK_N, DqAdd DQ_ADD>
__global__ void __launch_bounds__(BLOCK_N / 64 * 128, 1)
flash_bwd_wgmma(const __grid_constant__ BwdParams p) {
    // Fixed point: bulk reductions from shared memory. One panel per warpgroup per iteration in
    // every configuration (DQ_PANELS == NWG), so a staging row is reused an iteration later.
    constexpr bool PANEL_MAJOR = DQ_ADD == DqAdd::fixed_panels;
    constexpr bool STAGED = DQ_ADD == DqAdd::fixed || PANEL_MAJOR;
    typedef WgmmaSmem<D_TILE, BLOCK_M, BLOCK_N, DQ_ADD> L;
    constexpr int NWG = BLOCK_N / 64, NTHREADS = NWG * 128, NWARPS = NWG * 4;
    constexpr int SJ = BLOCK_M / 8;        // 8-column blocks of S^T, dP^T per thread
    constexpr int DJ = D_TILE / 8;         // ... of dK, dV
    constexpr int QK = BLOCK_M / 16;       // k-steps of dV, dK (over queries)
    constexpr int DQ_PANELS = (BLOCK_M / 64) * (D_TILE / 64);  // 64 x 64 dQ output panels
    constexpr bool ORDERED = DQ_ADD == DqAdd::ordered;
    constexpr bool WITH_DQ = DQ_ADD != DqAdd::none;  // none: dK and dV only (flash_bwd_dq_wgmma.cu)
    typedef WgmmaKeyBlock<T, Mask, L, BLOCK_M, BLOCK_N, D_TILE, NTHREADS, ORDERED> KeyBlock;
    typedef typename KeyBlock::Walk Walk;
    static_assert(BLOCK_N % 64 == 0 && BLOCK_M % 64 == 0 && D_TILE % 64 == 0, "64-row/column panels");
    static_assert(!WITH_DQ || DQ_PANELS % NWG == 0, "dQ panels divide among the warpgroups");
    // The ordered adds' counters and the fixed point's padded rows are laid out per dense query
    // block, their bound per dense key count.
    static_assert(!Mask::PACKED || DQ_ADD == DqAdd::none || DQ_ADD == DqAdd::atomic,
                  "a packed batch adds dQ by atomics or not at all");
    static_assert(L::BYTES + 1024 <= 227 * 1024, "shared memory");
    cta_timeline(MARK_ENTRY, threadIdx.x == 0);  // first: a CTA's setup is its prologue (dev/cta_timeline.py)

    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 base = aligned_dynamic_smem<L::BYTES>(smem_raw);
    unsigned char* const smem = smem_raw + (base - smem_u32(smem_raw));
    const u32 s_k = base + L::K, s_v = base + L::V, s_dst = base + L::DST;

    const SequenceRows seq = cta_sequence_uniform<Mask>(p, blockIdx.z);
    const WgmmaBwdArgs<T> args = wgmma_bwd_args<T>(p);

    const int tid = threadIdx.x;
    const KeyBlockCoords<BLOCK_N> key_block_at(seq);
    // Past a shorter sequence's end: leave before the mask, the walk and the copies.
    if (KeyBlock::past_end(key_block_at, seq)) return;
    const KeyBlock key_block(p, seq, key_block_at, args.group);
    auto load_query_block = [&](int it, int stage) { key_block.load_query_block(it, stage, args, base, seq, tid); };
    key_block.load_key_block_and_first(p, seq, s_k, s_v, args, tid, load_query_block);

    const int wg = tid / 128, warp_in_wg = (tid / 32) % 4, lane = tid % 32;
    float dk_acc[DJ][4], dv_acc[DJ][4];
    zero(dk_acc);
    zero(dv_acc);

    int* pending_release = nullptr;  // ORDERED: counter of the query block added last, not yet released
    const float dq_limit = fixed_limit((seq.seqlen_k + BLOCK_N - 1) / BLOCK_N);  // fixed: one add per key block
    for (int it = 0; it < key_block.walk.iters; ++it) {
        const int stage = it & 1;
        Walk::land(it, stage, key_block.walk.iters, load_query_block);  // and the previous iteration's dS^T stores
        if (it == 0) cta_timeline(MARK_FIRST_STEP, tid == 0);

        const int head = key_block.head(it);
        const int m_block = key_block.query_block(it), m0 = m_block * BLOCK_M;
        int* const sem = args.dq_semaphore + ((i64)key_block.batch * args.nheads + head) * key_block.q_blocks + m_block;
        int sem_seen = 0;  // ORDERED: the counter, read early so its latency hides behind steps 1-7
        if constexpr (ORDERED) sem_seen = ld_acquire_gpu(sem);
        const u32 s_q = base + L::Q + stage * L::Q_TILE, s_do = base + L::DO + stage * L::Q_TILE;
        const float* s_lse = reinterpret_cast<const float*>(smem + L::LSE) + stage * BLOCK_M;
        const float* s_delta = reinterpret_cast<const float*>(smem + L::DELTA) + stage * BLOCK_M;
        const bool partial = key_block.mask.partial(m0, BLOCK_M, key_block.n0, BLOCK_N);
        const ScoreOf<Mask, float, Tanh::EXP_RCP> score(score_problem<Mask>(p, seq), seq.index, head, args.scale);

        // Steps 1-2: S^T = K_g Q^T and dP^T = V_g dO^T, issued back to back (wgmma_bwd.cuh's
        // issue_st_dpt).
        float s_acc[SJ][4], dp_acc[SJ][4];
        wgmma_fence();
        issue_st_dpt<T, L, BLOCK_M, D_TILE>(s_acc, dp_acc, s_k, s_v, s_q, s_do, wg);
        // ORDERED: the previous query block's release, while the tensor cores work on S^T and
        // dP^T (measured: releasing after P^T instead, 285 vs 308 TFLOP/s at d128 16k).
        Walk::release_and_prefetch(pending_release, lane, it, stage, key_block.walk.iters, load_query_block);
        wgmma_wait<1>();
        pin_registers(reinterpret_cast<float(&)[SJ * 4]>(s_acc));

        // Steps 3-4: P^T, then dS^T = P^T o (dP^T - D), packed as dV's and dK's A fragments
        // (wgmma_bwd.cuh's probabilities_and_ds_t).
        const int key_row = 64 * wg + 16 * warp_in_wg + lane / 4;  // within the block
        u32 p_frag[QK][4], ds_frag[QK][4];
        probabilities_and_ds_t<T, Mask, BLOCK_M, BLOCK_N>(p_frag, ds_frag, s_acc, dp_acc, key_block, score, partial, m0,
                                                          key_row, s_lse, s_delta, s_dst, args.scale_log2, p,
                                                          seq.index, head, lane);

        // Step 5: dS^T to shared memory for dQ (which needs every warpgroup's key rows); the pair
        // (row, 8j + 2 (lane % 4)) is word lane % 4 of chunk j.
        if constexpr (WITH_DQ) {
#pragma unroll
            for (int kk = 0; kk < QK; ++kk)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int chunk = 2 * kk + h;
                    st_shared_b32(s_dst + panel_offset<BLOCK_N>(key_row, chunk) + 4 * (lane % 4), ds_frag[kk][2 * h]);
                    st_shared_b32(s_dst + panel_offset<BLOCK_N>(key_row + 8, chunk) + 4 * (lane % 4),
                                  ds_frag[kk][2 * h + 1]);
                }
        }

        // Steps 6-7: dV_g += P^T dO, dK_g += dS^T Q (wgmma_bwd.cuh's issue_dv_dk).
        wgmma_fence();
        issue_dv_dk<T, L, D_TILE>(dv_acc, dk_acc, p_frag, ds_frag, s_do, s_q);
        if constexpr (!WITH_DQ) {  // the next barrier's copies overwrite the Q and dO that dK, dV read
            wgmma_wait<0>();
            pin_registers(reinterpret_cast<float(&)[DJ * 4]>(dv_acc));
            pin_registers(reinterpret_cast<float(&)[DJ * 4]>(dk_acc));
            continue;
        }
        fence_proxy_async_shared();
        __syncthreads();  // dS^T complete

        // Step 8: dQ_i += dS K_j, 64 x 64 panels (query panel qp, head-dim panel dp); A = dS is the
        // MN-major view of dS^T panel qp, B = K_j panel dp (MN-major), k-steps of 16 keys.
        const i64 dqa_head =
            (i64)key_block.batch * args.dqa_sb + (i64)head * args.dqa_sh + (i64)seq.q_begin * args.dqa_ss;
        float* const dqa = static_cast<float*>(args.dq_accum) + dqa_head;  // float adds
        float* const row_scale = args.dq_row_scale + seq.stat(args.stat_dims, head, 0);  // fixed
#pragma unroll 1
        for (int panel = wg; panel < DQ_PANELS; panel += NWG) {
            const int qp = panel / (D_TILE / 64), dp = panel % (D_TILE / 64);
            float dq_acc[8][4];
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk)
                Wgmma<T, 64>::template ss<1, 1>(reinterpret_cast<float(&)[32]>(dq_acc),
                                                smem_desc(s_dst + qp * L::DS_PANEL + kk * 2048, L::DS_PANEL, 1024),
                                                smem_desc(s_k + dp * L::KV_PANEL + kk * 2048, L::KV_PANEL, 1024), kk > 0);
            wgmma_commit();
            const int m_lo = m0 + 64 * qp + 16 * warp_in_wg + lane / 4, m_hi = m_lo + 8;
            float scale_lo = 0.f, scale_hi = 0.f;  // fixed: the rows' scales, loaded while dQ runs
            if constexpr (STAGED) {
                if (m_lo < seq.seqlen_q) scale_lo = row_scale[m_lo];
                if (m_hi < seq.seqlen_q) scale_hi = row_scale[m_hi];
            }
            wgmma_wait<0>();
            pin_registers(reinterpret_cast<float(&)[32]>(dq_acc));
            if constexpr (PANEL_MAJOR) {
                // Fixed point, panel-major dq_accum ([batch][head][D_TILE / 64 panels][rows][64];
                // dqa_sp is the panel stride): a warp's 16 rows of the panel are 8 KiB of
                // contiguous int64 there, staged in the same order and added by one bulk reduction
                // (fixed issues 16 of 512 bytes, which the uniform datapath serialises: measured,
                // a third of fixed's stall samples). A quarter-warp stores rows g and g + 1, 512
                // bytes apart; odd rows take the column blocks in the order j ^ 1, so the two rows
                // fall on opposite halves of the banks (4 wavefronts per store, the minimum). The
                // warp's staging is free again once its last reduction has read it (lane 0 waits).
                const u32 s_warp = base + L::DQ_STAGE + (wg * 64 + 16 * warp_in_wg) * L::STAGE_ROW;
                if (lane == 0) bulk_wait_read_all();
                __syncwarp();
                const int flip = (lane / 4) & 1;
                bool bad_lo = false, bad_hi = false;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    float x[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) x[e] = flip ? dq_acc[j ^ 1][e] : dq_acc[j][e];
                    const u32 at = s_warp + (lane / 4) * L::STAGE_ROW + 64 * (j ^ flip) + 16 * (lane % 4);
                    st_shared_v2_b64(at, to_fixed(x[0], scale_lo, dq_limit, bad_lo),
                                     to_fixed(x[1], scale_lo, dq_limit, bad_lo));
                    st_shared_v2_b64(at + 8 * L::STAGE_ROW, to_fixed(x[2], scale_hi, dq_limit, bad_hi),
                                     to_fixed(x[3], scale_hi, dq_limit, bad_hi));
                }
                if (bad_lo && m_lo < seq.seqlen_q) poison_dq_row(row_scale + m_lo);
                if (bad_hi && m_hi < seq.seqlen_q) poison_dq_row(row_scale + m_hi);
                fence_proxy_async_shared();  // the stores, visible to the TMA unit's reads
                __syncwarp();
                if (lane == 0) {
                    // Rows past seqlen_q (zero contributions) land in the buffer's padding rows.
                    const int m = m0 + 64 * qp + 16 * warp_in_wg;
                    if (m < seq.seqlen_q)
                        bulk_reduce_add_s64(
                            static_cast<long long*>(args.dq_accum) + dqa_head + dp * args.dqa_sp + m * args.dqa_ss,
                            s_warp, 16 * L::STAGE_ROW);
                    bulk_commit();
                }
            } else if constexpr (STAGED) {
                // Fixed point: each warp converts its 16 rows of the panel to int64 in the
                // warpgroup's staging tile, and its lanes 0-15 hand them to the TMA unit, one bulk
                // reduction per row. A warp writes and issues only its own rows, so it syncs with
                // itself only; a row is free once the reduction issued from it last time has read
                // it (its issuer waits).
                const u32 s_stage = base + L::DQ_STAGE + wg * 64 * DQ_STAGE_ROW;
                if (lane < 16) bulk_wait_read_all();
                __syncwarp();
                const int r_lo = 16 * warp_in_wg + lane / 4;
                bool bad_lo = false, bad_hi = false;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const u32 at = s_stage + r_lo * DQ_STAGE_ROW + 64 * j + 16 * (lane % 4);
                    st_shared_v2_b64(at, to_fixed(dq_acc[j][0], scale_lo, dq_limit, bad_lo),
                                     to_fixed(dq_acc[j][1], scale_lo, dq_limit, bad_lo));
                    st_shared_v2_b64(at + 8 * DQ_STAGE_ROW, to_fixed(dq_acc[j][2], scale_hi, dq_limit, bad_hi),
                                     to_fixed(dq_acc[j][3], scale_hi, dq_limit, bad_hi));
                }
                if (bad_lo && m_lo < seq.seqlen_q) poison_dq_row(row_scale + m_lo);
                if (bad_hi && m_hi < seq.seqlen_q) poison_dq_row(row_scale + m_hi);
                fence_proxy_async_shared();  // the stores, visible to the TMA unit's reads
                __syncwarp();
                if (lane < 16) {
                    const int row = 16 * warp_in_wg + lane, m = m0 + 64 * qp + row;
                    if (m < seq.seqlen_q)
                        bulk_reduce_add_s64(
                            static_cast<long long*>(args.dq_accum) + dqa_head + m * args.dqa_ss + 64 * dp,
                            s_stage + row * DQ_STAGE_ROW, 64 * 8);
                    bulk_commit();
                }
            } else {
                // ORDERED: this query block's turn comes when all NWARPS warps of key blocks
                // 0..n_block-1 have released it.
                if constexpr (ORDERED) wait_dq_turn(sem, sem_seen, key_block.n_block * NWARPS);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int col = 64 * dp + 8 * j + 2 * (lane % 4);
                    if (col < args.headdim) {
                        if (m_lo < seq.seqlen_q)
                            red_add_f32x2(dqa + m_lo * args.dqa_ss + col, dq_acc[j][0], dq_acc[j][1]);
                        if (m_hi < seq.seqlen_q)
                            red_add_f32x2(dqa + m_hi * args.dqa_ss + col, dq_acc[j][2], dq_acc[j][3]);
                    }
                }
            }
        }
        wgmma_wait<0>();
        pin_registers(reinterpret_cast<float(&)[DJ * 4]>(dv_acc));
        pin_registers(reinterpret_cast<float(&)[DJ * 4]>(dk_acc));
        if constexpr (ORDERED) pending_release = sem;
    }
    Walk::end(pending_release, lane);
    cta_timeline(MARK_WALKED, tid == 0, key_block.walk.iters);

    // Epilogue: dK = scale dS^T Q summed, and dV (times dropout's 1 / (1 - p)), staged through the
    // K and V tiles for 16-byte row stores, as the mma.sync kernels store theirs. The tiles are free
    // once every warpgroup has walked (dQ's products read all of K to the last step). Straight from
    // the accumulators, a warp's 4-byte stores to 8 rows at a time held a CTA 8-10 k cycles, 2.7
    // steps of a 32-step walk (perf log bwd-epilogue-staged).
    const int warp_row0 = 64 * wg + 16 * warp_in_wg;
    const float dv_scale = DropoutOf<Mask>::kept_scale(p);  // 1 / (1 - p)
    __syncthreads();
    stage_acc<T, D_TILE, D_TILE>(s_k, warp_row0, 0, dk_acc, args.scale, lane);
    stage_acc<T, D_TILE, D_TILE>(s_v, warp_row0, 0, dv_acc, dv_scale, lane);
    __syncthreads();
    store_key_block_grads<T, BLOCK_N, D_TILE, NTHREADS>(p.dk, p.dv, s_k, s_v, seq, key_block.head_kv, key_block.n0,
                                                        seq.seqlen_k, args.headdim, args.headdim_v, tid);
    // Fixed point: the staging tiles must outlive the bulk reductions' reads of them.
    if constexpr (STAGED) {
        if (lane < 16) bulk_wait_read_all();
    }
    cta_timeline(MARK_EXIT, tid == 0);
}

}  // namespace cf

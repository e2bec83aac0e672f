// flash_bwd_mma: attention backward on tensor cores (mma.sync m16n8k16), fp16/bf16, sm_80 and sm_90.
// FlashAttention-2 work split; P and dS are recomputed from the saved lse, never stored globally.
//
//   flash_bwd_dkdv_mma    one CTA per (key block j, kv head, batch). K_j and V_j stay in shared
//                         memory while the CTA walks every query block i of every query head of its
//                         GQA group (Q_i, dO_i, lse_i, D_i double-buffered by cp.async) and keeps
//                         dK_j, dV_j in registers, so the sum over the group is deterministic.
//                         With DqAdd::atomic it also adds dS_ij K_j to a float32 dq_accum by red.add
//                         (DqAdd::none: no dQ, flash_bwd_dq_mma computes it).
//   flash_bwd_dq_mma      one CTA per (query block i, head, batch) walking the key blocks: dQ_i with
//                         no atomics (bitwise reproducible), at the price of recomputing S and dP.
//   flash_bwd_dq_mma_v2   the same with 2 x 16 query rows per warp: half the K_j, V_j reads per mma.
//   flash_bwd_dkdv_mma_v2 flash_bwd_dkdv_mma with 2 x 16 key rows per warp (head dim 64).
//   flash_bwd_dkdv_mma_split  warp pairs over 2 x 16 key rows, one warp for dV, one for dK (d128).
//   flash_bwd_dq_convert  dq = scale * dq_accum in the input dtype, after the atomic path.
//
// Warp split of flash_bwd_dkdv_mma: warp w owns 16 key rows (w / WARPS_D) and head-dim slice
// (w % WARPS_D) of dK_j and dV_j. It computes the transposed scores S^T = K_j Q_i^T and
// dP^T = V_j dO_i^T of its 16 key rows, so the accumulator fragments of P^T and dS^T repack
// directly into the A operands of dV += P^T dO_i and dK += dS^T Q_i (see mma.cuh): neither goes
// through shared memory. Only dQ += dS K_j, which sums over the key rows of all warps, reads dS
// from shared memory. A query block of BLOCK_M rows (one pipeline stage) is processed in steps of
// M_SUB query columns, sized so that S^T and dP^T of a step fit next to dK_j and dV_j in
// registers. With WARPS_D = 2 (head dim 256: 16 rows of dK and dV at full width would need 256
// accumulator registers per thread) the two warps of a key-row group each reduce S^T and dP^T
// over their half of the head dim and swap the partial sums through shared memory.
//
// Every shared tile row of 16-bit values is swizzled (mma.cuh), so all ldmatrix reads and all
// fragment-sized writes are free of bank conflicts.
//
// The mask is the policy's (mask.cuh): a dK/dV CTA walks only the query blocks that see some key
// of its block, a dQ CTA only the key blocks that some of its rows see; blocks outside a window
// are never loaded. Rows of a visited block that see none of its keys get P = 0 by selection.
#include "common.cuh"
#include "dq_add.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "mma_bwd.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"

namespace cf {

// ---------------------------------------------------------------------------------------------
// dK, dV (and optionally dQ by atomics)
// ---------------------------------------------------------------------------------------------

// Shared-memory layout of flash_bwd_dkdv_mma, in bytes; cupyflash/backward_plans.py
// (dkdv_smem_bytes) computes the same total.
template <int D_TILE, int BLOCK_M, int M_SUB, int BLOCK_N, int NWARPS, int WARPS_D, DqAdd DQ_ADD>
struct DkdvSmem {
    static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 2;
    static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 2;
    static constexpr u32 K = 0;
    static constexpr u32 V = K + KV_TILE;
    static constexpr u32 Q = V + KV_TILE;    // [2 stages]
    static constexpr u32 DO = Q + 2 * Q_TILE;  // [2 stages]
    static constexpr u32 DS = DO + 2 * Q_TILE;  // dS^T [BLOCK_N][BLOCK_M], 16-bit
    static constexpr u32 XCHG = DS + (DQ_ADD == DqAdd::atomic ? BLOCK_N * BLOCK_M * 2 : 0);
    // per warp: its partial S^T then dP^T, one float4 per (C fragment, lane)
    static constexpr u32 XCHG_WARP = (WARPS_D > 1 ? 2 * (M_SUB / 8) * 32 * 16 : 0);
    static constexpr u32 LSE = XCHG + NWARPS * XCHG_WARP;  // float [2 stages][BLOCK_M]
    static constexpr u32 DELTA = LSE + 2 * BLOCK_M * 4;    // float [2 stages][BLOCK_M]
    static constexpr u32 BYTES = DELTA + 2 * BLOCK_M * 4;
};

template <typename T, int D_TILE, class Mask, int BLOCK_M, int M_SUB, int BLOCK_N, int NWARPS,
          int WARPS_D, DqAdd DQ_ADD>
__global__ void __launch_bounds__(NWARPS * 32, 1)
flash_bwd_dkdv_mma(const __grid_constant__ BwdParams p) {
    static_assert(DQ_ADD == DqAdd::atomic || DQ_ADD == DqAdd::none, "dQ by float32 atomics or by flash_bwd_dq_mma");
    constexpr bool ATOMIC_DQ = DQ_ADD == DqAdd::atomic;
    typedef DkdvSmem<D_TILE, BLOCK_M, M_SUB, BLOCK_N, NWARPS, WARPS_D, DQ_ADD> L;
    constexpr int NTHREADS = NWARPS * 32;
    constexpr int DW = D_TILE / WARPS_D;  // dK, dV columns per warp
    constexpr int DQ_WARPS_M = BLOCK_M / 16;
    constexpr int DQ_COLS = D_TILE / (NWARPS / DQ_WARPS_M);  // dQ columns per warp (DqAdd::atomic)
    constexpr int DQ_PASS = DQ_COLS < 32 ? DQ_COLS : 32;
    static_assert(BLOCK_N == 16 * NWARPS / WARPS_D, "one 16-row key group per warp (pair)");
    static_assert(WARPS_D == 1 || WARPS_D == 2, "head-dim split into 1 or 2 slices");
    static_assert(BLOCK_M % M_SUB == 0 && M_SUB % 16 == 0 && DW % 16 == 0, "m16n8k16 tiles");
    static_assert(!ATOMIC_DQ || (NWARPS % DQ_WARPS_M == 0 && DQ_COLS % DQ_PASS == 0 && DQ_PASS % 16 == 0),
                  "dQ warp grid");
    static_assert(L::BYTES <= 227 * 1024, "shared memory");

    extern __shared__ __align__(128) unsigned char smem[];
    if (dynamic_smem_bytes() < L::BYTES) __trap();
    const u32 base = smem_u32(smem);
    const u32 s_k = base + L::K, s_v = base + L::V, s_ds = base + L::DS, s_xchg = base + L::XCHG;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int key_group = warp / WARPS_D, d_part = warp % WARPS_D;
    const int row0 = 16 * key_group;  // this warp's key rows within the block
    const int n0 = blockIdx.x * BLOCK_N, head_kv = blockIdx.y, batch = blockIdx.z;
    // The run-time arguments, read once here (bwd_args in mma_bwd.cuh says why).
    const int seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k, nheads = p.nheads, group = p.group, headdim = p.headdim;
    const float scale_log2 = p.scale_log2, scale = p.scale;
    const TensorRows q = p.q, k = p.k, v = p.v, dout = p.dout, dk = p.dk, dv = p.dv, dq_accum = p.dq_accum;
    const float* __restrict__ lse = static_cast<const float*>(p.lse);
    const float* __restrict__ delta = static_cast<const float*>(p.delta);
    const Mask mask(seqlen_q, seqlen_k, p.window_left, p.window_right);

    // Query blocks [m_block_first, m_block_end) see some key of this block (mask.cuh); the others
    // are never loaded.
    const int m_block_first = mask.query_begin(n0) / BLOCK_M;
    const int m_block_end = (mask.query_end(n0, BLOCK_N) + BLOCK_M - 1) / BLOCK_M;
    const int m_blocks = max(0, m_block_end - m_block_first);
    const int n_iters = group * m_blocks;  // (query head of the group, query block) pairs

    auto load_query_block = [&](int it, int stage) {
        const int head = head_kv * group + it / m_blocks;
        const int m0 = (m_block_first + it % m_blocks) * BLOCK_M;
        cp_async_tile<BLOCK_M, D_TILE, NTHREADS>(base + L::Q + stage * L::Q_TILE,
                                                 q.row<const T>(batch, m0, head),
                                                 seqlen_q - m0, headdim, q.row_stride, tid);
        cp_async_tile<BLOCK_M, D_TILE, NTHREADS>(base + L::DO + stage * L::Q_TILE,
                                                 dout.row<const T>(batch, m0, head),
                                                 seqlen_q - m0, headdim, dout.row_stride, tid);
        cp_async_row_stats<BLOCK_M, NTHREADS>(base + L::LSE, base + L::DELTA, stage, lse, delta,
                                               ((i64)batch * nheads + head) * seqlen_q + m0, m0, seqlen_q, tid);
    };

    // Prologue: K_j, V_j and the first query block in one group.
    cp_async_tile<BLOCK_N, D_TILE, NTHREADS>(s_k, k.row<const T>(batch, n0, head_kv), seqlen_k - n0, headdim,
                                             k.row_stride, tid);
    cp_async_tile<BLOCK_N, D_TILE, NTHREADS>(s_v, v.row<const T>(batch, n0, head_kv), seqlen_k - n0, headdim,
                                             v.row_stride, tid);
    if (n_iters > 0) load_query_block(0, 0);
    cp_async_commit();

    float dk_acc[DW / 8][4], dv_acc[DW / 8][4];
    zero(dk_acc);
    zero(dv_acc);

    for (int it = 0; it < n_iters; ++it) {
        const int stage = it & 1;
        // The wait lands this block's copies; the barrier makes every thread's copies visible and
        // guarantees that all warps are done with iteration it - 1 (stage ^ 1 and the dS tile).
        cp_async_wait<0>();
        __syncthreads();
        if (it + 1 < n_iters) load_query_block(it + 1, stage ^ 1);
        cp_async_commit();

        const int head = head_kv * group + it / m_blocks;
        const int m0 = (m_block_first + it % m_blocks) * BLOCK_M;
        const u32 s_q = base + L::Q + stage * L::Q_TILE, s_do = base + L::DO + stage * L::Q_TILE;
        const float* s_lse = reinterpret_cast<const float*>(smem + L::LSE) + stage * BLOCK_M;
        const float* s_delta = reinterpret_cast<const float*>(smem + L::DELTA) + stage * BLOCK_M;

        // Steps 1-6 per sub-block of M_SUB query columns, one after the other: the S^T and dP^T
        // fragments of a sub-block are what the registers left by dK_j, dV_j can hold.
#pragma unroll 1
        for (int mc0 = 0; mc0 < BLOCK_M; mc0 += M_SUB) {
            const u32 s_q_sub = s_q + mc0 * (D_TILE * 2), s_do_sub = s_do + mc0 * (D_TILE * 2);
            const int m0_sub = m0 + mc0;
            const bool partial = mask.partial(m0_sub, M_SUB, n0, BLOCK_N);

            // Step 1: S^T = K_j Q^T for this warp's key rows (over its head-dim slice if WARPS_D = 2).
            float s_acc[M_SUB / 8][4];
            zero(s_acc);
            mma_ABt<T, M_SUB, DW, D_TILE, D_TILE>(s_acc, s_k, row0, s_q_sub, d_part * DW, lane);
            if constexpr (WARPS_D == 2) swap_partial_sums(s_acc, s_xchg, L::XCHG_WARP, warp, key_group, lane);

            // Step 2: P^T = exp2(S^T scale log2(e) - lse log2(e)); entries are (key row, query
            // column), so lse is per column. Hidden entries are set to 0 by selection, not by
            // multiplication, so that a non-finite score there cannot leak; blocks inside the mask
            // run an instance without the test (masked_or_not, mma_bwd.cuh; likewise in step 5).
#pragma unroll
            for (int j = 0; j < M_SUB / 8; ++j) {
                const int c = 8 * j + 2 * (lane % 4);
                const float2 lse2 = *reinterpret_cast<const float2*>(s_lse + mc0 + c);
                const float base_log2[2] = {lse_base_log2(lse2.x), lse_base_log2(lse2.y)};
                masked_or_not(partial, [&](auto masked) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const bool hidden =
                            masked.value && !mask.visible(m0_sub + c + (e & 1), n0 + row0 + lane / 4 + 8 * (e >> 1));
                        const float p = recomputed_p(s_acc[j][e], scale_log2, base_log2[e & 1]);
                        s_acc[j][e] = hidden ? 0.f : p;
                    }
                });
            }

            // Step 3: dV_j += P^T dO on this warp's head-dim slice.
            {
                u32 p_frag[M_SUB / 16][4];
                pack_a_frags<T, M_SUB>(p_frag, s_acc);
                mma_AB_regs<T, DW, M_SUB, D_TILE>(dv_acc, p_frag, s_do_sub, d_part * DW, lane);
            }

            // Step 4: dP^T = V_j dO^T.
            float dp_acc[M_SUB / 8][4];
            zero(dp_acc);
            mma_ABt<T, M_SUB, DW, D_TILE, D_TILE>(dp_acc, s_v, row0, s_do_sub, d_part * DW, lane);
            if constexpr (WARPS_D == 2)
                swap_partial_sums(dp_acc, s_xchg + M_SUB / 8 * 512, L::XCHG_WARP, warp, key_group, lane);

            // Step 5: dS^T = P^T o (dP^T - D), D per column (P^T is already 0 where hidden).
#pragma unroll
            for (int j = 0; j < M_SUB / 8; ++j) {
                const int c = 8 * j + 2 * (lane % 4);
                const float2 d2 = *reinterpret_cast<const float2*>(s_delta + mc0 + c);
                masked_or_not(partial, [&](auto masked) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const bool hidden =
                            masked.value && !mask.visible(m0_sub + c + (e & 1), n0 + row0 + lane / 4 + 8 * (e >> 1));
                        const float ds = s_acc[j][e] * (dp_acc[j][e] - ((e & 1) ? d2.y : d2.x));
                        dp_acc[j][e] = hidden ? 0.f : ds;
                    }
                });
            }
            u32 ds_frag[M_SUB / 16][4];
            pack_a_frags<T, M_SUB>(ds_frag, dp_acc);

            // Step 6: dK_j += dS^T Q.
            mma_AB_regs<T, DW, M_SUB, D_TILE>(dk_acc, ds_frag, s_q_sub, d_part * DW, lane);

            // dS^T to shared memory for step 7 (both warps of a pair hold the same values).
            if (ATOMIC_DQ && d_part == 0) {
                const int r = row0 + lane / 4, c = 2 * (lane % 4);
#pragma unroll
                for (int kk = 0; kk < M_SUB / 16; ++kk) {
                    const int chunk = mc0 / 8 + 2 * kk;
                    st_shared_b32(s_ds + tile_offset<BLOCK_M>(r, chunk) + 2 * c, ds_frag[kk][0]);
                    st_shared_b32(s_ds + tile_offset<BLOCK_M>(r + 8, chunk) + 2 * c, ds_frag[kk][1]);
                    st_shared_b32(s_ds + tile_offset<BLOCK_M>(r, chunk + 1) + 2 * c, ds_frag[kk][2]);
                    st_shared_b32(s_ds + tile_offset<BLOCK_M>(r + 8, chunk + 1) + 2 * c, ds_frag[kk][3]);
                }
            }
        }

        // Step 7 (DqAdd::atomic): dq_accum += dS K_j, dS read back from shared memory. Warps tile the
        // query block by 16 rows x DQ_COLS columns, in passes of DQ_PASS columns (registers again),
        // each reduced over all BLOCK_N keys and added to dq_accum by red.global.add.
        if constexpr (ATOMIC_DQ) {
            __syncthreads();
            const int q_row0 = 16 * (warp % DQ_WARPS_M);
            const int m_lo = m0 + q_row0 + lane / 4, m_hi = m_lo + 8;
            float* dqa = dq_accum.head_rows<float>(batch, head);  // float32 rows (panel stride 64)
            const i64 dqa_ss = dq_accum.row_stride;
#pragma unroll 1
            for (int col0 = DQ_COLS * (warp / DQ_WARPS_M); col0 < DQ_COLS * (warp / DQ_WARPS_M + 1);
                 col0 += DQ_PASS) {
                float dq_acc[DQ_PASS / 8][4];
                zero(dq_acc);
                mma_AtB<T, DQ_PASS, BLOCK_N, BLOCK_M, D_TILE>(dq_acc, s_ds, q_row0, s_k, col0, lane);
#pragma unroll
                for (int j = 0; j < DQ_PASS / 8; ++j) {
                    const int col = col0 + 8 * j + 2 * (lane % 4);
                    if (col < headdim) {
                        if (m_lo < seqlen_q) red_add_f32x2(dqa + m_lo * dqa_ss + col, dq_acc[j][0], dq_acc[j][1]);
                        if (m_hi < seqlen_q) red_add_f32x2(dqa + m_hi * dqa_ss + col, dq_acc[j][2], dq_acc[j][3]);
                    }
                }
            }
        }
    }

    // Epilogue: dK = scale dS^T Q summed, dV; staged through the K and V tiles for 16-byte stores.
    cp_async_wait<0>();
    __syncthreads();
    stage_acc<T, DW, D_TILE>(s_k, row0, d_part * DW, dk_acc, scale, lane);
    stage_acc<T, DW, D_TILE>(s_v, row0, d_part * DW, dv_acc, 1.f, lane);
    __syncthreads();
    store_tile<BLOCK_N, D_TILE, NTHREADS>(dk.row<T>(batch, n0, head_kv), s_k, seqlen_k - n0, headdim,
                                          dk.row_stride, tid);
    store_tile<BLOCK_N, D_TILE, NTHREADS>(dv.row<T>(batch, n0, head_kv), s_v, seqlen_k - n0, headdim,
                                          dv.row_stride, tid);
}

// ---------------------------------------------------------------------------------------------
// dQ without atomics
// ---------------------------------------------------------------------------------------------

template <int D_TILE, int BLOCK_M, int BLOCK_N>
struct DqSmem {
    static constexpr u32 Q_TILE = BLOCK_M * D_TILE * 2;
    static constexpr u32 KV_TILE = BLOCK_N * D_TILE * 2;
    static constexpr u32 Q = 0;
    static constexpr u32 DO = Q + Q_TILE;
    static constexpr u32 K = DO + Q_TILE;      // [2 stages]
    static constexpr u32 V = K + 2 * KV_TILE;  // [2 stages]
    static constexpr u32 BYTES = V + 2 * KV_TILE;
};

template <typename T, int D_TILE, class Mask, int BLOCK_M, int BLOCK_N, int NWARPS>
__global__ void __launch_bounds__(NWARPS * 32, 1)
flash_bwd_dq_mma(const __grid_constant__ BwdParams p) {
    typedef DqSmem<D_TILE, BLOCK_M, BLOCK_N> L;
    constexpr int NTHREADS = NWARPS * 32;
    static_assert(BLOCK_M == 16 * NWARPS, "16 query rows per warp");
    static_assert(BLOCK_N % 16 == 0 && D_TILE % 16 == 0, "m16n8k16 tiles");
    static_assert(L::BYTES <= 227 * 1024, "shared memory");

    extern __shared__ __align__(128) unsigned char smem[];
    if (dynamic_smem_bytes() < L::BYTES) __trap();
    const u32 base = smem_u32(smem);
    const u32 s_q = base + L::Q, s_do = base + L::DO;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int row0 = 16 * warp;  // this warp's query rows within the block
    // The run-time arguments, read once here (bwd_args in mma_bwd.cuh says why).
    const int seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k, nheads = p.nheads, headdim = p.headdim;
    const float scale_log2 = p.scale_log2, scale = p.scale;
    const TensorRows q = p.q, k = p.k, v = p.v, dout = p.dout, dq = p.dq;
    const float* __restrict__ lse = static_cast<const float*>(p.lse);
    const float* __restrict__ delta = static_cast<const float*>(p.delta);
    const Mask mask(seqlen_q, seqlen_k, p.window_left, p.window_right);
    const int m0 = Mask::query_block(blockIdx.x, gridDim.x) * BLOCK_M;
    const int head = blockIdx.y, batch = blockIdx.z, head_kv = head / p.group;

    // Key blocks [j_begin, j_end) hold the keys some existing row of the block sees (mask.cuh);
    // K_j and V_j sit in stage j % 2, whichever block the walk starts at.
    const int j_begin = mask.key_begin(m0) / BLOCK_N;
    const int j_end = (mask.key_end(m0, min(BLOCK_M, seqlen_q - m0)) + BLOCK_N - 1) / BLOCK_N;

    const T* k_head = k.head_rows<const T>(batch, head_kv);
    const T* v_head = v.head_rows<const T>(batch, head_kv);
    const i64 k_ss = k.row_stride, v_ss = v.row_stride;
    auto load_key_block = [&](int j, int stage) {
        const int n0 = j * BLOCK_N;
        cp_async_tile<BLOCK_N, D_TILE, NTHREADS>(base + L::K + stage * L::KV_TILE, k_head + n0 * k_ss,
                                                 seqlen_k - n0, headdim, k_ss, tid);
        cp_async_tile<BLOCK_N, D_TILE, NTHREADS>(base + L::V + stage * L::KV_TILE, v_head + n0 * v_ss,
                                                 seqlen_k - n0, headdim, v_ss, tid);
    };

    cp_async_tile<BLOCK_M, D_TILE, NTHREADS>(s_q, q.row<const T>(batch, m0, head), seqlen_q - m0, headdim,
                                             q.row_stride, tid);
    cp_async_tile<BLOCK_M, D_TILE, NTHREADS>(s_do, dout.row<const T>(batch, m0, head), seqlen_q - m0, headdim,
                                             dout.row_stride, tid);
    if (j_begin < j_end) load_key_block(j_begin, j_begin & 1);
    cp_async_commit();

    // Per-row statistics of this lane's two accumulator rows (lane / 4 and lane / 4 + 8), by ldg
    // (bwd_args in mma_bwd.cuh).
    float base_log2[2], d[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int m = m0 + row0 + lane / 4 + 8 * half;
        const i64 stat = ((i64)batch * nheads + head) * seqlen_q + m;
        base_log2[half] = m < seqlen_q ? lse_base_log2(ldg(lse + stat)) : 0.f;
        d[half] = m < seqlen_q ? ldg(delta + stat) : 0.f;
    }

    float dq_acc[D_TILE / 8][4];
    zero(dq_acc);

    for (int j = j_begin; j < j_end; ++j) {
        const int stage = j & 1;
        // As in flash_bwd_dkdv_mma: lands block j, and all warps are done with block j - 1.
        cp_async_wait<0>();
        __syncthreads();
        if (j + 1 < j_end) load_key_block(j + 1, stage ^ 1);
        cp_async_commit();

        const int n0 = j * BLOCK_N;
        const u32 s_k = base + L::K + stage * L::KV_TILE, s_v = base + L::V + stage * L::KV_TILE;

        // Step 1: S = Q_i K_j^T, dP = dO_i V_j^T for this warp's 16 query rows.
        float s_acc[BLOCK_N / 8][4], dp_acc[BLOCK_N / 8][4];
        zero(s_acc);
        zero(dp_acc);
        mma_ABt<T, BLOCK_N, D_TILE, D_TILE, D_TILE>(s_acc, s_q, row0, s_k, 0, lane);
        mma_ABt<T, BLOCK_N, D_TILE, D_TILE, D_TILE>(dp_acc, s_do, row0, s_v, 0, lane);

        // Step 2: dS = P o (dP - D) with P = exp2(S scale log2(e) - lse log2(e)); lse, D per row.
        const bool partial = mask.partial(m0, BLOCK_M, n0, BLOCK_N);
#pragma unroll
        for (int f = 0; f < BLOCK_N / 8; ++f) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = recomputed_p(s_acc[f][e], scale_log2, base_log2[e >> 1]);
                const float ds = p * (dp_acc[f][e] - d[e >> 1]);
                const bool hidden = partial && !mask.visible(m0 + row0 + lane / 4 + 8 * (e >> 1),
                                                             n0 + 8 * f + 2 * (lane % 4) + (e & 1));
                dp_acc[f][e] = hidden ? 0.f : ds;
            }
        }
        u32 ds_frag[BLOCK_N / 16][4];
        pack_a_frags<T, BLOCK_N>(ds_frag, dp_acc);

        // Step 3: dQ_i += dS K_j.
        mma_AB_regs<T, D_TILE, BLOCK_N, D_TILE>(dq_acc, ds_frag, s_k, 0, lane);
    }

    // Epilogue: dQ = scale dS K, staged through this warp's own rows of the Q tile (no other warp
    // reads them; the barrier covers the case of no key block, where copies may still be landing).
    cp_async_wait<0>();
    __syncthreads();
    stage_acc<T, D_TILE, D_TILE>(s_q, row0, 0, dq_acc, scale, lane);
    __syncwarp();
    T* dq_rows = dq.row<T>(batch, m0 + row0, head);
    store_tile<16, D_TILE, 32>(dq_rows, s_q + tile_offset<D_TILE>(row0, 0), seqlen_q - m0 - row0, headdim,
                               dq.row_stride, lane);
}

// ---------------------------------------------------------------------------------------------
// v2 dQ: ROW_GROUPS 16-row query groups per warp
// ---------------------------------------------------------------------------------------------
//
// v1's warp owns 16 query rows, so each K_j / V_j B fragment it loads feeds 2 mma, and every warp
// of the CTA reads all of K_j and V_j: 0.58 ldmatrix.x4 per mma at head dim 128, which is what
// bounds it (shared-memory pipe ~80 % busy, tensor pipe < 50 %). Here a warp owns ROW_GROUPS = 2
// groups of 16 rows, so a B fragment feeds 2 * ROW_GROUPS mma; the register cost (twice the dQ
// accumulator) is paid for with a narrower key block (BLOCK_N = 32 at head dim 128). Head dim
// 128: 80 ldmatrix.x4 per 192 mma (0.42); head dim 64 (BLOCK_N = 64): 64 per 192 (0.33).

// v1's layout plus the rows' lse (log2 units, lse_base_log2) and D: read from shared memory when
// needed instead of being held in 8 registers for the whole kernel (the margin to spilling).
template <int D_TILE, int BLOCK_M, int BLOCK_N>
struct DqSmemV2 : DqSmem<D_TILE, BLOCK_M, BLOCK_N> {
    typedef DqSmem<D_TILE, BLOCK_M, BLOCK_N> V1;
    static constexpr u32 LSE = V1::BYTES;             // float [BLOCK_M]
    static constexpr u32 DELTA = LSE + BLOCK_M * 4;   // float [BLOCK_M]
    static constexpr u32 BYTES = DELTA + BLOCK_M * 4;
};

template <typename T, int D_TILE, class Mask, int BLOCK_M, int BLOCK_N, int NWARPS, int ROW_GROUPS>
__global__ void __launch_bounds__(NWARPS * 32, 1)
flash_bwd_dq_mma_v2(const __grid_constant__ BwdParams p) {
    typedef DqSmemV2<D_TILE, BLOCK_M, BLOCK_N> L;
    constexpr int NTHREADS = NWARPS * 32;
    constexpr int G = ROW_GROUPS;
    constexpr int WARP_ROWS = 16 * G;
    constexpr int DP_COLS = D_TILE >= 128 ? 16 : BLOCK_N;
    static_assert(BLOCK_M == WARP_ROWS * NWARPS, "16 * ROW_GROUPS query rows per warp");
    static_assert(BLOCK_N % 16 == 0 && D_TILE % 16 == 0, "m16n8k16 tiles");
    static_assert(L::BYTES <= 227 * 1024, "shared memory");

    extern __shared__ __align__(128) unsigned char smem[];
    if (dynamic_smem_bytes() < L::BYTES) __trap();
    const u32 base = smem_u32(smem);
    const u32 s_q = base + L::Q, s_do = base + L::DO;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int row0 = WARP_ROWS * warp;  // this warp's query rows within the block
    // The run-time arguments, read once here (bwd_args in mma_bwd.cuh says why).
    const int seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k, nheads = p.nheads, headdim = p.headdim;
    const float scale_log2 = p.scale_log2, scale = p.scale;
    const TensorRows q = p.q, k = p.k, v = p.v, dout = p.dout, dq = p.dq;
    const float* __restrict__ lse = static_cast<const float*>(p.lse);
    const float* __restrict__ delta = static_cast<const float*>(p.delta);
    const Mask mask(seqlen_q, seqlen_k, p.window_left, p.window_right);
    const int m0 = Mask::query_block(blockIdx.x, gridDim.x) * BLOCK_M;
    const int head = blockIdx.y, batch = blockIdx.z, head_kv = head / p.group;

    // Key blocks [j_begin, j_end) hold the keys some existing row of the block sees (mask.cuh);
    // K_j and V_j sit in stage j % 2, whichever block the walk starts at.
    const int j_begin = mask.key_begin(m0) / BLOCK_N;
    const int j_end = (mask.key_end(m0, min(BLOCK_M, seqlen_q - m0)) + BLOCK_N - 1) / BLOCK_N;

    // The key-block addresses are recomputed from the run-time arguments (p: constant bank) at each
    // load: held across the loop, they are what tips the main loop into spilling.
    auto load_key_block = [&](int j, int stage) {
        const int n0 = j * BLOCK_N;
        cp_async_tile<BLOCK_N, D_TILE, NTHREADS>(base + L::K + stage * L::KV_TILE,
                                                 p.k.row<const T>(batch, n0, head_kv),
                                                 seqlen_k - n0, headdim, p.k.row_stride, tid);
        cp_async_tile<BLOCK_N, D_TILE, NTHREADS>(base + L::V + stage * L::KV_TILE,
                                                 p.v.row<const T>(batch, n0, head_kv),
                                                 seqlen_k - n0, headdim, p.v.row_stride, tid);
    };

    cp_async_tile<BLOCK_M, D_TILE, NTHREADS>(s_q, q.row<const T>(batch, m0, head), seqlen_q - m0, headdim,
                                             q.row_stride, tid);
    cp_async_tile<BLOCK_M, D_TILE, NTHREADS>(s_do, dout.row<const T>(batch, m0, head), seqlen_q - m0, headdim,
                                             dout.row_stride, tid);
    if (j_begin < j_end) load_key_block(j_begin, j_begin & 1);
    cp_async_commit();

    // Row statistics (by ldg: bwd_args in mma_bwd.cuh), made visible by the first iteration's barrier.
    float* s_lse = reinterpret_cast<float*>(smem + L::LSE);
    float* s_delta = reinterpret_cast<float*>(smem + L::DELTA);
    for (int r = tid; r < BLOCK_M; r += NTHREADS) {
        const int m = m0 + r;
        const i64 stat = ((i64)batch * nheads + head) * seqlen_q + m;
        s_lse[r] = m < seqlen_q ? lse_base_log2(ldg(lse + stat)) : 0.f;
        s_delta[r] = m < seqlen_q ? ldg(delta + stat) : 0.f;
    }
    // This lane's accumulator rows within the block: group g, half h is lane_row + 16 g + 8 h.
    const int lane_row = row0 + lane / 4;

    float dq_acc[G][D_TILE / 8][4];
#pragma unroll
    for (int g = 0; g < G; ++g) zero(dq_acc[g]);

    for (int j = j_begin; j < j_end; ++j) {
        const int stage = j & 1;
        // Lands block j; all warps are done with block j - 1, whose stage the next load reuses.
        cp_async_wait<0>();
        __syncthreads();
        if (j + 1 < j_end) load_key_block(j + 1, stage ^ 1);
        cp_async_commit();

        const int n0 = j * BLOCK_N;
        const u32 s_k = base + L::K + stage * L::KV_TILE, s_v = base + L::V + stage * L::KV_TILE;

        // Step 1: S = Q_i K_j^T for this warp's 16 G query rows, turned into P = exp2(S scale
        // log2(e) - lse log2(e)) in place. The window's left bound (from the policy's origin: query
        // m0 + lane_row, key n0 + 2 (lane % 4)) selects P to 0 here, where dP is not live yet, and
        // step 2 tells those entries by P == 0: the d128 kernel has no registers to spare there.
        const bool partial = mask.partial(m0, BLOCK_M, n0, BLOCK_N);
        const typename Mask::Origin origin = mask.origin(m0 + lane_row, n0 + 2 * (lane % 4));
        float s_acc[G][BLOCK_N / 8][4];
#pragma unroll
        for (int g = 0; g < G; ++g) zero(s_acc[g]);
        mma_ABt_groups<T, G, BLOCK_N, D_TILE, D_TILE, D_TILE>(s_acc, s_q, row0, s_k, 0, lane);
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int f = 0; f < BLOCK_N / 8; ++f)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float p =
                        recomputed_p(s_acc[g][f][e], scale_log2, s_lse[lane_row + 16 * g + 8 * (e >> 1)]);
                    const bool hidden_left =
                        partial && mask.hidden_left(origin, 16 * g + 8 * (e >> 1), 8 * f + (e & 1));
                    s_acc[g][f][e] = hidden_left ? 0.f : p;
                }

        // Step 2: dP = dO_i V_j^T and dS = P o (dP - D), in slices of DP_COLS keys: at head dim 128
        // a full-width dP next to P and dQ spills (the dO fragments are reloaded per slice).
        // Hidden entries are selected to 0 (a non-finite score or dP there must not leak).
        // Row m sees the keys n < n_lim (none past the last query), as far as the left bound goes.
        int n_lim[G][2];
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int m = m0 + lane_row + 16 * g + 8 * half;
                n_lim[g][half] = m < seqlen_q ? mask.row_key_end(m) : 0;
            }
        u32 ds_frag[G][BLOCK_N / 16][4];
#pragma unroll
        for (int c0 = 0; c0 < BLOCK_N; c0 += DP_COLS) {
            float dp_acc[G][DP_COLS / 8][4];
#pragma unroll
            for (int g = 0; g < G; ++g) zero(dp_acc[g]);
            // Row offsets that are multiples of 8 keep the swizzle phase: V rows c0.. are a tile.
            mma_ABt_groups<T, G, DP_COLS, D_TILE, D_TILE, D_TILE>(dp_acc, s_do, row0,
                                                                  s_v + c0 * (D_TILE * 2), 0, lane);
#pragma unroll
            for (int g = 0; g < G; ++g) {
#pragma unroll
                for (int f = 0; f < DP_COLS / 8; ++f) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const float ds = s_acc[g][c0 / 8 + f][e] *
                                         (dp_acc[g][f][e] - s_delta[lane_row + 16 * g + 8 * (e >> 1)]);
                        const int n = n0 + c0 + 8 * f + 2 * (lane % 4) + (e & 1);
                        const bool hidden = partial && (n >= n_lim[g][e >> 1] ||
                                                        (Mask::HAS_LEFT && s_acc[g][c0 / 8 + f][e] == 0.f));
                        dp_acc[g][f][e] = hidden ? 0.f : ds;
                    }
                }
                auto& ds_slice = *reinterpret_cast<u32 (*)[DP_COLS / 16][4]>(&ds_frag[g][c0 / 16]);
                pack_a_frags<T, DP_COLS>(ds_slice, dp_acc[g]);
            }
        }

        // Step 3: dQ_i += dS K_j.
        mma_AB_regs_groups<T, G, D_TILE, BLOCK_N, D_TILE>(dq_acc, ds_frag, s_k, 0, lane);
    }

    // Epilogue: as in v1, staged through this warp's own rows of the Q tile.
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int g = 0; g < G; ++g) stage_acc<T, D_TILE, D_TILE>(s_q, row0 + 16 * g, 0, dq_acc[g], scale, lane);
    __syncwarp();
    T* dq_rows = dq.row<T>(batch, m0 + row0, head);
    store_tile<WARP_ROWS, D_TILE, 32>(dq_rows, s_q + tile_offset<D_TILE>(row0, 0), seqlen_q - m0 - row0,
                                      headdim, dq.row_stride, lane);
}

// ---------------------------------------------------------------------------------------------
// v2 dK, dV: ROW_GROUPS 16-row key groups per warp (head dim 64)
// ---------------------------------------------------------------------------------------------
//
// As flash_bwd_dkdv_mma with WARPS_D = 1, but a warp owns 16 ROW_GROUPS key rows, so each Q / dO
// fragment it loads for S^T, dP^T, dV and dK feeds ROW_GROUPS times as many mma: at head dim 64,
// 2 groups and M_SUB = 32, 48 ldmatrix.x4 per 128 mma (v1: 72 per 128). Two 16-row groups of dK
// and dV at head dim 128 would take 256 accumulator registers, so there v1 stays.
template <typename T, int D_TILE, class Mask, int BLOCK_M, int M_SUB, int BLOCK_N, int NWARPS, int ROW_GROUPS,
          DqAdd DQ_ADD>
__global__ void __launch_bounds__(NWARPS * 32, 1)
flash_bwd_dkdv_mma_v2(const __grid_constant__ BwdParams p) {
    static_assert(DQ_ADD == DqAdd::atomic || DQ_ADD == DqAdd::none, "dQ by float32 atomics or by flash_bwd_dq_mma");
    constexpr bool ATOMIC_DQ = DQ_ADD == DqAdd::atomic;
    typedef DkdvSmem<D_TILE, BLOCK_M, M_SUB, BLOCK_N, NWARPS, 1, DQ_ADD> L;
    constexpr int NTHREADS = NWARPS * 32;
    constexpr int G = ROW_GROUPS;
    constexpr int WARP_ROWS = 16 * G;
    constexpr int DQ_WARPS_M = BLOCK_M / 16;
    constexpr int DQ_COLS = D_TILE / (NWARPS / DQ_WARPS_M);  // dQ columns per warp (DqAdd::atomic)
    constexpr int DQ_PASS = DQ_COLS < 32 ? DQ_COLS : 32;
    static_assert(BLOCK_N == WARP_ROWS * NWARPS, "16 * ROW_GROUPS key rows per warp");
    static_assert(BLOCK_M % M_SUB == 0 && M_SUB % 16 == 0 && D_TILE % 16 == 0, "m16n8k16 tiles");
    static_assert(!ATOMIC_DQ || (NWARPS % DQ_WARPS_M == 0 && DQ_COLS % DQ_PASS == 0 && DQ_PASS % 16 == 0),
                  "dQ warp grid");
    static_assert(L::BYTES <= 227 * 1024, "shared memory");

    extern __shared__ __align__(128) unsigned char smem[];
    if (dynamic_smem_bytes() < L::BYTES) __trap();
    const u32 base = smem_u32(smem);
    const u32 s_k = base + L::K, s_v = base + L::V, s_ds = base + L::DS;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int row0 = WARP_ROWS * warp;  // this warp's key rows within the block
    const int n0 = blockIdx.x * BLOCK_N, head_kv = blockIdx.y, batch = blockIdx.z;
    // The run-time arguments, read once here (bwd_args in mma_bwd.cuh says why).
    const int seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k, nheads = p.nheads, group = p.group, headdim = p.headdim;
    const float scale_log2 = p.scale_log2, scale = p.scale;
    const TensorRows q = p.q, k = p.k, v = p.v, dout = p.dout, dk = p.dk, dv = p.dv, dq_accum = p.dq_accum;
    const float* __restrict__ lse = static_cast<const float*>(p.lse);
    const float* __restrict__ delta = static_cast<const float*>(p.delta);
    const Mask mask(seqlen_q, seqlen_k, p.window_left, p.window_right);

    // Query blocks [m_block_first, m_block_end) see some key of this block (mask.cuh); the others
    // are never loaded.
    const int m_block_first = mask.query_begin(n0) / BLOCK_M;
    const int m_block_end = (mask.query_end(n0, BLOCK_N) + BLOCK_M - 1) / BLOCK_M;
    const int m_blocks = max(0, m_block_end - m_block_first);
    const int n_iters = group * m_blocks;  // (query head of the group, query block) pairs

    auto load_query_block = [&](int it, int stage) {
        const int head = head_kv * group + it / m_blocks;
        const int m0 = (m_block_first + it % m_blocks) * BLOCK_M;
        cp_async_tile<BLOCK_M, D_TILE, NTHREADS>(base + L::Q + stage * L::Q_TILE,
                                                 q.row<const T>(batch, m0, head),
                                                 seqlen_q - m0, headdim, q.row_stride, tid);
        cp_async_tile<BLOCK_M, D_TILE, NTHREADS>(base + L::DO + stage * L::Q_TILE,
                                                 dout.row<const T>(batch, m0, head),
                                                 seqlen_q - m0, headdim, dout.row_stride, tid);
        cp_async_row_stats<BLOCK_M, NTHREADS>(base + L::LSE, base + L::DELTA, stage, lse, delta,
                                               ((i64)batch * nheads + head) * seqlen_q + m0, m0, seqlen_q, tid);
    };

    cp_async_tile<BLOCK_N, D_TILE, NTHREADS>(s_k, k.row<const T>(batch, n0, head_kv), seqlen_k - n0, headdim,
                                             k.row_stride, tid);
    cp_async_tile<BLOCK_N, D_TILE, NTHREADS>(s_v, v.row<const T>(batch, n0, head_kv), seqlen_k - n0, headdim,
                                             v.row_stride, tid);
    if (n_iters > 0) load_query_block(0, 0);
    cp_async_commit();

    float dk_acc[G][D_TILE / 8][4], dv_acc[G][D_TILE / 8][4];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        zero(dk_acc[g]);
        zero(dv_acc[g]);
    }

    for (int it = 0; it < n_iters; ++it) {
        const int stage = it & 1;
        // As in v1: lands this block's copies; all warps are done with iteration it - 1.
        cp_async_wait<0>();
        __syncthreads();
        if (it + 1 < n_iters) load_query_block(it + 1, stage ^ 1);
        cp_async_commit();

        const int head = head_kv * group + it / m_blocks;
        const int m0 = (m_block_first + it % m_blocks) * BLOCK_M;
        const u32 s_q = base + L::Q + stage * L::Q_TILE, s_do = base + L::DO + stage * L::Q_TILE;
        const float* s_lse = reinterpret_cast<const float*>(smem + L::LSE) + stage * BLOCK_M;
        const float* s_delta = reinterpret_cast<const float*>(smem + L::DELTA) + stage * BLOCK_M;

#pragma unroll 1
        for (int mc0 = 0; mc0 < BLOCK_M; mc0 += M_SUB) {
            const u32 s_q_sub = s_q + mc0 * (D_TILE * 2), s_do_sub = s_do + mc0 * (D_TILE * 2);
            const int m0_sub = m0 + mc0;
            const bool partial = mask.partial(m0_sub, M_SUB, n0, BLOCK_N);
            // Key row n is seen by the queries m_min <= m < seqlen_q (none if n >= seqlen_k) that the
            // window's left bound allows: that bound from the policy's origin (query m0_sub + 2 (lane
            // % 4), key n0 + row0 + lane / 4), one register for all rows of the lane.
            int m_min[G][2];
#pragma unroll
            for (int g = 0; g < G; ++g)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int n = n0 + row0 + 16 * g + lane / 4 + 8 * half;
                    m_min[g][half] = n < seqlen_k ? mask.row_query_begin(n) : seqlen_q;
                }
            const typename Mask::Origin origin = mask.origin(m0_sub + 2 * (lane % 4), n0 + row0 + lane / 4);

            // Step 1: S^T = K_j Q^T for this warp's 16 G key rows.
            float s_acc[G][M_SUB / 8][4];
#pragma unroll
            for (int g = 0; g < G; ++g) zero(s_acc[g]);
            mma_ABt_groups<T, G, M_SUB, D_TILE, D_TILE, D_TILE>(s_acc, s_k, row0, s_q_sub, 0, lane);

            // Step 2: P^T = exp2(S^T scale log2(e) - lse log2(e)), lse per column; hidden entries
            // selected to 0, blocks inside the mask without the test (masked_or_not; also step 5).
            masked_or_not(partial, [&](auto masked) {
#pragma unroll
                for (int j = 0; j < M_SUB / 8; ++j) {
                    const int c = 8 * j + 2 * (lane % 4);
                    const float2 lse2 = *reinterpret_cast<const float2*>(s_lse + mc0 + c);
                    const float base_log2[2] = {lse_base_log2(lse2.x), lse_base_log2(lse2.y)};
#pragma unroll
                    for (int g = 0; g < G; ++g) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int m = m0_sub + c + (e & 1);
                            const bool hidden = masked.value && (m < m_min[g][e >> 1] || m >= seqlen_q ||
                                                                 mask.hidden_left(origin, 8 * j + (e & 1),
                                                                                  16 * g + 8 * (e >> 1)));
                            const float p = recomputed_p(s_acc[g][j][e], scale_log2, base_log2[e & 1]);
                            s_acc[g][j][e] = hidden ? 0.f : p;
                        }
                    }
                }
            });

            // Step 3: dV_j += P^T dO.
            {
                u32 p_frag[G][M_SUB / 16][4];
#pragma unroll
                for (int g = 0; g < G; ++g) pack_a_frags<T, M_SUB>(p_frag[g], s_acc[g]);
                mma_AB_regs_groups<T, G, D_TILE, M_SUB, D_TILE>(dv_acc, p_frag, s_do_sub, 0, lane);
            }

            // Steps 4, 5: dP^T = V_j dO^T and dS^T = P^T o (dP^T - D), D per column, in slices of
            // 16 query columns: a full-width dP^T next to P^T, dK_j and dV_j spills (the V_j
            // fragments are reloaded per slice). P^T is already 0 where hidden; the selection
            // keeps a non-finite dP^T there out.
            u32 ds_frag[G][M_SUB / 16][4];
#pragma unroll
            for (int kk = 0; kk < M_SUB / 16; ++kk) {
                float dp_acc[G][2][4];
#pragma unroll
                for (int g = 0; g < G; ++g) zero(dp_acc[g]);
                // dO rows 16 kk.. form a tile of their own: 16 rows keep the swizzle phase.
                mma_ABt_groups<T, G, 16, D_TILE, D_TILE, D_TILE>(dp_acc, s_v, row0,
                                                                 s_do_sub + 16 * kk * (D_TILE * 2), 0, lane);
                masked_or_not(partial, [&](auto masked) {
#pragma unroll
                    for (int jj = 0; jj < 2; ++jj) {
                        const int j = 2 * kk + jj;
                        const int c = 8 * j + 2 * (lane % 4);
                        const float2 d2 = *reinterpret_cast<const float2*>(s_delta + mc0 + c);
#pragma unroll
                        for (int g = 0; g < G; ++g) {
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const int m = m0_sub + c + (e & 1);
                                const bool hidden = masked.value && (m < m_min[g][e >> 1] || m >= seqlen_q ||
                                                                     (Mask::HAS_LEFT && s_acc[g][j][e] == 0.f));
                                const float ds = s_acc[g][j][e] * (dp_acc[g][jj][e] - ((e & 1) ? d2.y : d2.x));
                                dp_acc[g][jj][e] = hidden ? 0.f : ds;
                            }
                        }
                    }
                });
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    ds_frag[g][kk][0] = pack2<T>(dp_acc[g][0][0], dp_acc[g][0][1]);
                    ds_frag[g][kk][1] = pack2<T>(dp_acc[g][0][2], dp_acc[g][0][3]);
                    ds_frag[g][kk][2] = pack2<T>(dp_acc[g][1][0], dp_acc[g][1][1]);
                    ds_frag[g][kk][3] = pack2<T>(dp_acc[g][1][2], dp_acc[g][1][3]);
                }
            }

            // Step 6: dK_j += dS^T Q.
            mma_AB_regs_groups<T, G, D_TILE, M_SUB, D_TILE>(dk_acc, ds_frag, s_q_sub, 0, lane);

            // dS^T to shared memory for step 7.
            if constexpr (ATOMIC_DQ) {
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    const int r = row0 + 16 * g + lane / 4, c = 2 * (lane % 4);
#pragma unroll
                    for (int kk = 0; kk < M_SUB / 16; ++kk) {
                        const int chunk = mc0 / 8 + 2 * kk;
                        st_shared_b32(s_ds + tile_offset<BLOCK_M>(r, chunk) + 2 * c, ds_frag[g][kk][0]);
                        st_shared_b32(s_ds + tile_offset<BLOCK_M>(r + 8, chunk) + 2 * c, ds_frag[g][kk][1]);
                        st_shared_b32(s_ds + tile_offset<BLOCK_M>(r, chunk + 1) + 2 * c, ds_frag[g][kk][2]);
                        st_shared_b32(s_ds + tile_offset<BLOCK_M>(r + 8, chunk + 1) + 2 * c, ds_frag[g][kk][3]);
                    }
                }
            }
        }

        // Step 7 (DqAdd::atomic): as in v1.
        if constexpr (ATOMIC_DQ) {
            __syncthreads();
            const int q_row0 = 16 * (warp % DQ_WARPS_M);
            const int m_lo = m0 + q_row0 + lane / 4, m_hi = m_lo + 8;
            float* dqa = dq_accum.head_rows<float>(batch, head);  // float32 rows (panel stride 64)
            const i64 dqa_ss = dq_accum.row_stride;
#pragma unroll 1
            for (int col0 = DQ_COLS * (warp / DQ_WARPS_M); col0 < DQ_COLS * (warp / DQ_WARPS_M + 1);
                 col0 += DQ_PASS) {
                float dq_acc[DQ_PASS / 8][4];
                zero(dq_acc);
                mma_AtB<T, DQ_PASS, BLOCK_N, BLOCK_M, D_TILE>(dq_acc, s_ds, q_row0, s_k, col0, lane);
#pragma unroll
                for (int j = 0; j < DQ_PASS / 8; ++j) {
                    const int col = col0 + 8 * j + 2 * (lane % 4);
                    if (col < headdim) {
                        if (m_lo < seqlen_q) red_add_f32x2(dqa + m_lo * dqa_ss + col, dq_acc[j][0], dq_acc[j][1]);
                        if (m_hi < seqlen_q) red_add_f32x2(dqa + m_hi * dqa_ss + col, dq_acc[j][2], dq_acc[j][3]);
                    }
                }
            }
        }
    }

    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int g = 0; g < G; ++g) {
        stage_acc<T, D_TILE, D_TILE>(s_k, row0 + 16 * g, 0, dk_acc[g], scale, lane);
        stage_acc<T, D_TILE, D_TILE>(s_v, row0 + 16 * g, 0, dv_acc[g], 1.f, lane);
    }
    __syncthreads();
    store_tile<BLOCK_N, D_TILE, NTHREADS>(dk.row<T>(batch, n0, head_kv), s_k, seqlen_k - n0, headdim,
                                          dk.row_stride, tid);
    store_tile<BLOCK_N, D_TILE, NTHREADS>(dv.row<T>(batch, n0, head_kv), s_v, seqlen_k - n0, headdim,
                                          dv.row_stride, tid);
}

// ---------------------------------------------------------------------------------------------
// v3 dK, dV: warp pairs split by role (head dim 128)
// ---------------------------------------------------------------------------------------------
//
// Two 16-row groups of dK and dV at head dim 128 do not fit one warp's registers (256 fp32), so
// the two warps of a pair share 16 ROW_GROUPS key rows and split the work by gradient: warp p
// (role dV) computes S^T = K_j Q^T, P^T and dV += P^T dO; warp p + NWARPS / 2 (role dK) computes
// dP^T = V_j dO^T, receives P^T through shared memory, and accumulates dK += dS^T Q. Each Q / dO
// fragment then feeds 2 ROW_GROUPS mma. Head dim 128, 2 groups, M_SUB = 32: per pair and
// sub-block 96 ldmatrix.x4 and 8 KiB of P^T exchange per 256 mma (v1: 160 ldmatrix.x4).
//
// The P^T exchange is one float4 per (lane, group, C fragment): both warps own the same key rows
// and query columns, so lane l of the dK warp reads what lane l of the dV warp wrote. Two slots
// per pair alternate by sub-block: a slot is rewritten two pair barriers after it was written,
// and the dK warp reaches the second of them only after reading it.
template <int D_TILE, int BLOCK_M, int M_SUB, int BLOCK_N, int NWARPS, int ROW_GROUPS, DqAdd DQ_ADD>
struct DkdvSplitSmem {
    typedef DkdvSmem<D_TILE, BLOCK_M, M_SUB, BLOCK_N, NWARPS, 1, DQ_ADD> V1;
    static constexpr u32 XCHG_SLOT = ROW_GROUPS * (M_SUB / 8) * 32 * 16;
    static constexpr u32 XCHG = V1::BYTES;  // [NWARPS / 2 pairs][2 slots]
    static constexpr u32 BYTES = XCHG + (NWARPS / 2) * 2 * XCHG_SLOT;
};

template <typename T, int D_TILE, class Mask, int BLOCK_M, int M_SUB, int BLOCK_N, int NWARPS, int ROW_GROUPS,
          DqAdd DQ_ADD>
__global__ void __launch_bounds__(NWARPS * 32, 1)
flash_bwd_dkdv_mma_split(const __grid_constant__ BwdParams p) {
    static_assert(DQ_ADD == DqAdd::atomic || DQ_ADD == DqAdd::none, "dQ by float32 atomics or by flash_bwd_dq_mma");
    constexpr bool ATOMIC_DQ = DQ_ADD == DqAdd::atomic;
    typedef DkdvSmem<D_TILE, BLOCK_M, M_SUB, BLOCK_N, NWARPS, 1, DQ_ADD> L;
    typedef DkdvSplitSmem<D_TILE, BLOCK_M, M_SUB, BLOCK_N, NWARPS, ROW_GROUPS, DQ_ADD> X;
    constexpr int NTHREADS = NWARPS * 32;
    constexpr int PAIRS = NWARPS / 2;
    constexpr int G = ROW_GROUPS;
    constexpr int WARP_ROWS = 16 * G;
    constexpr int DQ_WARPS_M = BLOCK_M / 16;
    constexpr int DQ_COLS = D_TILE / (NWARPS / DQ_WARPS_M);  // dQ columns per warp (DqAdd::atomic)
    constexpr int DQ_PASS = DQ_COLS < 32 ? DQ_COLS : 32;
    static_assert(NWARPS % 2 == 0 && PAIRS <= 15, "warp pairs, one named barrier each");
    static_assert(BLOCK_N == WARP_ROWS * PAIRS, "16 * ROW_GROUPS key rows per warp pair");
    static_assert(BLOCK_M % M_SUB == 0 && M_SUB % 16 == 0 && D_TILE % 16 == 0, "m16n8k16 tiles");
    static_assert(!ATOMIC_DQ || (NWARPS % DQ_WARPS_M == 0 && DQ_COLS % DQ_PASS == 0 && DQ_PASS % 16 == 0),
                  "dQ warp grid");
    static_assert(X::BYTES <= 227 * 1024, "shared memory");

    extern __shared__ __align__(128) unsigned char smem[];
    if (dynamic_smem_bytes() < X::BYTES) __trap();
    const u32 base = smem_u32(smem);
    const u32 s_k = base + L::K, s_v = base + L::V, s_ds = base + L::DS;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int pair = warp % PAIRS;
    const bool role_dk = warp >= PAIRS;  // warp-uniform
    const int row0 = WARP_ROWS * pair;   // the pair's key rows within the block
    const u32 s_xchg = base + X::XCHG + pair * 2 * X::XCHG_SLOT + lane * 16;
    const int n0 = blockIdx.x * BLOCK_N, head_kv = blockIdx.y, batch = blockIdx.z;
    // The run-time arguments, read once here (bwd_args in mma_bwd.cuh says why).
    const int seqlen_q = p.seqlen_q, seqlen_k = p.seqlen_k, nheads = p.nheads, group = p.group, headdim = p.headdim;
    const float scale_log2 = p.scale_log2, scale = p.scale;
    const TensorRows q = p.q, k = p.k, v = p.v, dout = p.dout, dk = p.dk, dv = p.dv, dq_accum = p.dq_accum;
    const float* __restrict__ lse = static_cast<const float*>(p.lse);
    const float* __restrict__ delta = static_cast<const float*>(p.delta);
    const Mask mask(seqlen_q, seqlen_k, p.window_left, p.window_right);

    // Query blocks [m_block_first, m_block_end) see some key of this block (mask.cuh); the others
    // are never loaded.
    const int m_block_first = mask.query_begin(n0) / BLOCK_M;
    const int m_block_end = (mask.query_end(n0, BLOCK_N) + BLOCK_M - 1) / BLOCK_M;
    const int m_blocks = max(0, m_block_end - m_block_first);
    const int n_iters = group * m_blocks;  // (query head of the group, query block) pairs

    auto load_query_block = [&](int it, int stage) {
        const int head = head_kv * group + it / m_blocks;
        const int m0 = (m_block_first + it % m_blocks) * BLOCK_M;
        cp_async_tile<BLOCK_M, D_TILE, NTHREADS>(base + L::Q + stage * L::Q_TILE,
                                                 q.row<const T>(batch, m0, head),
                                                 seqlen_q - m0, headdim, q.row_stride, tid);
        cp_async_tile<BLOCK_M, D_TILE, NTHREADS>(base + L::DO + stage * L::Q_TILE,
                                                 dout.row<const T>(batch, m0, head),
                                                 seqlen_q - m0, headdim, dout.row_stride, tid);
        cp_async_row_stats<BLOCK_M, NTHREADS>(base + L::LSE, base + L::DELTA, stage, lse, delta,
                                               ((i64)batch * nheads + head) * seqlen_q + m0, m0, seqlen_q, tid);
    };

    cp_async_tile<BLOCK_N, D_TILE, NTHREADS>(s_k, k.row<const T>(batch, n0, head_kv), seqlen_k - n0, headdim,
                                             k.row_stride, tid);
    cp_async_tile<BLOCK_N, D_TILE, NTHREADS>(s_v, v.row<const T>(batch, n0, head_kv), seqlen_k - n0, headdim,
                                             v.row_stride, tid);
    if (n_iters > 0) load_query_block(0, 0);
    cp_async_commit();

    // dV_j rows of the pair (role dV) or dK_j rows (role dK).
    float acc[G][D_TILE / 8][4];
#pragma unroll
    for (int g = 0; g < G; ++g) zero(acc[g]);
    int slot = 0;

    for (int it = 0; it < n_iters; ++it) {
        const int stage = it & 1;
        // As in v1: lands this block's copies; all warps are done with iteration it - 1.
        cp_async_wait<0>();
        __syncthreads();
        if (it + 1 < n_iters) load_query_block(it + 1, stage ^ 1);
        cp_async_commit();

        const int head = head_kv * group + it / m_blocks;
        const int m0 = (m_block_first + it % m_blocks) * BLOCK_M;
        const u32 s_q = base + L::Q + stage * L::Q_TILE, s_do = base + L::DO + stage * L::Q_TILE;
        const float* s_lse = reinterpret_cast<const float*>(smem + L::LSE) + stage * BLOCK_M;
        const float* s_delta = reinterpret_cast<const float*>(smem + L::DELTA) + stage * BLOCK_M;

#pragma unroll 1
        for (int mc0 = 0; mc0 < BLOCK_M; mc0 += M_SUB, slot ^= 1) {
            const u32 s_q_sub = s_q + mc0 * (D_TILE * 2), s_do_sub = s_do + mc0 * (D_TILE * 2);
            const u32 s_p = s_xchg + slot * X::XCHG_SLOT;
            const int m0_sub = m0 + mc0;
            const bool partial = mask.partial(m0_sub, M_SUB, n0, BLOCK_N);
            // Key row n is seen by the queries m_min <= m < seqlen_q (none if n >= seqlen_k) that the
            // window's left bound allows: that bound from the policy's origin (query m0_sub + 2 (lane
            // % 4), key n0 + row0 + lane / 4), one register for all rows of the lane.
            int m_min[G][2];
#pragma unroll
            for (int g = 0; g < G; ++g)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int n = n0 + row0 + 16 * g + lane / 4 + 8 * half;
                    m_min[g][half] = n < seqlen_k ? mask.row_query_begin(n) : seqlen_q;
                }
            const typename Mask::Origin origin = mask.origin(m0_sub + 2 * (lane % 4), n0 + row0 + lane / 4);

            if (!role_dk) {
                // S^T = K_j Q^T; P^T = exp2(S^T scale log2(e) - lse log2(e)), lse per column,
                // hidden entries selected to 0 (masked_or_not); P^T to the pair's slot; dV_j += P^T dO.
                float s_acc[G][M_SUB / 8][4];
#pragma unroll
                for (int g = 0; g < G; ++g) zero(s_acc[g]);
                mma_ABt_groups<T, G, M_SUB, D_TILE, D_TILE, D_TILE>(s_acc, s_k, row0, s_q_sub, 0, lane);
#pragma unroll
                for (int j = 0; j < M_SUB / 8; ++j) {
                    const int c = 8 * j + 2 * (lane % 4);
                    const float2 lse2 = *reinterpret_cast<const float2*>(s_lse + mc0 + c);
                    const float base_log2[2] = {lse_base_log2(lse2.x), lse_base_log2(lse2.y)};
#pragma unroll
                    for (int g = 0; g < G; ++g) {
                        masked_or_not(partial, [&](auto masked) {
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const int m = m0_sub + c + (e & 1);
                                const bool hidden = masked.value && (m < m_min[g][e >> 1] || m >= seqlen_q ||
                                                                     mask.hidden_left(origin, 8 * j + (e & 1),
                                                                                      16 * g + 8 * (e >> 1)));
                                const float p = recomputed_p(s_acc[g][j][e], scale_log2, base_log2[e & 1]);
                                s_acc[g][j][e] = hidden ? 0.f : p;
                            }
                        });
                        st_shared_v4(s_p + (g * (M_SUB / 8) + j) * 512, __float_as_uint(s_acc[g][j][0]),
                                     __float_as_uint(s_acc[g][j][1]), __float_as_uint(s_acc[g][j][2]),
                                     __float_as_uint(s_acc[g][j][3]));
                    }
                }
                named_barrier_sync(1 + pair, 64);
                u32 p_frag[G][M_SUB / 16][4];
#pragma unroll
                for (int g = 0; g < G; ++g) pack_a_frags<T, M_SUB>(p_frag[g], s_acc[g]);
                mma_AB_regs_groups<T, G, D_TILE, M_SUB, D_TILE>(acc, p_frag, s_do_sub, 0, lane);
            } else {
                // dP^T = V_j dO^T; dS^T = P^T o (dP^T - D), D per column (P^T from the pair's
                // slot, already 0 where hidden; the selection keeps a non-finite dP^T out);
                // dK_j += dS^T Q.
                float dp_acc[G][M_SUB / 8][4];
#pragma unroll
                for (int g = 0; g < G; ++g) zero(dp_acc[g]);
                mma_ABt_groups<T, G, M_SUB, D_TILE, D_TILE, D_TILE>(dp_acc, s_v, row0, s_do_sub, 0, lane);
                named_barrier_sync(1 + pair, 64);
#pragma unroll
                for (int j = 0; j < M_SUB / 8; ++j) {
                    const int c = 8 * j + 2 * (lane % 4);
                    const float2 d2 = *reinterpret_cast<const float2*>(s_delta + mc0 + c);
#pragma unroll
                    for (int g = 0; g < G; ++g) {
                        u32 p[4];
                        ld_shared_v4(p, s_p + (g * (M_SUB / 8) + j) * 512);
                        masked_or_not(partial, [&](auto masked) {
#pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const int m = m0_sub + c + (e & 1);
                                const bool hidden =
                                    masked.value && (m < m_min[g][e >> 1] || m >= seqlen_q ||
                                                     (Mask::HAS_LEFT && __uint_as_float(p[e]) == 0.f));
                                const float ds =
                                    __uint_as_float(p[e]) * (dp_acc[g][j][e] - ((e & 1) ? d2.y : d2.x));
                                dp_acc[g][j][e] = hidden ? 0.f : ds;
                            }
                        });
                    }
                }
                u32 ds_frag[G][M_SUB / 16][4];
#pragma unroll
                for (int g = 0; g < G; ++g) pack_a_frags<T, M_SUB>(ds_frag[g], dp_acc[g]);
                mma_AB_regs_groups<T, G, D_TILE, M_SUB, D_TILE>(acc, ds_frag, s_q_sub, 0, lane);

                if constexpr (ATOMIC_DQ) {
#pragma unroll
                    for (int g = 0; g < G; ++g) {
                        const int r = row0 + 16 * g + lane / 4, c = 2 * (lane % 4);
#pragma unroll
                        for (int kk = 0; kk < M_SUB / 16; ++kk) {
                            const int chunk = mc0 / 8 + 2 * kk;
                            st_shared_b32(s_ds + tile_offset<BLOCK_M>(r, chunk) + 2 * c, ds_frag[g][kk][0]);
                            st_shared_b32(s_ds + tile_offset<BLOCK_M>(r + 8, chunk) + 2 * c, ds_frag[g][kk][1]);
                            st_shared_b32(s_ds + tile_offset<BLOCK_M>(r, chunk + 1) + 2 * c, ds_frag[g][kk][2]);
                            st_shared_b32(s_ds + tile_offset<BLOCK_M>(r + 8, chunk + 1) + 2 * c,
                                          ds_frag[g][kk][3]);
                        }
                    }
                }
            }
        }

        // Step 7 (DqAdd::atomic): as in v1, by all warps.
        if constexpr (ATOMIC_DQ) {
            __syncthreads();
            const int q_row0 = 16 * (warp % DQ_WARPS_M);
            const int m_lo = m0 + q_row0 + lane / 4, m_hi = m_lo + 8;
            float* dqa = dq_accum.head_rows<float>(batch, head);  // float32 rows (panel stride 64)
            const i64 dqa_ss = dq_accum.row_stride;
#pragma unroll 1
            for (int col0 = DQ_COLS * (warp / DQ_WARPS_M); col0 < DQ_COLS * (warp / DQ_WARPS_M + 1);
                 col0 += DQ_PASS) {
                float dq_acc[DQ_PASS / 8][4];
                zero(dq_acc);
                mma_AtB<T, DQ_PASS, BLOCK_N, BLOCK_M, D_TILE>(dq_acc, s_ds, q_row0, s_k, col0, lane);
#pragma unroll
                for (int j = 0; j < DQ_PASS / 8; ++j) {
                    const int col = col0 + 8 * j + 2 * (lane % 4);
                    if (col < headdim) {
                        if (m_lo < seqlen_q) red_add_f32x2(dqa + m_lo * dqa_ss + col, dq_acc[j][0], dq_acc[j][1]);
                        if (m_hi < seqlen_q) red_add_f32x2(dqa + m_hi * dqa_ss + col, dq_acc[j][2], dq_acc[j][3]);
                    }
                }
            }
        }
    }

    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (role_dk) stage_acc<T, D_TILE, D_TILE>(s_k, row0 + 16 * g, 0, acc[g], scale, lane);
        else stage_acc<T, D_TILE, D_TILE>(s_v, row0 + 16 * g, 0, acc[g], 1.f, lane);
    }
    __syncthreads();
    store_tile<BLOCK_N, D_TILE, NTHREADS>(dk.row<T>(batch, n0, head_kv), s_k, seqlen_k - n0, headdim,
                                          dk.row_stride, tid);
    store_tile<BLOCK_N, D_TILE, NTHREADS>(dv.row<T>(batch, n0, head_kv), s_v, seqlen_k - n0, headdim,
                                          dv.row_stride, tid);
}

// ---------------------------------------------------------------------------------------------
// dq = scale * dq_accum (atomic path)
// ---------------------------------------------------------------------------------------------

// One thread per 8 columns of one (batch, row, head): two 16-byte loads, one 16-byte store.
template <typename T>
__global__ void __launch_bounds__(256)
flash_bwd_dq_convert(const __grid_constant__ BwdParams p) {
    const int seqlen_q = p.seqlen_q, nheads = p.nheads, headdim = p.headdim;
    const i64 n_chunks = ((i64)p.batch * seqlen_q) * (nheads * (headdim / 8));  // nheads headdim / 8 < 2^31
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_chunks) return;
    const int chunks_per_row = headdim / 8;
    const int chunk = (int)(idx % chunks_per_row);
    const i64 row_id = idx / chunks_per_row;  // (batch, row, head) in C order
    const int head = (int)(row_id % nheads);
    const int row = (int)((row_id / nheads) % seqlen_q);
    const int batch = (int)(row_id / ((i64)nheads * seqlen_q));
    const float scale = p.scale;
    const float4* src = reinterpret_cast<const float4*>(p.dq_accum.row<const float>(batch, row, head) + chunk * 8);
    const float4 lo = __ldg(src), hi = __ldg(src + 1);  // the read-only path (bwd_args in mma_bwd.cuh)
    const u32 r[4] = {pack2<T>(lo.x * scale, lo.y * scale), pack2<T>(lo.z * scale, lo.w * scale),
                      pack2<T>(hi.x * scale, hi.y * scale), pack2<T>(hi.z * scale, hi.w * scale)};
    st_global_v4(p.dq.row<T>(batch, row, head) + chunk * 8, r);
}

}  // namespace cf

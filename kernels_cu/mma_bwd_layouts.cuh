// The two-kernel attention backward on tensor cores (mma.sync m16n8k16), fp16/bf16, sm_80 and sm_90.
// FlashAttention-2 work split; P and dS are recomputed from the saved lse, never stored globally.
//
// Each kernel is in a file of its own, named after it (flash_bwd_dkdv_mma.cu, ...):
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
// Every shared tile row of 16-bit values is swizzled (mma.cuh), so all ldmatrix reads and all
// fragment-sized writes are free of bank conflicts.
//
// The mask is the policy's (mask.cuh): a dK/dV CTA walks only the query blocks that see some key
// of its block, a dQ CTA only the key blocks that some of its rows see; blocks outside a window
// are never loaded. Rows of a visited block that see none of its keys get P = 0 by selection.
//
// This header holds the shared-memory layouts that several of them use.
#pragma once

#include "common.cuh"
#include "dq_add.cuh"
#include "mma.cuh"

namespace cf {

// Shared-memory layout of flash_bwd_dkdv_mma (flash_bwd_dkdv_mma_v2's with WARPS_D = 1, the base of
// flash_bwd_dkdv_mma_split's), in bytes; cupyflash/backward_plans.py (dkdv_smem_bytes) computes the
// same total.
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

// Shared-memory layout of flash_bwd_dq_mma (the base of flash_bwd_dq_mma_v2's), in bytes;
// cupyflash/backward_plans.py (dq_smem_bytes) computes the same total.
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

}  // namespace cf

// The CTA of the tensor-core kernels that own a query block and compute its dQ without atomics:
// flash_bwd_dq_mma and flash_bwd_dq_mma_v2 (the family: mma_bwd_layouts.cuh). Query block m0 of
// head blockIdx.y keeps its Q and dO rows in shared memory for the whole walk over the key blocks
// [keys.first, keys.end) that some of its rows see (mask.cuh, block_walk.cuh); K_j and V_j come
// in two pipeline stages (stage j % 2, whichever block the walk starts at), block j + 1's copies
// landing while block j computes.
//
// What the two kernels share is here, once: the run-time arguments they hold (copied from the
// BwdParams at the top: bwd_args in mma_bwd.cuh), the copies in, the walk's bounds, its pipeline
// and the store of dQ. The scales stay in the kernels: flash_bwd_dq_mma_v2 converts them itself
// (its comment says why).
#pragma once

#include "block_walk.cuh"
#include "common.cuh"
#include "mask.cuh"
#include "mma.cuh"
#include "mma_bwd.cuh"
#include "mma_bwd_layouts.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"

namespace cf {

// L: DqSmem or a layout derived from it.
template <typename T, class L, class Mask, int BLOCK_M, int BLOCK_N, int D_TILE, int NTHREADS>
struct MmaQueryCta {
    u32 base;  // the shared-memory layout L's origin
    SequenceRows seq;
    int seqlen_q, seqlen_k, headdim;
    int m0, head, batch, head_kv;
    TensorRows q, dout, dq;
    const float* lse;
    const float* delta;
    Mask mask;
    KeyBlockRange<BLOCK_N> keys;  // the key blocks some existing row of the block sees

    __device__ __forceinline__ static int first_row() { return Mask::query_block(blockIdx.x, gridDim.x) * BLOCK_M; }

    // A query block past a shorter (packed) sequence's end: the kernel leaves at once, before it
    // builds the CTA (as MmaKeyCta's past_end says why).
    __device__ __forceinline__ static bool past_end(const SequenceRows& seq) {
        return Mask::PACKED && first_row() >= seq.seqlen_q;
    }

    __device__ __forceinline__ MmaQueryCta(const BwdParams& p, unsigned char* smem, const SequenceRows& seq_)
        : base(smem_u32(smem)),
          seq(seq_),
          seqlen_q(seq_.seqlen_q),
          seqlen_k(seq_.seqlen_k),
          headdim(p.headdim),
          m0(first_row()),
          head(blockIdx.y),
          batch(seq_.batch),
          head_kv(blockIdx.y / p.group),
          q(p.q),
          dout(p.dout),
          dq(p.dq),
          lse(static_cast<const float*>(p.lse)),
          delta(static_cast<const float*>(p.delta)),
          mask(cta_mask<Mask, CtaRows::QUERIES>(p, seq_.index, seq_.seqlen_q, seq_.seqlen_k)),
          keys(mask, m0, min(BLOCK_M, seq_.seqlen_q - m0)) {}

    // K_j and V_j into stage `stage` (no commit). Their addresses are recomputed from the
    // run-time arguments (p: the constant bank) at each load: held across the loop, they tipped
    // flash_bwd_dq_mma_v2's main loop into spilling.
    __device__ __forceinline__ void load_key_block(const BwdParams& p, int j, int stage, int tid) const {
        const int n0 = j * BLOCK_N;
        cp_async_tile<BLOCK_N, D_TILE, NTHREADS>(base + L::K + stage * L::KV_TILE,
                                                 p.k.row<const T>(batch, seq.k_begin + n0, head_kv), seqlen_k - n0,
                                                 headdim, p.k.row_stride, tid);
        cp_async_tile<BLOCK_N, D_TILE, NTHREADS>(base + L::V + stage * L::KV_TILE,
                                                 p.v.row<const T>(batch, seq.k_begin + n0, head_kv), seqlen_k - n0,
                                                 p.headdim_v, p.v.row_stride, tid);
    }

    // Prologue: the block's Q and dO rows and the first key block, one commit group.
    __device__ __forceinline__ void load_rows_and_first(const BwdParams& p, int tid) const {
        cp_async_tile<BLOCK_M, D_TILE, NTHREADS>(base + L::Q, q.row<const T>(batch, seq.q_begin + m0, head),
                                                 seqlen_q - m0, headdim, q.row_stride, tid);
        cp_async_tile<BLOCK_M, D_TILE, NTHREADS>(base + L::DO, dout.row<const T>(batch, seq.q_begin + m0, head),
                                                 seqlen_q - m0, p.headdim_v, dout.row_stride, tid);
        if (keys.first < keys.end) load_key_block(p, keys.first, keys.first & 1, tid);
        cp_async_commit();
    }

    // Top of key block j: the wait lands its copies, the barrier makes them visible and
    // guarantees that all warps are done with block j - 1, whose stage block j + 1's copies take.
    __device__ __forceinline__ void land_and_prefetch(const BwdParams& p, int j, int tid) const {
        cp_async_wait<0>();
        __syncthreads();
        if (j + 1 < keys.end) load_key_block(p, j + 1, (j + 1) & 1, tid);
        cp_async_commit();
    }
    __device__ __forceinline__ u32 k_tile(int j) const { return base + L::K + (j & 1) * L::KV_TILE; }
    __device__ __forceinline__ u32 v_tile(int j) const { return base + L::V + (j & 1) * L::KV_TILE; }

    // Epilogue, around the kernel's staging of dQ (times the scale) into the warp's own rows of
    // the Q tile (no other warp reads them): end_walk() waits for every copy and every warp (the
    // barrier covers a walk of no key block, where copies may still be landing); store_dq() stores
    // the warp's WARP_ROWS rows from row0 on.
    __device__ __forceinline__ void end_walk() const {
        cp_async_wait<0>();
        __syncthreads();
    }
    template <int WARP_ROWS>
    __device__ __forceinline__ void store_dq(int row0, int lane) const {
        __syncwarp();
        store_tile<WARP_ROWS, D_TILE, 32>(dq.row<T>(batch, seq.q_begin + m0 + row0, head),
                                          base + L::Q + tile_offset<D_TILE>(row0, 0), seqlen_q - m0 - row0, headdim,
                                          dq.row_stride, lane);
    }
};

}  // namespace cf

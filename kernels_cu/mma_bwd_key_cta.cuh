// The CTA of the tensor-core kernels that own a key block, flash_bwd_dkdv_mma_v2 and
// flash_bwd_dkdv_mma_split (the family: mma_bwd_layouts.cuh). Key block n0 = blockIdx.x BLOCK_N
// of kv head blockIdx.y stays in shared memory (K_j, V_j) while the CTA walks the query blocks that
// see some of its keys, of every query head of the GQA group (block_walk.cuh), two pipeline stages
// deep: Q_i, dO_i, lse_i and D_i of iteration it + 1 land by cp.async while iteration it computes.
//
// The kernels differ in how their warps split the key rows and the gradients; what they share is
// here, once: the run-time arguments (copied from the BwdParams at the top, as bwd_args in
// mma_bwd.cuh says why), the copies in, the order of the walk, the atomic dQ adds (step 7), the
// staging and stores of dK_j and dV_j, and below the CTA a sub-block's mask of a warp's key rows.
// flash_bwd_dkdv_mma (v1) and flash_bwd_fused_mma keep their own setup for now: on this CTA, v1's
// packed instance with the compile check's user modifier and atomic dQ (d128) spilled 8 bytes at
// sm_90 in CI, and the fused kernel's causal softcap d128 instance 152 (docs/perf-log.md, mma-bwd-cta).
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

// Shared-memory addresses of one pipeline stage of layout L (DkdvSmem or a layout with its
// fields): the query block's Q and dO tiles, and its rows' lse and D.
template <class L, int BLOCK_M>
struct QueryStageTiles {
    u32 q, d_o;
    const float* lse;
    const float* delta;

    __device__ __forceinline__ QueryStageTiles(unsigned char* smem, int stage)
        : q(smem_u32(smem) + L::Q + stage * L::Q_TILE),
          d_o(smem_u32(smem) + L::DO + stage * L::Q_TILE),
          lse(reinterpret_cast<const float*>(smem + L::LSE) + stage * BLOCK_M),
          delta(reinterpret_cast<const float*>(smem + L::DELTA) + stage * BLOCK_M) {}
};

template <typename T, class L, class Mask, int BLOCK_M, int BLOCK_N, int D_TILE, int NTHREADS>
struct MmaKeyCta {
    u32 base;  // the shared-memory layout L's origin
    int n0, head_kv;
    SequenceRows seq;
    int seqlen_q, seqlen_k, group, headdim, headdim_v;
    int query_cols;  // of the Q and dO tiles: max(headdim, headdim_v) (cp_async_query_block)
    StatDims stat_dims;
    float scale_log2, scale, drop_scale;  // drop_scale: 1 / (1 - p)
    TensorRows q, k, v, dout, dk, dv, dq_accum;
    const float* lse;
    const float* delta;
    Mask mask;
    // The query blocks that see some key of this block, for each query head of the group; the
    // others are never loaded.
    QueryBlockWalk<BLOCK_M> walk;

    // seq: the CTA's sequence, cta_sequence or cta_sequence_uniform (softmax_bwd.cuh), as the
    // kernel's registers allow.
    __device__ __forceinline__ MmaKeyCta(const BwdParams& p, unsigned char* smem, const SequenceRows& seq_)
        : base(smem_u32(smem)),
          n0(blockIdx.x * BLOCK_N),
          head_kv(blockIdx.y),
          seq(seq_),
          seqlen_q(seq_.seqlen_q),
          seqlen_k(seq_.seqlen_k),
          group(p.group),
          headdim(p.headdim),
          headdim_v(p.headdim_v),
          query_cols(max(p.headdim, p.headdim_v)),
          stat_dims{p.nheads, p.seqlen_q},
          scale_log2(p.scale_log2),
          scale(p.scale),
          drop_scale(DropoutOf<Mask>::kept_scale(p)),
          q(p.q),
          k(p.k),
          v(p.v),
          dout(p.dout),
          dk(p.dk),
          dv(p.dv),
          dq_accum(p.dq_accum),
          lse(static_cast<const float*>(p.lse)),
          delta(static_cast<const float*>(p.delta)),
          mask(cta_mask<Mask, CtaRows::KEYS>(p, seq_.index, seq_.seqlen_q, seq_.seqlen_k)),
          walk(mask, n0, BLOCK_N, group) {}

    // A key block past a shorter (packed) sequence's end: the kernel leaves at once, before it
    // builds the CTA (built first, its mask and walk ahead of the branch took the CTA's address
    // arithmetic off the uniform datapath: flash_bwd_dkdv_mma_v2 packed d64 at sm_90, 32 bytes of
    // spills). A sequence without queries still stores dK = dV = 0 (an empty walk).
    static __device__ __forceinline__ bool past_end(const SequenceRows& seq) {
        return Mask::PACKED && int(blockIdx.x) * BLOCK_N >= seq.seqlen_k;
    }

    // Iteration it's query head and query block.
    __device__ __forceinline__ int head(int it) const { return walk.head(head_kv, it); }
    __device__ __forceinline__ int m_block(int it) const { return walk.block(it); }

    // Iteration it's Q_i, dO_i, lse_i and D_i into pipeline stage `stage` (no commit).
    __device__ __forceinline__ void load_query_block(int it, int stage, int tid) const {
        cp_async_query_block<T, L, BLOCK_M, D_TILE, NTHREADS>(base, stage, q, dout, lse, delta, seq, stat_dims,
                                                              head(it), m_block(it) * BLOCK_M, seqlen_q, query_cols,
                                                              tid);
    }

    // Prologue: K_j, V_j and the first query block in one commit group.
    __device__ __forceinline__ void load_key_block_and_first(int tid) const {
        cp_async_key_block<T, BLOCK_N, D_TILE, NTHREADS>(base + L::K, base + L::V, k, v, seq, head_kv, n0, seqlen_k,
                                                         headdim, headdim_v, tid);
        if (walk.iters > 0) load_query_block(0, 0, tid);
        cp_async_commit();
    }

    // Top of iteration it: the wait lands its block's copies, and the barrier makes every
    // thread's copies visible and guarantees that all warps are done with iteration it - 1 (the
    // stage the next block's copies overwrite, and any tile the kernel's warps exchange through);
    // then iteration it + 1's copies start into the other stage, one commit group (empty past the
    // last).
    __device__ __forceinline__ void land_and_prefetch(int it, int tid) const {
        cp_async_wait<0>();
        __syncthreads();
        if (it + 1 < walk.iters) load_query_block(it + 1, (it + 1) & 1, tid);
        cp_async_commit();
    }

    // Epilogue, in two steps around the kernel's staging of dK_j (times the scale: dS^T Q is summed
    // unscaled) and dV_j (times drop_scale) into the K and V tiles (stage_acc): end_walk() waits
    // for every copy and every warp, so the tiles are free; store_grads() waits for every warp's
    // staging and stores the tiles, 16 bytes a thread. (One call taking the staging as a lambda
    // moved the CTA's address arithmetic off the uniform datapath: flash_bwd_dkdv_mma d256, 11
    // more registers.)
    __device__ __forceinline__ void end_walk() const {
        cp_async_wait<0>();
        __syncthreads();
    }
    // The staging of 16 rows from row0 of dK_j or dV_j, as mma_AB_regs_groups summed them
    // (between end_walk and store_grads).
    __device__ __forceinline__ void stage_dk(int row0, const float (&dk_acc)[D_TILE / 8][4], int lane) const {
        stage_acc<T, D_TILE, D_TILE>(base + L::K, row0, 0, dk_acc, scale, lane);
    }
    __device__ __forceinline__ void stage_dv(int row0, const float (&dv_acc)[D_TILE / 8][4], int lane) const {
        stage_acc<T, D_TILE, D_TILE>(base + L::V, row0, 0, dv_acc, drop_scale, lane);
    }
    __device__ __forceinline__ void store_grads(int tid) const {
        __syncthreads();
        store_key_block_grads<T, BLOCK_N, D_TILE, NTHREADS>(dk, dv, base + L::K, base + L::V, seq, head_kv, n0,
                                                            seqlen_k, headdim, headdim_v, tid);
    }

    // Step 7 (DqAdd::atomic), after the last sub-block of query block m0 of head `head`:
    // dq_accum += dS K_j, dS read back from the dS^T tile the warps stored (mma_bwd_layouts.cuh).
    __device__ __forceinline__ void add_dq(int head, int m0, int warp, int lane) const {
        add_dq_atomic<T, BLOCK_M, BLOCK_N, D_TILE, NTHREADS / 32>(dq_accum, seq, head, m0, base + L::DS, base + L::K,
                                                                 seqlen_q, headdim, warp, lane);
    }
};

// The first query each of a lane's key rows sees (mask.row_query_begin), seqlen_q for a row past
// the keys: rows n0_warp + 16 g + lane / 4 + 8 half of the warp's G 16-row groups, one register a
// row for the whole sub-block (the window's left bound, from the key's side).
template <int G, class Mask>
__device__ __forceinline__ void key_rows_query_begin(int (&m_min)[G][2], const Mask& mask, int n0_warp, int lane,
                                                     int seqlen_q, int seqlen_k) {
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int n = n0_warp + 16 * g + lane / 4 + 8 * half;
            m_min[g][half] = n < seqlen_k ? mask.row_query_begin(n) : seqlen_q;
        }
}

// The mask of a sub-block's queries [m0_sub, m0_sub + M_SUB) for key rows n0_warp.. of a warp's G
// 16-row groups: key row n is seen by the queries m_min <= m < seqlen_q (none if n >= seqlen_k)
// that the window's left bound allows, that bound from the policy's origin returned here (query
// m0_sub + 2 (lane % 4), key n0_warp + lane / 4), one register for all rows of the lane.
template <int G, class Mask>
__device__ __forceinline__ typename Mask::Origin key_rows_of_sub_block(int (&m_min)[G][2], const Mask& mask, int m0_sub,
                                                                       int n0_warp, int lane, int seqlen_q,
                                                                       int seqlen_k) {
    key_rows_query_begin(m_min, mask, n0_warp, lane, seqlen_q, seqlen_k);
    return mask.origin(m0_sub + 2 * (lane % 4), n0_warp + lane / 4);
}

// The element tests of entry e of C fragment (g, j) of the warp's S^T-shaped tiles: query
// m = m_c + (e & 1) (m_c = m0_sub + 8 j + 2 (lane % 4)), key row 16 g + 8 (e >> 1) + lane / 4 of the
// warp's. hides_p, for P^T: before the row's first query (m_min), past the queries, or left of
// the window, tested at the entry's offset (di, dj) = (8 j + (e & 1), 16 g + 8 (e >> 1)) from the
// origin (the caller computes the offset: computed here, the test compiled into other integer
// compares, flash_bwd_dkdv_mma_v2 and _split with Local, docs/perf-log.md dkdv-subblock-v2).
// hides_ds, for dS^T, given the entry's P^T (0 where hidden): the window's left bound read from
// P^T = 0 instead (a visible P^T of 0 gives dS^T = 0 anyway; the test, not the product, keeps a
// non-finite dP^T out of the hidden entries).
template <int G, class Mask>
__device__ __forceinline__ bool hides_p(const Mask& mask, const typename Mask::Origin& origin, const int (&m_min)[G][2],
                                        int m_c, int seqlen_q, int g, int e, int di, int dj) {
    const int m = m_c + (e & 1);
    return m < m_min[g][e >> 1] || m >= seqlen_q || mask.hidden_left(origin, di, dj);
}
template <class Mask, int G>
__device__ __forceinline__ bool hides_ds(const int (&m_min)[G][2], int m_c, int seqlen_q, int g, int e, float p) {
    const int m = m_c + (e & 1);
    return m < m_min[g][e >> 1] || m >= seqlen_q || (Mask::HAS_LEFT && p == 0.f);
}

}  // namespace cf

// What the wgmma dK/dV kernels (flash_bwd_wgmma, flash_bwd_wgmma_dsplit, flash_bwd_wgmma_ws) share:
// the run-time arguments they read at their top (WgmmaBwdArgs), the copies into their tiles,
// wgmma's 128-byte-swizzled panels (wgmma.cuh) filled by cp.async, the order of their walk over the
// query blocks, its pipeline's waits, the key block a CTA owns with its mask and walk
// (WgmmaKeyBlock), and the element steps of flash_bwd_wgmma and flash_bwd_wgmma_ws (P^T and dS^T)
// and of the dQ kernels flash_bwd_dq_wgmma and flash_bwd_dq_wgmma_ws (P and dS), at the end. Their epilogues stage dK_j and dV_j through the K and V tiles and store rows as the
// mma.sync kernels do (mma_bwd_layouts.cuh). The kernels hold their tensors as a raw pointer and
// three strides each, copied from BwdParams at their top into a plain struct of values, and the
// functions here take those values, not a CTA object: a CTA struct holding them with the mask and
// the walk (docs/perf-log.md, wgmma-bwd-cta) changed the kernels' machine code. WgmmaKeyBlock
// holds only what the kernels computed behind their packed early return; these leave the code as
// it was when it stood in both kernels.
#pragma once

#include "block_walk.cuh"
#include "common.cuh"
#include "dq_order.cuh"
#include "dropout.cuh"
#include "mask.cuh"
#include "mma_bwd.cuh"
#include "params.cuh"
#include "softmax_bwd.cuh"
#include "wgmma.cuh"

namespace cf {

// K_j, V_j: rows n0 .. n0 + BLOCK_N - 1 of this kv head's keys (k_rows, v_rows: its row 0 of the
// sequence), zero past seqlen_k and past headdim (K) and headdim_v (V) columns.
template <int BLOCK_N, int D_TILE, int NTHREADS, typename T>
__device__ __forceinline__ void cp_async_key_panels(u32 k_tile, u32 v_tile, const T* k_rows, i64 k_ss, const T* v_rows,
                                                    i64 v_ss, int n0, int seqlen_k, int headdim, int headdim_v,
                                                    int tid) {
    cp_async_panels<BLOCK_N, D_TILE, NTHREADS>(k_tile, k_rows + n0 * k_ss, seqlen_k - n0, headdim, k_ss, tid);
    cp_async_panels<BLOCK_N, D_TILE, NTHREADS>(v_tile, v_rows + n0 * v_ss, seqlen_k - n0, headdim_v, v_ss, tid);
}

// Q_i, dO_i (query block m0 of query head `head`, strides batch / row / head) and the lse, D of
// its rows into pipeline stage `stage` of layout L: its Q and DO tiles (Q_TILE bytes a stage) and
// its LSE, DELTA slots; rows past seqlen_q, Q's columns past headdim and dO's past headdim_v
// zero-filled.
template <class L, int BLOCK_M, int D_TILE, int NTHREADS, typename T>
__device__ __forceinline__ void cp_async_query_panels(u32 base, int stage, const T* q, i64 q_sb, i64 q_ss, i64 q_sh,
                                                      const T* dout, i64 do_sb, i64 do_ss, i64 do_sh,
                                                      const float* lse, const float* delta, const SequenceRows& seq,
                                                      const StatDims& stat_dims, int head, int m0, int seqlen_q,
                                                      int headdim, int headdim_v, int tid) {
    cp_async_panels<BLOCK_M, D_TILE, NTHREADS>(base + L::Q + stage * L::Q_TILE,
                                               q + row_offset(seq.batch, seq.q_begin + m0, head, q_sb, q_ss, q_sh),
                                               seqlen_q - m0, headdim, q_ss, tid);
    cp_async_panels<BLOCK_M, D_TILE, NTHREADS>(base + L::DO + stage * L::Q_TILE,
                                               dout + row_offset(seq.batch, seq.q_begin + m0, head, do_sb, do_ss, do_sh),
                                               seqlen_q - m0, headdim_v, do_ss, tid);
    cp_async_row_stats<BLOCK_M, NTHREADS>(base + L::LSE, base + L::DELTA, stage, lse, delta,
                                           seq.stat(stat_dims, head, m0), m0, seqlen_q, tid);
}

// Where the query blocks' copies read: Q and dO (pointer; batch, row and head strides), lse and D,
// copied from BwdParams at the kernel's top (as separate locals before; the same code).
template <typename T>
struct QuerySources {
    const T* q;
    i64 q_sb, q_ss, q_sh;
    const T* dout;
    i64 do_sb, do_ss, do_sh;
    const float* lse;
    const float* delta;
};
template <typename T>
__device__ __forceinline__ QuerySources<T> query_sources(const BwdParams& p) {
    return {static_cast<const T*>(p.q.data), p.q.batch_stride, p.q.row_stride, p.q.head_stride,
            static_cast<const T*>(p.dout.data), p.dout.batch_stride, p.dout.row_stride, p.dout.head_stride,
            static_cast<const float*>(p.lse), static_cast<const float*>(p.delta)};
}

// The run-time arguments both kernels read at their top (bwd_args in mma_bwd.cuh says why), in
// the order they read them before, as values: a plain struct filled once, like QuerySources (a
// CTA object with a constructor, the mask and the walk among its members changed the kernels'
// code: docs/perf-log.md, wgmma-bwd-cta). The sequence's lengths are the CTA's SequenceRows'.
template <typename T>
struct WgmmaBwdArgs {
    int nheads, group, headdim, headdim_v;
    StatDims stat_dims;
    float scale_log2, scale;
    // Q, dO and the row statistics move with the query head; K, V, dK, dV are this CTA's kv head.
    QuerySources<T> query_src;
    i64 k_ss, v_ss;
    // dq_accum (a DQ_ADD other than none): a head's rows at batch dqa_sb + head dqa_sh
    // (fixed_panels: the head's D_TILE / 64 panels, dqa_sp apart), rows dqa_ss apart; the ordered
    // adds' counters (dq_semaphore) and the fixed point's row scales (dq_row_scale). (The kernels'
    // locals had __restrict__ on these pointers; without it the code is the same.)
    void* dq_accum;
    i64 dqa_sb, dqa_ss, dqa_sh, dqa_sp;
    int* dq_semaphore;
    float* dq_row_scale;
};
template <typename T>
__device__ __forceinline__ WgmmaBwdArgs<T> wgmma_bwd_args(const BwdParams& p) {
    return {p.nheads, p.group, p.headdim, p.headdim_v, StatDims{p.nheads, p.seqlen_q}, p.scale_log2, p.scale,
            query_sources<T>(p), p.k.row_stride, p.v.row_stride,
            p.dq_accum.data, p.dq_accum.batch_stride, p.dq_accum.row_stride, p.dq_accum.head_stride,
            p.dq_accum_panel_stride, p.dq_semaphore, p.dq_row_scale};
}

// The walk of a key block (one CTA of NTHREADS, layout L), two pipeline stages deep: iteration
// it's query block lands in stage it & 1 while the copies of iteration it + 1 fill the other. The
// functions take the kernel's locals; load_query_block(it, stage) is the kernel's call of this
// struct's load_query_block with them. ORDERED (the ordered dQ adds, dq_order.cuh) walks each
// query head's blocks from the last to the first and starts iteration it + 1's copies later,
// behind the previous block's release (release_and_prefetch).
template <typename T, class L, int BLOCK_M, int BLOCK_N, int D_TILE, int NTHREADS, bool ORDERED>
struct WgmmaKeyWalk {
    // Iteration it's query block; q_blocks: the query blocks of a head (ORDERED: dense only).
    static __device__ __forceinline__ int query_block(const QueryBlockWalk<BLOCK_M>& walk, int q_blocks, int it) {
        return ORDERED ? walk.block_down_from(q_blocks - 1, it) : walk.block(it);
    }

    // Iteration it's Q_i, dO_i, lse_i and D_i into pipeline stage `stage` (no commit).
    static __device__ __forceinline__ void load_query_block(int it, int stage, const QuerySources<T>& src,
                                                            const QueryBlockWalk<BLOCK_M>& walk, int q_blocks,
                                                            int head_kv, u32 base, const SequenceRows& seq,
                                                            const StatDims& stat_dims, int seqlen_q, int headdim,
                                                            int headdim_v, int tid) {
        cp_async_query_panels<L, BLOCK_M, D_TILE, NTHREADS>(base, stage, src.q, src.q_sb, src.q_ss, src.q_sh, src.dout,
                                                            src.do_sb, src.do_ss, src.do_sh, src.lse, src.delta, seq,
                                                            stat_dims, walk.head(head_kv, it),
                                                            query_block(walk, q_blocks, it) * BLOCK_M, seqlen_q,
                                                            headdim, headdim_v, tid);
    }

    // Prologue: K_j, V_j (cp_async_key_panels) and the first query block, one commit group.
    template <class LoadQueryBlock>
    static __device__ __forceinline__ void load_key_block_and_first(u32 k_tile, u32 v_tile, const T* k_rows, i64 k_ss,
                                                                    const T* v_rows, i64 v_ss, int n0, int seqlen_k,
                                                                    int headdim, int headdim_v, int tid, int iters,
                                                                    const LoadQueryBlock& load_query_block) {
        cp_async_key_panels<BLOCK_N, D_TILE, NTHREADS>(k_tile, v_tile, k_rows, k_ss, v_rows, v_ss, n0, seqlen_k, headdim,
                                                       headdim_v, tid);
        if (iters > 0) load_query_block(0, 0);
        cp_async_commit();
    }

    // Top of iteration it (stage it & 1): the wait lands its block's copies; the proxy fence hands
    // them (and the previous iteration's stores to shared memory) to wgmma's async proxy; the
    // barrier does so for every thread and guarantees that all warpgroups are done with iteration
    // it - 1, whose stage the next copies overwrite. Then, unless ORDERED, iteration it + 1's
    // copies start, one commit group (empty past the last).
    template <class LoadQueryBlock>
    static __device__ __forceinline__ void land(int it, int stage, int iters, const LoadQueryBlock& load_query_block) {
        cp_async_wait<0>();
        fence_proxy_async_shared();
        __syncthreads();
        if constexpr (!ORDERED) {
            if (it + 1 < iters) load_query_block(it + 1, stage ^ 1);
            cp_async_commit();
        }
    }

    // ORDERED: the previous query block's release (pending_release; the fence stall costs least
    // while the tensor cores work on the iteration's first products, where the kernels call
    // this), then iteration it + 1's copies (issued before the release, they would be in flight
    // and the release's fence would wait for them).
    template <class LoadQueryBlock>
    static __device__ __forceinline__ void release_and_prefetch(int*& pending_release, int lane, int it, int stage,
                                                                int iters, const LoadQueryBlock& load_query_block) {
        if constexpr (ORDERED) {
            release_dq_block(pending_release, lane);
            pending_release = nullptr;
            if (it + 1 < iters) load_query_block(it + 1, stage ^ 1);
            cp_async_commit();
        }
    }

    // After the last iteration: ORDERED, the last block's release; every copy landed (the last
    // commit group may be an empty one).
    static __device__ __forceinline__ void end(int* pending_release, int lane) {
        if constexpr (ORDERED) release_dq_block(pending_release, lane);
        cp_async_wait<0>();
    }
};

// Which key block a CTA owns: block n_block = blockIdx.x of BLOCK_N keys (rows n0 .. n0 + BLOCK_N - 1
// of the CTA's sequence), kv head head_kv = blockIdx.y, in the tensors' batch `batch`. Read once,
// ahead of the packed early return that needs n0 (read again behind it, the block index cost an
// extra special-register read in the packed kernels).
template <int BLOCK_N>
struct KeyBlockCoords {
    int n_block, n0, head_kv, batch;

    __device__ __forceinline__ explicit KeyBlockCoords(const SequenceRows& seq)
        : n_block(blockIdx.x), n0(n_block * BLOCK_N), head_kv(blockIdx.y), batch(seq.batch) {}
};

// The key block of a CTA of either kernel, the mask it is seen through and the query blocks that
// see some of its keys, for each query head of the GQA group (block_walk.cuh; the others are never
// loaded); Walk is the order and pipeline of that walk. A kernel reads its coordinates, returns if
// past_end, and only then builds this (the mask and the walk stay out of a returning CTA). K's and
// V's addresses are not members but computed where the prologue copies from them: as members they
// moved the kernels' address arithmetic from the uniform to the vector datapath.
template <typename T, class Mask, class L, int BLOCK_M, int BLOCK_N, int D_TILE, int NTHREADS, bool ORDERED>
struct WgmmaKeyBlock : KeyBlockCoords<BLOCK_N> {
    typedef WgmmaKeyWalk<T, L, BLOCK_M, BLOCK_N, D_TILE, NTHREADS, ORDERED> Walk;
    // The ordered dQ adds count every key block of a query block's column: no skipped blocks.
    static_assert(!ORDERED || !(Mask::HAS_LEFT || Mask::HAS_BLOCK_MAP), "ordered dQ adds need every key block");

    Mask mask;
    QueryBlockWalk<BLOCK_M> walk;
    int q_blocks;  // the query blocks of a head (ORDERED: the counters' stride, dense only)

    // Past a shorter (packed) sequence's end: the kernel returns before anything else. A sequence
    // without queries still stores dK = dV = 0 (an empty walk).
    static __device__ __forceinline__ bool past_end(const KeyBlockCoords<BLOCK_N>& at, const SequenceRows& seq) {
        return Mask::PACKED && at.n0 >= seq.seqlen_k;
    }

    // group: p.group, read at the kernel's top (read here, behind the packed return, it moved a
    // parameter load and the address arithmetic after it to the vector datapath).
    __device__ __forceinline__ WgmmaKeyBlock(const BwdParams& p, const SequenceRows& seq,
                                             const KeyBlockCoords<BLOCK_N>& at, int group)
        : KeyBlockCoords<BLOCK_N>(at),
          mask(cta_mask<Mask, CtaRows::KEYS>(p, seq.index, seq.seqlen_q, seq.seqlen_k)),
          walk(mask, at.n0, BLOCK_N, group),
          q_blocks((seq.seqlen_q + BLOCK_M - 1) / BLOCK_M) {}

    // Iteration it's query head and query block.
    __device__ __forceinline__ int head(int it) const { return walk.head(this->head_kv, it); }
    __device__ __forceinline__ int query_block(int it) const { return Walk::query_block(walk, q_blocks, it); }

    // Iteration it's Q_i, dO_i, lse_i and D_i into pipeline stage `stage` (no commit), from the
    // kernel's run-time arguments. Each kernel wraps this call in its own lambda load_query_block(it, stage),
    // which Walk's functions call (a lambda returned from here changed every kernel's code).
    __device__ __forceinline__ void load_query_block(int it, int stage, const WgmmaBwdArgs<T>& args, u32 base,
                                                     const SequenceRows& seq, int tid) const {
        Walk::load_query_block(it, stage, args.query_src, walk, q_blocks, this->head_kv, base, seq, args.stat_dims,
                               seq.seqlen_q, args.headdim, args.headdim_v, tid);
    }

    // Prologue: K_j, V_j into k_tile, v_tile (K's and V's row strides from args, read at the
    // kernel's top) and the first query block (load_query_block: the kernel's lambda
    // around the function above), one commit group.
    template <class LoadQueryBlock>
    __device__ __forceinline__ void load_key_block_and_first(const BwdParams& p, const SequenceRows& seq, u32 k_tile,
                                                             u32 v_tile, const WgmmaBwdArgs<T>& args, int tid,
                                                             const LoadQueryBlock& load_query_block) const {
        const T* __restrict__ k_rows = p.k.row<const T>(this->batch, seq.k_begin, this->head_kv);
        const T* __restrict__ v_rows = p.v.row<const T>(this->batch, seq.k_begin, this->head_kv);
        Walk::load_key_block_and_first(k_tile, v_tile, k_rows, args.k_ss, v_rows, args.v_ss, this->n0, seq.seqlen_k,
                                       args.headdim, args.headdim_v, tid, walk.iters, load_query_block);
    }
};

// The dS^T tile's word of accumulator column block j, half h (rows key_row, key_row + 8) of a
// thread: where steps 3-4 below keep a score policy's derivative between them.
template <int BLOCK_N>
__device__ __forceinline__ u32 stash_addr(u32 s_dst, int key_row, int j, int h, int lane) {
    return s_dst + panel_offset<BLOCK_N>(key_row + 8 * h, j) + 4 * (lane % 4);
}

// Step 3 of a dK/dV step (flash_bwd_wgmma, flash_bwd_wgmma_ws): P^T from S^T, in place in s_acc,
// lse per column (query); hidden entries 0 by selection (a non-finite score cannot leak). Element
// (j, e) is key key0 + 8 (e / 2), query query0 + 8 j + e % 2 (the kernel's key0 = n0 + key_row,
// query0 = m0 + 2 (lane % 4); origin and score_origin are theirs). The score policy's transform
// first (score.cuh). Its derivative waits for step 4 in float16 in the dS^T tile, at the thread's
// own words there (stash_addr), which flash_bwd_wgmma's step 5 overwrites with dS^T: registers are
// what limit these kernels (measured, 4-52 bytes of spills with the derivative kept in them).
// flash_bwd_wgmma's dQ readers of the tile's previous iteration were waited for before its first
// barrier; nothing else reads it before step 5. Two copies, with and without the element mask (a
// block inside the mask needs none): the split the compiler made itself while the shape came as
// kernel arguments, and no longer makes with it read from BwdParams.
template <int BLOCK_N, int SJ, class Mask, class Score, class ScoreOrigin>
__device__ __forceinline__ void probabilities_t(float (&s_acc)[SJ][4], const Mask& mask,
                                                const typename Mask::Origin& origin, const Score& score,
                                                const ScoreOrigin& score_origin, bool partial, const float* s_lse,
                                                float scale_log2, u32 s_dst, int key_row, int lane) {
    auto probabilities = [&](auto masked) {
#pragma unroll
        for (int j = 0; j < SJ; ++j) {
            const float2 lse2 = *reinterpret_cast<const float2*>(s_lse + 8 * j + 2 * (lane % 4));
            const float base_log2[2] = {lse_base_log2(lse2.x), lse_base_log2(lse2.y)};
            float dsds[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key_off = 8 * (e >> 1), query_off = 8 * j + (e & 1);
                const float p_ij = recomputed_p(score, s_acc[j][e], score_origin, query_off, key_off, dsds[e],
                                                scale_log2, base_log2[e & 1]);
                const bool hidden = mask.hidden(origin, query_off, key_off);
                s_acc[j][e] = decltype(masked)::value && hidden ? 0.f : p_ij;
            }
            if constexpr (Mask::Score::HAS_GRAD) {
                st_shared_b32(stash_addr<BLOCK_N>(s_dst, key_row, j, 0, lane), pack2<half_t>(dsds[0], dsds[1]));
                st_shared_b32(stash_addr<BLOCK_N>(s_dst, key_row, j, 1, lane), pack2<half_t>(dsds[2], dsds[3]));
            }
        }
    };
    if (partial)
        probabilities(Flag<true>());
    else
        probabilities(Flag<false>());
}

// Step 4 of a dK/dV step: dS^T = P^T o (dP^T - D) in place in dp_acc, from the 16-bit P^T that dV
// uses (p_frag: the float32 one is dead by now, fewer live registers), times the score policy's
// derivative from step 3's stash. 0 where P^T is 0, by selection (a non-finite dP^T of a hidden key
// must not become NaN). Dropout (dropout.cuh): a dropped weight kept its magnitude for dS and lost
// its sign; its 1 / (1 - p) is read from p where it is used (as a value argument, it moved an
// instruction in one kernel's machine code).
template <typename T, class Mask, int BLOCK_N, int SJ, int QK>
__device__ __forceinline__ void ds_t(float (&dp_acc)[SJ][4], const u32 (&p_frag)[QK][4], const float* s_delta,
                                     const BwdParams& p, u32 s_dst, int key_row, int lane) {
#pragma unroll
    for (int j = 0; j < SJ; ++j) {
        const float2 d2 = *reinterpret_cast<const float2*>(s_delta + 8 * j + 2 * (lane % 4));
        const float2 lo = unpack2<T>(p_frag[j / 2][2 * (j % 2)]), hi = unpack2<T>(p_frag[j / 2][2 * (j % 2) + 1]);
        const float p16[4] = {lo.x, lo.y, hi.x, hi.y};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float d = (e & 1) ? d2.y : d2.x;
            const float ds = DropoutOf<Mask>::ENABLED ? dropped_ds(p16[e], dp_acc[j][e], d, p.variant.dropout.scale)
                                                      : p16[e] * (dp_acc[j][e] - d);
            dp_acc[j][e] = p16[e] == 0.f ? 0.f : ds;
        }
        if constexpr (Mask::Score::HAS_GRAD) {
            const float2 g_lo = unpack2<half_t>(ld_shared_b32(stash_addr<BLOCK_N>(s_dst, key_row, j, 0, lane)));
            const float2 g_hi = unpack2<half_t>(ld_shared_b32(stash_addr<BLOCK_N>(s_dst, key_row, j, 1, lane)));
            dp_acc[j][0] *= g_lo.x, dp_acc[j][1] *= g_lo.y, dp_acc[j][2] *= g_hi.x, dp_acc[j][3] *= g_hi.y;
        }
    }
}

// Steps 3-4 of a dK/dV step (flash_bwd_wgmma, flash_bwd_wgmma_ws), once S^T has landed and while
// dP^T's product may still run: P^T (probabilities_t) packed as dV's A fragments, dropout's marks
// on them (dropout.cuh: a dropped weight keeps its magnitude for dS and loses its sign); then, dP^T
// waited for, dS^T (ds_t) packed as dK's, and dV's P^T left with the kept weights. key_row: the
// thread's first key row within the block; m0 the query block's first row; sequence and head the
// dropout stream's.
template <typename T, class Mask, int BLOCK_M, int BLOCK_N, class KeyBlock, class Score>
__device__ __forceinline__ void probabilities_and_ds_t(u32 (&p_frag)[BLOCK_M / 16][4], u32 (&ds_frag)[BLOCK_M / 16][4],
                                                       float (&s_acc)[BLOCK_M / 8][4], float (&dp_acc)[BLOCK_M / 8][4],
                                                       const KeyBlock& key_block, const Score& score, bool partial,
                                                       int m0, int key_row, const float* s_lse, const float* s_delta,
                                                       u32 s_dst, float scale_log2, const BwdParams& p, int sequence,
                                                       int head, int lane) {
    // Element (j, e) of S^T is key key0 + 8 (e / 2), query query0 + 8 j + e % 2.
    const int key0 = key_block.n0 + key_row, query0 = m0 + 2 * (lane % 4);
    const typename Mask::Origin origin = key_block.mask.origin(query0, key0);
    const auto score_origin = score.origin(query0, key0, partial);
    probabilities_t<BLOCK_N>(s_acc, key_block.mask, origin, score, score_origin, partial, s_lse, scale_log2, s_dst,
                             key_row, lane);
    pack_a_frags<T, BLOCK_M>(p_frag, s_acc);
    if constexpr (DropoutOf<Mask>::ENABLED)
        mark_packed_pt<DropoutOf<Mask>, BLOCK_M / 8>(p_frag, DropoutOf<Mask>(p, sequence, head), key0, query0);

    wgmma_wait<0>();
    pin_registers(reinterpret_cast<float(&)[BLOCK_M / 2]>(dp_acc));
    ds_t<T, Mask, BLOCK_N>(dp_acc, p_frag, s_delta, p, s_dst, key_row, lane);
    pack_a_frags<T, BLOCK_M>(ds_frag, dp_acc);
    if constexpr (DropoutOf<Mask>::ENABLED) relu_frags<T>(p_frag);  // dV's P^T: the kept weights
}

// Step 3 of a dQ step (flash_bwd_dq_wgmma, flash_bwd_dq_wgmma_ws): P from S, in place in s_acc, 0
// where hidden by selection (a non-finite score cannot leak). Element (f, e) is row row_lo + 8
// (e / 2), key key0 + 8 f + e % 2 (the kernels' key0 = n0 + 2 (lane % 4); score_origin is theirs);
// base_log2 the thread's two rows' lse in log2 units. The score policy's transform first
// (score.cuh); P is read only by dS here, so with a derivative it is kept as P ds'/ds. Two copies,
// with and without the element mask (a block inside the mask needs none): the split the compiler
// made itself while the shape came as kernel arguments, and no longer makes with it read from
// BwdParams.
template <int N_FRAGS, class Mask, class Score, class ScoreOrigin>
__device__ __forceinline__ void probabilities_dq(float (&s_acc)[N_FRAGS][4], const Mask& mask, const Score& score,
                                                 const ScoreOrigin& score_origin, bool partial, int row_lo, int key0,
                                                 float scale_log2, const float (&base_log2)[2]) {
    auto probabilities = [&](auto masked) {
#pragma unroll
        for (int f = 0; f < N_FRAGS; ++f)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float dsds;
                float p_ij = recomputed_p(score, s_acc[f][e], score_origin, 8 * (e >> 1), 8 * f + (e & 1), dsds,
                                          scale_log2, base_log2[e >> 1]);
                if constexpr (Mask::Score::HAS_GRAD) p_ij *= dsds;
                const bool hidden = !mask.visible(row_lo + 8 * (e >> 1), key0 + 8 * f + (e & 1));
                s_acc[f][e] = decltype(masked)::value && hidden ? 0.f : p_ij;
            }
    };
    if (partial)
        probabilities(Flag<true>());
    else
        probabilities(Flag<false>());
}

// Step 4 of a dQ step: dS = P o (dP - D), in place in dp_acc, 0 where P is 0 by selection (a
// non-finite dP of a hidden key must not become NaN); delta_row the thread's two rows' D. With
// dropout P o (Z dP / (1 - p) - D) (dropout.cuh): the kept factor Z / (1 - p) in the FMA.
template <class Mask, int N_FRAGS>
__device__ __forceinline__ void ds_dq(float (&dp_acc)[N_FRAGS][4], const float (&s_acc)[N_FRAGS][4],
                                      const DropoutOf<Mask>& dropout, const BwdParams& p, int row_lo, int key0,
                                      const float (&delta_row)[2]) {
    if constexpr (DropoutOf<Mask>::ENABLED) {
        const float kept_scale = p.variant.dropout.scale;
        walk_s_frags<DropoutOf<Mask>, 1, N_FRAGS, true>(dropout, row_lo, key0, [&](int, int f, int e, bool kept) {
            const float ds = s_acc[f][e] * fmaf(dp_acc[f][e], kept ? kept_scale : 0.f, -delta_row[e >> 1]);
            dp_acc[f][e] = s_acc[f][e] == 0.f ? 0.f : ds;
        });
    } else {
#pragma unroll
        for (int f = 0; f < N_FRAGS; ++f)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                dp_acc[f][e] = s_acc[f][e] == 0.f ? 0.f : s_acc[f][e] * (dp_acc[f][e] - delta_row[e >> 1]);
    }
}

// A dQ consumer thread's two rows (accumulator halves h = 0, 1: rows row_lo and row_lo + 8) for the
// whole walk (flash_bwd_dq_wgmma, flash_bwd_dq_wgmma_ws): lse in log2 units and D, 0 past the
// sequence's end. __ldg: the read-only path that const __restrict__ kernel parameters gave these loads.
__device__ __forceinline__ void load_row_statistics(float (&base_log2)[2], float (&delta_row)[2],
                                                    const SequenceRows& seq, const StatDims& stat_dims, int head,
                                                    int row_lo, int seqlen_q, const float* __restrict__ lse,
                                                    const float* __restrict__ delta) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int m = row_lo + 8 * h;
        const i64 stat = seq.stat(stat_dims, head, m);
        base_log2[h] = m < seqlen_q ? lse_base_log2(__ldg(lse + stat)) : 0.f;
        delta_row[h] = m < seqlen_q ? __ldg(delta + stat) : 0.f;
    }
}

// Steps 1-2 of a dQ step (flash_bwd_dq_wgmma, flash_bwd_dq_wgmma_ws): S = Q K_j^T and dP = dO V_j^T,
// issued back to back, one commit group each (K-major operands; q_rows and do_rows the warpgroup's
// 64 rows of Q and dO). The caller fences before.
template <typename T, int BLOCK_N, int D_TILE, u32 Q_PANEL, u32 KV_PANEL, int N_FRAGS>
__device__ __forceinline__ void issue_s_dp(float (&s_acc)[N_FRAGS][4], float (&dp_acc)[N_FRAGS][4], u32 q_rows,
                                           u32 do_rows, u32 k_tile, u32 v_tile) {
    wgmma_rows_times_rows<T, BLOCK_N, D_TILE, Q_PANEL, KV_PANEL>(reinterpret_cast<float(&)[N_FRAGS * 4]>(s_acc), q_rows,
                                                                 k_tile);
    wgmma_commit();
    wgmma_rows_times_rows<T, BLOCK_N, D_TILE, Q_PANEL, KV_PANEL>(reinterpret_cast<float(&)[N_FRAGS * 4]>(dp_acc),
                                                                 do_rows, v_tile);
    wgmma_commit();
}

// Steps 3-4 of a dQ step, once S has landed and while dP's product may still run: P
// (probabilities_dq); then, dP waited for, dS = P o (dP - D) (ds_dq), packed as the A fragments of
// dS K_j. Element (f, e) is row row_lo + 8 (e / 2), key n0 + 8 f + 2 (lane % 4) + e % 2.
template <typename T, int BLOCK_M, int BLOCK_N, class Mask, class Score, int N_FRAGS>
__device__ __forceinline__ void probabilities_and_ds_dq(u32 (&ds_frag)[BLOCK_N / 16][4], float (&s_acc)[N_FRAGS][4],
                                                        float (&dp_acc)[N_FRAGS][4], const Mask& mask,
                                                        const Score& score, const DropoutOf<Mask>& dropout,
                                                        const BwdParams& p, int m0, int n0, int row_lo,
                                                        float scale_log2, const float (&base_log2)[2],
                                                        const float (&delta_row)[2], int lane) {
    const bool partial = mask.partial(m0, BLOCK_M, n0, BLOCK_N);
    const int key0 = n0 + 2 * (lane % 4);
    const auto score_origin = score.origin(row_lo, key0, partial);
    probabilities_dq(s_acc, mask, score, score_origin, partial, row_lo, key0, scale_log2, base_log2);

    wgmma_wait<0>();
    pin_registers(reinterpret_cast<float(&)[N_FRAGS * 4]>(dp_acc));
    ds_dq<Mask>(dp_acc, s_acc, dropout, p, row_lo, key0, delta_row);
    pack_a_frags<T, BLOCK_N>(ds_frag, dp_acc);
}

// Step 5 of a dQ step: dQ += dS K_j (B = K_j MN-major: 16-key k-steps of 2048 bytes, 64-column
// atoms KV_PANEL apart), one commit group. The caller fences before.
template <typename T, int D_TILE, int BLOCK_N, u32 KV_PANEL, int D_FRAGS>
__device__ __forceinline__ void issue_ds_k(float (&dq_acc)[D_FRAGS][4], const u32 (&ds_frag)[BLOCK_N / 16][4],
                                           u32 k_tile) {
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk)
        Wgmma<T, D_TILE>::template rs<1>(reinterpret_cast<float(&)[D_FRAGS * 4]>(dq_acc), ds_frag[kk],
                                         smem_desc(k_tile + kk * 2048, KV_PANEL, 1024), 1);
    wgmma_commit();
}

// One product of steps 1-2, one commit group: acc = X_g Y^T, X a key tile (K or V; warpgroup wg's
// keys are its rows 64 wg .. 64 wg + 63), Y a query tile (Q or dO), k-steps over the head dim, both
// operands K-major (a 16-column k-step is 32 bytes into a panel). The first k-step overwrites the
// accumulator (scale-d = 0): nothing to zero.
template <typename T, class L, int BLOCK_M, int D_TILE, int SJ>
__device__ __forceinline__ void issue_keys_times_queries(float (&acc)[SJ][4], u32 key_tile, u32 query_tile, int wg) {
#pragma unroll
    for (int kk = 0; kk < D_TILE / 16; ++kk) {
        const u32 key_off = (kk / 4) * L::KV_PANEL + wg * 64 * 128 + (kk % 4) * 32;
        const u32 q_off = (kk / 4) * L::Q_PANEL + (kk % 4) * 32;
        Wgmma<T, BLOCK_M>::template ss<0, 0>(reinterpret_cast<float(&)[SJ * 4]>(acc),
                                             smem_desc(key_tile + key_off, 16, 1024),
                                             smem_desc(query_tile + q_off, 16, 1024), kk > 0);
    }
    wgmma_commit();
}

// Steps 1-2 of a dK/dV step (flash_bwd_wgmma, flash_bwd_wgmma_ws): S^T = K_g Q^T and dP^T =
// V_g dO^T, issued back to back. The caller fences before.
template <typename T, class L, int BLOCK_M, int D_TILE, int SJ>
__device__ __forceinline__ void issue_st_dpt(float (&s_acc)[SJ][4], float (&dp_acc)[SJ][4], u32 s_k, u32 s_v, u32 s_q,
                                             u32 s_do, int wg) {
    issue_keys_times_queries<T, L, BLOCK_M, D_TILE>(s_acc, s_k, s_q, wg);
    issue_keys_times_queries<T, L, BLOCK_M, D_TILE>(dp_acc, s_v, s_do, wg);
}

// Steps 6-7 of a dK/dV step: dV_g += P^T dO, dK_g += dS^T Q (A from registers; MN-major B: 16-row
// k-steps of 2048 bytes, 64-column atoms one panel apart), one commit group. The caller fences
// before.
template <typename T, class L, int D_TILE, int QK, int DJ>
__device__ __forceinline__ void issue_dv_dk(float (&dv_acc)[DJ][4], float (&dk_acc)[DJ][4], const u32 (&p_frag)[QK][4],
                                            const u32 (&ds_frag)[QK][4], u32 s_do, u32 s_q) {
#pragma unroll
    for (int kk = 0; kk < QK; ++kk)
        Wgmma<T, D_TILE>::template rs<1>(reinterpret_cast<float(&)[DJ * 4]>(dv_acc), p_frag[kk],
                                         smem_desc(s_do + kk * 2048, L::Q_PANEL, 1024), 1);
#pragma unroll
    for (int kk = 0; kk < QK; ++kk)
        Wgmma<T, D_TILE>::template rs<1>(reinterpret_cast<float(&)[DJ * 4]>(dk_acc), ds_frag[kk],
                                         smem_desc(s_q + kk * 2048, L::Q_PANEL, 1024), 1);
    wgmma_commit();
}

}  // namespace cf

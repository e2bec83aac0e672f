// flash_fwd_kvcache_mma: attention of a few new queries per sequence over a KV cache (decoding,
// speculative decoding, chunked prefill), float16 / bfloat16 on mma.sync, head dim up to D_TILE.
//
// The work of one sequence is cut two ways so that a decode step fills the GPU and reads each
// K/V byte once:
// - GQA packing: a CTA's BLOCK_M = 16 WARPS rows are (query, head) pairs of ONE kv head
//   (cache_rows.cuh, PackedRows), so the group's query heads share each K/V tile. One decode
//   query of a 32/8-head model is 4 rows of one 16-row strip: the tensor cores idle on the rest,
//   and the kernel stays bound by memory, which is what decoding is.
// - split-KV (flash-decoding): blockIdx.x = m_block * num_splits + split; split s visits keys
//   [s split_keys, (s + 1) split_keys) of the mask's range, and with num_splits > 1 writes its
//   O / l and lse to float32 partials that flash_fwd_combine.cu merges by the LSE rule.
// Keys come from the cache through the sequence's block table (CacheKeys: any page size, or a
// contiguous cache row), each sequence with its own seqlens_k[b] keys; the mask and score
// policies (mask.cuh, score.cuh) are the dense kernels', asked per query of each packed row.
//
// Per key block the steps are flash_fwd_mma's: S = Q K^T, the score's transform and the mask,
// the running max, P = exp2(S - m), O = rescale O + P V.
#include "cache_rows.cuh"
#include "mma.cuh"
#include "mma_fwd_steps.cuh"
#include "online_softmax.cuh"
#include "params.cuh"

namespace cf {

// Shared memory, mirrored by cupyflash/kernels/kvcache_mma.py (smem_bytes):
//   [Q: BLOCK_M x D_TILE] [stage 0: K, V: BLOCK_N x D_TILE each] [stage 1] ...
template <int D_TILE, int BLOCK_M, int BLOCK_N, int STAGES>
struct CacheSmemLayout {
    static constexpr u32 Q_BYTES = BLOCK_M * D_TILE * 2;
    static constexpr u32 KV_TILE_BYTES = BLOCK_N * D_TILE * 2;
    static constexpr u32 STAGE_BYTES = 2 * KV_TILE_BYTES;
    static constexpr u32 BYTES = Q_BYTES + STAGES * STAGE_BYTES;
    static __device__ __forceinline__ u32 k_tile(u32 base, int stage) { return base + Q_BYTES + stage * STAGE_BYTES; }
    static __device__ __forceinline__ u32 v_tile(u32 base, int stage) { return k_tile(base, stage) + KV_TILE_BYTES; }
};

// Scores of the warp's strip to log2 units: each of the lane's two rows (h) through the score of
// its own head and the mask row of its own query (packed rows: the row's query is not its index).
// `masked` is uniform over the block (Mask::keys_partial over the block's queries).
template <class Mask, class Score, int N_FRAGS>
__device__ __forceinline__ void scale_and_mask_packed(float (&s)[1][N_FRAGS][4], float scale_log2, bool masked,
                                                      const Mask& mask, const Score (&score)[2],
                                                      const int (&query)[2], int n0, int lane) {
    if constexpr (!Score::IDENTITY) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const typename Score::Origin origin = score[h].origin(query[h], n0 + 2 * (lane & 3));
#pragma unroll
            for (int f = 0; f < N_FRAGS; ++f)
#pragma unroll
                for (int e = 0; e < 2; ++e) s[0][f][2 * h + e] = score[h].transform(s[0][f][2 * h + e], origin, 0, 8 * f + e);
        }
    }
#pragma unroll
    for (int f = 0; f < N_FRAGS; ++f)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[0][f][e] *= scale_log2;
    if (!masked) return;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int key_end = mask.row_key_end(query[h]), key_begin = mask.row_key_begin(query[h]);
#pragma unroll
        for (int f = 0; f < N_FRAGS; ++f)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int key = n0 + 8 * f + 2 * (lane & 3) + e;
                if (key >= key_end || (Mask::HAS_LEFT && key < key_begin)) s[0][f][2 * h + e] = neg_inf<float>();
            }
    }
}

template <typename T, int D_TILE, class Mask, int WARPS, int BLOCK_N, int STAGES, bool PAGED, bool SPLIT>
__global__ void __launch_bounds__(WARPS * 32)
flash_fwd_kvcache_mma(const __grid_constant__ CacheFwdParams p) {
    constexpr int NTHREADS = WARPS * 32;
    constexpr int BLOCK_M = 16 * WARPS;
    constexpr int N_FRAGS = BLOCK_N / 8;
    constexpr int D_FRAGS = D_TILE / 8;
    // Q in registers up to d128 (32 of them); at d256 its 64 would crowd O's 128.
    constexpr bool Q_IN_REGS = D_TILE <= 128;
    constexpr int Q_STEPS = Q_IN_REGS ? D_TILE / 16 : 1;
    typedef CacheSmemLayout<D_TILE, BLOCK_M, BLOCK_N, STAGES> Smem;
    static_assert(BLOCK_N % 16 == 0 && D_TILE % 64 == 0 && STAGES >= 2, "tile shape");

    extern __shared__ __align__(128) unsigned char smem[];
    if (dynamic_smem_bytes() < Smem::BYTES) __trap();
    const u32 smem_base = smem_u32(smem);
    const u32 q_tile = smem_base;

    // --- the block's rows and keys -------------------------------------------------------------
    const int batch = blockIdx.z, head_kv = blockIdx.y;
    const int split = SPLIT ? blockIdx.x % p.num_splits : 0;
    const int m_block = SPLIT ? blockIdx.x / p.num_splits : blockIdx.x;
    const int seqlen_q = p.seqlen_q, headdim = p.headdim;
    const int seqlen_k = __ldg(p.seqlens_k + batch);
    const PackedRows rows{p.group, seqlen_q * p.group, head_kv};
    const int m0 = m_block * BLOCK_M;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int strip_row0 = 16 * warp;
    const Mask mask = sequence_mask<Mask>(p, seqlen_q, seqlen_k);
    const SequenceProblem problem{p.variant, seqlen_q, seqlen_k};

    // The block's queries, and the keys some of them see within this split.
    const int q_first = rows.query(m0), q_count = rows.query(m0 + BLOCK_M - 1) - q_first + 1;
    int n_begin = mask.key_begin(q_first), n_end = mask.key_end(q_first, q_count);
    if constexpr (SPLIT) {
        n_begin = max(n_begin, split * p.split_keys);
        n_end = min(n_end, (split + 1) * p.split_keys);
    }
    const int j_begin = n_begin / BLOCK_N;

    // The lane's two rows (h = 0, 1: rows lane / 4 and 8 + lane / 4 of the warp's strip): their
    // queries and heads, and a score function per head (ALiBi's slope and the sink are per head).
    typedef ScoreOf<Mask, float, true> Score;
    int query[2], head[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = m0 + strip_row0 + 8 * h + (lane >> 2);
        query[h] = rows.query(r);
        head[h] = rows.head(r);
    }
    const Score score[2] = {Score(problem, batch, head[0], p.scale), Score(problem, batch, head[1], p.scale)};

    const CacheKeys<PAGED> keys(p, batch, head_kv);
    const T* k_cache = static_cast<const T*>(p.k.data);
    const T* v_cache = static_cast<const T*>(p.v.data);
    auto load_kv_tile = [&](int block, int stage) {
        cp_async_cache_rows<BLOCK_N, D_TILE, NTHREADS>(Smem::k_tile(smem_base, stage), Smem::v_tile(smem_base, stage),
                                                       k_cache, v_cache, keys, block * BLOCK_N, seqlen_k, headdim,
                                                       threadIdx.x);
    };

    // --- prologue: Q, then STAGES - 1 key blocks (commit groups as in flash_fwd_mma) -------------
    cp_async_packed_rows<BLOCK_M, D_TILE, NTHREADS, T>(q_tile, p.q, batch, rows, m0, headdim, threadIdx.x);
    cp_async_commit();
#pragma unroll
    for (int ahead = 0; ahead < STAGES - 1; ++ahead) {
        const int j = j_begin + ahead;
        if (j * BLOCK_N < n_end) load_kv_tile(j, j % STAGES);
        cp_async_commit();
    }

    const FragmentAddress<D_TILE> a_addr(lane & 15, lane >> 4);
    const FragmentAddress<D_TILE> k_addr(((lane >> 4) << 3) + (lane & 7), (lane >> 3) & 1);
    const u32 q_strip = q_tile + strip_row0 * D_TILE * 2;
    u32 q_frag[1][Q_STEPS][4];
    if constexpr (Q_IN_REGS) {
        cp_async_wait<STAGES - 1>();
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < Q_STEPS; ++kk) ldmatrix_x4(q_frag[0][kk], a_addr(q_strip, 0, kk));
    }

    float o_acc[1][D_FRAGS][4];
    RowStats<RowState::ALL_LANES, 1> row_stats;
#pragma unroll
    for (int f = 0; f < D_FRAGS; ++f)
#pragma unroll
        for (int e = 0; e < 4; ++e) o_acc[0][f][e] = 0.f;

    // --- the key loop ----------------------------------------------------------------------------
    for (int j = j_begin; j * BLOCK_N < n_end; ++j) {
        const int stage = j % STAGES;
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        {
            const int ahead = j + STAGES - 1;
            if (ahead * BLOCK_N < n_end) load_kv_tile(ahead, ahead % STAGES);
            cp_async_commit();
        }
        float s[1][N_FRAGS][4];
        mma_qk<T, D_TILE>(s, q_frag, q_strip, a_addr, Smem::k_tile(smem_base, stage), k_addr);
        const int n0 = j * BLOCK_N;
        const bool masked = mask.keys_partial(q_first, q_count, n0, BLOCK_N);
        scale_and_mask_packed(s, p.scale_log2, masked, mask, score, query, n0, lane);
        float m_new[1][2];
        row_max(m_new, s, row_stats, lane);
        softmax_rescale(s, o_acc, row_stats, m_new, lane);
        u32 p_frag[1][N_FRAGS / 2][4];
        pack_p<T>(p_frag, s);
        mma_pv<T, D_TILE>(o_acc, p_frag, Smem::v_tile(smem_base, stage), a_addr);
    }
    cp_async_wait<0>();  // a block that saw no key may still have copies in flight

    // --- epilogue: each row to its own (query, head) -----------------------------------------------
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float m, l;
        row_stats.get(0, h, lane, m, l);
        const int r = m0 + strip_row0 + 8 * h + (lane >> 2);
        if (r >= rows.rows) continue;
        const i64 row_id = ((i64)batch * p.nheads + head[h]) * seqlen_q + query[h];  // (batch, head, query)
        float inv_l, lse;
        if constexpr (SPLIT) {
            // O / l and lse of this split alone; the sink joins once, in the combine.
            inv_l = l > 0.f ? 1.f / l : 0.f;
            lse = l > 0.f ? (m + __log2f(l)) * 0.6931471805599453f : neg_inf<float>();
            const i64 part = (i64)split * p.batch * p.nheads * seqlen_q + row_id;
            if ((lane & 3) == 0) p.lse_partial[part] = lse;
            if (l > 0.f) {  // a split that saw no key of this row: the combine reads its lse only
                float* o_row = p.o_partial + part * headdim;
#pragma unroll
                for (int f = 0; f < D_FRAGS; ++f)
                    if (8 * f < headdim)
                        *reinterpret_cast<float2*>(o_row + 8 * f + 2 * (lane & 3)) =
                            make_float2(o_acc[0][f][2 * h] * inv_l, o_acc[0][f][2 * h + 1] * inv_l);
            }
        } else {
            if constexpr (Mask::Score::HAS_SINK) {
                finish_row_with_sink(m, l, sink_log2<Mask, float>(p, head[h]), inv_l, lse);
            } else {
                inv_l = l > 0.f ? 1.f / l : 0.f;
                lse = l > 0.f ? (m + __log2f(l)) * 0.6931471805599453f : neg_inf<float>();
            }
            if ((lane & 3) == 0) static_cast<float*>(p.lse)[row_id] = lse;
            T* o_row = p.o.row<T>(batch, query[h], head[h]);
#pragma unroll
            for (int f = 0; f < D_FRAGS; ++f)
                if (8 * f < headdim)
                    *reinterpret_cast<u32*>(o_row + 8 * f + 2 * (lane & 3)) =
                        pack2<T>(o_acc[0][f][2 * h] * inv_l, o_acc[0][f][2 * h + 1] * inv_l);
        }
    }
}

}  // namespace cf

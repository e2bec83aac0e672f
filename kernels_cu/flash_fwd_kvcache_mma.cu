// flash_fwd_kvcache_mma: attention of a few new queries per sequence over a KV cache (decoding,
// speculative decoding, chunked prefill), float16 / bfloat16 on mma.sync, head dim up to D_TILE.
//
// The work of one sequence is cut three ways so that a decode step fills the GPU and reads each
// K/V byte once:
// - GQA packing: a CTA's BLOCK_M = 16 ROW_WARPS rows are (query, head) pairs of ONE kv head
//   (cache_rows.cuh, PackedRows), so the group's query heads share each K/V tile. One decode
//   query of a 32/8-head model is 4 rows of one 16-row strip: the tensor cores idle on the rest,
//   and the kernel stays bound by memory, which is what decoding is.
// - split-KV (flash-decoding): blockIdx.x = m_block * num_splits + split; split s visits keys
//   [s split_keys, (s + 1) split_keys) of the mask's range, and with num_splits > 1 writes its
//   O / l and lse to float32 partials that flash_fwd_combine.cu merges by the LSE rule.
// - keys across warps: the KEY_WARPS warps of a row strip take WARP_KEYS = BLOCK_N / KEY_WARPS
//   keys each of every tile, with their own running max, sum and O, merged through shared memory
//   at the end in a fixed order (merge_key_warps). A decode CTA is then 4 warps on one 16-row
//   strip: 4 times the warps per SM of one warp per strip for the same shared memory, which is
//   what hides the latency of the loads and of the mma chains when each warp has little to do.
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
//   [Q: BLOCK_M x D_TILE] [stage 0: K, V: BLOCK_N x D_TILE each] [stage 1] ... [paged: RowOffsetRing]
template <int D_TILE, int BLOCK_M, int BLOCK_N, int STAGES, u32 RING_BYTES>
struct CacheSmemLayout {
    static constexpr u32 Q_BYTES = BLOCK_M * D_TILE * 2;
    static constexpr u32 KV_TILE_BYTES = BLOCK_N * D_TILE * 2;
    static constexpr u32 STAGE_BYTES = 2 * KV_TILE_BYTES;
    static constexpr u32 BYTES = Q_BYTES + STAGES * STAGE_BYTES + RING_BYTES;
    static __device__ __forceinline__ u32 k_tile(u32 base, int stage) { return base + Q_BYTES + stage * STAGE_BYTES; }
    static __device__ __forceinline__ u32 v_tile(u32 base, int stage) { return k_tile(base, stage) + KV_TILE_BYTES; }
    static __device__ __forceinline__ u32 ring(u32 base) { return base + Q_BYTES + STAGES * STAGE_BYTES; }
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

// The epilogue of one row: the factor of its O (1 / l, or with a sink finish_row_with_sink's) and
// its lse, from the running max m and sum l in log2 units. SPLIT: the split's own O / l and lse,
// without the sink, which joins once in the combine.
template <class Mask, bool SPLIT>
__device__ __forceinline__ void finish_row(float m, float l, const CacheFwdParams& p, int head, float& o_factor,
                                           float& lse) {
    if constexpr (!SPLIT && Mask::Score::HAS_SINK) {
        finish_row_with_sink(m, l, sink_log2<Mask, float>(p, head), o_factor, lse);
    } else {
        o_factor = l > 0.f ? 1.f / l : 0.f;
        lse = l > 0.f ? (m + __log2f(l)) * 0.6931471805599453f : neg_inf<float>();
    }
}

// Where row r's results go: lse at (batch, head, query) of p.lse or (split, ...) of p.lse_partial,
// O at the row of o or of o_partial. `id` is (batch, head, query) flattened.
template <bool SPLIT>
__device__ __forceinline__ i64 result_row(const CacheFwdParams& p, int split, int batch, int head, int query) {
    const i64 id = ((i64)batch * p.nheads + head) * p.seqlen_q + query;
    return SPLIT ? (i64)split * p.batch * p.nheads * p.seqlen_q + id : id;
}

// The epilogue of KEY_WARPS warps that took different keys of the same 16 rows: each warp's
// (m, l, O) through shared memory, merged in warp order (deterministic), then the rows stored.
//   M = max_w m_w    L = sum_w l_w 2^(m_w - M)    O = (sum_w 2^(m_w - M) O_w) o_factor(M, L)
// Stats go to `stats` (2 KEY_WARPS x 16 floats), the warps' O (float32, 16 x D_TILE each, a
// warp's fragments at their own columns) to `o_tiles`, both free once the key loop is done.
template <typename T, int D_TILE, class Mask, int KEY_WARPS, bool SPLIT, int D_FRAGS>
__device__ __forceinline__ void merge_key_warps(const float (&o)[1][D_FRAGS][4],
                                                const RowStats<RowState::ALL_LANES, 1>& row_stats,
                                                const CacheFwdParams& p, u32 stats, u32 o_tiles,
                                                const PackedRows& rows, int m0, int split, int batch, int lane) {
    constexpr int NTHREADS = 32 * KEY_WARPS;
    const int warp = threadIdx.x / 32;
    __syncthreads();  // every warp is done with the tiles (and Q) the merge reuses
    float m[2], l[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        row_stats.get(0, h, lane, m[h], l[h]);
        const int r = 8 * h + (lane >> 2);
        if ((lane & 3) == 0) {
            st_shared_b32(stats + 4 * (warp * 16 + r), __float_as_uint(m[h]));
            st_shared_b32(stats + 4 * ((KEY_WARPS + warp) * 16 + r), __float_as_uint(l[h]));
        }
    }
    __syncthreads();
    // This warp's share of each of its rows: 2^(m_w - M).
    float share[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = 8 * h + (lane >> 2);
        float top = neg_inf<float>();
#pragma unroll
        for (int w = 0; w < KEY_WARPS; ++w) top = fmaxf(top, __uint_as_float(ld_shared_b32(stats + 4 * (w * 16 + r))));
        share[h] = m[h] == neg_inf<float>() ? 0.f : exp2_approx(m[h] - top);
    }
    const u32 tile = o_tiles + warp * 16 * D_TILE * 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = 8 * h + (lane >> 2);
#pragma unroll
        for (int f = 0; f < D_FRAGS; ++f) {
            const u32 at = tile + 4 * (r * D_TILE + 8 * f + 2 * (lane & 3));
            st_shared_b32(at, __float_as_uint(o[0][f][2 * h] * share[h]));
            st_shared_b32(at + 4, __float_as_uint(o[0][f][2 * h + 1] * share[h]));
        }
    }
    __syncthreads();
    // Every thread: 4 consecutive columns of one row at a time, summed over the warps in order.
    const int headdim = p.headdim_v;  // of o
    for (int idx = threadIdx.x; idx < 16 * D_TILE / 4; idx += NTHREADS) {
        const int r = idx / (D_TILE / 4), c = 4 * (idx % (D_TILE / 4));
        if (m0 + r >= rows.rows || c >= headdim) continue;
        float top = neg_inf<float>(), total = 0.f;
#pragma unroll
        for (int w = 0; w < KEY_WARPS; ++w) top = fmaxf(top, __uint_as_float(ld_shared_b32(stats + 4 * (w * 16 + r))));
#pragma unroll
        for (int w = 0; w < KEY_WARPS; ++w) {
            const float m_w = __uint_as_float(ld_shared_b32(stats + 4 * (w * 16 + r)));
            const float l_w = __uint_as_float(ld_shared_b32(stats + 4 * ((KEY_WARPS + w) * 16 + r)));
            total += m_w == neg_inf<float>() ? 0.f : l_w * exp2_approx(m_w - top);
        }
        const int head = rows.head(m0 + r), query = rows.query(m0 + r);
        float o_factor, lse;
        finish_row<Mask, SPLIT>(top, total, p, head, o_factor, lse);
        const i64 out = result_row<SPLIT>(p, split, batch, head, query);
        if (c == 0) (SPLIT ? p.lse_partial : static_cast<float*>(p.lse))[out] = lse;
        if (SPLIT && total == 0.f) continue;  // the combine reads this split's lse only
        float x[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int w = 0; w < KEY_WARPS; ++w) {
            u32 v[4];
            ld_shared_v4(v, o_tiles + w * 16 * D_TILE * 4 + 4 * (r * D_TILE + c));
#pragma unroll
            for (int e = 0; e < 4; ++e) x[e] += __uint_as_float(v[e]);
        }
        if constexpr (SPLIT) {
            *reinterpret_cast<float4*>(p.o_partial + out * headdim + c) =
                make_float4(x[0] * o_factor, x[1] * o_factor, x[2] * o_factor, x[3] * o_factor);
        } else {
            T* o_row = p.o.row<T>(batch, query, head) + c;
            *reinterpret_cast<uint2*>(o_row) = make_uint2(pack2<T>(x[0] * o_factor, x[1] * o_factor),
                                                          pack2<T>(x[2] * o_factor, x[3] * o_factor));
        }
    }
}

// P V with P in two parts for bfloat16 (P_TWICE): P = hi + lo, hi = bf16(P) and lo = bf16(P - hi),
// O += hi V + lo V with V's fragments loaded once. bfloat16's 8-bit P is the largest error of a
// 16-bit forward (each P off by up to 2^-9 relative, rounded before the normalisation that
// standard attention rounds after); two products make P good to about 2^-17, and cost nothing
// where this kernel runs: a decode step is bound by memory, its tensor cores mostly idle. One
// H200 property example (a 16-key row, d8) had put the one-part kernel at 0.8 ulp of o, past
// the test rule of twice standard attention's error (docs/perf-log.md, "kvcache"). The decode
// tiles only (one row strip): with four strips the second product made ptxas spill, and those
// tiles' P is then the dense kernels' one-part P.
template <typename T>
struct TwoPartP {
    static constexpr bool ON = false;
};
template <>
struct TwoPartP<bf16_t> {
    static constexpr bool ON = true;
};

template <typename T, int D_TILE, int P_STEPS, int D_FRAGS>
__device__ __forceinline__ void mma_pv_two_parts(float (&o)[1][D_FRAGS][4], const u32 (&hi)[1][P_STEPS][4],
                                                 const u32 (&lo)[1][P_STEPS][4], u32 v_tile,
                                                 const FragmentAddress<D_TILE>& v_addr) {
#pragma unroll
    for (int kk = 0; kk < P_STEPS; ++kk) {
#pragma unroll
        for (int f = 0; f < D_FRAGS; f += 2) {
            u32 b[4];
            ldmatrix_x4_trans(b, v_addr(v_tile, kk, f / 2));
            mma_16816<T>(o[0][f], hi[0][kk], b[0], b[1]);
            mma_16816<T>(o[0][f + 1], hi[0][kk], b[2], b[3]);
            mma_16816<T>(o[0][f], lo[0][kk], b[0], b[1]);
            mma_16816<T>(o[0][f + 1], lo[0][kk], b[2], b[3]);
        }
    }
}

// The low parts of P: lo = P - hi for each bfloat16 pair of hi (a bfloat16 is the top half of
// its float).
template <int P_STEPS, int N_FRAGS>
__device__ __forceinline__ void p_low_parts(u32 (&lo)[1][P_STEPS][4], const u32 (&hi)[1][P_STEPS][4],
                                            const float (&s)[1][N_FRAGS][4]) {
#pragma unroll
    for (int kk = 0; kk < P_STEPS; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int f = 2 * kk + e / 2, x = 2 * (e % 2);  // hi[kk][e] holds s[f][x], s[f][x + 1]
            const float h0 = __uint_as_float(hi[0][kk][e] << 16), h1 = __uint_as_float(hi[0][kk][e] & 0xffff0000u);
            lo[0][kk][e] = pack2<bf16_t>(s[0][f][x] - h0, s[0][f][x + 1] - h1);
        }
}

// Launch bounds: the four-strip tiles say "one block per SM at least", which lets ptxas use up to
// 255 registers; left to itself (a minimum of 0 is none) it held them to 168 and spilled up to 28
// bytes at d128. The decode tiles keep ptxas's own choice (164-168 registers, no spills), which
// is what the H200 measured.
template <typename T, int D_TILE, class Mask, int ROW_WARPS, int KEY_WARPS, int BLOCK_N, int STAGES, bool PAGED,
          bool SPLIT>
__global__ void __launch_bounds__(ROW_WARPS * KEY_WARPS * 32, ROW_WARPS > 1 ? 1 : 0)
flash_fwd_kvcache_mma(const __grid_constant__ CacheFwdParams p) {
    constexpr int NTHREADS = ROW_WARPS * KEY_WARPS * 32;
    constexpr int BLOCK_M = 16 * ROW_WARPS;
    constexpr int WARP_KEYS = BLOCK_N / KEY_WARPS;
    constexpr int N_FRAGS = WARP_KEYS / 8;
    constexpr int D_FRAGS = D_TILE / 8;
    // Q in registers up to d128 (32 of them); at d256 its 64 would crowd O's 128.
    constexpr bool Q_IN_REGS = D_TILE <= 128;
    constexpr int Q_STEPS = Q_IN_REGS ? D_TILE / 16 : 1;
    typedef RowOffsetRing<BLOCK_N, NTHREADS, STAGES> Ring;
    typedef CacheSmemLayout<D_TILE, BLOCK_M, BLOCK_N, STAGES, PAGED ? Ring::BYTES : 0> Smem;
    static_assert(WARP_KEYS % 16 == 0 && BLOCK_N == KEY_WARPS * WARP_KEYS && D_TILE % 64 == 0 && STAGES >= 2,
                  "tile shape: whole 16-key steps per warp");
    static_assert(KEY_WARPS == 1 || ROW_WARPS == 1, "keys across warps: one row strip");
    static_assert(KEY_WARPS == 1 || (KEY_WARPS * 16 * D_TILE * 4 <= STAGES * Smem::STAGE_BYTES &&
                                     2 * KEY_WARPS * 16 * 4 <= Smem::Q_BYTES), "merge_key_warps' shared memory");

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
    const int key_warp = warp % KEY_WARPS;
    const int strip_row0 = 16 * (warp / KEY_WARPS);
    const u32 warp_keys = key_warp * WARP_KEYS * D_TILE * 2;  // the warp's rows of a K or V tile
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
    typedef ScoreOf<Mask, float, Tanh::EXP_RCP> Score;
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
                                                       p.headdim_v, threadIdx.x);
    };
    // Paged caches: the key loop's tiles from row offsets worked out a tile ahead, from table
    // entries copied STAGES tiles before that (RowOffsetRing).
    const Ring ring{Smem::ring(smem_base)};
    auto load_kv_tile_in_loop = [&](int block, int stage) {
        if constexpr (PAGED) {
            cp_async_cache_rows<BLOCK_N, D_TILE, NTHREADS>(Smem::k_tile(smem_base, stage),
                                                           Smem::v_tile(smem_base, stage), k_cache, v_cache, ring,
                                                           block, seqlen_k, headdim, p.headdim_v, threadIdx.x);
        } else {
            load_kv_tile(block, stage);
        }
    };

    // --- prologue: Q, then STAGES - 1 key blocks (commit groups as in flash_fwd_mma), each with
    // the table entries of the block STAGES after it (paged) ----------------------------------------
    cp_async_packed_rows<BLOCK_M, D_TILE, NTHREADS, T>(q_tile, p.q, batch, rows, m0, headdim, threadIdx.x);
    cp_async_commit();
#pragma unroll
    for (int ahead = 0; ahead < STAGES - 1; ++ahead) {
        const int j = j_begin + ahead;
        if (j * BLOCK_N < n_end) load_kv_tile(j, j % STAGES);
        if (PAGED && (j + STAGES) * BLOCK_N < n_end) ring.request(keys, j + STAGES, seqlen_k, threadIdx.x);
        cp_async_commit();
    }
    if constexpr (PAGED) {  // the first tile the key loop loads (the loop's barrier orders it)
        const int j = j_begin + STAGES - 1;
        if (j * BLOCK_N < n_end) ring.fill(keys, j, seqlen_k, threadIdx.x);
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
        const int ahead = j + STAGES - 1;
        if (ahead * BLOCK_N < n_end) load_kv_tile_in_loop(ahead, ahead % STAGES);
        // Paged: the table entries of block ahead + STAGES go out with these copies; those of
        // the block after `ahead` (copied with tile j's, which the wait above covers) are read
        // now, and its offsets stored after this tile's math.
        if (PAGED && (ahead + STAGES) * BLOCK_N < n_end) ring.request(keys, ahead + STAGES, seqlen_k, threadIdx.x);
        cp_async_commit();
        const bool look_ahead = PAGED && (ahead + 1) * BLOCK_N < n_end;
        typename Ring::Pending pending;
        if (look_ahead) pending = ring.requested(keys, ahead + 1, threadIdx.x);
        float s[1][N_FRAGS][4];
        mma_qk<T, D_TILE>(s, q_frag, q_strip, a_addr, Smem::k_tile(smem_base, stage) + warp_keys, k_addr);
        const bool masked = mask.keys_partial(q_first, q_count, j * BLOCK_N, BLOCK_N);
        scale_and_mask_packed(s, p.scale_log2, masked, mask, score, query, j * BLOCK_N + key_warp * WARP_KEYS, lane);
        float m_new[1][2];
        row_max(m_new, s, row_stats, lane);
        softmax_rescale(s, o_acc, row_stats, m_new, lane);
        u32 p_frag[1][N_FRAGS / 2][4];
        pack_p<T>(p_frag, s);
        if constexpr (TwoPartP<T>::ON && ROW_WARPS == 1) {  // the decode tiles (four row strips would spill)
            u32 p_low[1][N_FRAGS / 2][4];
            p_low_parts(p_low, p_frag, s);
            mma_pv_two_parts<T, D_TILE>(o_acc, p_frag, p_low, Smem::v_tile(smem_base, stage) + warp_keys, a_addr);
        } else {
            mma_pv<T, D_TILE>(o_acc, p_frag, Smem::v_tile(smem_base, stage) + warp_keys, a_addr);
        }
        if (look_ahead) ring.store(keys, pending, ahead + 1, threadIdx.x);
    }
    cp_async_wait<0>();  // a block that saw no key may still have copies in flight
    if constexpr (KEY_WARPS > 1) {
        merge_key_warps<T, D_TILE, Mask, KEY_WARPS, SPLIT>(o_acc, row_stats, p, smem_base, Smem::k_tile(smem_base, 0),
                                                           rows, m0, split, batch, lane);
        return;
    }

    // --- epilogue: each row to its own (query, head) -----------------------------------------------
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float m, l;
        row_stats.get(0, h, lane, m, l);
        const int r = m0 + strip_row0 + 8 * h + (lane >> 2);
        if (r >= rows.rows) continue;
        float o_factor, lse;
        finish_row<Mask, SPLIT>(m, l, p, head[h], o_factor, lse);
        const i64 out = result_row<SPLIT>(p, split, batch, head[h], query[h]);
        if ((lane & 3) == 0) (SPLIT ? p.lse_partial : static_cast<float*>(p.lse))[out] = lse;
        if constexpr (SPLIT) {
            if (l == 0.f) continue;  // a split that saw no key of this row: the combine reads its lse only
            float* o_row = p.o_partial + out * p.headdim_v;
#pragma unroll
            for (int f = 0; f < D_FRAGS; ++f)
                if (8 * f < p.headdim_v)
                    *reinterpret_cast<float2*>(o_row + 8 * f + 2 * (lane & 3)) =
                        make_float2(o_acc[0][f][2 * h] * o_factor, o_acc[0][f][2 * h + 1] * o_factor);
        } else {
            T* o_row = p.o.row<T>(batch, query[h], head[h]);
#pragma unroll
            for (int f = 0; f < D_FRAGS; ++f)
                if (8 * f < p.headdim_v)
                    *reinterpret_cast<u32*>(o_row + 8 * f + 2 * (lane & 3)) =
                        pack2<T>(o_acc[0][f][2 * h] * o_factor, o_acc[0][f][2 * h + 1] * o_factor);
        }
    }
}

}  // namespace cf

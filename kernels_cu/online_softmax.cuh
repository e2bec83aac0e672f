// The online softmax of the forward kernels (flash_fwd_mma.cu, flash_fwd_wgmma.cu), on S and O
// held as m16n8 accumulator fragments: a warp owns M_STRIPS strips of 16 rows, fragment [i][f]
// covering columns 8f..8f+7 of strip i (mma.cuh; wgmma's accumulators have the same layout, with
// M_STRIPS = 1 per warp). Scaling and masking, the running maximum m and sum l (RowStats), the
// rescale of O, P packed as A fragments, and the epilogue O / l with lse.
#pragma once

#include "common.cuh"
#include "mask.cuh"
#include "mma.cuh"

namespace cf {

// Scores to log2 units; keys the mask hides from a row (past the end of the sequence, outside
// its band: mask.cuh) become -inf. `masked` is uniform over the block (Mask::keys_partial): only
// the blocks that cross a bound of the band pay for the compares.
// The score policy's transform (score.cuh; none for the plain softmax) takes the raw scores to
// log2 units itself (transform_scaled: the scale folded into its constants, so that softcap costs
// two FP32 operations a score fewer and ALiBi one than a transform followed by this multiply).
// A user mask with a block map evaluates its predicate on the masked blocks only: the transform is
// unrolled once for each value of `masked`, so a full block's code has no trace of it.
// BELOW_BOUND (block_softmax's fixed maximum): the scores less the policy's bound
// (below_bound_scaled), which the weights' exponentials then take as they are.
template <class Mask, class Score, int M_STRIPS, int N_FRAGS, bool BELOW_BOUND = false>
__device__ __forceinline__ void transform_scores(float (&s)[M_STRIPS][N_FRAGS][4], float scale_log2, bool masked,
                                                 const Score& score, int row0, int n0, int lane) {
#pragma unroll
    for (int i = 0; i < M_STRIPS; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const typename Score::Origin origin = score.origin(row0 + 16 * i + 8 * h + (lane >> 2),
                                                               n0 + 2 * (lane & 3), masked);
#pragma unroll
            for (int f = 0; f < N_FRAGS; ++f)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    if constexpr (BELOW_BOUND)
                        s[i][f][2 * h + e] = score.below_bound_scaled(s[i][f][2 * h + e], origin, 0, 8 * f + e,
                                                                      scale_log2);
                    else
                        s[i][f][2 * h + e] = score.template transform_scaled<Mask::RIGHT_IS_DIAGONAL>(
                            s[i][f][2 * h + e], origin, 0, 8 * f + e, scale_log2);
                }
        }
}

// SKIP_WHOLE false: a kernel at its register limit keeps the predicate on every block (one copy
// of the transform).
template <class Mask, class Score, int M_STRIPS, int N_FRAGS, bool SKIP_WHOLE = true, bool BELOW_BOUND = false>
__device__ __forceinline__ void scale_and_mask(float (&s)[M_STRIPS][N_FRAGS][4], float scale_log2,
                                               bool masked, const Mask& mask, const Score& score,
                                               int row0, int n0, int lane) {
    if constexpr (Score::SKIPS_FULL_BLOCKS && SKIP_WHOLE) {
        if (masked) transform_scores<Mask, Score, M_STRIPS, N_FRAGS, BELOW_BOUND>(s, scale_log2, true, score, row0, n0, lane);
        else transform_scores<Mask, Score, M_STRIPS, N_FRAGS, BELOW_BOUND>(s, scale_log2, false, score, row0, n0, lane);
    } else if constexpr (!Score::IDENTITY) {
        transform_scores<Mask, Score, M_STRIPS, N_FRAGS, BELOW_BOUND>(s, scale_log2, true, score, row0, n0, lane);
    } else {
#pragma unroll
        for (int i = 0; i < M_STRIPS; ++i)
#pragma unroll
            for (int f = 0; f < N_FRAGS; ++f)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[i][f][e] *= scale_log2;
    }
    if (!masked) return;
#pragma unroll
    for (int i = 0; i < M_STRIPS; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + 16 * i + 8 * h + (lane >> 2);
            const int key_end = mask.row_key_end(row), key_begin = mask.row_key_begin(row);
#pragma unroll
            for (int f = 0; f < N_FRAGS; ++f)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = n0 + 8 * f + 2 * (lane & 3) + e;
                    if (key >= key_end || (Mask::HAS_LEFT && key < key_begin))
                        s[i][f][2 * h + e] = neg_inf<float>();
                }
        }
}

// Subtraction base of the exponentials of a row with running maximum m_new. A row with every key
// masked so far has m_new = -inf; subtracting 0 instead keeps exp2(-inf - base) = 0 rather than NaN.
__device__ __forceinline__ float exp2_base(float m_new) {
    return m_new == neg_inf<float>() ? 0.f : m_new;
}

// Sums over the quad of lanes 4g..4g+3 of ROWS per-lane partial row sums (ROWS = 2 strips x 2
// halves, or 2 for one strip), scattered: lane t of the quad gets the full sum of row t % ROWS.
// A reduce-scatter needs 3 shuffles for 4 rows where all-reducing each row needs 8.
template <int ROWS>
__device__ __forceinline__ float quad_sum_scatter(const float (&x)[ROWS], int lane) {
    static_assert(ROWS == 2 || ROWS == 4, "2 or 4 rows per lane");
    const bool odd = lane & 1;
    // Step 1 (lanes t, t ^ 1): keep rows with t's parity, hand over the others.
    float a0 = odd ? x[1] : x[0];
    a0 += __shfl_xor_sync(0xffffffffu, odd ? x[0] : x[1], 1);
    if constexpr (ROWS == 2) {
        return a0 + __shfl_xor_sync(0xffffffffu, a0, 2);
    } else {
        float a1 = odd ? x[3] : x[2];
        a1 += __shfl_xor_sync(0xffffffffu, odd ? x[2] : x[3], 1);
        // Step 2 (lanes t, t ^ 2): a0 holds row (t & 1), a1 row 2 + (t & 1); keep row t.
        const bool high = lane & 2;
        return (high ? a1 : a0) + __shfl_xor_sync(0xffffffffu, high ? a0 : a1, 2);
    }
}

// Where the running maximum m and sum l of the online softmax live. A lane's fragments cover
// 2 M_STRIPS rows (i, h): row 16 i + 8 h + lane / 4 of the warp's strips, r = 2 i + h; the 4
// lanes of a quad share each of them.
enum class RowState {
    // Every lane of the quad holds m and l of all its rows (FlashAttention-2): m is the same on
    // the 4 lanes, l is the lane's partial sum, reduced over the quad once, in the epilogue.
    // 4 M_STRIPS registers; the key loop shuffles only to reduce the row maxima.
    ALL_LANES,
    // Lane t of the quad holds m and the full l of row t % (2 M_STRIPS) only: 2 registers, for
    // 3 + 2 M_STRIPS more shuffles per key block (reduce-scatter of the row sums, broadcast of
    // the rescale factors).
    ONE_LANE,
};

// RowStats<LAYOUT, M_STRIPS>: m and l of the lane's rows in layout LAYOUT, with the four steps
// the online softmax takes on them:
//   old_max(i, h, lane)      this lane's input to the quad maximum that gives m_new of row (i, h)
//   take_max(m_new, lane)    m = m_new; returns the Rescale factors exp2(m_old - m_new),
//                            rescale.row(i, h, lane) being that of row (i, h)
//   add_sums(rescale, row_sum, lane)   l = rescale l + row_sum, row_sum the lane's partial sums
//   hold_bound(bound, row_sum, weight_sum, lane)   block_softmax's fixed maximum (ALL_LANES only:
//                            the producer forward's): m = bound, l += row_sum, and the sum of the
//                            16-bit weights += weight_sum
//   weights(i, h, lane)      that sum of row (i, h), on every lane of the quad
//   get(i, h, lane, m, l)    the final m and full l of row (i, h), on every lane of the quad
template <RowState LAYOUT, int M_STRIPS>
struct RowStats;

template <int M_STRIPS>
struct RowStats<RowState::ALL_LANES, M_STRIPS> {
    float m[M_STRIPS][2];
    float l[M_STRIPS][2];  // this lane's partial sums
    float w[M_STRIPS][2];  // block_softmax's fixed maximum: this lane's partial sums of the 16-bit weights

    struct Rescale {
        float factor[M_STRIPS][2];
        __device__ __forceinline__ float row(int i, int h, int) const { return factor[i][h]; }
    };

    __device__ __forceinline__ RowStats() {
#pragma unroll
        for (int i = 0; i < M_STRIPS; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                m[i][h] = neg_inf<float>();
                l[i][h] = 0.f;
                w[i][h] = 0.f;
            }
    }
    __device__ __forceinline__ float old_max(int i, int h, int) const { return m[i][h]; }
    __device__ __forceinline__ Rescale take_max(const float (&m_new)[M_STRIPS][2], int) {
        Rescale rescale;
#pragma unroll
        for (int i = 0; i < M_STRIPS; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                rescale.factor[i][h] = exp2_approx(m[i][h] - exp2_base(m_new[i][h]));
                m[i][h] = m_new[i][h];
            }
        return rescale;
    }
    __device__ __forceinline__ void add_sums(const Rescale& rescale,
                                             const float (&row_sum)[M_STRIPS][2], int) {
#pragma unroll
        for (int i = 0; i < M_STRIPS; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) l[i][h] = l[i][h] * rescale.factor[i][h] + row_sum[i][h];
    }
    __device__ __forceinline__ void hold_bound(float bound, const float (&row_sum)[M_STRIPS][2],
                                               const float (&weight_sum)[M_STRIPS][2], int) {
#pragma unroll
        for (int i = 0; i < M_STRIPS; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                m[i][h] = bound;
                l[i][h] += row_sum[i][h];
                w[i][h] += weight_sum[i][h];
            }
    }
    __device__ __forceinline__ float weights(int i, int h, int) const { return group_sum<4>(w[i][h]); }
    __device__ __forceinline__ void get(int i, int h, int, float& m_row, float& l_row) const {
        m_row = m[i][h];
        l_row = group_sum<4>(l[i][h]);
    }
};

template <int M_STRIPS>
struct RowStats<RowState::ONE_LANE, M_STRIPS> {
    static constexpr int ROWS = 2 * M_STRIPS;
    float m, l;  // of row own_row(lane)

    static __device__ __forceinline__ int own_row(int lane) { return (lane & 3) % ROWS; }
    static __device__ __forceinline__ int holder(int i, int h, int lane) {
        return (lane & ~3) | (2 * i + h);
    }

    struct Rescale {
        float own;  // factor of the lane's own row; the others' are fetched from their holders
        __device__ __forceinline__ float row(int i, int h, int lane) const {
            return __shfl_sync(0xffffffffu, own, holder(i, h, lane));
        }
    };

    __device__ __forceinline__ RowStats() : m(neg_inf<float>()), l(0.f) {}
    __device__ __forceinline__ float old_max(int i, int h, int lane) const {
        return own_row(lane) == 2 * i + h ? m : neg_inf<float>();
    }
    __device__ __forceinline__ Rescale take_max(const float (&m_new)[M_STRIPS][2], int lane) {
        const int own = own_row(lane);
        float own_m_new = m_new[0][0];
#pragma unroll
        for (int r = 1; r < ROWS; ++r)
            if (own == r) own_m_new = m_new[r / 2][r % 2];
        const Rescale rescale{exp2_approx(m - exp2_base(own_m_new))};
        m = own_m_new;
        return rescale;
    }
    __device__ __forceinline__ void add_sums(const Rescale& rescale,
                                             const float (&row_sum)[M_STRIPS][2], int lane) {
        float rows[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) rows[r] = row_sum[r / 2][r % 2];
        l = l * rescale.own + quad_sum_scatter(rows, lane);
    }
    __device__ __forceinline__ void get(int i, int h, int lane, float& m_row, float& l_row) const {
        m_row = __shfl_sync(0xffffffffu, m, holder(i, h, lane));
        l_row = __shfl_sync(0xffffffffu, l, holder(i, h, lane));
    }
};

// New running maxima of the rows of the warp's strips: max of the old ones and of S over the key
// block, reduced over the quad that shares each row.
template <int M_STRIPS, int N_FRAGS, typename Stats>
__device__ __forceinline__ void row_max(float (&m_new)[M_STRIPS][2],
                                        const float (&s)[M_STRIPS][N_FRAGS][4], const Stats& stats,
                                        int lane) {
#pragma unroll
    for (int i = 0; i < M_STRIPS; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float x = stats.old_max(i, h, lane);
#pragma unroll
            for (int f = 0; f < N_FRAGS; ++f) x = fmaxf(x, fmaxf(s[i][f][2 * h], s[i][f][2 * h + 1]));
            m_new[i][h] = group_max<4>(x);
        }
}

// Online-softmax update: S becomes P = exp2(S - m_new) in place, O is rescaled by
// exp2(m - m_new) (RESCALE_O; otherwise the caller applies the returned factors), l becomes
// rescale l + rowsum P and m becomes m_new.
template <bool RESCALE_O = true, int M_STRIPS, int N_FRAGS, int D_FRAGS, typename Stats>
__device__ __forceinline__ typename Stats::Rescale softmax_rescale(float (&s)[M_STRIPS][N_FRAGS][4],
                                                                   float (&o)[M_STRIPS][D_FRAGS][4], Stats& stats,
                                                                   const float (&m_new)[M_STRIPS][2], int lane) {
    const typename Stats::Rescale rescale = stats.take_max(m_new, lane);
    float row_sum[M_STRIPS][2];
#pragma unroll
    for (int i = 0; i < M_STRIPS; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float base = exp2_base(m_new[i][h]);
            float sum = 0.f;
#pragma unroll
            for (int f = 0; f < N_FRAGS; ++f)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float p = exp2_approx(s[i][f][2 * h + e] - base);
                    s[i][f][2 * h + e] = p;
                    sum += p;
                }
            row_sum[i][h] = sum;
            if constexpr (RESCALE_O) {
                const float row_rescale = rescale.row(i, h, lane);
#pragma unroll
                for (int f = 0; f < D_FRAGS; ++f) {
                    o[i][f][2 * h] *= row_rescale;
                    o[i][f][2 * h + 1] *= row_rescale;
                }
            }
        }
    stats.add_sums(rescale, row_sum, lane);
    return rescale;
}

// P rounded to 16 bits, packed as mma A fragments: the accumulator fragments of key columns
// 16kk..16kk+15 (fragments 2kk, 2kk+1) are the A fragment of k-step kk (see mma.cuh). Packing
// the whole tile first lets the fp32 S registers die before P V.
template <typename T, int M_STRIPS, int N_FRAGS>
__device__ __forceinline__ void pack_p(u32 (&p)[M_STRIPS][N_FRAGS / 2][4],
                                       const float (&s)[M_STRIPS][N_FRAGS][4]) {
#pragma unroll
    for (int i = 0; i < M_STRIPS; ++i)
#pragma unroll
        for (int kk = 0; kk < N_FRAGS / 2; ++kk) {
            p[i][kk][0] = pack2<T>(s[i][2 * kk][0], s[i][2 * kk][1]);
            p[i][kk][1] = pack2<T>(s[i][2 * kk][2], s[i][2 * kk][3]);
            p[i][kk][2] = pack2<T>(s[i][2 * kk + 1][0], s[i][2 * kk + 1][1]);
            p[i][kk][3] = pack2<T>(s[i][2 * kk + 1][2], s[i][2 * kk + 1][3]);
        }
}

// A key block's scores (the accumulators S of its products) to weights P, packed to T as the A
// fragments of its P V (pack_p): the score's transform and the mask (scale_and_mask), then the
// online softmax with O and l rescaled to the rows' new running maxima (row_max,
// softmax_rescale). A score policy that bounds every score from above can ask for that bound as
// every row's maximum instead (Mask::Score::FIXED_MAX: softcap, whose scores in log2 units stay
// at or under a = c log2(e); perf log softcap-fixed-max): the transform gives S - a directly
// (below_bound_scaled), P = exp2(S - a) <= 1, l gains the row sums and m = a, so no maximum is
// reduced over the quad and neither O nor l is rescaled; lse = a + log2 l as before.
// With a running maximum the row's largest weight is exactly 1 in T; here every weight is rounded
// to T, so a row of one key would weigh its value by round(P) / P (up to 2^-9 off in bfloat16).
// So the 16-bit weights are summed too (RowStats::weights), and O is divided by their sum (the
// WEIGHT_SUMS epilogue), which makes O the average that P V forms; lse keeps the exact sum.
// P then spans [2^(-2a), 1] instead of reaching 1 in every row, so the plans ask for it only
// where that range stays normal in float32 and in T (bfloat16 and 2 c log2(e) <= 96:
// cupyflash/plans.py takes_fixed_max).
template <typename T, class Mask, class Score, int M_STRIPS, int N_FRAGS, int D_FRAGS, class Stats>
__device__ __forceinline__ void block_softmax(float (&s)[M_STRIPS][N_FRAGS][4], float (&o)[M_STRIPS][D_FRAGS][4],
                                              u32 (&p)[M_STRIPS][N_FRAGS / 2][4], Stats& stats, float scale_log2,
                                              bool masked, const Mask& mask, const Score& score, int row0, int n0,
                                              int lane) {
    if constexpr (Mask::Score::FIXED_MAX) {
        scale_and_mask<Mask, Score, M_STRIPS, N_FRAGS, true, true>(s, scale_log2, masked, mask, score, row0, n0,
                                                                    lane);
#pragma unroll
        for (int i = 0; i < M_STRIPS; ++i)
#pragma unroll
            for (int f = 0; f < N_FRAGS; ++f)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[i][f][e] = exp2_approx(s[i][f][e]);
        pack_p<T>(p, s);
        // Each row's sums, exact and of its 16-bit weights as packed (pack_p: row h's pairs are
        // words h and 2 + h of k-step kk, fragments 2 kk and 2 kk + 1)
        float row_sum[M_STRIPS][2], weight_sum[M_STRIPS][2];
#pragma unroll
        for (int i = 0; i < M_STRIPS; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float sum = 0.f, weights = 0.f;
#pragma unroll
                for (int kk = 0; kk < N_FRAGS / 2; ++kk)
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        sum += s[i][2 * kk + j][2 * h];
                        sum += s[i][2 * kk + j][2 * h + 1];
                        float lo, hi;
                        unpack2<T>(p[i][kk][h + 2 * j], lo, hi);
                        weights += lo + hi;
                    }
                row_sum[i][h] = sum;
                weight_sum[i][h] = weights;
            }
        stats.hold_bound(score.bound_scaled(scale_log2), row_sum, weight_sum, lane);
    } else {
        scale_and_mask(s, scale_log2, masked, mask, score, row0, n0, lane);
        float m_new[M_STRIPS][2];
        row_max(m_new, s, stats, lane);
        softmax_rescale(s, o, stats, m_new, lane);
        pack_p<T>(p, s);
    }
}

// The factor of row (i, h)'s O in the epilogue, 1 / l (0 for a row that saw no key; with a sink,
// finish_row_with_sink's), and its lse in natural log, which lane 0 of the row's quad stores at
// lse_rows[row] where the row is one of the sequence's (m0 + row < seqlen_q). Rows that saw no key
// get lse = -inf. WEIGHT_SUMS (block_softmax's fixed maximum): O's factor from the row's sum of
// its 16-bit weights (RowStats::weights), lse from the exact sum as always.
template <bool HAS_SINK, bool WEIGHT_SUMS = false, typename Stats>
__device__ __forceinline__ float row_epilogue(const Stats& stats, int i, int h, int lane, int row, int m0,
                                              int seqlen_q, float* lse_rows, float sink2) {
    float m, l;
    stats.get(i, h, lane, m, l);
    float inv_l;
    if constexpr (WEIGHT_SUMS) {
        const float w = stats.weights(i, h, lane);
        float lse, unused;
        if constexpr (HAS_SINK) {
            finish_row_with_sink(m, l, sink2, unused, lse);
            finish_row_with_sink(m, w, sink2, inv_l, unused);
        } else {
            inv_l = w == 0.f ? 0.f : 1.f / w;  // (a NaN weight: NaN, as below)
            lse = l > 0.f ? (m + __log2f(l)) * 0.6931471805599453f : neg_inf<float>();
        }
        if ((lane & 3) == 0 && m0 + row < seqlen_q) lse_rows[row] = lse;
    } else if constexpr (HAS_SINK) {
        float lse;
        finish_row_with_sink(m, l, sink2, inv_l, lse);
        if ((lane & 3) == 0 && m0 + row < seqlen_q) lse_rows[row] = lse;
    } else {
        // l == 0: the row saw no key. A NaN l (a NaN score: the row's softmax is NaN) gives a NaN O,
        // so that the tf32 kernels' P split need not carry it (tf32.cuh, split_tf32's Tf32Lo::FINITE); its lse
        // stays -inf, as in every other family and the reference (a row with nothing finite to weigh).
        inv_l = l == 0.f ? 0.f : 1.f / l;
        if ((lane & 3) == 0 && m0 + row < seqlen_q) {
            const float ln2 = 0.6931471805599453f;
            lse_rows[row] = l > 0.f ? (m + __log2f(l)) * ln2 : neg_inf<float>();
        }
    }
    return inv_l;
}

// Epilogue: O / l as T (16-bit, or float32 for the tf32 kernels) through the warp's own rows of
// the (swizzled) Q tile, then 16-byte coalesced stores of the rows < seqlen_q and columns <
// headdim; lse by lane 0 of each quad. Rows that saw no key (l = 0) get O = 0 and lse = -inf.
// Only the warp's own rows of the Q tile are touched, which no other warp reads, so a warp
// barrier suffices. With a sink (HAS_SINK, sink2 its logit in log2 units) the row's denominator
// gains it (score.cuh, finish_row_with_sink).
template <typename T, int D_TILE, bool HAS_SINK = false, bool WEIGHT_SUMS = false, int M_STRIPS, int D_FRAGS,
          typename Stats>
__device__ __forceinline__ void store_o(float (&o)[M_STRIPS][D_FRAGS][4], const Stats& stats,
                                        u32 stage_tile, int strip_row0, int m0, int seqlen_q,
                                        int headdim, T* o_rows, i64 o_ss, float* lse_rows,
                                        int lane, float sink2 = 0.f) {
    constexpr bool F32 = sizeof(T) == 4;
    constexpr int CHUNK_ELEMS = 16 / sizeof(T), ROW_DIM = F32 ? 2 * D_TILE : D_TILE;  // swizzled_offset's DIM
#pragma unroll
    for (int i = 0; i < M_STRIPS; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = strip_row0 + 16 * i + 8 * h + (lane >> 2);
            const float inv_l = row_epilogue<HAS_SINK, WEIGHT_SUMS>(stats, i, h, lane, row, m0, seqlen_q, lse_rows,
                                                                     sink2);
#pragma unroll
            for (int f = 0; f < D_FRAGS; ++f) {
                if constexpr (F32)
                    st_shared_v2_f32(stage_tile + swizzled_offset_f32<D_TILE>(row, 8 * f + 2 * (lane & 3)),
                                     o[i][f][2 * h] * inv_l, o[i][f][2 * h + 1] * inv_l);
                else
                    st_shared_b32(stage_tile + swizzled_offset<D_TILE>(row, f) + 4 * (lane & 3),
                                  pack2<T>(o[i][f][2 * h] * inv_l, o[i][f][2 * h + 1] * inv_l));
            }
        }
    __syncwarp();
    constexpr int CHUNKS = D_TILE / CHUNK_ELEMS;
    constexpr int WARP_ROWS = 16 * M_STRIPS;
#pragma unroll
    for (int it = 0; it < WARP_ROWS * CHUNKS / 32; ++it) {
        const int idx = lane + 32 * it;
        const int row = strip_row0 + idx / CHUNKS, chunk = idx % CHUNKS;
        if (m0 + row < seqlen_q && chunk * CHUNK_ELEMS < headdim) {
            u32 r[4];
            ld_shared_v4(r, stage_tile + swizzled_offset<ROW_DIM>(row, chunk));
            st_global_v4(o_rows + row * o_ss + chunk * CHUNK_ELEMS, r);
        }
    }
}

}  // namespace cf

// Dropout on the attention weights P, the same mask in the forward and in every backward kernel,
// whatever the launch configuration: a counter-based generator (Philox4x32-10, Salmon et al.,
// SC'11) evaluated at each element's coordinates, nothing stored. Python twin:
// cupyflash/dropout.py (the same words; dropout_mask()).
//
// Element (query i, key j) of (sequence b, query head h) belongs to the group of eight elements
// {i0, i0 + 8} x {j0, j0 + 1, j0 + 8, j0 + 9} with i0 = i & ~8, j0 = j & ~9, and one Philox call
// gives the group's four 32-bit words, two 16-bit halves each:
//   counter = (j0, i0, b * nheads + h, offset), key = (seed low 32 bits, seed high 32 bits),
//   half e = j & 1 (0 low, 1 high) of word 2 a + c for the element (i0 + 8 a, j0 + e + 8 c);
//   kept iff that half < threshold, threshold = round((1 - dropout_p) 2^16) (1 .. 2^16: the API
//   refuses a dropout_p that would keep nothing). The kernels compare whole words: the half is
//   below threshold iff the word, moved so that the half is its high 16 bits, is at most
//   limit = threshold 2^16 - 1 (DropoutFn::kept_in), whatever the other half holds.
// Half a word per element because the generator's integer work is what dropout costs (perf log
// "dropout"); 16 bits keep 1 - p to within 2^-17. The group is what an m16n8 fragment pair of S
// (forward, dQ: rows i, i + 8 of a strip, keys 2t, 2t + 1 of fragments f and f + 1, 8 keys
// apart) holds in one lane: those lanes use all eight elements of each call. A lane of S^T
// (dK/dV: key rows j, j + 8, queries 2t, 2t + 1, ...) holds four of a group's eight (its own key
// parity), and the lane four away the other four: each of the two makes one of their two calls
// and they trade halves by a shuffle (walk_st_frags). The SIMT kernels hold one row per thread and
// compute the group of each element.
//
// The forward multiplies kept weights by 1 / (1 - p) once, in O's epilogue (l, lse are the
// softmax's own: dropout does not change them). The backward marks a dropped weight by its sign
// (P >= 0, so -P is free to mean "dropped"): dV takes max(P, 0), dS = |P| (Z dP / (1 - p) - D)
// with D = rowsum(dO o O) of the dropped-out O, the chain rule through O = (P o Z / (1 - p)) V.
#pragma once

#include "common.cuh"

namespace cf {

template <typename A, typename B> struct is_same_type { static constexpr bool value = false; };
template <typename A> struct is_same_type<A, A> { static constexpr bool value = true; };

// A call's dropout (params.cuh's VariantArgs::dropout): zero threshold and scale without one.
struct DropoutArgs {
    unsigned long long seed;
    unsigned offset;
    unsigned threshold;  // round((1 - p) 2^16), 1 .. 2^16: a 16-bit half below it keeps its element
    float scale;         // 1 / (1 - p)
    double scale_f64;
};

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, unsigned k0, unsigned k1) {
    constexpr unsigned M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        const unsigned hi0 = __umulhi(M0, c.x), lo0 = M0 * c.x;
        const unsigned hi1 = __umulhi(M1, c.z), lo1 = M1 * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
        k0 += W0;
        k1 += W1;
    }
    return c;
}

// Word 2 a + c of a group's four (x, y, z, w): the elements (i0 + 8 a, j0 + e + 8 c), e = 0, 1.
__device__ __forceinline__ unsigned word_of(const uint4& w, int a, int c) {
    return a ? (c ? w.w : w.z) : (c ? w.y : w.x);
}

// Half e of a word: the element of key parity e.
__device__ __forceinline__ unsigned half_of(unsigned word, int e) {
    return e ? word >> 16 : word & 0xFFFFu;
}

// The mask of one (sequence, query head): ON false is no dropout, and every call below vanishes.
template <bool ON>
struct DropoutFn {
    static constexpr bool ENABLED = ON;
    unsigned k0 = 0, k1 = 0, stream = 0, offset = 0, limit = 0;

    DropoutFn() = default;
    template <class Params>
    __device__ __forceinline__ DropoutFn(const Params& p, int sequence, int head) {
        if constexpr (ON) {
            const DropoutArgs& d = p.variant.dropout;
            k0 = static_cast<unsigned>(d.seed);
            k1 = static_cast<unsigned>(d.seed >> 32);
            stream = static_cast<unsigned>(sequence) * static_cast<unsigned>(p.nheads) + static_cast<unsigned>(head);
            offset = d.offset;
            limit = limit_of(d.threshold);
        }
    }

    // The four words of the group at origin (i0, j0) (bit 3 of i0, bits 0 and 3 of j0 clear):
    // x (i0, j0 + e), y (i0, j0 + e + 8), z (i0 + 8, j0 + e), w (i0 + 8, j0 + e + 8), e = 0, 1.
    __device__ __forceinline__ uint4 words(int i0, int j0) const {
        return philox4x32_10(make_uint4(static_cast<unsigned>(j0), static_cast<unsigned>(i0), stream, offset), k0, k1);
    }
    // threshold 2^16 - 1 (mod 2^32: threshold 2^16, every half kept, gives 2^32 - 1)
    static __device__ __forceinline__ unsigned limit_of(unsigned threshold) { return (threshold << 16) - 1u; }
    // Whether the element in half e of a word (e = 0 the low half) is kept: one compare of the
    // word (the SIMT and float64 kernels, one element a call).
    __device__ __forceinline__ bool kept_in(unsigned word, int e) const { return (e ? word : word << 16) <= limit; }
    // The same for a half already extracted (limit >> 16 = threshold - 1): the fragment walks, whose
    // kernels run at their register limits with either form and spill with the other.
    __device__ __forceinline__ bool kept_half(unsigned half) const { return half <= (limit >> 16); }
    // The kept weights' factor 1 / (1 - p), 1 without dropout (the backward kernels' dP scale).
    template <class Params>
    static __device__ __forceinline__ float kept_scale(const Params& p) {
        if constexpr (ON) return p.variant.dropout.scale;
        else return 1.f;
    }
    // Whether element (i, j) is kept, from its own group (the SIMT kernels).
    __device__ __forceinline__ bool keep(int i, int j) const {
        const uint4 w = words(i & ~8, j & ~9);
        const unsigned pick = (i & 8) ? ((j & 8) ? w.w : w.z) : ((j & 8) ? w.y : w.x);
        return kept_in(pick, j & 1);
    }
};

template <class Mask>
using DropoutOf = DropoutFn<Mask::Score::HAS_DROPOUT>;

// The keep bits of a lane's m16n8 fragments of S, visit(i, f, k, kept) for s[i][f][k]: query
// row_lane + 16 i + 8 (k / 2), key key_lane + 8 f + k % 2 (row_lane = row of lane / 4 in strip 0,
// key_lane = n0 + 2 (lane % 4)). N_FRAGS even: fragments f and f + 1 of a pair hold keys j0 and
// j0 + 8, and elements k, k + 1 keys j0 and j0 + 1: one call, all eight elements.
template <class Drop, int M_STRIPS, int N_FRAGS, class Visit>
__device__ __forceinline__ void walk_s_frags(const Drop& d, int row_lane, int key_lane, Visit visit) {
    static_assert(N_FRAGS % 2 == 0, "fragment pairs");
#pragma unroll
    for (int i = 0; i < M_STRIPS; ++i)
#pragma unroll
        for (int fp = 0; fp < N_FRAGS / 2; ++fp) {
            const uint4 w = d.words(row_lane + 16 * i, key_lane + 16 * fp);
#pragma unroll
            for (int a = 0; a < 2; ++a)
#pragma unroll
                for (int c = 0; c < 2; ++c)
#pragma unroll
                    for (int e = 0; e < 2; ++e) visit(i, 2 * fp + c, 2 * a + e, d.kept_half(half_of(word_of(w, a, c), e)));
        }
}

// The same for a lane's fragments of S^T, visit(f, k, kept) for s[f][k]: key key_lane + 8 (k / 2),
// query query_lane + 8 f + k % 2 (key_lane = key row of lane / 4, query_lane = m0 + 2 (lane % 4)).
// A lane's keys have one parity, so it uses four of each group's eight halves; lanes lane and
// lane ^ 4 hold the two parities of the same keys and queries (key_lane = an even row + lane / 4
// in every caller, mma.cuh's C layout), so each computes one of the two calls they both need (the
// one at query offset e = its key parity) and hands its partner the partner's halves of it, two
// 16-bit halves a shuffle: one call per eight elements, as the S lanes. The whole warp must call.
template <class Drop, int N_FRAGS, class Visit>
__device__ __forceinline__ void walk_st_frags(const Drop& d, int key_lane, int query_lane, Visit visit) {
    static_assert(N_FRAGS % 2 == 0, "fragment pairs");
    const int key_parity = key_lane & 1;
    // byte_perm selectors: (low half of x, low half of y) or the high halves
    const unsigned mine = key_parity ? 0x7632u : 0x5410u, theirs = key_parity ? 0x5410u : 0x7632u;
#pragma unroll
    for (int fp = 0; fp < N_FRAGS / 2; ++fp) {
        const uint4 w = d.words(query_lane + 16 * fp + key_parity, key_lane & ~1);
        // (x, y) and (z, w) halves of this lane's parity: from its own call (query offset
        // key_parity) and from its partner's (query offset 1 - key_parity)
        const unsigned own[2] = {__byte_perm(w.x, w.y, mine), __byte_perm(w.z, w.w, mine)};
        const unsigned got[2] = {__shfl_xor_sync(0xffffffffu, __byte_perm(w.x, w.y, theirs), 4),
                                 __shfl_xor_sync(0xffffffffu, __byte_perm(w.z, w.w, theirs), 4)};
#pragma unroll
        for (int e = 0; e < 2; ++e)
#pragma unroll
            for (int a = 0; a < 2; ++a) {
                const unsigned halves = (e == key_parity) ? own[a] : got[a];
#pragma unroll
                for (int c = 0; c < 2; ++c) visit(2 * fp + a, 2 * c + e, d.kept_half(half_of(halves, c)));
            }
    }
}

// x = op(x, kept) over a lane's fragments of S (M_STRIPS strips, or one) and of S^T.
template <class Drop, int M_STRIPS, int N_FRAGS, class Op>
__device__ __forceinline__ void for_s_frags(float (&s)[M_STRIPS][N_FRAGS][4], const Drop& d, int row_lane,
                                            int key_lane, Op op) {
    walk_s_frags<Drop, M_STRIPS, N_FRAGS>(d, row_lane, key_lane,
                                          [&](int i, int f, int k, bool kept) { s[i][f][k] = op(s[i][f][k], kept); });
}
template <class Drop, int N_FRAGS, class Op>
__device__ __forceinline__ void for_s_frags(float (&s)[N_FRAGS][4], const Drop& d, int row_lane, int key_lane, Op op) {
    for_s_frags(reinterpret_cast<float(&)[1][N_FRAGS][4]>(s), d, row_lane, key_lane, op);
}
template <class Drop, int N_FRAGS, class Op>
__device__ __forceinline__ void for_st_frags(float (&s)[N_FRAGS][4], const Drop& d, int key_lane, int query_lane,
                                             Op op) {
    walk_st_frags<Drop, N_FRAGS>(d, key_lane, query_lane, [&](int f, int k, bool kept) { s[f][k] = op(s[f][k], kept); });
}

// The three uses of the keep bit. Forward: a dropped weight is 0 (the 1 / (1 - p) comes in the
// epilogue). Backward: a dropped weight is marked by its sign, dV takes max(x, 0) (relu_frags on
// the packed operand), dS dropped_ds(x, dp, D, scale).
struct DropToZero {
    template <typename A>
    __device__ __forceinline__ A operator()(A x, bool kept) const { return kept ? x : A(0); }
};
struct MarkDropped {
    template <typename A>
    __device__ __forceinline__ A operator()(A x, bool kept) const { return kept ? x : -x; }
};
// dP of a kernel that finds the keep bit where it forms dS but not where it forms P (one warp
// computes P, another dS): Z dP / (1 - p), and dS = P (that - D) as without dropout.
struct ScaleKept {
    float scale;
    template <typename A>
    __device__ __forceinline__ A operator()(A x, bool kept) const { return kept ? x * A(scale) : A(0); }
};
// P o (Z dP / (1 - p) - D) from a marked weight x (|x| = P; -0 and +0 both give 0).
template <typename A>
__device__ __forceinline__ A dropped_ds(A x, A dp, A delta, A scale) {
    return x > A(0) ? x * (dp * scale - delta) : x * delta;
}

// 1 / (1 - p) in a kernel's accumulator type A.
template <typename A, class Params>
__device__ __forceinline__ A dropout_scale_in(const Params& p) {
    if constexpr (sizeof(A) == sizeof(double)) return p.variant.dropout.scale_f64;
    else return p.variant.dropout.scale;
}

// acc *= scale for every accumulator of a fragment array (O's, dV's epilogue: 1 / (1 - p)).
template <int N, int W>
__device__ __forceinline__ void scale_acc(float (&acc)[N][W], float scale) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int k = 0; k < W; ++k) acc[i][k] *= scale;
}
template <int M, int N, int W>
__device__ __forceinline__ void scale_acc(float (&acc)[M][N][W], float scale) {
#pragma unroll
    for (int i = 0; i < M; ++i) scale_acc(acc[i], scale);
}

// max(x, 0) on the two 16-bit halves of a packed A fragment word (dV's P from marked weights).
template <typename T>
__device__ __forceinline__ unsigned relu_halves(unsigned x) {
    unsigned r;
    if constexpr (is_same_type<T, bf16_t>::value)
        asm("max.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(0u));
    else
        asm("max.f16x2 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(0u));
    return r;
}

template <typename T, int N, int W>
__device__ __forceinline__ void relu_frags(unsigned (&frag)[N][W]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int k = 0; k < W; ++k) frag[i][k] = relu_halves<T>(frag[i][k]);
}

template <typename T, int M, int N, int W>
__device__ __forceinline__ void relu_frags(unsigned (&frag)[M][N][W]) {
#pragma unroll
    for (int i = 0; i < M; ++i) relu_frags<T>(frag[i]);
}

// Z (1 kept, 0 dropped) of a lane's S^T fragments, as factors (the two warpgroups of
// flash_bwd_wgmma_dsplit, which each need the bits where they are not the weights' holder).
template <class Drop, int N_FRAGS>
__device__ __forceinline__ void keep_factors(float (&z)[N_FRAGS][4], const Drop& d, int key_lane, int query_lane) {
#pragma unroll
    for (int f = 0; f < N_FRAGS; ++f) z[f][0] = z[f][1] = z[f][2] = z[f][3] = 1.f;
    for_st_frags(z, d, key_lane, query_lane, DropToZero{});
}

}  // namespace cf

// Dropout on the attention weights P, the same mask in the forward and in every backward kernel,
// whatever the launch configuration: a counter-based generator (Philox4x32-10, Salmon et al.,
// SC'11) evaluated at each element's coordinates, nothing stored. Python twin:
// cupyflash/dropout.py (the same words; dropout_mask()).
//
// Element (query i, key j) of (sequence b, query head h) belongs to the group of four elements
// {i0, i0 + 8} x {j0, j0 + 8} with i0 = i & ~8, j0 = j & ~8 (a 2 x 2 grid at stride 8 inside a
// 16 x 16 tile), and one Philox call gives the group's four 32-bit words:
//   counter = (j0, i0, b * nheads + h, offset), key = (seed low 32 bits, seed high 32 bits),
//   word 2 a + c for the element (i0 + 8 a, j0 + 8 c);  kept iff word < threshold,
// threshold = round((1 - dropout_p) 2^32). The group is the one shape that every accumulator
// layout holds in one lane: an m16n8 fragment of S (forward, dQ: rows i, i + 8 of a strip, keys
// 8 f + .. for each fragment f) and one of S^T (dK/dV: key rows j, j + 8, queries 8 f + ..) both
// give a lane whole groups, so no lane computes a word it does not use. The SIMT kernels hold one
// row per thread and compute the group of each element (two of its four words go unused).
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
    unsigned threshold;  // round((1 - p) 2^32), at most 2^32 - 1
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

// Word 2 a + c of a group's four (x, y, z, w): the element (i0 + 8 a, j0 + 8 c).
__device__ __forceinline__ unsigned word_of(const uint4& w, int a, int c) {
    return a ? (c ? w.w : w.z) : (c ? w.y : w.x);
}

// The mask of one (sequence, query head): ON false is no dropout, and every call below vanishes.
template <bool ON>
struct DropoutFn {
    static constexpr bool ENABLED = ON;
    unsigned k0 = 0, k1 = 0, stream = 0, offset = 0, threshold = 0;

    DropoutFn() = default;
    template <class Params>
    __device__ __forceinline__ DropoutFn(const Params& p, int sequence, int head) {
        if constexpr (ON) {
            const DropoutArgs& d = p.variant.dropout;
            k0 = static_cast<unsigned>(d.seed);
            k1 = static_cast<unsigned>(d.seed >> 32);
            stream = static_cast<unsigned>(sequence) * static_cast<unsigned>(p.nheads) + static_cast<unsigned>(head);
            offset = d.offset;
            threshold = d.threshold;
        }
    }

    // The four words of the group at origin (i0, j0) (bit 3 of both clear): x (i0, j0),
    // y (i0, j0 + 8), z (i0 + 8, j0), w (i0 + 8, j0 + 8).
    __device__ __forceinline__ uint4 words(int i0, int j0) const {
        return philox4x32_10(make_uint4(static_cast<unsigned>(j0), static_cast<unsigned>(i0), stream, offset), k0, k1);
    }
    __device__ __forceinline__ bool kept(unsigned word) const { return word < threshold; }
    // The kept weights' factor 1 / (1 - p), 1 without dropout (the backward kernels' dP scale).
    template <class Params>
    static __device__ __forceinline__ float kept_scale(const Params& p) {
        if constexpr (ON) return p.variant.dropout.scale;
        else return 1.f;
    }
    // Whether element (i, j) is kept, from its own group (the SIMT kernels).
    __device__ __forceinline__ bool keep(int i, int j) const {
        const uint4 w = words(i & ~8, j & ~8);
        const unsigned pick = (i & 8) ? ((j & 8) ? w.w : w.z) : ((j & 8) ? w.y : w.x);
        return kept(pick);
    }
};

template <class Mask>
using DropoutOf = DropoutFn<Mask::Score::HAS_DROPOUT>;

// The keep bits of a lane's m16n8 fragments of S, visit(i, f, k, kept) for s[i][f][k]: query
// row_lane + 16 i + 8 (k / 2), key key_lane + 8 f + k % 2 (row_lane = row of lane / 4 in strip 0,
// key_lane = n0 + 2 (lane % 4)). N_FRAGS even: fragments f and f + 1 of a pair hold keys j0 and
// j0 + 8.
template <class Drop, int M_STRIPS, int N_FRAGS, class Visit>
__device__ __forceinline__ void walk_s_frags(const Drop& d, int row_lane, int key_lane, Visit visit) {
    static_assert(N_FRAGS % 2 == 0, "fragment pairs");
#pragma unroll
    for (int i = 0; i < M_STRIPS; ++i)
#pragma unroll
        for (int fp = 0; fp < N_FRAGS / 2; ++fp)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const uint4 w = d.words(row_lane + 16 * i, key_lane + 16 * fp + e);
#pragma unroll
                for (int a = 0; a < 2; ++a)
#pragma unroll
                    for (int c = 0; c < 2; ++c) visit(i, 2 * fp + c, 2 * a + e, d.kept(word_of(w, a, c)));
            }
}

// The same for a lane's fragments of S^T, visit(f, k, kept) for s[f][k]: key key_lane + 8 (k / 2),
// query query_lane + 8 f + k % 2 (key_lane = key row of lane / 4, query_lane = m0 + 2 (lane % 4)).
template <class Drop, int N_FRAGS, class Visit>
__device__ __forceinline__ void walk_st_frags(const Drop& d, int key_lane, int query_lane, Visit visit) {
    static_assert(N_FRAGS % 2 == 0, "fragment pairs");
#pragma unroll
    for (int fp = 0; fp < N_FRAGS / 2; ++fp)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const uint4 w = d.words(query_lane + 16 * fp + e, key_lane);
#pragma unroll
            for (int a = 0; a < 2; ++a)
#pragma unroll
                for (int c = 0; c < 2; ++c) visit(2 * fp + a, 2 * c + e, d.kept(word_of(w, a, c)));
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

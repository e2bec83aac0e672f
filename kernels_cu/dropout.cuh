// Dropout on the attention weights P, the same mask in the forward and in every backward kernel,
// whatever the launch configuration: a counter-based generator (Philox4x32, Salmon et al., SC'11,
// at 7 rounds) evaluated at each element's coordinates, nothing stored. Python twin:
// cupyflash/dropout.py (the same words; dropout_mask()).
//
// Element (query i, key j) of (sequence b, query head h) belongs to the group of eight elements
// {i0, i0 + 8} x {j0, j0 + 1, j0 + 8, j0 + 9} with i0 = i & ~8, j0 = j & ~9, and one Philox call
// gives the group's four 32-bit words, two 16-bit halves each:
//   counter = (j0, i0, b * nheads + h, offset), key = (seed low 32 bits, seed high 32 bits),
//   half e = j & 1 (0 low, 1 high) of word 2 a + c for the element (i0 + 8 a, j0 + e + 8 c);
//   kept iff the low 15 bits of that half are below threshold = round((1 - dropout_p) 2^15)
//   (1 .. 2^15: the API refuses a dropout_p that would keep nothing).
// Why these choices: the generator's integer work and the per-element select are what dropout
// costs (perf log "dropout", "dropout-v7"). 7 rounds is the fewest Salmon et al. found to pass
// BigCrush (flash-attn runs 7). 15 bits of a half leave its top bit free: adding 2^15 - threshold
// to both halves of a word at once (dropped_flags) carries into bit 15 of each half exactly where
// its element is dropped, with no carry between the halves, so a word's two elements are tested
// by two instructions, and the flags land on the sign bits of a packed pair of 16-bit weights
// (drop_packed_p, mark_packed_pt). The keep rate is 1 - p to within 2^-16.
// The group is what an m16n8 fragment pair of S (forward, dQ: rows i, i + 8 of a strip, keys 2t,
// 2t + 1 of fragments f and f + 1, 8 keys apart) holds in one lane: those lanes use all eight
// elements of each call, and a word's two halves are the two keys of one packed A register. A lane
// of S^T (dK/dV: key rows j, j + 8, queries 2t, 2t + 1, ...) holds four of a group's eight (its
// own key parity), and the lane four away the other four: each of the two makes one of their two
// calls, they trade halves by a shuffle, and each pairs its halves of queries 2t and 2t + 1 into
// one word, the layout of its packed P^T register (walk_st_units). The SIMT kernels hold one row
// per thread and compute the group of each element.
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
    unsigned threshold;  // round((1 - p) 2^15), 1 .. 2^15: a half whose low 15 bits are below it keeps its element
    float scale;         // 1 / (1 - p)
    double scale_f64;
};

constexpr int PHILOX_ROUNDS = 7;

__device__ __forceinline__ uint4 philox4x32(uint4 c, unsigned k0, unsigned k1) {
    constexpr unsigned M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#pragma unroll
    for (int round = 0; round < PHILOX_ROUNDS; ++round) {
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

// Bit 15 (half e = 0) and bit 31 (e = 1) of a word of flags: the sign bits of a packed 16-bit pair.
constexpr unsigned DROPPED_BITS = 0x80008000u;

// The mask of one (sequence, query head): ON false is no dropout, and every call below vanishes.
template <bool ON>
struct DropoutFn {
    static constexpr bool ENABLED = ON;
    unsigned k0 = 0, k1 = 0, stream = 0, offset = 0, addend = 0;

    DropoutFn() = default;
    template <class Params>
    __device__ __forceinline__ DropoutFn(const Params& p, int sequence, int head) {
        if constexpr (ON) {
            const DropoutArgs& d = p.variant.dropout;
            k0 = static_cast<unsigned>(d.seed);
            k1 = static_cast<unsigned>(d.seed >> 32);
            stream = static_cast<unsigned>(sequence) * static_cast<unsigned>(p.nheads) + static_cast<unsigned>(head);
            offset = d.offset;
            addend = addend_of(d.threshold);
        }
    }

    // The four words of the group at origin (i0, j0) (bit 3 of i0, bits 0 and 3 of j0 clear):
    // x (i0, j0 + e), y (i0, j0 + e + 8), z (i0 + 8, j0 + e), w (i0 + 8, j0 + e + 8), e = 0, 1.
    __device__ __forceinline__ uint4 words(int i0, int j0) const {
        return philox4x32(make_uint4(static_cast<unsigned>(j0), static_cast<unsigned>(i0), stream, offset), k0, k1);
    }
    // 2^15 - threshold in both halves (0 .. 2^15 - 1 each: threshold 2^15 keeps every element)
    static __device__ __forceinline__ unsigned addend_of(unsigned threshold) { return (0x8000u - threshold) * 0x10001u; }
    // The flags of a word's two elements: bit 15 + 16 e set iff half e's low 15 bits are at least
    // threshold (dropped). Each half's sum is at most 2 (2^15 - 1): no carry reaches the other half.
    __device__ __forceinline__ unsigned dropped_flags(unsigned word) const { return (word & 0x7FFF7FFFu) + addend; }
    // Whether element e of a word of flags is kept.
    static __device__ __forceinline__ bool kept_of(unsigned flags, int e) { return !(flags & (e ? 0x80000000u : 0x8000u)); }
    // The kept weights' factor 1 / (1 - p), 1 without dropout (the backward kernels' dP scale).
    template <class Params>
    static __device__ __forceinline__ float kept_scale(const Params& p) {
        if constexpr (ON) return p.variant.dropout.scale;
        else return 1.f;
    }
    // Whether element (i, j) is kept, from its own group (the SIMT kernels).
    __device__ __forceinline__ bool keep(int i, int j) const {
        const uint4 w = words(i & ~8, j & ~9);
        return kept_of(dropped_flags(word_of(w, (i >> 3) & 1, (j >> 3) & 1)), j & 1);
    }
};

template <class Mask>
using DropoutOf = DropoutFn<Mask::Score::HAS_DROPOUT>;

// The flags of a lane's m16n8 fragments of S, a fragment pair at a time, in the order of the
// registers that pack_p (online_softmax.cuh) packs them into: visit_unit(i, fp, flags) for strip i,
// fragments 2 fp and 2 fp + 1, flags[r] the two elements of packed register r:
// r = 0 fragment 2 fp rows + 0 (word x), 1 fragment 2 fp rows + 8 (z), 2 fragment 2 fp + 1 rows + 0
// (y), 3 fragment 2 fp + 1 rows + 8 (w); half e is key key_lane + 16 fp + 8 (r >> 1) + e
// (row_lane = row of lane / 4 in strip 0, key_lane = n0 + 2 (lane % 4)). One call, eight elements.
template <class Drop, int M_STRIPS, int N_FRAGS, class VisitUnit>
__device__ __forceinline__ void walk_s_units(const Drop& d, int row_lane, int key_lane, VisitUnit visit_unit) {
    static_assert(N_FRAGS % 2 == 0, "fragment pairs");
#pragma unroll
    for (int i = 0; i < M_STRIPS; ++i)
#pragma unroll
        for (int fp = 0; fp < N_FRAGS / 2; ++fp) {
            const uint4 w = d.words(row_lane + 16 * i, key_lane + 16 * fp);
            const unsigned flags[4] = {d.dropped_flags(w.x), d.dropped_flags(w.z), d.dropped_flags(w.y),
                                       d.dropped_flags(w.w)};
            visit_unit(i, fp, flags);
        }
}

// The keep bits of a lane's fragments of S, visit(i, f, k, kept) for s[i][f][k]: query
// row_lane + 16 i + 8 (k / 2), key key_lane + 8 f + k % 2. A word's flags are formed where they
// are used, not a unit's four first as walk_s_units does: at d256 the dQ mma.sync kernel (sm_80 /
// sm_90, 247-250 registers) spilled 284-364 bytes with the four alive together.
template <class Drop, int M_STRIPS, int N_FRAGS, class Visit>
__device__ __forceinline__ void walk_s_frags(const Drop& d, int row_lane, int key_lane, Visit visit) {
#pragma unroll
    for (int i = 0; i < M_STRIPS; ++i)
#pragma unroll
        for (int fp = 0; fp < N_FRAGS / 2; ++fp) {
            const uint4 w = d.words(row_lane + 16 * i, key_lane + 16 * fp);
#pragma unroll
            for (int a = 0; a < 2; ++a)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const unsigned flags = d.dropped_flags(word_of(w, a, c));
#pragma unroll
                    for (int e = 0; e < 2; ++e) visit(i, 2 * fp + c, 2 * a + e, Drop::kept_of(flags, e));
                }
        }
}

// The same for a lane's fragments of S^T, a fragment pair at a time, in the order of the
// registers that pack_a_frags (mma_bwd.cuh) packs them into: visit_unit(fp, flags), flags[r] the
// two elements of register r = 2 a + c of k-step fp: fragment 2 fp + a (queries + 8 a), key rows
// + 8 c, half e query query_lane + 16 fp + 8 a + e (key_lane = key row of lane / 4, query_lane =
// m0 + 2 (lane % 4)). A lane's keys have one parity, so it uses four of each group's eight halves;
// lanes lane and lane ^ 4 hold the two parities of the same keys and queries (key_lane = an even
// row + lane / 4 in every caller, mma.cuh's C layout), so each computes one of the two calls they
// both need (the one at query offset e = its key parity), hands its partner the partner's halves
// of it (two shuffles), and pairs its own halves of queries 2t and 2t + 1 into one word (a prmt
// each: the call at query offset 0 gives the low half). The whole warp must call.
template <class Drop, int N_FRAGS, class VisitUnit>
__device__ __forceinline__ void walk_st_units(const Drop& d, int key_lane, int query_lane, VisitUnit visit_unit) {
    static_assert(N_FRAGS % 2 == 0, "fragment pairs");
    const int key_parity = key_lane & 1;
    // byte_perm selectors. theirs: the partner's halves of (x, y) or (z, w) (the low halves for
    // an odd partner). pair[c]: own word (bytes 0-3) and the received word (4-7) into (query 2t,
    // query 2t + 1): even lanes own the low half (their own word's low half, the received c-th
    // half); odd lanes own the high half (their own word's high half, the received c-th half).
    const unsigned theirs = key_parity ? 0x5410u : 0x7632u;
    const unsigned pair[2] = {key_parity ? 0x3254u : 0x5410u, key_parity ? 0x3276u : 0x7610u};
#pragma unroll
    for (int fp = 0; fp < N_FRAGS / 2; ++fp) {
        const uint4 w = d.words(query_lane + 16 * fp + key_parity, key_lane & ~1);
        const unsigned got[2] = {__shfl_xor_sync(0xffffffffu, __byte_perm(w.x, w.y, theirs), 4),
                                 __shfl_xor_sync(0xffffffffu, __byte_perm(w.z, w.w, theirs), 4)};
        const unsigned own[4] = {w.x, w.y, w.z, w.w};
        unsigned flags[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) flags[r] = d.dropped_flags(__byte_perm(own[r], got[r >> 1], pair[r & 1]));
        visit_unit(fp, flags);
    }
}

// The keep bits of a lane's fragments of S^T, visit(f, k, kept) for s[f][k]: key key_lane + 8 (k / 2),
// query query_lane + 8 f + k % 2.
template <class Drop, int N_FRAGS, class Visit>
__device__ __forceinline__ void walk_st_frags(const Drop& d, int key_lane, int query_lane, Visit visit) {
    walk_st_units<Drop, N_FRAGS>(d, key_lane, query_lane, [&](int fp, const unsigned (&flags)[4]) {
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int e = 0; e < 2; ++e) visit(2 * fp + (r >> 1), 2 * (r & 1) + e, Drop::kept_of(flags[r], e));
    });
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

// Each half of a word of flags spread over its 16 bits: 0xFFFF where bit 15 + 16 e is set, 0
// elsewhere (prmt's sign replication, selector nibbles 8 + byte; CUDA's __byte_perm documents only
// three selector bits, so the PTX is written out).
__device__ __forceinline__ unsigned spread_flags(unsigned flags) {
    unsigned m;
    asm("prmt.b32 %0, %1, 0, 0xBB99;" : "=r"(m) : "r"(flags));
    return m;
}

// The forward's dropout on P packed by pack_p (16-bit A fragments, online_softmax.cuh): a dropped
// weight becomes +0, as packing a selected 0.f gave. Rounding to 16 bits before the mask is what
// the fp32 select followed by packing computed: pack2 of 0 is 0.
template <class Drop, int M_STRIPS, int N_FRAGS>
__device__ __forceinline__ void drop_packed_p(unsigned (&p)[M_STRIPS][N_FRAGS / 2][4], const Drop& d, int row_lane,
                                              int key_lane) {
    walk_s_units<Drop, M_STRIPS, N_FRAGS>(d, row_lane, key_lane, [&](int i, int fp, const unsigned (&flags)[4]) {
#pragma unroll
        for (int r = 0; r < 4; ++r) p[i][fp][r] &= ~spread_flags(flags[r]);
    });
}

// The dK/dV kernels' mark on P^T packed by pack_a_frags: a dropped weight's sign bit set (its
// flag is on the sign bit of its half). Rounding to 16 bits is sign-symmetric, so this is the
// packing of MarkDropped's -P.
template <class Drop, int N_FRAGS>
__device__ __forceinline__ void mark_packed_pt(unsigned (&p)[N_FRAGS / 2][4], const Drop& d, int key_lane, int query_lane) {
    walk_st_units<Drop, N_FRAGS>(d, key_lane, query_lane, [&](int fp, const unsigned (&flags)[4]) {
#pragma unroll
        for (int r = 0; r < 4; ++r) p[fp][r] ^= flags[r] & DROPPED_BITS;
    });
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

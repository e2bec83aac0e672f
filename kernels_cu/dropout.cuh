// Dropout on the attention weights P, the same mask in the forward and in every backward kernel,
// whatever the launch configuration: a counter-based generator (Philox4x32, Salmon et al., SC'11,
// at 7 rounds) evaluated at each element's coordinates, nothing stored. Python twin:
// cupyflash/dropout.py (the same words; dropout_mask()).
//
// Element (query i, key j) of (sequence b, query head h) belongs to the group of sixteen elements
// {i0, i0 + 1, i0 + 8, i0 + 9} x {j0, j0 + 1, j0 + 8, j0 + 9} with i0 = i & ~9, j0 = j & ~9, and
// one Philox call gives the group's four 32-bit words, a byte an element:
//   counter = (j0, i0, b * nheads + h, offset), key = (seed low 32 bits, seed high 32 bits),
//   byte 2 a + c (a = bit 3 of i, c = bit 3 of j) of word 2 (i & 1) + (j & 1);
//   kept iff that byte is below threshold = round((1 - dropout_p) 256) (1 .. 256: the API refuses
//   a dropout_p that would keep nothing). The keep rate is 1 - p to within 2^-9, as flash-attn's.
// Why these choices: the generator's integer work and the per-element select are what dropout
// costs (perf log "dropout", "dropout-v7", "dropout-v8"). 7 rounds is the fewest Salmon et al.
// found to pass BigCrush (flash-attn runs 7); a byte an element makes one call serve sixteen
// elements. A word's four bytes are tested together (byte_flags: the carry out of each byte of
// word + (256 - threshold), three instructions), and one prmt with sign replication spreads the
// flags of a packed pair of 16-bit weights over their halves (spread_pair).
// The group is symmetric in query and key parity. An m16n8 fragment lane of S (forward, dQ: rows
// i, i + 8 of a strip, keys 2t, 2t + 1 of fragments f and f + 1, 8 keys apart) holds the eight
// elements of one query parity (words 2 (i & 1), 2 (i & 1) + 1); a lane of S^T (dK/dV: key rows
// j, j + 8, queries 2t, 2t + 1, ...) the eight of one key parity (words j & 1, 2 + (j & 1)); in
// both the lane four away (lane ^ 4) holds the other eight. So the two alternate the calls over
// their units (fragment pairs) and hand each other the two words of each call that are the
// other's (two shuffles a call): one call per sixteen elements of the pair (walk_units). A last
// odd unit is called by both. In a packed register (pack_p, pack_a_frags) the two elements are
// the same byte of the lane's two words. The SIMT kernels hold one row per thread and compute the
// group of each element (keep).
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
    unsigned threshold;  // round((1 - p) 256), 1 .. 256: a byte below it keeps its element
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

// Word 2 qb + kb of a group's four (x, y, z, w): the elements of query parity qb, key parity kb.
__device__ __forceinline__ unsigned word_of(const uint4& w, int qb, int kb) {
    return qb ? (kb ? w.w : w.z) : (kb ? w.y : w.x);
}

// Bit 15 (half e = 0) and bit 31 (e = 1) of a packed pair's mask: the sign bits of its 16-bit weights.
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

    // The four words of the group at origin (i0, j0) (bits 0 and 3 of both clear).
    __device__ __forceinline__ uint4 words(int i0, int j0) const {
        return philox4x32(make_uint4(static_cast<unsigned>(j0), static_cast<unsigned>(i0), stream, offset), k0, k1);
    }
    // 256 - threshold in every byte (0 .. 255: threshold 256 keeps every element)
    static __device__ __forceinline__ unsigned addend_of(unsigned threshold) { return (256u - threshold) * 0x01010101u; }
    // The flags of a word's four elements: bit 7 of byte n set iff byte n is at least threshold
    // (dropped), the carry out of byte n of word + addend: the low seven bits of each byte added
    // apart (at most 254: nothing crosses into the next byte) give the carry into bit 7, and the
    // carry out is the majority of the two top bits and that carry. The other bits are noise.
    __device__ __forceinline__ unsigned byte_flags(unsigned word) const {
        const unsigned low = (word & 0x7F7F7F7Fu) + (addend & 0x7F7F7F7Fu);
        return (word & addend) | (word & low) | (addend & low);
    }
    // Whether byte n of a word of byte flags is kept.
    static __device__ __forceinline__ bool kept_in(unsigned flags, int n) { return !(flags & (0x80u << (8 * n))); }
    // Whether element e of a packed pair's mask (spread_pair) is kept.
    static __device__ __forceinline__ bool kept_of(unsigned mask, int e) { return !(mask & (e ? 0x80000000u : 0x8000u)); }
    // The kept weights' factor 1 / (1 - p), 1 without dropout (the backward kernels' dP scale).
    template <class Params>
    static __device__ __forceinline__ float kept_scale(const Params& p) {
        if constexpr (ON) return p.variant.dropout.scale;
        else return 1.f;
    }
    // Whether element (i, j) is kept, from its own group (the SIMT kernels).
    __device__ __forceinline__ bool keep(int i, int j) const {
        const uint4 w = words(i & ~9, j & ~9);
        return kept_in(byte_flags(word_of(w, i & 1, j & 1)), 2 * ((i >> 3) & 1) + ((j >> 3) & 1));
    }
};

template <class Mask>
using DropoutOf = DropoutFn<Mask::Score::HAS_DROPOUT>;

// The mask of a packed pair of 16-bit weights from its two elements' byte flags: byte n of flags0
// (half 0) and of flags1 (half 1), each spread over its half: 0xFFFF where dropped, 0 where kept
// (prmt's sign replication, selector nibble 8 + byte; CUDA's __byte_perm documents only three
// selector bits, so the PTX is written out).
template <int N>
__device__ __forceinline__ unsigned spread_pair(unsigned flags0, unsigned flags1) {
    static_assert(0 <= N && N < 4, "a byte of a word");
    constexpr unsigned SELECTOR = (8u + N) * 0x11u | (12u + N) * 0x1100u;
    unsigned m;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(m) : "r"(flags0), "r"(flags1), "n"(SELECTOR));
    return m;
}

// A lane's two words of a group: S lanes (query parity `parity`) take words 2 parity and
// 2 parity + 1 (keys of parity 0, 1: the two halves of a packed S register), S^T lanes (key
// parity `parity`) words parity and 2 + parity (queries of parity 0, 1: the halves of a packed
// P^T register).
template <bool ST>
__device__ __forceinline__ void lane_words(unsigned (&out)[2], const uint4& w, int parity) {
    if constexpr (ST) {
        out[0] = parity ? w.y : w.x;
        out[1] = parity ? w.w : w.z;
    } else {
        out[0] = parity ? w.z : w.x;
        out[1] = parity ? w.w : w.y;
    }
}

// The groups of a lane's UNITS units, visit(u, words) with the lane's two words of unit u's group
// (lane_words), origin(u) the group's origin (int2: i0, j0). Lanes lane and lane ^ 4 hold the two
// parities (parity) of the same units: the lane of parity q calls unit 2 k + q of each pair and
// hands its partner the partner's words of it; a last odd unit both call. The whole warp must call.
template <bool ST, int UNITS, class Drop, class Origin, class Visit>
__device__ __forceinline__ void walk_units(const Drop& d, int parity, Origin origin, Visit visit) {
#pragma unroll
    for (int u = 0; u + 1 < UNITS; u += 2) {
        const int2 o0 = origin(u), o1 = origin(u + 1);
        const uint4 w = d.words(parity ? o1.x : o0.x, parity ? o1.y : o0.y);
        unsigned mine[2], theirs[2], got[2];
        lane_words<ST>(mine, w, parity);
        lane_words<ST>(theirs, w, parity ^ 1);
#pragma unroll
        for (int k = 0; k < 2; ++k) got[k] = __shfl_xor_sync(0xffffffffu, theirs[k], 4);
        const unsigned first[2] = {parity ? got[0] : mine[0], parity ? got[1] : mine[1]};
        const unsigned second[2] = {parity ? mine[0] : got[0], parity ? mine[1] : got[1]};
        visit(u, first);
        visit(u + 1, second);
    }
    if constexpr (UNITS % 2) {
        const int2 o = origin(UNITS - 1);
        unsigned mine[2];
        lane_words<ST>(mine, d.words(o.x, o.y), parity);
        visit(UNITS - 1, mine);
    }
}

// The masks (spread_pair) of a lane's m16n8 fragments of S, a fragment pair at a time, in the
// order of the registers that pack_p (online_softmax.cuh) packs them into: visit_unit(i, fp, masks)
// for strip i, fragments 2 fp and 2 fp + 1, masks[r] the two elements of packed register r:
// r = 0 fragment 2 fp rows + 0 (byte 0 of the lane's words), 1 fragment 2 fp rows + 8 (byte 2),
// 2 fragment 2 fp + 1 rows + 0 (byte 1), 3 fragment 2 fp + 1 rows + 8 (byte 3); half e is key
// key_lane + 16 fp + 8 (r >> 1) + e (row_lane = row of lane / 4 in strip 0, its bit 3 clear;
// key_lane = n0 + 2 (lane % 4), n0 a multiple of 16). The whole warp must call.
template <class Drop, int M_STRIPS, int N_FRAGS, class VisitUnit>
__device__ __forceinline__ void walk_s_units(const Drop& d, int row_lane, int key_lane, VisitUnit visit_unit) {
    static_assert(N_FRAGS % 2 == 0, "fragment pairs");
    constexpr int PAIRS = N_FRAGS / 2;
    const int row0 = row_lane & ~1;
    walk_units<false, M_STRIPS * PAIRS>(
        d, row_lane & 1, [&](int u) { return make_int2(row0 + 16 * (u / PAIRS), key_lane + 16 * (u % PAIRS)); },
        [&](int u, const unsigned (&words)[2]) {
            const unsigned f0 = d.byte_flags(words[0]), f1 = d.byte_flags(words[1]);
            const unsigned masks[4] = {spread_pair<0>(f0, f1), spread_pair<2>(f0, f1), spread_pair<1>(f0, f1),
                                       spread_pair<3>(f0, f1)};
            visit_unit(u / PAIRS, u % PAIRS, masks);
        });
}

// The keep bits of a lane's fragments of S, visit(i, f, k, kept) for s[i][f][k]: query
// row_lane + 16 i + 8 (k / 2), key key_lane + 8 f + k % 2. PAIRED: walk_s_units' calls, one per
// sixteen elements of a lane pair (the whole warp must call); otherwise each lane calls each of
// its units' groups and forms a word's flags where they are used: at d256 the dQ mma.sync kernel
// (sm_80 / sm_90, 247-250 registers) spilled 284-364 bytes with a unit's flags alive together.
template <class Drop, int M_STRIPS, int N_FRAGS, bool PAIRED = false, class Visit>
__device__ __forceinline__ void walk_s_frags(const Drop& d, int row_lane, int key_lane, Visit visit) {
    if constexpr (PAIRED) {
        walk_s_units<Drop, M_STRIPS, N_FRAGS>(d, row_lane, key_lane, [&](int i, int fp, const unsigned (&masks)[4]) {
#pragma unroll
            for (int r = 0; r < 4; ++r)
#pragma unroll
                for (int e = 0; e < 2; ++e) visit(i, 2 * fp + (r >> 1), 2 * (r & 1) + e, Drop::kept_of(masks[r], e));
        });
    } else {
        const int parity = row_lane & 1, row0 = row_lane & ~1;
#pragma unroll
        for (int i = 0; i < M_STRIPS; ++i)
#pragma unroll
            for (int fp = 0; fp < N_FRAGS / 2; ++fp) {
                unsigned words[2];
                lane_words<false>(words, d.words(row0 + 16 * i, key_lane + 16 * fp), parity);
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const unsigned flags = d.byte_flags(words[e]);
#pragma unroll
                    for (int a = 0; a < 2; ++a)
#pragma unroll
                        for (int c = 0; c < 2; ++c) visit(i, 2 * fp + c, 2 * a + e, Drop::kept_in(flags, 2 * a + c));
                }
            }
    }
}

// The same for a lane's fragments of S^T, a fragment pair at a time, in the order of the
// registers that pack_a_frags (mma_bwd.cuh) packs them into: visit_unit(fp, masks), masks[r] the
// two elements of register r = 2 a + c of k-step fp: fragment 2 fp + a (queries + 8 a), key rows
// + 8 c, half e query query_lane + 16 fp + 8 a + e: byte r of the lane's two words (key_lane = key
// row of lane / 4, an even row + lane / 4 in every caller (mma.cuh's C layout), its bit 3 clear;
// query_lane = m0 + 2 (lane % 4), m0 a multiple of 16). The whole warp must call.
template <class Drop, int N_FRAGS, class VisitUnit>
__device__ __forceinline__ void walk_st_units(const Drop& d, int key_lane, int query_lane, VisitUnit visit_unit) {
    static_assert(N_FRAGS % 2 == 0, "fragment pairs");
    const int key0 = key_lane & ~1;
    walk_units<true, N_FRAGS / 2>(
        d, key_lane & 1, [&](int u) { return make_int2(query_lane + 16 * u, key0); },
        [&](int u, const unsigned (&words)[2]) {
            const unsigned f0 = d.byte_flags(words[0]), f1 = d.byte_flags(words[1]);
            const unsigned masks[4] = {spread_pair<0>(f0, f1), spread_pair<1>(f0, f1), spread_pair<2>(f0, f1),
                                       spread_pair<3>(f0, f1)};
            visit_unit(u, masks);
        });
}

// The keep bits of a lane's fragments of S^T, visit(f, k, kept) for s[f][k]: key key_lane + 8 (k / 2),
// query query_lane + 8 f + k % 2.
template <class Drop, int N_FRAGS, class Visit>
__device__ __forceinline__ void walk_st_frags(const Drop& d, int key_lane, int query_lane, Visit visit) {
    walk_st_units<Drop, N_FRAGS>(d, key_lane, query_lane, [&](int fp, const unsigned (&masks)[4]) {
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int e = 0; e < 2; ++e) visit(2 * fp + (r >> 1), 2 * (r & 1) + e, Drop::kept_of(masks[r], e));
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

// The forward's dropout on P packed by pack_p (16-bit A fragments, online_softmax.cuh): a dropped
// weight becomes +0, as packing a selected 0.f gave. Rounding to 16 bits before the mask is what
// the fp32 select followed by packing computed: pack2 of 0 is 0.
template <class Drop, int M_STRIPS, int N_FRAGS>
__device__ __forceinline__ void drop_packed_p(unsigned (&p)[M_STRIPS][N_FRAGS / 2][4], const Drop& d, int row_lane,
                                              int key_lane) {
    walk_s_units<Drop, M_STRIPS, N_FRAGS>(d, row_lane, key_lane, [&](int i, int fp, const unsigned (&masks)[4]) {
#pragma unroll
        for (int r = 0; r < 4; ++r) p[i][fp][r] &= ~masks[r];
    });
}

// The dK/dV kernels' mark on P^T packed by pack_a_frags: a dropped weight's sign bit set (its
// flag is on the sign bit of its half). Rounding to 16 bits is sign-symmetric, so this is the
// packing of MarkDropped's -P.
template <class Drop, int N_FRAGS>
__device__ __forceinline__ void mark_packed_pt(unsigned (&p)[N_FRAGS / 2][4], const Drop& d, int key_lane, int query_lane) {
    walk_st_units<Drop, N_FRAGS>(d, key_lane, query_lane, [&](int fp, const unsigned (&masks)[4]) {
#pragma unroll
        for (int r = 0; r < 4; ++r) p[fp][r] ^= masks[r] & DROPPED_BITS;
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

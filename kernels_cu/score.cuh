// The score policy of every live kernel: what a variant does to the scores inside the mask's
// band. Python twin: cupyflash/scores.py (the definitions, in flash-attn 2.8's order):
//   softcap c > 0   z <- c tanh(z / c)                        z = softmax_scale * q_i . k_j
//   ALiBi           z <- z - slope[b, h] |i + seqlen_k - seqlen_q - j|
//   sink            each row's sum gains exp(sink[h]) (no value row): lse includes it
//
// A mask policy (mask.cuh) carries its score as Mask::Score, a ScoreMod<SOFTCAP, ALIBI, SINK>;
// the plain band's is NoScore, whose IDENTITY makes every hook below vanish at compile time, so
// the plain kernels are the kernels without this header. A kernel builds the score's function
// in its accumulator type, ScoreOf<Mask, A, TANH> score(p, batch, head, unit), where unit says
// what its scores are: z = unit * s (softmax_scale for raw Q K^T accumulators, ln 2 for scores
// already in log2 units). The transform keeps that unit, so everything after it (the scale, the
// exponentials, lse) is the plain kernel's: s' = transform(s) = z' / unit.
//
// Where a kernel asks (the same place it asks the mask about an element): at a fragment origin
// (query i0, key j0), origin() once, then transform(s, origin, di, dj) per element with the
// offsets known after unrolling; ALiBi's distance is then one add and one FMA with |.| per element.
// The backward asks for the derivative too, transform(s, origin, di, dj, dsds), and multiplies dS
// by it (softcap's 1 - tanh^2; 1 otherwise, which it does not store: HAS_GRAD).
//
// Tanh: how a kernel takes softcap's tanh in float (double is always accurate):
//   EXP_RCP (the 16-bit tensor-core kernels): 1 - 2 / (1 + 2^(2 log2(e) y)) with ex2.approx and
//     rcp.approx, two MUFU operations, an absolute error near 1e-7.
//   RATIONAL (float32's one-product "tf32" forwards): the rational y N(y^2) / D(y^2) of
//     tanh_rational, y clamped to +-7, N and D cubic in y^2: eleven FP32 operations (two of them
//     the clamp) and one MUFU (rcp.approx), an absolute error below 1.25e-6
//     (tests/kernels/test_score_tanh.py evaluates these constants as the kernel does).
//   EXP_NEWTON (flash_fwd_wgmma_ws, the producer forward):
//     EXP_RCP with the reciprocal on the FMA pipe (rcp_newton, three of four: exp_form_rcp): one
//     MUFU operation, seven FP32 / integer ones more, the same accuracy.
//   ACCURATE (SIMT, float32 "ieee", float64): tanhf / tanh.
// The rational was made for the 16-bit forwards on the premise that a score's MUFU operations
// (EXP_RCP's two beside the softmax's exp2) were their limit. Measured on an H100 (8k causal d128
// bf16) it lost: forward 326.8 -> 290.5 TFLOP/s, backward with it in the dQ kernel 263.6 -> 253.3
// (docs/perf-log.md softcap-rational): the FP32 pipe's issue slots, not the MUFU, bound those
// kernels, and the rational spends nine of them to save one MUFU operation. They went back to
// EXP_RCP (SASS identical to the measured tree's).
// tanh.approx.f32 alone would be one MUFU operation, but its 2^-11 relative error is 0.015 in the
// exponent at c = 30: a 1.5% error in P, more than bfloat16's own rounding. RATIONAL's c tanh(z /
// c) is off by at most c * 1.25e-6 in the exponent (and by 4.3e-6 |z| where |z| << c): 4e-5 at
// the caps models use (30, 50), 1.25e-3 at c = 1e3, where it reaches bfloat16's rounding of P
// (api.md says so). A kernel that recomputes P from the forward's lse with the other form sees
// the two forms' difference as that much error in P's exponent.
#pragma once

#include "common.cuh"
#include "mma.cuh"
#include "params.cuh"

namespace cf {

__device__ __forceinline__ float abs_(float x) { return fabsf(x); }
__device__ __forceinline__ double abs_(double x) { return fabs(x); }

__device__ __forceinline__ float rcp_approx(float x) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ float tanh_(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_(double x) { return tanh(x); }

// tanh(y) to 1.25e-6 (1.15e-6 with a correctly rounded reciprocal; rcp.approx may be an ulp off):
// a rational fitted (minimax by reweighted least squares) to tanh(y) / y on [0, 7] in u = y^2,
// numerator and denominator cubic, beyond which tanh is 1 - 1.7e-6 and the clamp holds it there.
// NaN stays NaN (as tanhf's), +-inf gives +-(1 - 8e-7).
__device__ __forceinline__ float tanh_rational(float y) {
    const float y_c = min_nan(max_nan(y, -7.f), 7.f), u = y_c * y_c;
    const float n = fmaf(fmaf(fmaf(3.930092134396546e-06f, u, 0.0022770091891288757f), u, 0.12302207946777344f), u,
                         0.9999957084655762f);
    const float d = fmaf(fmaf(fmaf(0.00014235287380870432f, u, 0.021072279661893845f), u, 0.45634058117866516f), u,
                         1.f);
    return y_c * n * rcp_approx(d);
}

// 1 / x for x in [1, +inf] on the FMA pipe, for EXP_NEWTON. The seed is the float whose bits are
// RCP_SEED_BITS - bits(x), the exponent negated and the mantissa reflected: within 5.06% of 1 / x
// (the constant that minimizes it over a binade). One third-order step r (1 + d + d^2), with
// d = 1 - x r, takes the error to d^3 <= 1.3e-4 and one Newton step r (1 + d) to its square,
// 1.7e-8; with the FFMAs' roundings 7.7e-8 relative, under float32's ulp
// (tests/kernels/test_score_rcp_newton.py, every mantissa). Five FFMA: two Newton steps would leave
// 6.6e-6, three take six. x is clamped first (min.NaN: NaN stays NaN) to the float whose bits are
// RCP_SEED_BITS, so that the seed's bits never go negative: from x = 8.1e37 up (+inf included;
// 1 / x < 1.3e-38 there) the seed is subnormal or 0 and the FFMAs (-ftz=true) give r = 0, as
// rcp.approx.ftz gives 0 from 2^126.
__device__ __forceinline__ float rcp_newton(float x) {
    constexpr int RCP_SEED_BITS = 0x7EF311C2;
    const float x_c = min_nan(x, __int_as_float(RCP_SEED_BITS));
    const float seed = __int_as_float(RCP_SEED_BITS - __float_as_int(x_c));
    const float d_seed = fmaf(-x_c, seed, 1.f);
    const float r = fmaf(seed, fmaf(d_seed, d_seed, d_seed), seed);
    return fmaf(r, fmaf(-x_c, r, 1.f), r);
}

// EXP_NEWTON trades EXP_RCP's rcp.approx (a MUFU operation, 16 an SM a clock) for seven issue
// slots (the clamp, the seed's integer subtraction, five FFMA). In flash_fwd_wgmma that kind of
// trade lost (perf log softcap-rational: RATIONAL's nine FP32 operations for one MUFU cost 11%; a
// lockstep kernel whose softmax runs with the tensor cores idle is bound by its issue). In the
// producer forward one consumer's softmax runs under the other's products, and per 128 x 128 block
// pair at d128 an SM sub-partition's MUFU work with EXP_RCP (3 a score: 3,100 clocks) outlasts both
// the products (2,048) and the two warps' issue (1,700 slots, SASS); with EXP_NEWTON 2,080 and
// 2,480. Measured on an H100 (8k causal d128 bf16, perf log softcap-mufu): with the consumers'
// turns 1.663 -> 1.602 ms (softcap / plain 0.740 -> 0.771); without them 1.648 -> 1.830, where
// the two consumers' softmaxes meet on the issue slots. So the producer kernel, which takes turns,
// uses it. The backward's dQ kernel, whose three products a block (S, dP, dQ) take about as long
// as three MUFU operations a score, gained with it too (perf log softcap-bwd-dq-newton: on an H100
// the d128 8k causal backward 5.945 -> 5.579 ms, softcap / plain 0.773 -> 0.805), but waits as
// dev/experiments/softcap_bwd_dq_newton.patch for a whole GPU suite; the dK/dV kernel spills
// 16-56 bytes with it at d128.
enum class Tanh { ACCURATE, EXP_RCP, RATIONAL, EXP_NEWTON };

template <bool SOFTCAP, bool ALIBI, bool SINK, typename A, Tanh TANH>
struct ScoreFn {
    static constexpr bool IDENTITY = !SOFTCAP && !ALIBI;
    static constexpr bool HAS_GRAD = SOFTCAP;
    static constexpr bool SKIPS_FULL_BLOCKS = false;
    static constexpr bool FLOAT = sizeof(A) == sizeof(float);
    // EXP_RCP's form, 1 - 2 / (1 + 2^(k s)), with either reciprocal
    static constexpr bool EXP_FORM = FLOAT && (TANH == Tanh::EXP_RCP || TANH == Tanh::EXP_NEWTON);
    A cap_u = A(0), in_u = A(0);  // softcap: c / unit and unit / c (EXP_RCP: 2 log2(e) unit / c)
    A slope_u = A(0);             // ALiBi: slope / unit
    int diag = 0;                 // seqlen_k - seqlen_q

    struct Origin {
        A dist;  // i0 + diag - j0 as A
    };

    ScoreFn() = default;
    template <class Params>
    __device__ __forceinline__ ScoreFn(const Params& p, int batch, int head, A unit) {
        if constexpr (SOFTCAP) {
            const A cap = sizeof(A) == sizeof(double) ? A(p.variant.softcap_f64) : A(p.variant.softcap);
            cap_u = cap / unit;
            in_u = EXP_FORM ? A(2.8853900817779268) * unit / cap : unit / cap;
        }
        if constexpr (ALIBI) {
            slope_u = A(ldg(p.variant.alibi_slopes + batch * p.variant.alibi_batch_stride + head)) / unit;
            diag = p.seqlen_k - p.seqlen_q;
        }
    }

    // (block_partial: the built-in variants apply everywhere; UserScoreFn's below.)
    __device__ __forceinline__ Origin origin(int i0, int j0, bool block_partial = true) const {
        return {ALIBI ? A(i0 + diag - j0) : A(0)};
    }

    // 1 / (1 + 2^(k s)), EXP_FORM's reciprocal, for the score in column dj of its key block (a
    // constant once the fragment loops are unrolled): EXP_NEWTON takes NEWTON_OF_4 of every four
    // 8-column fragments' reciprocals on the FMA pipe and the rest on the MUFU, to balance the two
    // pipes (perf log softcap-rcp-mix: on an H100 three of four took the d128 8k causal softcap
    // forward from 1.596 to 1.540 ms, where all four had gained 3.8% over none; one and two of four
    // lost to three in the same run).
    static constexpr int NEWTON_OF_4 = 3;
    static __device__ __forceinline__ float exp_form_rcp(float x, int dj) {
        if constexpr (TANH == Tanh::EXP_NEWTON)
            return ((dj >> 3) & 3) < NEWTON_OF_4 ? rcp_newton(x) : rcp_approx(x);
        else
            return rcp_approx(x);
    }

    // tanh(s unit / c), from s in column dj of its key block (exp_form_rcp's mix).
    __device__ __forceinline__ A cap_tanh(A s, int dj) const {
        if constexpr (TANH == Tanh::RATIONAL && FLOAT)
            return tanh_rational(s * in_u);
        else if constexpr (EXP_FORM)
            // 1 - 2r as one FFMA, the same value (2r is exact): written 1 - 2 r, the compiler formed 2r
            // as r + r and took two FADDs
            return fmaf(-2.f, exp_form_rcp(1.f + exp2_approx(s * in_u), dj), 1.f);  // 2 log2(e) = 2.885... in in_u
        else
            return tanh_(s * in_u);
    }

    // s' (same unit as s) and ds'/ds.
    __device__ __forceinline__ A transform(A s, const Origin& o, int di, int dj, A& dsds) const {
        A out = s;
        dsds = A(1);
        if constexpr (SOFTCAP) {
            const A t = cap_tanh(s, dj);
            out = cap_u * t;
            dsds = A(1) - t * t;
        }
        if constexpr (ALIBI) out -= slope_u * abs_(o.dist + A(di - dj));
        return out;
    }
    __device__ __forceinline__ A transform(A s, const Origin& o, int di, int dj) const {
        A unused;
        return transform(s, o, di, dj, unused);
    }
    // transform(s) times `scale` (the forwards' scale_log2). With softcap the scale goes into the
    // constants: c tanh as a - 2a / (1 + 2^(k s)), a = scale c / unit, one FFMA where 1 - 2r, times
    // c / unit, times the scale took three (a and ALiBi's slope times the scale do not depend on
    // the score: the compiler hoists them). ALiBi alone keeps transform-then-multiply: its s still
    // needs the multiply, so folding saved nothing, and the slope's product spilled 52-68 bytes in
    // the d64 packed window kernels.
    //
    // RIGHT_IS_DIAGONAL (the mask policy's answer, mask.cuh: Causal): every pair the band keeps has
    // dist >= 0, so ALiBi's |dist| is dist and its bias splits into the row's part and the
    // column's, one FFMA a score where |dist| took an FADD and an FFMA. Only in the 16-bit kernels'
    // forms (EXP_RCP): the row's part is rounded at its own size (slope scale dist, up to about
    // slope seqlen), one constant for the whole row, so O does not see it and lse moves by 2^-24
    // of it: far below a 16-bit P's rounding, above float32's (whose kernels keep |dist|).
    // A bound every transform_scaled(s) stays at or under: softcap's a = scale c / unit (ALiBi only
    // subtracts); the FIXED_MAX forwards' row maximum (softcap alone: takes_fixed_max).
    __device__ __forceinline__ A bound_scaled(A scale) const { return cap_u * scale; }
    // transform_scaled(s) - bound_scaled(scale), softcap alone (FIXED_MAX's scores), formed
    // without the bound: -2a r where transform_scaled forms a - 2a r (one FMUL for its FFMA, and
    // the exponential's subtraction of the bound goes).
    __device__ __forceinline__ A below_bound_scaled(A s, const Origin&, int, int dj, A scale) const {
        static_assert(SOFTCAP && !ALIBI, "below_bound_scaled: softcap's bound, without ALiBi");
        const A a = cap_u * scale;
        if constexpr (EXP_FORM)
            return (-2.f * a) * exp_form_rcp(1.f + exp2_approx(s * in_u), dj);
        else
            return a * (cap_tanh(s, dj) - A(1));
    }
    template <bool RIGHT_IS_DIAGONAL = false>
    __device__ __forceinline__ A transform_scaled(A s, const Origin& o, int di, int dj, A scale) const {
        if constexpr (!SOFTCAP && ALIBI && RIGHT_IS_DIAGONAL && EXP_FORM) {
            const A slope_s = slope_u * scale, row = -slope_s * (o.dist + A(di));
            return fmaf(s, scale, fmaf(slope_s, A(dj), row));
        } else if constexpr (!SOFTCAP) {
            return transform(s, o, di, dj) * scale;
        } else {
            const A a = cap_u * scale;
            A out;
            if constexpr (EXP_FORM)
                out = fmaf(-2.f * a, exp_form_rcp(1.f + exp2_approx(s * in_u), dj), a);
            else
                out = a * cap_tanh(s, dj);
            if constexpr (ALIBI) out -= (slope_u * scale) * abs_(o.dist + A(di - dj));
            return out;
        }
    }
    // The backward's P exponent, transform(s) scale - base, and ds'/ds (float only: the
    // tensor-core kernels' recomputed P, softmax_bwd.cuh). With softcap alone the scale goes into
    // c / unit: t, 1 - t^2 and the exponent a t - base, a = scale c / unit hoisted out of the
    // loops, where c t / unit took one FMUL more before the exponent's FFMA.
    __device__ __forceinline__ float exponent_log2(float s, const Origin& o, int di, int dj, float& dsds, float scale,
                                                   float base) const {
        if constexpr (SOFTCAP && !ALIBI && FLOAT) {
            const float t = cap_tanh(s, dj);
            dsds = 1.f - t * t;
            return fmaf(cap_u * scale, t, -base);
        } else {
            return fmaf(transform(s, o, di, dj, dsds), scale, -base);
        }
    }
};

// The compile-time part, the template argument of a mask policy (mask.cuh's WithScore).
// DROPOUT: the weights P go through the call's dropout mask (dropout.cuh), which leaves the
// scores alone (the kernels ask DropoutOf<Mask> after the softmax, not the transform).
// FIXED_MAX (softcap without ALiBi): the forward's online softmax takes softcap's bound as every
// row's maximum (online_softmax.cuh block_softmax; the plans choose it where P's range allows,
// cupyflash/plans.py takes_fixed_max); kernels that do not ask keep the running maximum.
template <bool SOFTCAP, bool ALIBI, bool SINK, bool DROPOUT = false, bool FIXED_MAX_ = false>
struct ScoreMod {
    static_assert((SOFTCAP && !ALIBI) || !FIXED_MAX_, "a fixed row maximum is softcap's bound, without ALiBi");
    static constexpr bool IDENTITY = !SOFTCAP && !ALIBI;
    static constexpr bool HAS_GRAD = SOFTCAP;
    static constexpr bool HAS_SINK = SINK;
    static constexpr bool HAS_DROPOUT = DROPOUT;
    static constexpr bool FIXED_MAX = FIXED_MAX_;
    static constexpr bool HAS_BLOCK_MAP = false;
    template <typename A, Tanh TANH, bool FAST_MODS = false>
    using In = ScoreFn<SOFTCAP, ALIBI, SINK, A, TANH>;
};

typedef ScoreMod<false, false, false> NoScore;

// A user's modifiers M (modifier.cuh's contract: a struct generated by cupyflash/modifiers.py)
// as a score function: z = unit s goes through M::score (when there is one), and a pair that
// M::mask hides gets -inf (its P is then exactly 0, in the forward and in every backward kernel,
// with ds'/ds = 0). The indices are clamped into the sequences first: pairs past the end (the
// band hides them) never reach the user's code, so its tensor reads stay where the user put
// them. A mask alone returns s itself for the pairs it keeps (no round trip through the unit),
// so a mask_mod equal to a band gives the band's scores bit for bit.
// With a block map (BLOCK_MAP) the kernel's block is partial or full by the mask policy
// (mask.cuh's WithScore: full where the map holds every pair kept), and the kernel passes that to
// origin(): a full block's pairs skip the predicate, whose tensor reads (a document id a key) are
// most of a mask's cost. Without a map (the KV-cache kernel) every pair evaluates it.
template <class M, typename A, bool BLOCK_MAP, bool FAST = false>
struct UserScoreFn {
    static constexpr bool IDENTITY = false;
    static constexpr bool HAS_GRAD = M::HAS_GRAD;
    // Whether origin()'s block_partial may take the predicate off a block: the forwards then
    // unroll their transform once for each answer (online_softmax.cuh's scale_and_mask).
    static constexpr bool SKIPS_FULL_BLOCKS = BLOCK_MAP && M::HAS_MASK;
    ModArgs t;
    int batch = 0, head = 0, last_q = 0, last_kv = 0;
    A unit = A(1), inv_unit = A(1);

    struct Origin {
        int q, kv;
        bool check;  // the block may hold a pair the mask hides: evaluate it
    };

    template <class Params>
    __device__ __forceinline__ UserScoreFn(const Params& p, int batch_, int head_, A unit_)
        : t(p.variant.mods), batch(batch_), head(head_), last_q(p.seqlen_q - 1), last_kv(p.seqlen_k - 1),
          unit(unit_), inv_unit(A(1) / unit_) {}

    // block_partial: the mask policy's partial() (keys_partial()) of the block the origin is in.
    __device__ __forceinline__ Origin origin(int i0, int j0, bool block_partial = true) const {
        return {i0, j0, !SKIPS_FULL_BLOCKS || block_partial};
    }

    __device__ __forceinline__ A transform(A s, const Origin& o, int di, int dj, A& dsds) const {
        const int q = min(o.q + di, last_q), kv = min(o.kv + dj, last_kv);
        A out = s;
        dsds = A(1);
        if constexpr (M::HAS_SCORE) {
            A dz = A(1);
            out = M::template score<A, FAST && M::FAST_MATH>(s * unit, batch, head, q, kv, t, dz) * inv_unit;
            dsds = dz;
        }
        if constexpr (M::HAS_MASK) {
            if (o.check && !M::mask(batch, head, q, kv, t)) {
                out = neg_inf<A>();
                dsds = A(0);
            }
        }
        return out;
    }
    __device__ __forceinline__ A transform(A s, const Origin& o, int di, int dj) const {
        A unused;
        return transform(s, o, di, dj, unused);
    }
    // transform(s) times `scale`; a mask alone keeps s * scale, the band's scaled score bit for bit.
    template <bool RIGHT_IS_DIAGONAL = false>
    __device__ __forceinline__ A transform_scaled(A s, const Origin& o, int di, int dj, A scale) const {
        return transform(s, o, di, dj) * scale;
    }
    __device__ __forceinline__ float exponent_log2(float s, const Origin& o, int di, int dj, float& dsds, float scale,
                                                   float base) const {
        return fmaf(transform(s, o, di, dj, dsds), scale, -base);
    }
};

// The compile-time part of a call with user modifiers M (and a sink, which they may combine
// with); HAS_BLOCK_MAP: the mask policy narrows its block ranges by the mask's block map.
// BLOCK_MAP false: a mask without a map, applied element by element only (the KV-cache kernel,
// whose CTAs mix query heads and read each sequence's own length: mask.cuh's sequence_mask).
template <class M, bool SINK, bool DROPOUT = false, bool BLOCK_MAP = M::HAS_MASK>
struct UserScore {
    static constexpr bool IDENTITY = false;
    static constexpr bool HAS_GRAD = M::HAS_GRAD;
    static constexpr bool HAS_SINK = SINK;
    static constexpr bool HAS_DROPOUT = DROPOUT;
    static constexpr bool FIXED_MAX = false;
    static constexpr bool HAS_BLOCK_MAP = BLOCK_MAP && M::HAS_MASK;
    template <typename A, Tanh TANH, bool FAST_MODS = false>
    using In = UserScoreFn<M, A, HAS_BLOCK_MAP, FAST_MODS>;
};

// FAST_MODS: a user modifier's float math in its fast forms (modifier.cuh), which the 16-bit
// producer kernels take: elsewhere the cheaper code let ptxas spill (8-44 bytes in the mma.sync
// kernels and the d256 packed wgmma forward with the compile check's example modifier).
template <class Mask, typename A, Tanh TANH = Tanh::ACCURATE, bool FAST_MODS = false>
using ScoreOf = typename Mask::Score::template In<A, TANH, FAST_MODS>;

// The sink logit of `head` in log2 units, or -inf without one (a row's sum then gains 0).
template <class Mask, typename A, class Params>
__device__ __forceinline__ A sink_log2(const Params& p, int head) {
    if constexpr (Mask::Score::HAS_SINK)
        return A(ldg(p.variant.sink + head)) * A(1.4426950408889634074);
    else
        return neg_inf<A>();
}

// The epilogue of a row with running maximum m and sum l (log2 units) and the sink logit
// sink2 (log2 units, -inf: none): the factor of O (1 / l, or 0 for a row that saw no key) and
// lse = top + log2_sum in log2 units. With a sink the denominator is l 2^(m - M) + 2^(sink2 - M),
// top = M = max(m, sink2), and O is scaled by 2^(m - M) over it; a row that saw no key gets O = 0,
// lse = sink, and one that weighs nothing top = -inf. A sink of -inf is no sink: then top = m
// and the denominator l, so l = 1 gives log2_sum = 0 exactly (flash_bwd_stats_simt relies on it).
template <typename A>
__device__ __forceinline__ void finish_row_log2(A m, A l, A sink2, A& o_factor, A& top, A& log2_sum) {
    const bool seen = l > A(0);
    top = seen ? max_(m, sink2) : sink2;
    if (top == neg_inf<A>()) {
        // O's factor 0 for a row that saw no key (l = 0), NaN for one whose softmax is NaN (a NaN
        // l), which the tf32 wgmma forward's unguarded P split no longer carries into O
        // (tf32-nan-v2); lse -inf for both, as without a sink
        o_factor = A(0) * l;
        log2_sum = A(0);
        return;
    }
    const A own = seen ? exp2_(m - top) : A(0);
    const A denom = l * own + exp2_(sink2 - top);
    o_factor = own / denom;
    log2_sum = log2_(denom);
}

// finish_row_log2 with lse in natural log, the forward kernels' sink epilogue. (The kernels
// without a sink keep their own epilogue.)
template <typename A>
__device__ __forceinline__ void finish_row_with_sink(A m, A l, A sink2, A& o_factor, A& lse) {
    A top, log2_sum;
    finish_row_log2(m, l, sink2, o_factor, top, log2_sum);
    lse = (top + log2_sum) * A(0.6931471805599453094172321);  // -inf stays -inf
}

}  // namespace cf

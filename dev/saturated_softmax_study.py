"""When the softmax saturates, how far is the float32 backward from float64, against standard
attention in float32? A CPU study for issue 18's saturated-softmax item.

Three backward recipes, each with the forward statistics it needs, against the float64
reference (cupyflash.reference) and standard float32 attention (materialised P, D = rowsum(P dP)):

    kernels   today's: lse in natural log from log2-unit statistics, P = exp2(min(S c2 - lse log2 e, 0)),
              D = rowsum(dO * O) from the stored O
    pdp       the same P, D = rowsum(P * dP) (one more pass over the keys of each row)
    natural   the forward's lse = m + log(l) with m the largest fl(S * scale), the backward's
              P = exp(min(fl(S * scale) - lse, 0)) in natural units, D = rowsum(P * dP)
    natural_o natural's P with the kernels' D = rowsum(dO * O)
    lse64     lse kept in float64 (from the kernels' float32 log2-unit m and l), the backward's
              exponent fl32(S c2) - lse log2 e formed in float64, D = rowsum(P * dP)
    lse_ext   lse64 one precision up: lse kept, and the exponent formed, in NumPy's longdouble
              (x86: 64-bit significand), with ln 2 and log2 e in longdouble too, D = rowsum(P * dP);
              the float64 inputs' lse64
    m_l       no lse: the forward keeps each row's maximum m (log2 units, exact: one of the
              scores) and log2(l) apart, the backward forms (S c2 - m) - log2(l), so the row
              maximum's exponent is exactly -log2(l); D = rowsum(P * dP)

Each recipe keeps the kernels' arithmetic in the accumulator type (float32, or float64) and their
order of operations per element; the matrix products are NumPy's in that type. The reference is
cupyflash.reference's float64 for float32 inputs; for float64 inputs float64 cannot judge float64,
so there it is the same definition evaluated in longdouble (``extended_reference``; ``--reference``
chooses). Printed:
for each softmax scale and input magnitude, the worst ratio over seeds of a recipe's max abs
error to standard attention's (per gradient: dq, dk, dv), with the floor of the error at 1e-30 of
the gradients' own size so that exact zeros compare.

    python dev/saturated_softmax_study.py [--seeds 3] [--dtype float32 | float64] [--reference float64 | extended]
"""
from __future__ import annotations

import argparse

import numpy as np

from cupyflash import reference

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
RECIPES = ("kernels", "pdp", "natural", "natural_o", "lse64", "lse_ext", "m_l")
EXT = np.longdouble
LN2_EXT = np.log(EXT(2))  # ln 2 and log2 e to longdouble's precision: float64's would round the
LOG2E_EXT = EXT(1) / LN2_EXT  # natural-log round trip of lse_ext's lse to float64's ulp


def forward_log2(q, k, v, scale, acc):
    """o and lse as the kernels make them: log2-unit statistics, lse in natural log."""
    s2 = (q @ k.T).astype(acc) * acc(scale * LOG2E)
    m2 = s2.max(axis=-1, keepdims=True)
    p = np.exp2(s2 - m2)
    l = p.sum(axis=-1, keepdims=True)
    o = (p @ v) / l
    lse = (m2 + np.log2(l)) * acc(LN2)
    return o.astype(acc), lse[:, 0].astype(acc)


def forward_natural(q, k, v, scale, acc):
    """o and lse with natural-unit statistics: lse = m + log(l), m the largest fl(S * scale)."""
    sn = (q @ k.T).astype(acc) * acc(scale)
    m = sn.max(axis=-1, keepdims=True)
    p = np.exp(sn - m)
    l = p.sum(axis=-1, keepdims=True)
    o = (p @ v) / l
    lse = m + np.log(l)
    return o.astype(acc), lse[:, 0].astype(acc)


def extended_reference(do, q, k, v, scale):
    """(dq, dk, dv) of softmax attention from its definition, every step in longdouble: the
    reference for float64 inputs (float64's own rounding is what is measured). Safe softmax: the
    row maximum subtracted before the exponential (the result does not depend on it; its rounding
    is longdouble's)."""
    do, q, k, v = (x.astype(EXT) for x in (do, q, k, v))
    s = (q @ k.T) * EXT(scale)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    dp = do @ v.T
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    return (ds @ k) * EXT(scale), (ds.T @ q) * EXT(scale), p.T @ do


def forward_stats(q, k, v, scale, acc):
    """The kernels' forward statistics in the accumulator type: the scores in log2 units s2, each
    row's maximum m2 (one of the scores, so exact) and sum l, and o."""
    s2 = (q @ k.T).astype(acc) * acc(scale * LOG2E)
    m2 = s2.max(axis=-1, keepdims=True)
    e = np.exp2(s2 - m2)
    l = e.sum(axis=-1, keepdims=True)
    return s2, m2, l, ((e @ v) / l).astype(acc)


def backward(recipe, do, q, k, v, scale, acc):
    if recipe in ("m_l", "lse_ext", "lse64"):
        s2, m2, l, o = forward_stats(q, k, v, scale, acc)
        if recipe == "m_l":
            p = np.exp2(np.minimum((s2 - m2) - np.log2(l), 0)).astype(acc)
        else:  # lse kept one precision up (lse_ext: longdouble, lse64: float64)
            wide, ln2, log2e = (EXT, LN2_EXT, LOG2E_EXT) if recipe == "lse_ext" else (np.float64, LN2, LOG2E)
            lse = (m2.astype(wide) + np.log2(l.astype(wide))) * wide(ln2)
            p = np.exp2(np.minimum(s2.astype(wide) - lse * wide(log2e), 0)).astype(acc)
    elif recipe.startswith("natural"):
        o, lse = forward_natural(q, k, v, scale, acc)
        sn = (q @ k.T).astype(acc) * acc(scale)
        p = np.exp(np.minimum(sn - lse[:, None], 0))
    else:  # kernels, pdp
        o, lse = forward_log2(q, k, v, scale, acc)
        s2 = (q @ k.T).astype(acc) * acc(scale * LOG2E)
        p = np.exp2(np.minimum(s2 - lse[:, None] * acc(LOG2E), 0))
    dp = (do @ v.T).astype(acc)
    from_o = recipe in ("kernels", "natural_o")
    d = (do * o).sum(axis=-1, keepdims=True) if from_o else (p * dp).sum(axis=-1, keepdims=True)
    ds = p * (dp - d)
    return (ds @ k) * acc(scale), (ds.T @ q) * acc(scale), p.T @ do


def worst_ratios(scale, magnitude, seeds, acc, n=96, d=64, extended=False):
    """{recipe: [dq, dk, dv]} worst ratios over seeds, and {recipe: worst error on the gradients'
    natural scale}: where the softmax saturates the reference's gradients can be exactly 0 (a
    one-hot P makes dS = 0), and so standard attention's error, so that a ratio of any nonzero
    error is huge; the second number says how large that error is, as a fraction of the size the
    gradients have without saturation (|dS| ~ |dP| ~ |dO| |V|, times |K| or |Q| and the scale, or
    |dO| for dv)."""
    out = {r: [0.0, 0.0, 0.0] for r in RECIPES}
    absolute = {r: 0.0 for r in RECIPES}
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        q, k, v, do = ((rng.standard_normal((n, d)) * (magnitude if i < 2 else 1)).astype(acc) for i in range(4))
        shaped = [x[None, :, None, :] for x in (do, q, k, v)]
        with np.errstate(all="ignore"):
            if extended:
                ref = [np.asarray(g) for g in extended_reference(do, q, k, v, scale)]
            else:
                ref = [np.asarray(g, np.float64)[0, :, 0]
                       for g in reference.attention_backward(*shaped, softmax_scale=scale)]
            std = reference.standard_attention_backward(*shaped, softmax_scale=scale, dtype=acc)
        std = [np.asarray(g, np.float64)[0, :, 0] for g in std]
        big = lambda x: float(np.abs(x.astype(np.float64)).max())  # noqa: E731
        dp_scale = big(do) * big(v) * d
        natural = (dp_scale * big(k) * scale * n, dp_scale * big(q) * scale * n, big(do) * n)
        for recipe in out:
            with np.errstate(all="ignore"):
                got = backward(recipe, do, q, k, v, scale, acc)
            for i, (g, r, s) in enumerate(zip(got, ref, std)):
                wide = r.dtype  # the reference's precision: the differences are taken in it
                floor = max(1e-30 * float(np.abs(r).max()), 1e-300)
                err = float(np.nan_to_num(np.abs(np.asarray(g).astype(wide) - r).max(), nan=np.inf))
                err_std = float(np.abs(s.astype(wide) - r).max())
                out[recipe][i] = max(out[recipe][i], (err + floor) / (err_std + floor))
                absolute[recipe] = max(absolute[recipe], err / natural[i])
    return out, absolute


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--reference", choices=("float64", "extended"), default=None,
                        help="float64 (cupyflash.reference) or longdouble (extended_reference); default: "
                             "float64 for float32 inputs, extended for float64")
    args = parser.parse_args(argv)
    acc = np.dtype(args.dtype).type
    extended = (args.reference or ("extended" if args.dtype == "float64" else "float64")) == "extended"
    if extended and np.finfo(EXT).nmant <= np.finfo(np.float64).nmant:
        parser.error("this platform's longdouble is float64: no extended reference")
    print(f"worst max-abs error / standard {args.dtype} attention's, over {args.seeds} seeds (dq, dk, dv), "
          f"reference in {'longdouble' if extended else 'float64'}")
    print(f"{'scale':>8} {'magnitude':>9}  " + "  ".join(f"{r:>24}" for r in RECIPES))
    rows = []
    for scale in (0.125, 1.0, 1e2, 1e4):
        for magnitude in (1.0, 10.0, 100.0):
            ratios, absolute = worst_ratios(scale, magnitude, args.seeds, acc, extended=extended)
            cells = ["/".join(f"{x:7.2g}" for x in ratios[r]) for r in RECIPES]
            print(f"{scale:8g} {magnitude:9g}  " + "  ".join(f"{c:>24}" for c in cells))
            rows.append((scale, magnitude, absolute))
    print(f"\nworst max-abs error on the gradients' natural scale (worst_ratios), {args.dtype} eps "
          f"{np.finfo(acc).eps:.1e}")
    print(f"{'scale':>8} {'magnitude':>9}  " + "  ".join(f"{r:>10}" for r in RECIPES))
    for scale, magnitude, absolute in rows:
        print(f"{scale:8g} {magnitude:9g}  " + "  ".join(f"{absolute[r]:10.2g}" for r in RECIPES))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

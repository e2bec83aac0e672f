"""How accurate is attention with float32 products on tensor cores? A CPU study for issue 18.

Standard attention (materialised S, P; forward and backward) in float32 with every matrix product
done one of three ways, each measured against float64:

    fp32    the products in float32 (NumPy's float32 matmul: float32 accumulation)
    3xtf32  each operand split x = hi + lo, hi = tf32(x), lo = tf32(x - hi), the product as
            hi.hi + hi.lo + lo.hi with float32 accumulation (the lo.lo term dropped)
    1xtf32  the operands rounded to tf32, one product (PyTorch's allow_tf32)

tf32(x) is cvt.rna.tf32.f32: round to nearest, ties away from zero, to 10 explicit mantissa
bits. A tf32 x tf32 product has at most 22 significant bits, so it is exact in float32; the
model's only other rounding is float32 accumulation, which the tensor cores do at least as well
(this model is optimistic about the hardware's adder: ncu cannot show it, the GPU can). The ratio
3xtf32 / fp32 of each output's max error is what issue 18's accuracy bar ("within 2x standard
fp32 attention") asks about.

    python dev/tf32_split_study.py [--seeds 4]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cupyflash.precision import round_tf32 as tf32  # noqa: E402  (cvt.rna.tf32.f32, the kernels' rounding)


def product(kind: str):
    def fp32(a, b):
        return np.asarray(a, np.float32) @ np.asarray(b, np.float32)

    def three(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        a_hi, b_hi = tf32(a), tf32(b)
        a_lo, b_lo = tf32(a - a_hi), tf32(b - b_hi)
        # the small terms first, as a kernel would accumulate them before the large one
        return (a_hi @ b_lo + a_lo @ b_hi) + a_hi @ b_hi

    def one(a, b):
        return tf32(a) @ tf32(b)

    return {"fp32": fp32, "3xtf32": three, "1xtf32": one}[kind]


def attention(q, k, v, do, scale, mm, dtype):
    """Forward and backward of standard attention (one head), products by ``mm``, the rest in
    ``dtype``. Returns o, dq, dk, dv."""
    q, k, v, do = (x.astype(dtype) for x in (q, k, v, do))
    s = mm(q, k.T).astype(dtype) * dtype(scale)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    p = e / e.sum(axis=-1, keepdims=True)
    o = mm(p, v).astype(dtype)
    dv = mm(p.T, do).astype(dtype)
    dp = mm(do, v.T).astype(dtype)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    dq = mm(ds, k).astype(dtype) * dtype(scale)
    dk = mm(ds.T, q).astype(dtype) * dtype(scale)
    return o, dq, dk, dv


def study(seeds: int = 4):
    rows = []
    for seqlen, headdim, magnitude in ((256, 64, 1.0), (1024, 64, 1.0), (512, 128, 1.0), (512, 128, 4.0),
                                       (1024, 128, 0.25)):
        worst = {}
        for seed in range(seeds):
            rng = np.random.default_rng(seed)
            q, k, v, do = (rng.standard_normal((seqlen, headdim)) * magnitude for _ in range(4))
            q, k, v, do = (x.astype(np.float32).astype(np.float64) for x in (q, k, v, do))  # float32 inputs
            scale = headdim ** -0.5
            ref = attention(q, k, v, do, scale, lambda a, b: a @ b, np.float64)
            for kind in ("fp32", "3xtf32", "1xtf32"):
                got = attention(q, k, v, do, scale, product(kind), np.float32)
                for name, g, r in zip(("o", "dq", "dk", "dv"), got, ref):
                    err = float(np.abs(g.astype(np.float64) - r).max())
                    worst[kind, name] = max(worst.get((kind, name), 0.0), err)
        rows.append(((seqlen, headdim, magnitude), worst))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4)
    args = parser.parse_args(argv)
    print("| seqlen | d | |x| | output | fp32 max err | 3xtf32 | 3xtf32 / fp32 | 1xtf32 | 1xtf32 / fp32 |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for (seqlen, headdim, magnitude), worst in study(args.seeds):
        for name in ("o", "dq", "dk", "dv"):
            base, three, one = worst["fp32", name], worst["3xtf32", name], worst["1xtf32", name]
            print(f"| {seqlen} | {headdim} | {magnitude} | {name} | {base:.2e} | {three:.2e} | {three / base:.2f} | "
                  f"{one:.2e} | {one / base:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

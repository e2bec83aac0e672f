"""Where the SIMT float32 backward's ordinary-case error comes from, on the CPU: its dQ kernel
emulated in float32 (FMA as an exact float64 product rounded once), against attention's gradient
in extended precision (tests/saturation.py), for the example the GPU property found at 3.1x
standard attention's dq error (docs/perf-log.md, bwd-stats-v1).

    python dev/simt_dot_chains_study.py

Prints the emulated error with each product exact in turn (S = q.k, dP = dO.v, dQ = dS K), then
the error over 30 seeds with row_dots' single FMA chain over the head dim split into 2 and 4
interleaved chains. Measured (2026-12-03): S dominates (exact S: 8.9e-6 -> 1.4e-6); 4 chains
lower the median error 1.8x and the worst 2.3x. Not yet in the kernels.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import saturation  # noqa: E402

from cupyflash import reference  # noqa: E402

F32 = np.float32


def fma(a, b, c):
    """float32 FMA: the exact product (float64 holds it) plus c, rounded once."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(F32)


def dots(a, rows, chains=1, exact=False):
    """a . rows[n] for every n: `chains` interleaved FMA chains over the head dim, summed
    pairwise (1: row_dots), or exact then rounded."""
    if exact:
        return (rows.astype(np.float64) @ a.astype(np.float64)).astype(F32)
    parts = []
    for c in range(chains):
        acc = np.zeros(rows.shape[0], F32)
        for d in range(c, a.shape[0], chains):
            acc = fma(np.full(rows.shape[0], a[d], F32), rows[:, d], acc)
        parts.append(acc)
    while len(parts) > 1:
        parts = [(parts[i] + parts[i + 1]).astype(F32) for i in range(0, len(parts), 2)]
    return parts[0]


def kernel_dq(case, chains=1, exact_s=False, exact_dp=False, exact_dq=False):
    """dq of head 0 as flash_bwd_stats_simt + flash_bwd_dq_simt form it (recomputed statistics)."""
    q, k, v, do = case.arrays()
    Q, K, V, dO = q[0, :, 0], k[0, :, 0], v[0, :, 0], do[0, :, 0]
    n, m = Q.shape[0], K.shape[0]
    scale_log2 = F32(case.softmax_scale * 1.4426950408889634)
    dq = np.zeros_like(Q)
    for i in range(n):
        visible = np.arange(m) <= i + (m - n) if case.causal else np.ones(m, bool)
        if not visible.any():
            continue
        x = np.where(visible, (dots(Q[i], K, chains, exact_s) * scale_log2).astype(F32), -np.inf).astype(F32)
        dp = dots(dO[i], V, chains, exact_dp)
        j = int(np.argmax(x))
        top, ref = x[j], dp[j]
        e = np.exp2((x - top).astype(np.float64)).astype(F32)
        weight = F32(F32(1) / e.sum(dtype=F32))
        d_shift = F32(np.where(visible, e * (dp - ref), 0).astype(F32).sum(dtype=F32) * weight)
        ds = np.where(visible, (e * weight).astype(F32) * ((dp - ref).astype(F32) - d_shift), 0).astype(F32)
        if exact_dq:
            dq[i] = (ds.astype(np.float64) @ K.astype(np.float64)).astype(F32)
        else:
            acc = np.zeros(Q.shape[1], F32)
            for t in range(m):
                acc = fma(np.full(Q.shape[1], ds[t], F32), K[t], acc)
            dq[i] = acc
    return (dq * F32(case.softmax_scale)).astype(F32)


def error(case, **options) -> float:
    q, k, v, do = case.arrays()
    truth, _ = saturation.extended_gradients(do, q, k, v, softmax_scale=case.softmax_scale, causal=case.causal)
    return float(np.abs(kernel_dq(case, **options).astype(np.longdouble) - truth[0][0, :, 0]).max())


def main() -> None:
    case = saturation.Case(np.dtype(np.float32), 53, 12, 1, 40, True, 1.0, 1.0, 2750)
    q, k, v, do = case.arrays()
    truth, _ = saturation.extended_gradients(do, q, k, v, softmax_scale=1.0, causal=True)
    standard = reference.standard_attention_backward(do, q, k, v, dtype=np.float32, softmax_scale=1.0, causal=True)
    print(f"standard attention (this machine's NumPy): {float(np.abs(standard[0][0, :, 0] - truth[0][0, :, 0]).max()):.2e}")
    for flags in ({}, {"exact_s": True}, {"exact_dp": True}, {"exact_dq": True}):
        print(f"emulated kernel {flags or '(as is)'}: {error(case, **flags):.2e}")
    for chains in (1, 2, 4):
        errors = [error(saturation.Case(np.dtype(np.float32), 53, 12, 1, 40, True, 1.0, 1.0, seed), chains=chains)
                  for seed in range(30)]
        print(f"{chains} chain(s) over the head dim, 30 seeds: median {np.median(errors):.2e}, worst {max(errors):.2e}")


if __name__ == "__main__":
    main()

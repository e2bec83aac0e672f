"""Issue 18's float32 accuracy bar, 2x standard float32 attention's error, as the GPU tests of the
float32 tensor-core kernels assert it: over a fixed set of draws, not on every draw.

Per draw the bar is a lottery at the 0.1% level (docs/perf-log.md tf32-apart-accuracy, measured
on the CPU with dev/fuzz_split_tf32.py over the tests' own strategy and bound): standard float32
attention itself, with Q K^T summed in another order, exceeds its own bound on 0.05% of draws;
the kernels' arithmetic, emulated, on 0.1-0.5% (the median ratio to the bound 0.22-0.26, p99
0.67-0.82, against standard reordered's 0.25 and 0.79); every form of S short of float64 fails
some. The distribution moves when a kernel loses accuracy (the chained kernel without sums apart:
22.5% over, median 0.78), a lucky draw does not.
"""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from accuracy_distribution import Rule, assert_distribution
from cupyflash import reference
from cupyflash.testing.tolerance import max_abs_error

FLOOR = 2.0 ** -21  # times max|ref|: where standard float32 attention is exact
# Over the bound: at most 2% of the draws, and one draw always (the emulated kernels' rate is
# 0.1-0.5%: with 200 draws 5 or more over is a 0.1% event; with the suite's 25, 2 or more 0.7%).
RULE = Rule(max_share_over=0.02, max_median=0.4, max_p99=1.2, max_ratio=4.0, p99_from=100)


def ratio_to_bound(q, k, v, o, lse, problem, options: dict) -> float:
    """max(|o - ref| / o's bound, |lse - ref| / lse's bound): the bounds 2x standard float32's error
    plus FLOOR max(1, max|ref|) (lse: over the finite entries)."""
    assert not np.isnan(o).any() and not np.isnan(lse).any(), problem
    o_ref, lse_ref = reference.attention(q, k, v, **problem.kwargs, **options)
    o_std, lse_std = reference.standard_attention(q, k, v, dtype=np.float32, **problem.kwargs, **options)
    o_bound = 2 * max_abs_error(o_std, o_ref) + FLOOR * max(1.0, float(np.abs(o_ref).max(initial=0.0)))
    finite = lse_ref[np.isfinite(lse_ref)]
    lse_bound = 2 * max_abs_error(lse_std, lse_ref) + FLOOR * max(1.0, float(np.abs(finite).max(initial=0.0)))
    return max(max_abs_error(o, o_ref) / o_bound, max_abs_error(lse, lse_ref) / lse_bound)


def assert_within_twice_standard(label: str, problems, variants, ratio_of) -> None:
    """Draws as many (problem, variant) pairs of the strategies as the Hypothesis profile's
    max_examples (dev 25, gpu 200), derandomized (the same draws every run, none shrunk),
    ratio_of(problem, variant) each, and asserts their distribution (tests/accuracy_distribution.py):
    over the bound at most 2% of them or one, median <= 0.4, p99 <= 1.2 (from 100 draws), max <= 4.
    Prints the summary."""
    assert_distribution(label, st.tuples(problems, st.sampled_from(variants)), lambda pair: ratio_of(*pair), RULE)

"""score.cuh's tanh_rational, the tanh of softcap in the 16-bit tensor-core kernels (and float32's
"tf32"): its constants read from the header and evaluated as the kernel evaluates them (float32
operations, each FMA rounded once; rcp.approx, which PTX allows an ulp of error, as the correctly
rounded reciprocal and as that one ulp either way), against float64 tanh over the whole float32
line. The kernel's claim: an absolute error below 1.25e-6, |tanh| never above 1, odd, NaN kept
(the clamp's max_nan / min_nan, mma.cuh, are PTX's .NaN forms: fmaxf / fminf would return the
bound)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

SCORE = Path(__file__).resolve().parents[2] / "kernels_cu" / "score.cuh"
BOUND = 1.25e-6


def tanh_rational_source() -> str:
    text = SCORE.read_text()
    start = text.index("__device__ __forceinline__ float tanh_rational(float y)")
    return text[start:text.index("\n}", start)]


def constants() -> tuple[float, list[float], list[float]]:
    """(clamp, N's coefficients from u^3 down, D's from u^3 down) as written in the header."""
    body = tanh_rational_source()
    clamp = float(re.search(r"min_nan\(max_nan\(y, -([0-9.]+)f\), ([0-9.]+)f\)", body).group(1))
    polys = re.findall(r"const float (\w) = (fmaf\(.*?);", " ".join(body.split()))
    coefficients = {}
    for name, expression in polys:
        coefficients[name] = [float(c) for c in re.findall(r"([0-9.]+(?:e-?[0-9]+)?)f", expression)]
    return clamp, coefficients["n"], coefficients["d"]


def f32(x):
    return np.asarray(x, dtype=np.float64).astype(np.float32)


def fma32(a, b, c):
    """fmaf: one rounding of the exact a b + c (float32 a b is exact in float64)."""
    return f32(a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64))


def horner(coefficients, u):
    """fmaf(fmaf(fmaf(c3, u, c2), u, c1), u, c0) as the header nests it."""
    acc = np.full_like(u, np.float32(coefficients[0]))
    for c in coefficients[1:]:
        acc = fma32(acc, u, np.full_like(u, np.float32(c)))
    return acc


def tanh_rational(y, clamp, n, d, rcp_ulps=0):
    """The header's arithmetic; ``rcp_ulps``: rcp.approx's result moved that many ulps from the
    correctly rounded reciprocal. np.maximum / np.minimum keep NaN, as max.NaN / min.NaN do."""
    y = f32(y)
    y_c = np.minimum(np.maximum(y, np.float32(-clamp)), np.float32(clamp))
    u = f32(y_c.astype(np.float64) * y_c)
    num, den = horner(n, u), horner(d, u)
    r = f32(1.0 / den.astype(np.float64))
    for _ in range(abs(rcp_ulps)):
        r = np.nextafter(r, np.float32(np.inf if rcp_ulps > 0 else 0.0))
    return f32(f32(y_c.astype(np.float64) * num).astype(np.float64) * r)


def grid() -> np.ndarray:
    """Dense where tanh bends, every float32 magnitude beyond, and the clamp's edge."""
    dense = np.linspace(0.0, 10.0, 2_000_001)
    wide = np.geomspace(1e-30, 3e38, 20_001)
    edge = np.float32(7.0) + np.arange(-2000, 2001, dtype=np.float64) * 2.0 ** -20
    y = np.concatenate([dense, wide, edge])
    return f32(np.concatenate([y, -y]))


def test_the_header_has_one_clamp_and_two_cubics():
    clamp, n, d = constants()
    assert clamp == 7.0 and len(n) == 4 and len(d) == 4 and d[-1] == 1.0


@pytest.mark.parametrize("rcp_ulps", [0, 1, -1])
def test_tanh_rational_within_its_bound_everywhere(rcp_ulps):
    clamp, n, d = constants()
    y = grid()
    t = tanh_rational(y, clamp, n, d, rcp_ulps)
    error = np.abs(t.astype(np.float64) - np.tanh(y.astype(np.float64)))
    assert error.max() < BOUND, (float(error.max()), float(y[np.argmax(error)]))
    assert np.abs(t).max() <= 1.0
    np.testing.assert_array_equal(tanh_rational(-y, clamp, n, d, rcp_ulps), -t)


def test_nan_stays_nan_and_infinities_saturate():
    body = tanh_rational_source()
    assert "fminf" not in body and "fmaxf" not in body  # they would turn a NaN score finite
    text = (SCORE.parent / "mma.cuh").read_text()  # where max_nan / min_nan live
    for op in ("max", "min"):
        assert re.search(rf'asm\("{op}\.NaN\.f32 %0, %1, %2;"', text), op
    clamp, n, d = constants()
    t = tanh_rational(np.array([np.nan, np.inf, -np.inf]), clamp, n, d)
    assert np.isnan(t[0]) and 1 - 1e-6 < t[1] <= 1 and t[2] == -t[1]


@pytest.mark.parametrize("which, index, factor", [("n", 0, 1 + 2e-6), ("n", 3, 1.001), ("d", 1, 1 + 1e-5),
                                                  ("clamp", None, 6.5 / 7.0)])
def test_a_changed_constant_breaks_the_bound(which, index, factor):
    """The check can fail: each of these perturbations takes the error past 1.2e-6."""
    clamp, n, d = constants()
    if which == "clamp":
        clamp *= factor
    else:
        coefficients = n if which == "n" else d
        coefficients[-1 - index] *= factor
    y = grid()
    error = np.abs(tanh_rational(y, clamp, n, d).astype(np.float64) - np.tanh(y.astype(np.float64)))
    assert error.max() >= BOUND

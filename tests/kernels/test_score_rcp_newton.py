"""score.cuh's rcp_newton, the reciprocal of softcap's EXP_NEWTON form (the producer forward,
flash_fwd_wgmma_ws): its seed constant read from the header and its steps evaluated as the kernel
evaluates them (float32 operations, each FFMA rounded once, subnormal inputs and results flushed
to zero as -ftz=true compiles them), against float64 over the argument's range 1 + 2^(k s) in
[1, +inf]. The kernel's claims: a relative error below 2e-7 wherever 1 / x is a normal float
(seed normal: x up to 8.1e37; the error is periodic in the binade, so every float of [1, 2) is
every case), r = 0 from there up and for +inf, NaN kept; and the capped score a - 2a r then within
float32's rounding of a tanh, as with rcp.approx."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

SCORE = Path(__file__).resolve().parents[2] / "kernels_cu" / "score.cuh"
BOUND = 2e-7
TINY = np.float32(2.0 ** -126)  # the smallest normal float32

# rcp_newton's statements, in order, as the emulation below takes them
STATEMENTS = (
    "const float x_c = min_nan(x, __int_as_float(RCP_SEED_BITS));",
    "const float seed = __int_as_float(RCP_SEED_BITS - __float_as_int(x_c));",
    "const float d_seed = fmaf(-x_c, seed, 1.f);",
    "const float r = fmaf(seed, fmaf(d_seed, d_seed, d_seed), seed);",
    "return fmaf(r, fmaf(-x_c, r, 1.f), r);",
)


def rcp_newton_source() -> str:
    text = SCORE.read_text()
    start = text.index("__device__ __forceinline__ float rcp_newton(float x)")
    return text[start:text.index("\n}", start)]


def seed_bits() -> int:
    return int(re.search(r"constexpr int RCP_SEED_BITS = (0x[0-9A-Fa-f]+);", rcp_newton_source()).group(1), 16)


def f32(x):
    return np.asarray(x, dtype=np.float64).astype(np.float32)


def ftz(x):
    """-ftz=true: a subnormal operand or result is a zero of its sign."""
    x = np.asarray(x, dtype=np.float32)
    return np.where(np.abs(x) < TINY, np.copysign(np.float32(0), x), x).astype(np.float32)


def fma32(a, b, c):
    """FFMA.FTZ: a b + c rounded once to float32. a b is exact in float64; where the float64 sum
    lands exactly halfway between two floats, its rounding error (two-sum) says which way the exact
    sum lies (the one case a double rounding gets wrong)."""
    a, b, c = (ftz(v).astype(np.float64) for v in (a, b, c))
    with np.errstate(invalid="ignore", over="ignore"):
        ab = a * b
        hi = ab + c
        bb = hi - ab
        lo = (ab - (hi - bb)) + (c - bb)
        r = hi.astype(np.float32)
        r64 = r.astype(np.float64)
        other = np.where(r64 < hi, np.nextafter(r, np.float32(np.inf)), np.nextafter(r, np.float32(-np.inf)))
        halfway = (r64 != hi) & np.isfinite(hi) & (np.abs(hi - r64) == np.abs(other.astype(np.float64) - hi))
        towards_other = np.sign(other.astype(np.float64) - r64) == np.sign(lo)
        r = np.where(halfway & (lo != 0) & towards_other, other, r)
    return ftz(r)


def rcp_newton(x, bits: int | None = None, third_order: bool = True, clamp: bool = True):
    """The header's steps (STATEMENTS); the keyword arguments undo one of them, for the tests
    that show the check can fail."""
    bits = seed_bits() if bits is None else bits
    x = f32(x)
    bound = np.array([bits], dtype=np.uint32).view(np.float32)[0]
    x_c = np.minimum(x, bound) if clamp else x  # np.minimum keeps NaN, as min.NaN does
    seed = (np.int64(bits) - x_c.view(np.int32).astype(np.int64)).astype(np.uint32).view(np.float32)
    d_seed = fma32(-x_c, seed, np.float32(1))
    r = fma32(seed, fma32(d_seed, d_seed, d_seed) if third_order else d_seed, seed)
    return fma32(r, fma32(-x_c, r, np.float32(1)), r)


def relative_error(x, r):
    exact = 1.0 / x.astype(np.float64)
    return np.abs(r.astype(np.float64) - exact) / exact


def binade() -> np.ndarray:
    """Every float32 of [1, 2)."""
    return ((np.arange(1 << 23, dtype=np.uint32) + np.uint32(127 << 23))).view(np.float32)


def wide() -> np.ndarray:
    """The argument's range on a log scale up to the last normal seed, and 1 + 2^y's own values."""
    y = np.linspace(-30.0, 126.0, 400_001)
    return np.unique(f32(np.concatenate([1.0 + np.exp2(y), np.geomspace(1.0, 8.0e37, 200_001)])))


def test_the_header_has_the_steps_the_emulation_takes():
    body = " ".join(rcp_newton_source().split())
    for statement in STATEMENTS:
        assert statement in body, statement
    assert "fminf" not in body  # it would turn a NaN argument finite
    text = (SCORE.parent / "mma.cuh").read_text()  # where min_nan lives
    assert re.search(r'asm\("min\.NaN\.f32 %0, %1, %2;"', text)


def test_within_float32_rounding_over_every_mantissa():
    x = binade()
    for part in np.array_split(x, 8):
        error = relative_error(part, rcp_newton(part))
        assert error.max() < BOUND, (float(error.max()), float(part[np.argmax(error)]))


def test_within_float32_rounding_over_the_range():
    x = wide()
    normal = x <= np.float32(8.0e37)
    r = rcp_newton(x)
    error = relative_error(x[normal], r[normal])
    assert error.max() < BOUND, (float(error.max()), float(x[normal][np.argmax(error)]))
    assert np.all(r[normal] <= 1.0) and rcp_newton(np.float32(1.0)) == 1.0


def test_large_arguments_infinity_and_nan():
    bits = seed_bits()
    clamp_value = np.array([bits], dtype=np.uint32).view(np.float32)[0]
    large = f32(np.concatenate([np.geomspace(8.2e37, 3.4e38, 10_001), [clamp_value, np.finfo(np.float32).max]]))
    r = rcp_newton(large)
    assert np.all(r == 0.0), float(r.max())  # 1 / x < 1.3e-38 there: rcp.approx.ftz gives 0 from 2^126
    # between the last normal seed and the clamp: 0 or within the bound, never above 1 / x by more
    edge = f32(np.geomspace(7.9e37, 8.2e37, 10_001))
    r_edge = rcp_newton(edge)
    ok = (r_edge == 0.0) | (relative_error(edge, r_edge) < BOUND)
    assert ok.all()
    assert rcp_newton(np.float32(np.inf)) == 0.0
    assert np.isnan(rcp_newton(np.float32(np.nan)))


@pytest.mark.parametrize("cap", [1.0, 30.0, 50.0, 1000.0])
def test_the_capped_score_is_a_tanh_within_float32(cap):
    """transform_scaled's a - 2a r, r = 1 / (1 + 2^(k s)), k = 2 log2(e) unit / c, against a tanh(s
    unit / c) in float64; ex2.approx taken as correctly rounded. Against EXP_RCP with a correctly
    rounded reciprocal: the same error to within one float32 rounding of a."""
    unit = 1.0 / np.sqrt(128.0)
    a = np.float32(np.float32(cap / unit) * np.float32(unit * np.log2(np.e)))  # cap_u scale (scale = scale_log2)
    k = np.float32(2.8853900817779268 * unit / cap)
    s = f32(np.concatenate([np.linspace(-8.0, 8.0, 400_001) * cap / unit, [0.0, 1e30, -1e30]]))
    with np.errstate(over="ignore"):
        e = f32(np.exp2((s * k).astype(np.float64)))  # s * in_u rounds in float32 first
    x = f32(np.float32(1.0) + e)
    y_exact = a.astype(np.float64) * np.tanh(s.astype(np.float64) * unit / cap)
    newton = fma32(np.float32(-2.0) * a, rcp_newton(x), a)
    correct = fma32(np.float32(-2.0) * a, f32(1.0 / x.astype(np.float64)), a)
    error_newton = np.abs(newton.astype(np.float64) - y_exact).max()
    error_correct = np.abs(correct.astype(np.float64) - y_exact).max()
    assert error_newton <= error_correct + float(np.spacing(a)), (error_newton, error_correct)
    assert np.isnan(fma32(np.float32(-2.0) * a, rcp_newton(f32(1.0) + f32(np.nan)), a))
    capped = fma32(np.float32(-2.0) * a, rcp_newton(f32(np.inf)), a)
    assert capped == a  # +inf scores take the cap, as 1 / (1 + inf) = 0 gives


@pytest.mark.parametrize("change", ["seed", "newton_only", "no_clamp"])
def test_a_changed_step_breaks_the_check(change):
    """The checks can fail: a seed constant 2^-4 of a binade off, two Newton steps in place of the
    third-order one, or no clamp (+inf then gives -inf, not 0)."""
    x = binade()[::64]
    if change == "no_clamp":
        assert rcp_newton(np.float32(np.inf), clamp=False) != 0.0
        return
    r = rcp_newton(x, bits=seed_bits() + (1 << 19)) if change == "seed" else rcp_newton(x, third_order=False)
    assert relative_error(x, r).max() >= BOUND

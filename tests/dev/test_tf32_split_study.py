"""dev/tf32_split_study.py's TF32 rounding (cvt.rna.tf32.f32) and split products."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

PATH = Path(__file__).resolve().parents[2] / "dev" / "tf32_split_study.py"


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("tf32_split_study", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tf32_rounds_to_nearest_ties_away(study):
    ulp = 2.0 ** -10  # of tf32 at 1
    x = np.array([1.0, 1 + ulp, 1 + ulp / 2, 1 + ulp / 2 - 2 ** -23, -(1 + ulp / 2), 3.0, np.inf, -np.inf, 0.0],
                 np.float32)
    expected = np.array([1.0, 1 + ulp, 1 + ulp, 1.0, -(1 + ulp), 3.0, np.inf, -np.inf, 0.0], np.float32)
    np.testing.assert_array_equal(study.tf32(x), expected)
    assert np.isnan(study.tf32(np.array([np.nan], np.float32)))[0]


def test_tf32_keeps_ten_mantissa_bits(study):
    x = np.random.default_rng(0).standard_normal(10000).astype(np.float32)
    r = study.tf32(x)
    assert not (r.view(np.uint32) & np.uint32(0x1FFF)).any()
    assert (np.abs(r - x) <= np.abs(x) * 2.0 ** -11).all()


def test_three_products_are_float32_accurate_and_one_is_not(study):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((64, 128)).astype(np.float32), rng.standard_normal((128, 32)).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    err = {kind: np.abs(study.product(kind)(a, b) - exact).max() for kind in ("fp32", "3xtf32", "1xtf32")}
    assert err["3xtf32"] < 4 * err["fp32"] and err["1xtf32"] > 100 * err["fp32"]

"""flash_fwd_tf32 (models/tf32.py): the m16n8k8 tf32 fragments of Q, K (ldmatrix on float32 tiles
seen as 16-bit tiles of twice the width) and the permuted P and V give Q K^T and P V; the split
gives float32-level products with three tf32 products and tf32-rounded ones with one; the V reads
hit 32 distinct banks; the mirrored statements are the kernels' (CPU)."""
from __future__ import annotations

import numpy as np
import pytest
from models.mirrors import MIRRORED, missing_statements
from models.mma import a_operand_address, c_from_matrix, k_operand_address
from models.mma import ldmatrix_x4
from models.tf32 import (float32_tile, mma_pv_tf32, mma_qk_tf32, split_tf32, split_tile, tensor_core_reads,
                         tf32_rounded, tf32_rounded_finite, v_read_banks, words)
from nvrtc_check import needs_nvrtc

from cupyflash.precision import round_tf32


@pytest.mark.parametrize("source", sorted({m.source for m in MIRRORED if "tf32" in m.source}))
def test_mirrored_statements_are_the_kernels(source):
    assert not (missing := missing_statements(source)), f"mirrored statements no longer in {source}: {missing}"


def test_rounding_is_to_nearest_ties_away():
    one = np.float32(1.0)
    ulp = np.float32(2.0 ** -10)  # of tf32 at 1
    x = np.array([1.0, 1.0 + 2.0 ** -11, 1.0 + 2.0 ** -11 - 2.0 ** -23, -(1.0 + 2.0 ** -11), 3.0e-39], np.float32)
    read = tensor_core_reads(tf32_rounded(x))
    assert read.tolist() == [1.0, float(one + ulp), 1.0, -float(one + ulp), float(round_tf32(x[4:])[0])]
    assert np.array_equal(round_tf32(x).astype(np.float64), read)
    special = np.array([np.inf, -np.inf], np.float32)
    assert np.array_equal(tensor_core_reads(tf32_rounded(special)), special.astype(np.float64))
    assert np.isnan(tensor_core_reads(tf32_rounded(np.array([np.nan], np.float32))))


def test_every_nan_stays_nan_through_the_split():
    """The NaN the GPU makes (0x7fffffff: exp2 of a NaN score, x - x) has every mantissa bit set: an
    add of half a tf32 ulp to its bits carries into the sign and reads as -0, and a NaN score's P
    would vanish from P V (the tf32 wgmma forward's poisoned rows came out finite on an H100).
    Split, what the tensor core sums is hi b + lo b (+ hi b_lo): NaN if hi or lo reads as NaN."""
    bits = np.array([0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FFFF000, 0xFFC02000, 0xFF800001, 0x7F800FFF],
                    np.uint32)
    x = bits.view(np.float32)
    assert np.isnan(x).all()
    assert tensor_core_reads(tf32_rounded_finite(x[1:2])).tolist() == [0.0], "the carry this guards against"
    hi, lo = split_tf32(3, x)
    with np.errstate(invalid="ignore"):
        assert np.isnan(tensor_core_reads(hi) + tensor_core_reads(lo)).all()
    # One product: hi alone, cvt.rna's; a NaN whose payload is all in the 13 low bits is an Inf to
    # every tf32 read (cvt.rna's SASS clears them as well): a row of infinite scores, NaN after the
    # softmax.
    hi1, _ = split_tf32(1, x)
    assert np.isnan(tensor_core_reads(hi1[:5])).all()
    assert tensor_core_reads(hi1[5:]).tolist() == [-np.inf, np.inf]
    inf = np.array([np.inf, -np.inf], np.float32)
    assert np.array_equal(tensor_core_reads(split_tf32(1, inf)[0]), inf.astype(np.float64))
    hi, lo = split_tf32(3, inf)  # Inf - Inf: the product is NaN, as an Inf operand's sum mostly is
    assert np.array_equal(tensor_core_reads(hi), inf.astype(np.float64)) and np.isnan(tensor_core_reads(lo)).all()


def test_the_split_is_float32_accurate():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(100_000) * np.exp(rng.uniform(-20, 20, 100_000))).astype(np.float32)
    hi, lo = split_tf32(3, x)
    exact = x.astype(np.float64)
    assert np.all(np.abs(tensor_core_reads(hi) + tensor_core_reads(lo) - exact) <= 2.0 ** -22 * np.abs(exact))
    hi1, lo1 = split_tf32(1, x)
    assert np.array_equal(tensor_core_reads(hi1), round_tf32(x).astype(np.float64)) and not lo1.any()


@pytest.mark.parametrize("products", [3, 1])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_qk_fragments_give_q_k_transposed(dim, products):
    rng = np.random.default_rng(dim)
    q = rng.standard_normal((16, dim)).astype(np.float32)
    k = rng.standard_normal((32, dim)).astype(np.float32)
    s = mma_qk_tf32(products, dim, 4, float32_tile(16, dim, q), a_operand_address(2 * dim),
                    float32_tile(32, dim, k), k_operand_address(2 * dim))
    if products == 3:
        want, tol = q.astype(np.float64) @ k.T.astype(np.float64), 2.0 ** -20 * np.abs(q) @ np.abs(k).T
    else:  # exactly the products of the rounded operands
        want, tol = round_tf32(q).astype(np.float64) @ round_tf32(k).T.astype(np.float64), 1e-9
    for f in range(4):
        np.testing.assert_array_less(np.abs(s[:, f] - c_from_matrix(want[:, 8 * f: 8 * f + 8])),
                                     c_from_matrix(np.broadcast_to(tol, want.shape)[:, 8 * f: 8 * f + 8]) + 1e-12)


@pytest.mark.parametrize("products", [3, 1])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_pv_fragments_take_the_accumulators_permuted(dim, products):
    rng = np.random.default_rng(dim + 1)
    p = rng.uniform(0, 1, (16, 32)).astype(np.float32)
    v = rng.standard_normal((32, dim)).astype(np.float32)
    s = np.stack([c_from_matrix(p[:, 8 * f: 8 * f + 8].astype(np.float64)) for f in range(4)], axis=1)
    o = mma_pv_tf32(products, dim, s, float32_tile(32, dim, v))
    if products == 3:
        want, tol = p.astype(np.float64) @ v.astype(np.float64), 2.0 ** -20 * np.abs(p) @ np.abs(v) + 1e-12
    else:
        want, tol = round_tf32(p).astype(np.float64) @ round_tf32(v).astype(np.float64), np.full((16, dim), 1e-9)
    for c in range(dim // 8):
        cols = slice(8 * c, 8 * c + 8)
        assert np.all(np.abs(o[:, c] - c_from_matrix(want[:, cols])) <= c_from_matrix(tol[:, cols]))


@pytest.mark.parametrize("dim", [32, 64, 128, 256])
def test_v_reads_hit_32_banks(dim):
    for kk in range(4):
        for c in range(dim // 8):
            for e in range(2):
                assert len(set(v_read_banks(dim, kk, c, e).tolist())) == 32, (kk, c, e)


@needs_nvrtc
def test_the_fresh_o_candidate_compiles_without_spills():
    """Tf32FwdConfig(fresh_o=True) (dev/tf32_accumulation_probe.py's candidate: each key block's P V in
    accumulators of its own, merged by FFMA) at d128 with the shipped row's tiles, sm_90."""
    from cupyflash import plans
    from cupyflash.kernels import compile_check
    from cupyflash.masks import Causal

    spec = plans.specialization_for("float32", 128, Causal(), plans.Tf32FwdConfig(128, 64, 8, fresh_o=True))
    assert spec.name.endswith("_ieee_fresh_o") and spec.expression.endswith(", 3, true>")
    [result] = compile_check.check("90", [spec])
    assert result.spill_bytes == 0 and result.stack_bytes == 0, result


def test_step_sums_name_and_template_arguments():
    """Tf32FwdConfig(step_sums=True) (dev/tf32_accumulation_probe.py's candidate: each k-step's products
    summed apart and added by FADD) names its kernel and sets the last template argument; one tf32
    product has nothing to sum apart, so "tf32" drops it (one kernel, one name)."""
    from cupyflash import plans
    from cupyflash.masks import Causal

    both = plans.Tf32FwdConfig(128, 32, 8, presplit=True, step_sums=True)
    spec = plans.specialization_for("float32", 128, Causal(), both)
    assert spec.name.endswith("_ieee_presplit_stepsums") and spec.expression.endswith(", 3, false, true, true>")
    alone = plans.specialization_for("float32", 64, Causal(), plans.Tf32FwdConfig(128, 64, 8, step_sums=True))
    assert alone.name.endswith("_ieee_stepsums") and alone.expression.endswith(", 3, false, false, true>")
    one = plans.specialization_for("float32", 128, Causal(), both, precision="tf32")
    assert one == plans.specialization_for("float32", 128, Causal(), plans.Tf32FwdConfig(128, 32, 8, presplit=True),
                                           precision="tf32")
    assert one.expression.endswith(", 1, false, true>")


@pytest.mark.parametrize("products", [3, 1])
@pytest.mark.parametrize("dim,rows", [(64, 64), (128, 32), (256, 16)])
def test_presplit_tiles_hold_what_each_warp_would_split(dim, rows, products):
    """split_tile (PRESPLIT): the threads cover every 16-byte chunk of the tile once, with
    cp_async_tile's mapping, and ldmatrix of the hi and lo tiles gives bit for bit what splitting
    each fragment after its ldmatrix gives."""
    rng = np.random.default_rng(dim + products)
    k = (rng.standard_normal((rows, dim)) * np.exp(rng.uniform(-8, 8, (rows, dim)))).astype(np.float32)
    tile = float32_tile(rows, dim, k)
    touched = np.zeros(rows * 2 * dim * 2 // 16, int)
    hi_tile, lo_tile = split_tile(products, tile, rows, dim, 256, touched)
    assert (touched == 1).all()
    k_addr = k_operand_address(2 * dim)
    for r in range(rows // 16):
        for kk in range(dim // 8):
            hi, lo = split_tf32(products, words(ldmatrix_x4(tile, k_addr(0, r, kk))).view(np.float32))
            assert np.array_equal(words(ldmatrix_x4(hi_tile, k_addr(0, r, kk))), hi)
            if products == 3:
                assert np.array_equal(words(ldmatrix_x4(lo_tile, k_addr(0, r, kk))), lo)

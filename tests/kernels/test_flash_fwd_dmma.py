"""flash_fwd_dmma (kernels_cu/flash_fwd_dmma.cu), the float64 forward on the FP64 tensor cores, a
candidate: its fragment indexing against the PTX semantics of mma.m8n8k4 on the CPU
(tests/models/dmma.py), its specializations, and on a GPU its output against the float64
reference through its launcher (cupyflash.kernels.dmma)."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from cupyflash import plans, reference
from cupyflash.kernels import dmma
from cupyflash.masks import as_mask
from models import dmma as model


def test_the_model_is_the_ptx_layout():
    """The model's fragments round-trip and its product is A B + C."""
    rng = np.random.default_rng(0)
    a, b, c = rng.standard_normal(32), rng.standard_normal(32), rng.standard_normal((32, 2))
    assert np.array_equal(model.c_fragments(model.c_matrix(c)), c)
    assert np.allclose(model.c_matrix(model.mma_m8n8k4(a, b, c)),
                       model.a_matrix(a) @ model.b_matrix(b) + model.c_matrix(c))
    assert not np.isnan(model.a_matrix(a)).any() and not np.isnan(model.b_matrix(b)).any()


@pytest.mark.parametrize("d, block_n", [(16, 64), (64, 64), (128, 32)])
def test_warp_scores_and_pv_are_the_products(d, block_n):
    """S from Q's registers and K's rows, then O from S's own accumulators as P (the keys of an
    n-tile in two k-steps, {8 nt + 2t} and {8 nt + 2t + 1}) and V's rows in that order."""
    rng = np.random.default_rng(d)
    q, k, v = rng.standard_normal((8, d)), rng.standard_normal((block_n, d)), rng.standard_normal((block_n, d))
    s = model.warp_scores(q, k)
    assert np.allclose(model.rows_of(s), q @ k.T, rtol=0, atol=1e-12)
    p = np.exp(s - s.max())  # any values in S's layout
    o = model.warp_pv(p, v)
    assert np.allclose(model.rows_of(o), model.rows_of(p) @ v, rtol=0, atol=1e-12)


@pytest.mark.parametrize("d, block_n", [(16, 64), (64, 32), (128, 16)])
def test_wide_products_are_the_products(d, block_n):
    """WIDE's m16n8k8 calls (two m-tiles over two k-steps; P V with A from S's accumulators in the
    order c0, c2, c1, c3) against the PTX m16n8k8 layout: the same S and O as the 16 rows' products."""
    rng = np.random.default_rng(d + 7)
    q, k, v = rng.standard_normal((16, d)), rng.standard_normal((block_n, d)), rng.standard_normal((block_n, d))
    s = model.warp_scores_wide(q, k)
    rows = np.concatenate([model.rows_of(s[0]), model.rows_of(s[1])])
    assert np.allclose(rows, q @ k.T, rtol=0, atol=1e-12)
    p = np.exp(s - s.max())
    o = model.warp_pv_wide(p, v)
    p_rows = np.concatenate([model.rows_of(p[0]), model.rows_of(p[1])])
    assert np.allclose(np.concatenate([model.rows_of(o[0]), model.rows_of(o[1])]), p_rows @ v, rtol=0, atol=1e-12)


def test_wide_specializations_are_sm90_only():
    spec = plans.specialization_for("float64", 64, as_mask(True), plans.DmmaFwdConfig(32, 4, 2, False, 2, True))
    assert spec.arch == "90" and spec.name.endswith("_mt2_qsmem_mb2_wide")
    assert spec.expression == "cf::flash_fwd_dmma<64, cf::Causal, 32, 4, 2, false, 2, true>"


def test_specializations_are_float64_with_the_plan_tiles():
    spec = dmma.specialization(100, as_mask(True))  # the SM90 row (dmma-fwd-v2, wide)
    assert spec.name == "flash_fwd_dmma_fp64_hdim128_causal_bm64_bn16_w4_mt2_qsmem_mb2_wide"
    assert spec.expression == "cf::flash_fwd_dmma<128, cf::Causal, 16, 4, 2, false, 2, true>"
    # Q and K rows of 128 + 4 doubles, V's of 128 + 2
    assert spec.threads == 128 and spec.smem_bytes == 8 * ((64 + 16) * 132 + 16 * 130) and spec.arch == "90"
    spec = dmma.specialization(100, as_mask(True), plans.FORWARD_TILES[("dmma", plans.LARGE_SMEM, 128)])
    assert spec.name == "flash_fwd_dmma_fp64_hdim128_causal_bm64_bn32_w8"  # dmma-fwd-v1, any sm_80+
    assert spec.expression == "cf::flash_fwd_dmma<128, cf::Causal, 32, 8>"
    assert spec.threads == 256 and spec.smem_bytes == 8 * ((64 + 32) * 132 + 32 * 130) and spec.arch == ""
    with pytest.raises(TypeError, match="float64 only"):
        plans.specialization_for("float32", 64, True, plans.DmmaFwdConfig(64, 8))
    # four head-dim tiles for SM90 and four for the rest, and PORTABLE's own tiles at d64 and d128,
    # each with every mask kind the compile check builds
    from cupyflash.masks import KINDS, PACKED_KINDS, VARIANT_KINDS

    forward = [spec for spec in dmma.specializations() if spec.name.startswith("flash_fwd_dmma")]
    assert len(forward) == 10 * len(KINDS + VARIANT_KINDS + PACKED_KINDS)


@pytest.mark.gpu
@pytest.mark.parametrize("headdim", [8, 40, 64, 100, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_the_reference(headdim, causal):
    import cupy

    rng = np.random.default_rng(headdim)
    q = rng.standard_normal((2, 150, 4, headdim))
    k, v = (rng.standard_normal((2, 173, 2, headdim)) for _ in range(2))
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    o = cupy.full(q.shape, np.nan)
    lse = cupy.full((2, 4, 150), np.nan)
    dmma.forward(qd, kd, vd, o, lse, softmax_scale=headdim ** -0.5, causal=causal)
    o_ref, lse_ref = reference.attention(q, k, v, causal=causal)
    assert np.abs(o.get() - o_ref).max() <= 1e-12 * (1 + np.abs(o_ref).max())
    finite = np.isfinite(lse_ref)
    assert np.array_equal(np.isfinite(lse.get()), finite)
    assert np.abs(lse.get()[finite] - lse_ref[finite]).max() <= 1e-12 * (1 + np.abs(lse_ref[finite]).max())


# Against flash_fwd_simt, which takes the same policies through the same calls: to float64's
# rounding (the products' order differs).
SIMT_VARIANTS = {
    "window": dict(causal=False, window_size=(17, 5)),
    "softcap+sink": dict(causal=True, softcap=2.5, sink=[0.5, -1.0, 2.0, 0.0]),
    "alibi": dict(causal=True, alibi_slopes=[0.25, 0.0625, 0.5, 0.125]),
    "dropout": dict(causal=True, dropout_p=0.2, seed=5),
}


def _both_forwards(q, k, v, *, causal, window_size=(-1, -1), packed=None, config=None, **variant):
    import cupy

    from cupyflash.dropout import check_dropout
    from cupyflash.kernels import simt
    from cupyflash.scores import Variant

    dropout = check_dropout(variant.pop("dropout_p", 0.0), variant.pop("seed", None), 0)
    values = Variant(softcap=variant.get("softcap", 0.0), dropout=dropout,
                     **{name: cupy.asarray(np.asarray(variant[name], np.float32))
                        for name in ("alibi_slopes", "sink") if name in variant})
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    outputs = []
    for forward in (functools.partial(dmma.forward, config=config), simt.forward):
        o = cupy.full(q.shape[:-1] + v.shape[-1:], np.nan)
        lse = cupy.full((q.shape[0], q.shape[2], q.shape[1]), np.nan)
        forward(qd, kd, vd, o, lse, softmax_scale=q.shape[-1] ** -0.5, causal=causal, window_size=window_size,
                variant=values, packed=packed)
        outputs.append((o.get(), lse.get()))
    return outputs


def _assert_same(dmma_out, simt_out):
    for got, want in zip(dmma_out, simt_out):
        assert np.array_equal(np.isnan(got), np.isnan(want)) and not np.isnan(want).all()
        finite = np.isfinite(want)
        assert np.array_equal(np.isfinite(got), finite)
        assert np.abs(got[finite] - want[finite]).max() <= 1e-12 * (1 + np.abs(want[finite]).max())


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SIMT_VARIANTS))
@pytest.mark.parametrize("headdim, headdim_v", [(24, 24), (64, 40), (128, 128)])
def test_forward_matches_the_simt_kernel(name, headdim, headdim_v):
    rng = np.random.default_rng(headdim)
    q = rng.standard_normal((2, 150, 4, headdim))
    k = rng.standard_normal((2, 173, 2, headdim))
    v = rng.standard_normal((2, 173, 2, headdim_v))
    _assert_same(*_both_forwards(q, k, v, **dict(SIMT_VARIANTS[name])))


# The kernel's warp layouts beside sm_90's plan rows (dev/dmma_fwd.py times them): v1's 8-row warps
# of m8n8k4 products (the rows of every other arch), two 8-row m-tiles per warp sharing K and V
# fragments, Q's fragments from shared memory or registers, two blocks per SM, m16n8k8 ("wide").
WARP_LAYOUTS = [plans.DmmaFwdConfig(32, 4, 2, False, 2), plans.DmmaFwdConfig(16, 4, 2, True, 2),
                plans.DmmaFwdConfig(16, 8, 2, False), plans.DmmaFwdConfig(32, 8),
                plans.DmmaFwdConfig(16, 8, 2, True, 1, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("config", WARP_LAYOUTS, ids=lambda c: f"bn{c.block_n}w{c.warps}mt{c.m_tiles}"
                                                              f"{'q' if c.q_in_regs else 's'}mb{c.min_blocks}"
                                                              f"{'wide' if c.wide else ''}")
@pytest.mark.parametrize("name", list(SIMT_VARIANTS))
@pytest.mark.parametrize("headdim, headdim_v", [(24, 24), (64, 40), (128, 128)])
def test_warp_layouts_match_the_simt_kernel(config, name, headdim, headdim_v):
    from cupyflash.kernels._module import device_arch

    from cupyflash.kernels.mma_fwd import current_smem_optin

    if config.wide and device_arch() != "90":
        pytest.skip("m16n8k8 .f64: the wide layout is compiled for sm_90")
    need = plans.dmma_smem_bytes(dmma.d_tile(max(headdim, headdim_v)), config)
    if need > current_smem_optin():
        pytest.skip(f"{need} bytes of shared memory: more than this device's blocks may take")
    rng = np.random.default_rng(headdim + 1)
    q = rng.standard_normal((2, 150, 4, headdim))
    k = rng.standard_normal((2, 173, 2, headdim))
    v = rng.standard_normal((2, 173, 2, headdim_v))
    _assert_same(*_both_forwards(q, k, v, config=config, **dict(SIMT_VARIANTS[name])))


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, WARP_LAYOUTS[0], WARP_LAYOUTS[3]], ids=["plan", "mt2", "v1"])
def test_forward_matches_the_simt_kernel_on_a_packed_batch(config):
    import cupy

    from cupyflash.kernels.params import PackedBatch

    rng = np.random.default_rng(3)
    lengths_q, lengths_k = [0, 33, 190, 7, 64], [5, 40, 150, 0, 64]
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q = rng.standard_normal((1, cu_q[-1], 4, 64))
    k, v = (rng.standard_normal((1, cu_k[-1], 2, 64)) for _ in range(2))
    packed = PackedBatch(cupy.asarray(cu_q), cupy.asarray(cu_k), max(lengths_q), max(lengths_k))
    _assert_same(*_both_forwards(q, k, v, causal=True, packed=packed, config=config))

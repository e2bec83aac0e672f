"""flash_fwd_dmma (kernels_cu/flash_fwd_dmma.cu), the float64 forward on the FP64 tensor cores, a
candidate: its fragment indexing against the PTX semantics of mma.m8n8k4 on the CPU
(tests/models/dmma.py), its specializations, and on a GPU its output against the float64
reference through its launcher (cupyflash.kernels.dmma)."""
from __future__ import annotations

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


def test_specializations_are_float64_with_the_candidate_tiles():
    spec = dmma.specialization(100, as_mask(True))
    assert spec.name == "flash_fwd_dmma_fp64_hdim128_causal_bm64_bn32_w8"
    assert spec.expression == "cf::flash_fwd_dmma<128, cf::Causal, 32, 8>"
    assert spec.threads == 256 and spec.smem_bytes == 8 * (64 + 64) * 132
    with pytest.raises(TypeError, match="float64 only"):
        plans.specialization_for("float32", 64, True, plans.DmmaFwdConfig(64, 8))
    assert len(dmma.specializations()) == 4 * 9


@pytest.mark.gpu
@pytest.mark.parametrize("headdim", [8, 40, 64, 100, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_the_reference(headdim, causal):
    """Not yet run on a GPU (written with the kernel, the device time spent)."""
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

"""The mma.sync dK/dV kernels, flash_bwd_dkdv_mma, _v2 and _split (models/flash_bwd_dkdv_mma.py):
their mask mirrors are the kernels' statements; emulated with the dQ kernels or the atomic dQ adds
and flash_bwd_dq_convert (models/flash_bwd_mma.py), every table's tiles and smaller variants of the
same code paths give the float64 gradients, windows included; NaN in a value row stays out of the
queries that do not see it; the layouts are the launcher's and fit."""
from __future__ import annotations

import numpy as np
import pytest
from models import mma
from models.flash_bwd_dkdv_mma import bwd_dkdv_layout, bwd_dkdv_split_xchg, bwd_split_p_address
from models.flash_bwd_dq_mma import bwd_dq_layout
from models.flash_bwd_mma import bwd_case_id, bwd_emulated, check_bwd_case, check_bwd_emulation
from models.mirrors import MIRRORED, missing_statements
from models.mma_bwd_walks import DKDV_KERNELS, assert_walks_skip_blocks

from cupyflash import masks
from cupyflash.bench.tune import load_dev_backward

DEV_BWD = load_dev_backward()  # the backward's versions and candidates: dev/mma_bwd.py


@pytest.mark.parametrize("source", [*DKDV_KERNELS, "mask.cuh"])
def test_mirrors_match_the_kernel_sources(source):
    """Every mask statement the models of the dK/dV kernels name is still in its kernel (found by name) or
    header, whitespace aside: an edit of a walk or an element test there fails here until its model
    follows."""
    assert any(m.source == source for m in MIRRORED)
    assert not (missing := missing_statements(source)), f"mirrored statements no longer in {source}: {missing}"



@pytest.fixture
def nan_is_data(monkeypatch):
    """a_matrix and b_matrix take NaN for an unwritten fragment; under this fixture NaN is data."""
    mma.nan_is_data(monkeypatch)

# (d_tile, block_m, m_sub, block_n, nwarps, warps_d) of cupyflash.kernels.mma_bwd.DKDV_CONFIG
# and smaller variants of the same code paths (WARPS_D = 2 below head dim 256, 4 warps).
_BWD_CASES = [
    # dkdv config, dq config or None (atomic), headdim, batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal
    ((64, 64, 64, 128, 8, 1), (64, 64, 64, 4), 40, 1, 70, 150, 2, 1, False),
    ((64, 64, 64, 128, 8, 1), None, 64, 1, 150, 70, 1, 1, True),  # empty query rows
    ((128, 64, 32, 128, 8, 1), (128, 128, 64, 8), 96, 1, 100, 130, 1, 1, True),
    ((128, 64, 32, 128, 8, 1), None, 128, 1, 90, 90, 2, 2, True),
    ((256, 32, 16, 64, 8, 2), (256, 64, 32, 4), 136, 1, 40, 70, 2, 1, True),
    ((256, 32, 16, 64, 8, 2), None, 256, 1, 45, 33, 1, 1, False),
    ((64, 32, 16, 32, 4, 2), None, 48, 2, 50, 40, 2, 1, True),
    ((64, 64, 32, 64, 4, 1), (64, 64, 32, 4), 24, 1, 33, 97, 3, 1, True),
    # query 63, the last row of query block 0, is the first to see key 0 (causal block skipping)
    ((64, 64, 64, 128, 8, 1), None, 64, 1, 133, 70, 1, 1, True),
    ((128, 64, 32, 128, 8, 1), (128, 128, 64, 8), 64, 1, 191, 256, 1, 1, True),
]


@pytest.mark.parametrize("case", _BWD_CASES, ids=bwd_case_id)
def test_bwd_emulation_matches_reference(case):
    dkdv_config, dq_config, headdim, batch, sq, sk, nheads, nheads_kv, causal = case
    check_bwd_emulation(lambda q, k, v, do, scale: bwd_emulated(q, k, v, do, causal=causal, scale=scale,
                                                                  dkdv_config=dkdv_config, dq_config=dq_config),
                         headdim, batch, sq, sk, nheads, nheads_kv, causal)


def test_bwd_smem_layouts_match_python_and_fit():
    from cupyflash.kernels import mma_bwd

    for dt, (bm, ms, bn, nw, wd) in mma_bwd.DKDV_CONFIG.items():
        for dq_add in ("none", "atomic"):
            lay = bwd_dkdv_layout(dt, bm, ms, bn, nw, wd, dq_add)
            assert lay["BYTES"] == mma_bwd.dkdv_smem_bytes(dt, bm, ms, bn, nw, wd, dq_add)
            assert lay["BYTES"] <= 227 * 1024
            assert all(lay[r] % 128 == 0 for r in ("K", "V", "Q", "DO", "DS", "XCHG", "LSE", "DELTA"))
            assert bn == 16 * nw // wd and bm % ms == 0
    for dt, (bm, bn, nw) in mma_bwd.DQ_CONFIG.items():
        assert bwd_dq_layout(dt, bm, bn)["BYTES"] == mma_bwd.dq_smem_bytes(dt, bm, bn) <= 227 * 1024
        assert bm == 16 * nw


@pytest.mark.parametrize("dq_config", [None, (64, 64, 64, 4)], ids=["atomic", "dq_kernel"])
def test_bwd_nan_in_a_value_row_stays_out_of_queries_that_do_not_see_it(dq_config, nan_is_data):
    # dS is zeroed by selection where hidden, so dP = dO . NaN there cannot reach dQ of a query
    # that does not see the key (a product 0 * NaN would).
    from cupyflash.reference import attention_backward


    rng = np.random.default_rng(7)
    q, do = rng.standard_normal((1, 90, 1, 64)), rng.standard_normal((1, 90, 1, 64))
    k, v = rng.standard_normal((1, 90, 1, 64)), rng.standard_normal((1, 90, 1, 64))
    v[0, 40, 0, 3] = np.nan
    dq, dk, dv = bwd_emulated(q, k, v, do, causal=True, scale=0.125, dkdv_config=(64, 64, 64, 128, 8, 1),
                              dq_config=dq_config)
    dq_ref, dk_ref, dv_ref = attention_backward(do, q, k, v, softmax_scale=0.125, causal=True)
    assert np.isfinite(dq[0, :40]).all() and np.isnan(dq[0, 40:]).all()
    np.testing.assert_allclose(dq, dq_ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(dk, dk_ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(dv, dv_ref, rtol=1e-9, atol=1e-9)



@pytest.mark.parametrize("dkdv_config, dq_config", [(("v2", 64, 64, 32, 128, 4, 2), None),
                                                    (("split", 64, 64, 32, 64, 4, 2), None),
                                                    ((64, 64, 64, 128, 8, 1), (64, 64, 32, 2, 2))],
                         ids=["v2_atomic", "split_atomic", "dq_v2"])
def test_bwd_nan_in_a_value_row_stays_out_of_queries_outside_its_window(dkdv_config, dq_config, nan_is_data):
    # The same with the window (5, 5): key 40 is seen by queries 35..45. Past them its entries are
    # hidden by the left bound, which v2 dQ and the v2 / split dK/dV encode as P = 0 and then
    # select dS to 0 by that test: a product 0 * NaN would reach dQ of queries 46..89.
    from cupyflash.reference import attention_backward

    rng = np.random.default_rng(8)
    q, k, v, do = (rng.standard_normal((1, 90, 1, 64)) for _ in range(4))
    v[0, 40, 0, 3] = np.nan
    window = (5, 5)
    dq, _, dv = bwd_emulated(q, k, v, do, causal=False, scale=0.125, dkdv_config=dkdv_config,
                             dq_config=dq_config, window_size=window)
    # (the reference's dK = dS^T Q multiplies the NaN rows of dS by zeros: NaN for every key)
    dq_ref, _, dv_ref = attention_backward(do, q, k, v, softmax_scale=0.125, window_size=window)
    sees = (np.arange(90) >= 35) & (np.arange(90) <= 45)
    assert np.isfinite(dq[0, ~sees]).all() and np.isnan(dq[0, sees]).all()
    np.testing.assert_allclose(dq, dq_ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(dv, dv_ref, rtol=1e-9, atol=1e-9)


# ("v2", d_tile, BLOCK_M, M_SUB, BLOCK_N, NWARPS, ROW_GROUPS) of mma_bwd.DKDV_CONFIG_V2 and smaller
# variants (2 warps; BLOCK_M > M_SUB), with the v2 dQ kernel or the atomic dQ.
_BWD_V2_DKDV_CASES = [
    (("v2", 64, 64, 32, 128, 4, 2), (64, 128, 32, 4, 2), 40, 1, 150, 70, 2, 1, True),  # empty query rows
    (("v2", 64, 64, 32, 128, 4, 2), None, 64, 1, 70, 150, 2, 1, True),
    (("v2", 64, 64, 32, 128, 4, 2), None, 56, 2, 45, 33, 2, 2, False),
    (("v2", 64, 32, 32, 64, 2, 2), None, 64, 1, 133, 70, 1, 1, True),  # atomic dQ grid with 2 warps
    (("v2", 128, 32, 16, 64, 2, 2), (128, 64, 32, 2, 2), 72, 1, 50, 90, 3, 1, True),
]


@pytest.mark.parametrize("case", _BWD_V2_DKDV_CASES, ids=bwd_case_id)
def test_bwd_v2_dkdv_emulation_matches_reference(case):
    check_bwd_case(case)


def test_bwd_v2_dkdv_table_matches_layout_and_fits():
    from cupyflash.kernels import mma_bwd

    for dt, (bm, ms, bn, nw, rg) in mma_bwd.DKDV_CONFIG_V2.items():
        for dq_add in ("none", "atomic"):
            lay = bwd_dkdv_layout(dt, bm, ms, bn, nw, 1, dq_add)
            assert lay["BYTES"] == mma_bwd.dkdv_smem_bytes(dt, bm, ms, bn, nw, 1, dq_add) <= 227 * 1024
            assert bn == 16 * rg * nw and bm % ms == 0 and ms % 16 == 0
            spec = mma_bwd.dkdv_spec(np.float16, dt, False, dq_add, "v2")
            assert spec.smem_bytes == lay["BYTES"] and "dkdv_mma_v2" in spec.name
        assert DEV_BWD.dkdv_tiles(dt, "v2", False) == ("v2", (bm, ms, bn, nw, rg))
    assert DEV_BWD.dkdv_tiles(128, "v2", False) == ("v1", mma_bwd.DKDV_CONFIG[128])


# ("split", d_tile, BLOCK_M, M_SUB, BLOCK_N, NWARPS, ROW_GROUPS) of mma_bwd.DKDV_CONFIG_SPLIT and
# smaller variants (4 warps, head dim 64, BLOCK_M > M_SUB so that both P^T slots are used).
_BWD_SPLIT_CASES = [
    (("split", 128, 64, 32, 128, 8, 2), (128, 128, 32, 4, 2), 128, 1, 100, 150, 2, 1, True),
    (("split", 128, 64, 32, 128, 8, 2), (128, 128, 64, 8), 96, 1, 190, 70, 1, 1, True),  # empty rows
    (("split", 64, 64, 32, 64, 4, 2), None, 64, 2, 70, 50, 2, 2, False),  # the atomic dQ path too
    (("split", 64, 32, 16, 32, 4, 1), None, 40, 1, 45, 77, 3, 1, True),
    (("split", 256, 32, 32, 64, 8, 1), (256, 64, 32, 4), 200, 1, 40, 70, 2, 1, True),
]


@pytest.mark.parametrize("case", _BWD_SPLIT_CASES, ids=bwd_case_id)
def test_bwd_v3_split_emulation_matches_reference(case):
    check_bwd_case(case)


# Sliding windows (left, right) on every mma.sync backward model: v1 dK/dV (atomic dQ or the v1
# dQ kernel), v2 dK/dV and dQ, the split dK/dV. Each case's walks skip blocks: a dK/dV CTA stops
# short of the last query block, a dQ CTA starts past key block 0 (at an odd block for the stage
# parity where marked); partial blocks sit on both bounds; one-sided windows and rows that see no key.
_BWD_WINDOW_CASES = [
    # dkdv config, dq config or None (atomic), headdim, batch, seqlen_q, seqlen_k, nheads, nheads_kv,
    # causal, window_size
    ((64, 64, 32, 64, 4, 1), (64, 64, 32, 4), 40, 1, 200, 200, 1, 1, True, (70, -1)),  # dQ from block 3
    ((64, 32, 16, 32, 4, 2), None, 48, 1, 90, 120, 2, 1, False, (9, 17)),
    (("v2", 64, 64, 32, 128, 4, 2), (64, 128, 32, 4, 2), 64, 1, 150, 260, 1, 1, False, (60, 40)),  # block 1
    (("v2", 64, 32, 32, 64, 2, 2), None, 64, 1, 133, 200, 1, 1, False, (20, -1)),
    (("split", 64, 64, 32, 64, 4, 2), None, 40, 1, 100, 100, 2, 1, False, (0, 0)),
    # rows 0..44 see no key
    (("split", 128, 64, 32, 128, 8, 2), (128, 128, 32, 4, 2), 72, 1, 250, 200, 1, 1, False, (-1, 5)),
]


def _window_case_id(c):
    return bwd_case_id(c[:9]) + "_window{}_{}".format(*c[9])


@pytest.mark.parametrize("case", _BWD_WINDOW_CASES, ids=_window_case_id)
def test_bwd_emulation_with_window_matches_reference(case):
    dkdv_config, dq_config, headdim, batch, sq, sk, nheads, nheads_kv, causal, window = case
    mask = masks.mask_for(causal, window)
    assert mask.HAS_LEFT
    dkdv = dkdv_config[1:] if isinstance(dkdv_config[0], str) else dkdv_config
    assert_walks_skip_blocks(mask, sq, sk, dkdv[1], dkdv[3])
    check_bwd_emulation(lambda q, k, v, do, scale: bwd_emulated(q, k, v, do, causal=causal, scale=scale,
                                                                  dkdv_config=dkdv_config, dq_config=dq_config,
                                                                  window_size=window),
                         headdim, batch, sq, sk, nheads, nheads_kv, causal, window_size=window)


def test_bwd_v3_split_exchange_slots_are_disjoint_and_fit():
    from cupyflash.kernels import mma_bwd

    for dt, (bm, ms, bn, nw, rg) in mma_bwd.DKDV_CONFIG_SPLIT.items():
        xchg, slot_bytes, total = bwd_dkdv_split_xchg(dt, bm, ms, bn, nw, rg, "none")
        assert total == mma_bwd.dkdv_split_smem_bytes(dt, bm, ms, bn, nw, rg, "none") <= 163 * 1024
        assert bn == 16 * rg * nw // 2 and xchg % 128 == 0
        spec = mma_bwd.dkdv_spec(np.float16, dt, True, "none", DEV_BWD.dkdv_tiles(dt, "v3", False)[0])
        assert spec.smem_bytes == total and "dkdv_mma_split" in spec.name
        # the atomic path of v3 is v2's (the split kernel spills with ATOMIC_DQ)
        assert DEV_BWD.dkdv_tiles(dt, "v3", atomic_dq=True)[0] != "split"
        addrs = np.concatenate([bwd_split_p_address(xchg, slot_bytes, ms, p, s, g, j)
                                for p in range(nw // 2) for s in range(2) for g in range(rg) for j in range(ms // 8)])
        assert len(set(addrs.tolist())) == addrs.size and addrs.min() == xchg and addrs.max() + 16 == total

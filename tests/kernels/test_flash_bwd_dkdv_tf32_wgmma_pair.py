"""flash_bwd_dkdv_tf32_wgmma_pair and flash_bwd_dq_tf32_wgmma_pair on the CPU: their specializations
and shared memory are the plan's and the plan refuses what the kernels cannot run; each warpgroup's
head-dim half of dV and dK (dQ), read from rows 64 h .. of the block's transposed tiles, is its half
of P^T dO and dS^T Q (dS K), emulated from what the tensor cores read (the other half's rows give
other numbers). The compile check of their bench masks is test_flash_bwd_dkdv_tf32_wgmma.py's; the
GPU test is test_flash_bwd_dmma.py's test_the_pair_kernels_match_the_simt_backward_at_d128."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cupyflash import backward_plans
from cupyflash.backward_plans import Tf32WgmmaBwdConfig
from cupyflash.masks import as_mask
from models.wgmma import acc_from_matrix
from models.mirrors import missing_statements, unmirrored_statements
from models.wgmma_tf32_bwd_steps import (STEPS, acc_times_tile, close, pair_element_steps, prefetched_lines,
                                         split_into)

PAIR = Tf32WgmmaBwdConfig(32, 0, dq_block_n=0, pair=True)
PAIR_DQ = Tf32WgmmaBwdConfig(32, 0, dq_raw_stages=1, pair=True, dq_pair=True)
D_TILE, BLOCK_M, HALF = 128, 32, 64
Q_TILE = BLOCK_M * D_TILE * 4


def test_the_spec_and_its_shared_memory_are_the_plans():
    spec = backward_plans.tf32_wgmma_spec("dkdv", D_TILE, as_mask(True), PAIR)
    assert spec.name == "flash_bwd_dkdv_tf32_wgmma_pair_fp32_hdim128_causal_bm32_bn64_apart"
    assert spec.expression == "cf::flash_bwd_dkdv_tf32_wgmma_pair<128, cf::Causal, 32, true>"
    assert spec.threads == 256 and spec.arch == "90a" and spec.source_file == "flash_bwd_dkdv_tf32_wgmma_pair.cu"
    # BwdTf32PairSmem: K and V raw (64 rows of 128 floats each); the query block's eight tiles and
    # 4 x 32 statistics, padded to 1 KiB; the trade ([3][16][128] floats: pair_element_steps); the
    # base's alignment
    stage = -(-(8 * Q_TILE + 4 * BLOCK_M * 4) // 1024) * 1024
    assert spec.smem_bytes == 2 * 64 * D_TILE * 4 + stage + 3 * 16 * 128 * 4 + 1024 <= 227 * 1024
    tf32 = backward_plans.tf32_wgmma_spec("dkdv", D_TILE, as_mask(False),
                                          Tf32WgmmaBwdConfig(32, 0, False, dq_block_n=0, precision="tf32", pair=True))
    assert tf32.expression == "cf::flash_bwd_dkdv_tf32_wgmma_pair<128, cf::NoMask, 32, false, 1>"
    assert tf32.name.endswith("_bm32_bn64_tf32")
    # the backward: D, the pair's dK/dV, dQ on the tf32x3 kernel (head dims 65-128 take the tile)
    for headdim in (72, 128):
        names = [launch.spec.name for launch in backward_plans.tf32_wgmma_backward_plan(headdim, True, PAIR).launches]
        assert names[0] == "flash_bwd_preprocess_fp32" and names[1] == spec.name, names
        assert names[2].startswith("flash_bwd_dq_dmma_fp32_hdim128_") and names[2].endswith("_tf32x3"), names


def test_the_prefetch_form_is_its_own_specialization():
    """prefetch (perf log tf32-pair-prefetch): PREFETCH after PRODUCTS, "_pf" in the name, the same
    shared memory (L1 lines, not a stage); the pair's dK/dV kernel's option only."""
    plain = backward_plans.tf32_wgmma_spec("dkdv", D_TILE, as_mask(True), PAIR)
    spec = backward_plans.tf32_wgmma_spec("dkdv", D_TILE, as_mask(True), replace(PAIR, prefetch=True))
    assert spec.name == "flash_bwd_dkdv_tf32_wgmma_pair_fp32_hdim128_causal_bm32_bn64_pf_apart"
    assert spec.expression == "cf::flash_bwd_dkdv_tf32_wgmma_pair<128, cf::Causal, 32, true, 3, true>"
    assert spec.smem_bytes == plain.smem_bytes and spec.source_file == plain.source_file
    tf32 = backward_plans.tf32_wgmma_spec("dkdv", D_TILE, as_mask(False), Tf32WgmmaBwdConfig(
        32, 0, False, dq_block_n=0, precision="tf32", pair=True, prefetch=True))
    assert tf32.expression == "cf::flash_bwd_dkdv_tf32_wgmma_pair<128, cf::NoMask, 32, false, 1, true>"
    with pytest.raises(ValueError, match="prefetch"):
        backward_plans.tf32_wgmma_spec("dkdv", 64, as_mask(True), Tf32WgmmaBwdConfig(32, 1, producer=True,
                                                                                      prefetch=True))


@pytest.mark.parametrize("rows_valid, headdim, headdim_v", [(32, 128, 128), (5, 100, 68), (32, 48, 128), (0, 128, 128)])
def test_the_prefetch_asks_each_line_of_the_next_block_once(rows_valid, headdim, headdim_v):
    """prefetch_query_block_l1 (its model): every 128-byte line of Q's and dO's valid rows that
    starts inside their head dims, once, and no other; the lines of the first and the last valid
    row's lse and delta (the block's 32 floats of each span one line or two)."""
    got = prefetched_lines(BLOCK_M, D_TILE, 256, rows_valid, headdim, headdim_v)
    want = [(name, row, start) for name, dim in (("q", headdim), ("do", headdim_v))
            for row in range(rows_valid) for start in range(0, D_TILE, 32) if start < dim]
    want += [(slot, row, 0) for slot in ("lse", "delta")
             for row in ((0, min(rows_valid, BLOCK_M) - 1) if rows_valid else ())]
    assert sorted(got) == sorted(want)
    assert len({x for x in got if x[0] in ("q", "do")}) == len([x for x in got if x[0] in ("q", "do")])


def test_the_dq_spec_and_its_shared_memory_are_the_plans():
    spec = backward_plans.tf32_wgmma_spec("dq", D_TILE, as_mask(True), PAIR_DQ)
    assert spec.name == "flash_bwd_dq_tf32_wgmma_pair_fp32_hdim128_causal_bm64_bn32_r1_apart"
    assert spec.expression == "cf::flash_bwd_dq_tf32_wgmma_pair<128, cf::Causal, 32, 1, true>"
    assert spec.threads == 256 and spec.arch == "90a" and spec.source_file == "flash_bwd_dq_tf32_wgmma_pair.cu"
    # DqTf32PairSmem: Q and dO raw (64 rows of 128 floats each); the key block's six tiles (32 keys);
    # one raw stage of K and V; the trade ([2][16][128] floats: dS the one result); the base's alignment
    kv_tile = 32 * D_TILE * 4
    assert spec.smem_bytes == 2 * 64 * D_TILE * 4 + 6 * kv_tile + 2 * kv_tile + 2 * 16 * 128 * 4 + 1024 <= 227 * 1024
    names = [launch.spec.name for launch in backward_plans.tf32_wgmma_backward_plan(100, True, PAIR_DQ).launches]
    assert names == ["flash_bwd_preprocess_fp32", "flash_bwd_dkdv_tf32_wgmma_pair_fp32_hdim128_causal_bm32_bn64_apart",
                     spec.name], names
    for bad in (Tf32WgmmaBwdConfig(32, 0, dq_block_n=64, pair=True, dq_pair=True),
                Tf32WgmmaBwdConfig(32, 0, dq_raw_stages=2, pair=True, dq_pair=True),
                Tf32WgmmaBwdConfig(32, 0, dq_raw_stages=1, dq_producer=True, pair=True, dq_pair=True),
                Tf32WgmmaBwdConfig(32, 0, dq_raw_stages=1, pair=True)):  # d128's dQ: the pair's or tf32x3
        with pytest.raises(ValueError):
            backward_plans.tf32_wgmma_spec("dq", D_TILE, as_mask(True), bad)


@pytest.mark.parametrize("config", [Tf32WgmmaBwdConfig(32, 1, dq_block_n=0, pair=True),
                                    Tf32WgmmaBwdConfig(64, 0, dq_block_n=0, pair=True),
                                    Tf32WgmmaBwdConfig(32, 0, dq_block_n=0, producer=True, pair=True),
                                    Tf32WgmmaBwdConfig(32, 0, dq_block_n=0, fused_dq=True, pair=True)])
def test_the_plan_refuses_what_the_pair_cannot_run(config):
    with pytest.raises(ValueError):
        backward_plans.tf32_wgmma_spec("dkdv", D_TILE, as_mask(True), config)


def test_the_pair_is_the_d128_tiles_only_tf32_wgmma_dkdv_kernel():
    with pytest.raises(ValueError, match="pair"):
        backward_plans.tf32_wgmma_spec("dkdv", 64, as_mask(True), PAIR)
    with pytest.raises(ValueError):  # the one-warpgroup and producer forms do not fit at d128
        backward_plans.tf32_wgmma_spec("dkdv", D_TILE, as_mask(True), Tf32WgmmaBwdConfig(32, 0, dq_block_n=0))


def test_each_warpgroups_half_is_its_columns_of_dv_and_dk():
    """dV_h += P^T dO_h and dK_h += dS^T Q_h with B = rows 64 h .. of the dO^T and Q^T tiles
    (Tf32QueryBlockTiles' DOT and QT, KEY_PAIRS, one 32-column panel: 128 bytes a row), as the
    kernel's half_rows offsets them: the products of each half are that half's columns, and
    warpgroup 1 reading warpgroup 0's rows would not be."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((BLOCK_M, D_TILE)).astype(np.float32)
    do = rng.standard_normal((BLOCK_M, D_TILE)).astype(np.float32)
    do[:, 100:] = 0.0  # a head dim of v short of the tile: warpgroup 1's half partly empty
    layout = {"QT_HI": 4 * Q_TILE, "QT_LO": 5 * Q_TILE, "DOT_HI": 6 * Q_TILE, "DOT_LO": 7 * Q_TILE,
              "BYTES": 8 * Q_TILE + 4 * BLOCK_M * 4}
    smem = split_into(layout, D_TILE, [("QT", BLOCK_M, BLOCK_M, D_TILE, q, True),
                                      ("DOT", BLOCK_M, BLOCK_M, 100, do, True)])
    p_t = rng.random((64, BLOCK_M)).astype(np.float32).astype(np.float64)
    ds_t = rng.standard_normal((64, BLOCK_M)).astype(np.float32).astype(np.float64)
    for h in (0, 1):
        half_rows = h * HALF * 128
        columns = slice(HALF * h, HALF * (h + 1))
        dv = acc_times_tile(smem, HALF, BLOCK_M, acc_from_matrix(p_t), layout["DOT_HI"] + half_rows,
                            layout["DOT_LO"] + half_rows)
        dk = acc_times_tile(smem, HALF, BLOCK_M, acc_from_matrix(ds_t), layout["QT_HI"] + half_rows,
                            layout["QT_LO"] + half_rows)
        assert close(dv, p_t @ do[:, columns].astype(np.float64)), h
        assert close(dk, ds_t @ q[:, columns].astype(np.float64)), h
    wrong = acc_times_tile(smem, HALF, BLOCK_M, acc_from_matrix(ds_t), layout["QT_HI"], layout["QT_LO"])
    assert not close(wrong, ds_t @ q[:, HALF:].astype(np.float64))


def test_each_dq_warpgroups_half_is_its_columns_of_dq():
    """dQ_h += dS K_h with B = rows 64 h .. of the key block's K^T tiles (Tf32KeyBlockTiles' KT, 32
    keys, KEY_PAIRS), as flash_bwd_dq_tf32_wgmma_pair's half_rows offsets them."""
    rng = np.random.default_rng(11)
    k = rng.standard_normal((32, D_TILE)).astype(np.float32)
    kv_tile = 32 * D_TILE * 4
    layout = {"KT_HI": 2 * kv_tile, "KT_LO": 3 * kv_tile, "BYTES": 6 * kv_tile}
    smem = split_into(layout, D_TILE, [("KT", 32, 29, 100, k, True)])  # 29 keys, head dim 100
    want_k = k.astype(np.float64)
    want_k[29:], want_k[:, 100:] = 0.0, 0.0
    ds = rng.standard_normal((64, 32)).astype(np.float32).astype(np.float64)
    for h in (0, 1):
        half_rows = h * HALF * 128
        dq = acc_times_tile(smem, HALF, 32, acc_from_matrix(ds), layout["KT_HI"] + half_rows,
                            layout["KT_LO"] + half_rows)
        assert close(dq, ds @ want_k[:, HALF * h:HALF * (h + 1)]), h


def test_the_trade_mirrors_match_the_steps():
    assert not (missing := missing_statements(STEPS)), f"mirrored statements no longer in {STEPS}: {missing}"
    assert not (unmirrored := unmirrored_statements(STEPS)), f"layout statements without a mirror: {unmirrored}"


@pytest.mark.parametrize("both", [True, False])
def test_the_trade_gives_each_warpgroup_its_half_and_both_every_result(both):
    """pair_element_steps (its model): warpgroup h's element step sees warpgroup 0's product as a
    and warpgroup 1's as b on values h 8 .. h 8 + 7 with f0 = 2 h (the column blocks of those
    values), and after the second trade both warpgroups hold every value's results, in place."""
    nv = 16
    x = [[100 + v for v in range(nv)], [200 + v for v in range(nv)]]  # S (warpgroup 0), dP (warpgroup 1)
    seen = []

    def step(a, b, f0):
        seen.append((f0, list(a), list(b)))
        return [("p", f0, av, bv) for av, bv in zip(a, b)], [("ds", f0, av, bv) for av, bv in zip(a, b)]

    out = pair_element_steps(x, step, both)
    assert seen == [(0, x[0][:8], x[1][:8]), (2, x[0][8:], x[1][8:])]
    for first, second in out:
        assert first == [("p", 2 * (v // 8), x[0][v], x[1][v]) for v in range(nv)]
        assert second == ([("ds", 2 * (v // 8), x[0][v], x[1][v]) for v in range(nv)] if both else None)

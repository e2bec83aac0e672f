"""flash_fwd_mma (models/flash_fwd_mma.py): Q K^T and P V through the fragment layouts give the
matmuls, the quad scatter gives each row to its holder, both RowStats layouts keep the running max
and sum, and thread blocks emulated over every tile configuration (register or shared-memory Q,
2 or 3 stages, causal, windows, GQA, head dims short of the tile) give float64 attention."""
from __future__ import annotations

import math

import numpy as np
import pytest
from models.flash_fwd_mma import (ROW_STATS, attention_reference, exp2_base, fwd_emulated, pack_p, quad_sum_scatter,
                                  row_holder)
from models.mma import (GROUP, THREAD_IN_GROUP, a_operand_address, c_from_matrix, cp_async_tile, k_operand_address,
                        ldmatrix_x4, mma_16816, quad_reduce)


def _load_tile(rows, dim, values):
    smem = np.zeros(rows * dim)
    cp_async_tile(smem, 0, rows, dim, 128 if dim < 256 else 256, values, 0, rows, dim)
    return smem


@pytest.mark.parametrize("dim", [64, 128])
def test_fwd_qk_fragments_give_q_k_transposed(dim):
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((16, dim)), rng.standard_normal((32, dim))
    sq, sk = _load_tile(16, dim, q), _load_tile(32, dim, k)
    a_addr, k_addr = a_operand_address(dim), k_operand_address(dim)
    s = np.zeros((32, 4, 4))  # 4 fragments of 8 keys
    for kk in range(dim // 16):
        a = ldmatrix_x4(sq, a_addr(0, 0, kk))
        for f in range(0, 4, 2):
            b = ldmatrix_x4(sk, k_addr(0, f // 2, kk))
            mma_16816(s[:, f], a, b[:, 0], b[:, 1])
            mma_16816(s[:, f + 1], a, b[:, 2], b[:, 3])
    want = q @ k.T
    for f in range(4):
        np.testing.assert_allclose(s[:, f], c_from_matrix(want[:, 8 * f: 8 * f + 8]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dim", [64, 128])
def test_fwd_pv_fragments_repack_accumulators(dim):
    rng = np.random.default_rng(2)
    p, v = rng.standard_normal((16, 32)), rng.standard_normal((32, dim))
    sv = _load_tile(32, dim, v)
    s = np.stack([c_from_matrix(p[:, 8 * f: 8 * f + 8]) for f in range(4)], axis=1)  # (32, 4, 4)
    packed = pack_p(s[:, None])[:, 0]  # (32, 2, 4, 2)
    v_addr = a_operand_address(dim)
    o = np.zeros((32, dim // 8, 4))
    for kk in range(2):
        for f in range(0, dim // 8, 2):
            b = ldmatrix_x4(sv, v_addr(0, kk, f // 2), trans=True)
            mma_16816(o[:, f], packed[:, kk], b[:, 0], b[:, 1])
            mma_16816(o[:, f + 1], packed[:, kk], b[:, 2], b[:, 3])
    want = p @ v
    for f in range(dim // 8):
        np.testing.assert_allclose(o[:, f], c_from_matrix(want[:, 8 * f: 8 * f + 8]), rtol=1e-12, atol=1e-12)


# The default configurations of cupyflash.kernels.mma_fwd plus the register-resident Q and
# 3-stage variants, in both row-state layouts; small head dims inside each D_TILE exercise the
# zero-filled columns.
_FWD_CASES = [
    # (d_tile, block_m, block_n, warps, stages, q_in_regs, row_state,
    #  headdim, batch, seqlen_q, seqlen_k, nheads, nheads_kv, causal)
    (64, 128, 64, 4, 2, False, "all_lanes", 40, 1, 150, 97, 2, 1, False),  # default
    (64, 128, 64, 4, 2, False, "all_lanes", 64, 1, 70, 200, 1, 1, True),
    (64, 128, 64, 4, 2, False, "all_lanes", 64, 2, 200, 137, 1, 1, True),  # row 127 sees exactly key 64
    (64, 128, 64, 4, 2, False, "one_lane", 64, 2, 200, 137, 1, 1, True),
    (64, 128, 64, 4, 2, True, "all_lanes", 48, 1, 130, 190, 2, 1, True),
    (64, 128, 64, 8, 2, True, "one_lane", 56, 1, 130, 130, 1, 1, True),
    (64, 128, 64, 8, 2, False, "all_lanes", 64, 1, 100, 130, 1, 1, True),  # one strip per warp
    (128, 128, 32, 4, 2, False, "one_lane", 96, 1, 140, 75, 2, 2, False),
    (128, 128, 32, 4, 3, False, "one_lane", 128, 1, 200, 60, 1, 1, True),  # seqlen_q > seqlen_k: empty rows
    (128, 128, 64, 4, 2, False, "one_lane", 120, 1, 150, 190, 2, 1, True),  # sm_90 default
    (128, 128, 64, 4, 2, False, "one_lane", 128, 1, 130, 70, 1, 1, True),  # empty rows, 2 strips per warp
    (128, 128, 64, 4, 2, False, "all_lanes", 128, 1, 130, 70, 1, 1, True),
    (256, 128, 32, 8, 2, False, "one_lane", 136, 1, 40, 70, 1, 1, True),
    # Sliding windows (left, right): the walk starts past block 0, rows of a visited block see
    # none of its keys, one-sided and causal windows.
    (64, 128, 64, 4, 2, True, "all_lanes", 64, 1, 300, 300, 1, 1, (70, 0)),
    (64, 128, 64, 4, 2, False, "one_lane", 64, 1, 260, 330, 1, 1, (0, 0)),
    (128, 128, 32, 4, 3, False, "one_lane", 72, 1, 280, 200, 1, 1, (40, 17)),  # 3 stages from block j > 0
    (128, 128, 64, 4, 2, False, "one_lane", 128, 1, 200, 300, 1, 1, (100, -1)),
    (128, 128, 64, 4, 2, False, "all_lanes", 128, 1, 150, 150, 1, 1, (-1, 30)),
]


@pytest.mark.parametrize("case", _FWD_CASES, ids=lambda c: "d{0}_bm{1}_bn{2}_w{3}_s{4}_{5}_{6}_hd{7}".format(
    *c[:5], "qreg" if c[5] else "qsmem", c[6], c[7]) + (
        f"_window{c[-1][0]}_{c[-1][1]}" if isinstance(c[-1], tuple) else "_causal" if c[-1] else ""))
def test_fwd_block_emulation_matches_reference(case):
    (d_tile, block_m, block_n, warps, stages, q_in_regs, row_state,
     headdim, batch, sq, sk, nheads, nheads_kv, causal) = case
    window = causal if isinstance(causal, tuple) else (-1, -1)
    causal = causal is True
    rng = np.random.default_rng(sum(case[:6]) + sum(case[7:9]))
    q = rng.standard_normal((batch, sq, nheads, headdim))
    k = rng.standard_normal((batch, sk, nheads_kv, headdim))
    v = rng.standard_normal((batch, sk, nheads_kv, headdim))
    scale = 1 / math.sqrt(headdim)
    o, lse = fwd_emulated(q, k, v, causal=causal, scale=scale, d_tile=d_tile, block_m=block_m,
                          block_n=block_n, warps=warps, stages=stages, q_in_regs=q_in_regs,
                          row_state=row_state, window_size=window)
    o_ref, lse_ref = attention_reference(q, k, v, causal=causal, scale=scale, window_size=window)
    assert not np.isnan(o).any() and not np.isnan(lse).any(), "some output element was never written"
    np.testing.assert_allclose(o, o_ref, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-10, atol=1e-10)
    if causal and sq > sk:
        empty = sq - sk  # rows that see no key
        assert np.all(o[:, :empty] == 0) and np.all(lse[:, :, :empty] == -np.inf)


@pytest.mark.parametrize("rows", [2, 4])
def test_fwd_quad_sum_scatter_gives_each_row_to_its_holder(rows):
    x = np.random.default_rng(rows).standard_normal((32, rows))
    got = quad_sum_scatter(x)
    quad_sums = x.reshape(8, 4, rows).sum(axis=1)  # [quad, row]
    np.testing.assert_allclose(got, quad_sums[GROUP, THREAD_IN_GROUP % rows], rtol=1e-12)
    for r in range(rows):  # the lane store_o and the rescale broadcast read holds that row
        np.testing.assert_allclose(got[row_holder(r)], quad_sums[GROUP, r], rtol=1e-12)


@pytest.mark.parametrize("row_state", sorted(ROW_STATS))
@pytest.mark.parametrize("strips", [1, 2])
def test_fwd_distributed_running_max_and_sum(strips, row_state):
    """The online softmax with m and l of each row kept in either RowStats layout (row_max,
    softmax_rescale, store_o's get) gives the per-row max and sum of exp2 over all key blocks,
    fully masked blocks included, on every lane of the row's quad."""
    rng = np.random.default_rng(strips)
    n_frags, n_blocks = 4, 5
    blocks = rng.standard_normal((n_blocks, 32, strips, n_frags, 4)) * 4
    blocks[0, :, 0, :, 0:2] = -np.inf  # strip 0, half 0: nothing visible in block 0
    blocks[:, :, strips - 1, :, 2:4] = -np.inf  # last strip, half 1: never anything visible
    stats = ROW_STATS[row_state](strips)
    for s in blocks:
        m_new = np.empty((32, strips, 2))
        for i in range(strips):
            for h in range(2):
                x = np.maximum(stats.old_max(i, h), s[:, i, :, 2 * h: 2 * h + 2].max(axis=(1, 2)))
                m_new[:, i, h] = quad_reduce(x, np.maximum)
        rescale = stats.take_max(m_new)
        row_sum = np.exp2(s - exp2_base(m_new)[:, :, None, :].repeat(2, axis=3)).sum(axis=2)  # [lane, i, 4]
        stats.add_sums(rescale, row_sum[:, :, 0::2] + row_sum[:, :, 1::2])
    for i in range(strips):
        for h in range(2):
            row = blocks[:, :, i, :, 2 * h: 2 * h + 2].transpose(1, 0, 2, 3).reshape(8, 4, -1)  # [quad, lane, keys]
            row = row.reshape(8, -1)
            m_ref = row.max(axis=1)
            with np.errstate(invalid="ignore"):
                l_ref = np.where(np.isfinite(m_ref), np.exp2(row - np.where(np.isfinite(m_ref), m_ref, 0)[:, None]).sum(axis=1), 0.0)
            m_row, l_row = stats.get(i, h)
            np.testing.assert_array_equal(m_row, m_ref[GROUP])
            np.testing.assert_allclose(l_row, l_ref[GROUP], rtol=1e-12)

"""flash_bwd_dq_wgmma (models/flash_bwd_dq_wgmma.py): its mirrors are the kernel's statements,
every operand is the intended slice of Q, dO, K or V, P and dS are exact zeros where the mask
policy hides an entry, and both query blocks of a head, emulated over the key blocks each walks
(no mask, causal, a window), give dQ of plain matmuls."""
from __future__ import annotations

import math

import numpy as np
import pytest
from models.blocks import assert_float64_close, bwd_inputs, seeded_rng
from models.flash_bwd_dq_wgmma import (DQW, DQW_CONFIGS, dqw_dp_steps, dqw_dq_steps, dqw_emulated,
                                       dqw_load_kv_block, dqw_load_q_do, dqw_p_and_ds, dqw_s_steps, dqw_smem,
                                       dqw_thread_rows, dqw_tiles)
from models.fragments import lse_base_log2
from models.mask import MaskPolicy
from models.mirrors import missing_statements, unmirrored_statements
from models.smem import new_smem
from models.wgmma import acc_from_matrix, acc_to_matrix, assert_operand

from cupyflash import masks, reference


@pytest.mark.parametrize("source", [DQW])
def test_mirrors_match_the_kernel_sources(source):
    """Every C++ statement a mirror names is in the source (whitespace aside), and every layout
    statement of the kernel is mirrored: an edit there fails here until the mirror follows."""
    assert not (missing := missing_statements(source)), f"mirrored statements no longer in {source}: {missing}"
    unmirrored = unmirrored_statements(source)
    assert not unmirrored, f"layout statements of {source} without a mirror here: {unmirrored}"


@pytest.mark.parametrize("d_tile, block_m, block_n, k_stages", DQW_CONFIGS)
def test_dq_wgmma_operands_are_q_do_k_and_v_slices(d_tile, block_m, block_n, k_stages):
    """flash_bwd_dq_wgmma over K_STAGES + 2 key blocks (every K and V stage, each one reused) in the
    kernel's order: block j + 1's copies land before block j's products read, and, with K_STAGES
    3, before dS K_{j-1} (left running across the barrier) has read K_{j-1}. S = Q K_j^T reads the
    warpgroup's 64 Q rows and all BLOCK_N keys of K_j's stage over the head-dim k-steps (both
    K-major), dP = dO V_j^T likewise with dO and V_j's stage, dQ += dS K_j reads K_j MN-major: 16
    keys per k-step as the reduction, all D_TILE columns as N."""
    L = dqw_smem(d_tile, block_m, block_n, k_stages)
    rng = seeded_rng(10, d_tile, block_n, k_stages)
    smem = new_smem()
    q, do = rng.standard_normal((2, block_m, d_tile))
    dqw_load_q_do(smem, L, q, do, 0, d_tile)
    blocks = k_stages + 2
    k, v = rng.standard_normal((2, blocks * block_n, d_tile))
    dqw_load_kv_block(smem, L, 0, k, v, d_tile)
    for j in range(blocks):
        if j + 1 < blocks:
            dqw_load_kv_block(smem, L, j + 1, k, v, d_tile)
        # the products that may read now: block j's, and dS K_{j-1} where it runs across the barrier
        for i in ([j - 1, j] if L.DQ_ACROSS_BARRIER and j > 0 else [j]):
            tiles = dqw_tiles(L, i)
            k_i, v_i = (x[i * block_n: (i + 1) * block_n] for x in (k, v))
            for wg in range(L.NWG) if i == j else ():  # S, dP: A = 64 query rows of wg, B = the BLOCK_N keys
                rows = slice(64 * wg, 64 * wg + 64)
                for query_side, key_side, steps in ((q, k_i, dqw_s_steps(L, tiles, wg)),
                                                    (do, v_i, dqw_dp_steps(L, tiles, wg))):
                    assert len(steps) == d_tile // 16
                    for kk, step in enumerate(steps):
                        cols = slice(16 * kk, 16 * kk + 16)
                        assert_operand(smem, step.a, step.trans_a, 64, query_side[rows, cols])
                        assert_operand(smem, step.b, step.trans_b, block_n, key_side[:, cols])
            steps = dqw_dq_steps(L, tiles)  # B[key][d] = K_j
            assert len(steps) == block_n // 16 and all(step.a is None for step in steps)
            for kk, step in enumerate(steps):
                assert_operand(smem, step.b, step.trans_b, d_tile, k_i[16 * kk: 16 * kk + 16].T)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d_tile, block_m, block_n, k_stages", DQW_CONFIGS)
def test_dq_wgmma_p_and_ds_are_exact_zeros_where_hidden(d_tile, block_m, block_n, k_stages, causal):
    """Steps 3-4 on accumulators whose hidden entries (rows past seqlen_q, keys past seqlen_k, above
    the causal diagonal) hold +inf scores and NaN dP: P and dS are exact zeros there and the
    formula elsewhere, entry (f, e) of a thread being row row_lo + 8 (e / 2), key n0 + 8 f +
    2 (lane % 4) + e % 2 (the accumulator layout). The blocks are partial by rows only, by keys
    only, by the diagonal only (causal) and by all three."""
    L = dqw_smem(d_tile, block_m, block_n, k_stages)
    rng = seeded_rng(12, d_tile, block_n, int(causal))
    seqlen_q, seqlen_k, scale_log2 = 2 * block_m - 3, 2 * block_m + 2, 0.3
    visible = MaskPolicy(masks.mask_for(causal), seqlen_q, seqlen_k)
    lse, delta = rng.standard_normal((2, seqlen_q))
    last = (seqlen_k - 1) // block_n * block_n
    seen = set()
    for m0, n0 in ((0, 0), (0, last), (block_m, block_m), (block_m, last)):
        for wg in range(L.NWG):
            m, n = m0 + 64 * wg + np.arange(64)[:, None], n0 + np.arange(block_n)[None, :]
            vis = visible(m, n)
            seen |= set(vis.ravel().tolist())
            s, dp = rng.standard_normal((2, 64, block_n))
            s[~vis], dp[~vis] = np.inf, np.nan
            lane, row_lo, base_log2, delta_row = dqw_thread_rows(m0, wg, lse, delta, seqlen_q, 0, 0, 1)
            p, ds = dqw_p_and_ds(L, acc_from_matrix(s), acc_from_matrix(dp), visible, m0, n0, lane, row_lo,
                                 base_log2, delta_row, scale_log2)
            inside = m < seqlen_q
            row_base = np.where(inside, lse_base_log2(lse[np.minimum(m, seqlen_q - 1)]), 0.0)
            row_delta = np.where(inside, delta[np.minimum(m, seqlen_q - 1)], 0.0)
            # the exponent clamped at 0 (softmax_bwd.cuh): this lse is random, so P > 1 would occur
            want_p = np.where(vis, np.exp2(np.minimum(np.where(vis, s, 0.0) * scale_log2 - row_base, 0.0)), 0.0)
            want_ds = np.where(vis, want_p * (np.where(vis, dp, 0.0) - row_delta), 0.0)
            assert np.array_equal(acc_to_matrix(p), want_p) and np.array_equal(acc_to_matrix(ds), want_ds)
    assert seen == {False, True}


def _dq_reference(q, k, v, do, lse, delta, scale, causal, window_size=(-1, -1)):
    seqlen_q, seqlen_k = q.shape[0], k.shape[0]
    visible = reference.visible_keys(seqlen_q, seqlen_k, causal, window_size)
    p = np.where(visible, np.exp(np.minimum(q @ k.T * scale - lse[:, None], 0.0)), 0.0)  # P <= 1 (softmax_bwd.cuh)
    return scale * (p * (do @ v.T - delta[:, None])) @ k


@pytest.mark.parametrize("mode", ["full", "causal", "causal-short-k", "window"])
@pytest.mark.parametrize("d_tile, block_m, block_n, k_stages", DQW_CONFIGS)
def test_dq_wgmma_block_emulation_matches_numpy(d_tile, block_m, block_n, k_stages, mode):
    """flash_bwd_dq_wgmma, both query blocks of one head (the second short of BLOCK_M rows) over
    the key blocks each visits (the last one partial; every K and V stage, reused), head dim short
    of the tile, lse and D read at (batch 1, head 2) of three heads: dQ = scale (P o (dO V^T - D)) K,
    P = exp(S scale - lse), 0 where hidden. causal-short-k: seqlen_k < seqlen_q, so query block 0
    visits no key block (dQ = 0) and rows that see no key have lse = -inf."""
    L = dqw_smem(d_tile, block_m, block_n, k_stages)
    headdim, causal = d_tile - 8, mode.startswith("causal")
    # window: the second query block's walk starts past key block 0 (stages by absolute index).
    window = (block_n + 5, 3) if mode == "window" else (-1, -1)
    seqlen_q = 2 * block_m - 3
    seqlen_k = seqlen_q - block_m - 10 if mode == "causal-short-k" else seqlen_q + block_n + 7
    rng = seeded_rng(11, d_tile, block_n, k_stages)
    q, k, v, do, _, _ = bwd_inputs(rng, seqlen_q, seqlen_k, headdim)
    nheads, batch, head = 3, 1, 2
    lse, delta = rng.standard_normal((2, 2, nheads, seqlen_q))
    if causal:  # rows that see no key: the forward's lse = -inf
        lse[batch, head, np.arange(seqlen_q) + seqlen_k - seqlen_q < 0] = -np.inf
    scale = headdim ** -0.5
    dq, visited = np.full((seqlen_q, headdim), np.nan), []
    for m0 in range(0, seqlen_q, block_m):  # one CTA each: it writes its own rows, all of them
        visited.append([])
        cta = dqw_emulated(q, k, v, do, lse.ravel(), delta.ravel(), L, headdim, scale, causal, m0,
                           batch, head, nheads, visited[-1], window_size=window)
        rows = slice(m0, m0 + block_m)
        assert np.isnan(np.delete(cta, np.arange(seqlen_q)[rows], axis=0)).all() and not np.isnan(cta[rows]).any()
        dq[rows] = cta[rows]
    assert_float64_close(dq, _dq_reference(q, k, v, do, lse[batch, head], delta[batch, head], scale, causal, window))
    if mode == "window":
        assert visited[-1][0] > 0 and visited[-1] == list(range(visited[-1][0], visited[-1][-1] + 1))
        return
    assert len(visited[-1]) == math.ceil(seqlen_k / block_n) >= (k_stages + 1 if mode != "causal-short-k" else 1)
    assert (len(visited[0]) < len(visited[-1])) == causal and (visited[0] == []) == (mode == "causal-short-k")


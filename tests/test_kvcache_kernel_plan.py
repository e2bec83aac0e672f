"""The KV-cache kernel's plan on the CPU (cupyflash/kernels/kvcache_mma.py): FastDivmod against
integer division, the split heuristic's choices, the split of the keys, the tiles' shared memory,
the specializations; and the NumPy twin of the kernel's algorithm (numpy_backend.kvcache_forward:
splits, key shares per warp, the combine) against the float64 reference."""
from __future__ import annotations

import itertools
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cupyflash
from cupyflash import numpy_backend, reference
from cupyflash.kernels import kvcache_mma
from cupyflash.kernels.params import fast_divmod
from cupyflash.masks import VARIANT_KINDS, mask_for
from cupyflash.testing import KVCacheProblem, assert_kvcache_close
from cupyflash.testing.strategies import kvcache_problems


def fast_div(n: np.ndarray, divisor: int) -> np.ndarray:
    """params.cuh's FastDivmod::div, in uint64 arithmetic."""
    d, multiplier, shift = fast_divmod(divisor)
    if d == 1:
        return n
    return ((n.astype(np.uint64) * np.uint64(multiplier)) >> np.uint64(32)) >> np.uint64(shift)


@given(divisor=st.integers(1, 2**31 - 1), seed=st.integers(0, 2**32 - 1))
def test_fast_division_is_integer_division(divisor, seed):
    rng = np.random.default_rng(seed)
    n = np.concatenate([np.arange(0, 300), rng.integers(0, 2**31, 300), [2**31 - 1, divisor - 1, divisor,
                                                                          min(2 * divisor, 2**31 - 1)]])
    n = n[n < 2**31].astype(np.uint64)
    np.testing.assert_array_equal(fast_div(n, divisor), n // np.uint64(divisor))


@pytest.mark.parametrize("divisor", [1, 2, 3, 7, 16, 17, 255, 256, 257, 4095, 2**30, 2**31 - 1])
def test_fast_division_edges(divisor):
    n = np.array([0, 1, divisor - 1, divisor, divisor + 1, 2**31 - 2, 2**31 - 1], np.uint64)
    np.testing.assert_array_equal(fast_div(n, divisor), n // np.uint64(divisor))


def test_fast_divmod_refuses_what_it_cannot_divide_by():
    for bad in (0, -1, 2**31):
        with pytest.raises(ValueError):
            fast_divmod(bad)


@given(ctas=st.integers(1, 5000), sms=st.integers(1, 300), key_blocks=st.integers(0, 5000))
def test_the_split_heuristic_comes_closest_to_one_cta_per_sm(ctas, sms, key_blocks):
    s = kvcache_mma.num_splits_heuristic(ctas, sms, key_blocks)
    assert 1 <= s <= max(1, min(kvcache_mma.MAX_SPLITS, key_blocks))
    if key_blocks <= 1 or ctas >= sms:
        assert s == 1
        return
    runnable = sorted({kvcache_mma.split_layout(key_blocks, t)[0] for t in
                       range(1, min(kvcache_mma.MAX_SPLITS, key_blocks) + 1)})
    assert s in runnable and kvcache_mma.split_layout(key_blocks, s)[0] == s  # it runs as chosen
    distance = abs(ctas * s - sms)
    assert all(abs(ctas * t - sms) > distance or (abs(ctas * t - sms) == distance and t >= s) for t in runnable)


def efficiency(ctas, slots, s):
    waves = ctas * s / slots
    return waves / math.ceil(waves)


@given(ctas=st.integers(1, 5000), slots=st.integers(1, 2000), key_blocks=st.integers(0, 5000))
def test_the_paged_split_heuristic_fills_the_last_wave(ctas, slots, key_blocks):
    s = kvcache_mma.paged_num_splits_heuristic(ctas, slots, key_blocks)
    limit = max(1, min(kvcache_mma.MAX_SPLITS, key_blocks, math.ceil(4 * slots / ctas)))
    assert 1 <= s <= limit
    if key_blocks <= 1:
        assert s == 1
        return
    runnable = sorted({kvcache_mma.split_layout(key_blocks, t)[0] for t in range(1, limit + 1)})
    assert s in runnable and kvcache_mma.split_layout(key_blocks, s)[0] == s  # it runs as chosen
    best = max(efficiency(ctas, slots, t) for t in runnable)
    assert efficiency(ctas, slots, s) >= 0.95 * best
    assert all(efficiency(ctas, slots, t) < 0.95 * best for t in runnable if t < s)  # the fewest that do


def test_the_paged_split_heuristic_on_the_decode_shapes():
    """The H200 (2 decode CTAs per SM at d128, 264 slots): the splits of the decode table's paged runs."""
    slots = 264
    assert kvcache_mma.paged_num_splits_heuristic(8 * 32, slots, 512) == 1
    assert kvcache_mma.paged_num_splits_heuristic(8 * 8, slots, 512) == 4
    assert kvcache_mma.paged_num_splits_heuristic(1 * 8, slots, 2048) == 32
    assert kvcache_mma.paged_num_splits_heuristic(64 * 8, slots, 64) == 1
    assert kvcache_mma.paged_num_splits_heuristic(2 * slots, slots, 64) == 1


@given(key_blocks=st.integers(0, 10000), num_splits=st.integers(0, 1000))
def test_a_split_layout_covers_the_tiles_without_an_empty_split(key_blocks, num_splits):
    splits, per_split = kvcache_mma.split_layout(key_blocks, num_splits)
    tiles = max(1, key_blocks)
    assert 1 <= splits <= min(max(1, num_splits), tiles, kvcache_mma.MAX_SPLITS)
    assert splits * per_split >= tiles > (splits - 1) * per_split


def test_the_heuristic_scores_only_split_counts_that_run():
    """32 key tiles on 8 CTAs of a 132-SM device: 16 splits are 128 CTAs, and 17 would run as 16
    of 2 tiles; 31 splits too (the tie between 16 and 17 goes to the fewer)."""
    assert kvcache_mma.split_layout(32, 31) == (16, 2) and kvcache_mma.split_layout(32, 17) == (16, 2)
    assert kvcache_mma.num_splits_heuristic(8, 132, 32) == 16


def test_the_split_heuristic_on_the_decode_shapes():
    """The H200 (132 SMs, d128): the splits the --splits sweep measured fastest (docs/perf-log.md,
    "capture")."""
    sms = 132
    assert kvcache_mma.num_splits_heuristic(8 * 32, sms, 512) == 1      # 8 x 32/32 at 32k: 256 CTAs
    assert kvcache_mma.num_splits_heuristic(8 * 8, sms, 512) == 2       # 8 x 32/8 at 32k: 128 CTAs
    assert kvcache_mma.num_splits_heuristic(1 * 8, sms, 2048) == 16     # 1 x 32/8 at 128k: 128 CTAs
    assert kvcache_mma.num_splits_heuristic(64 * 8, sms, 64) == 1       # 64 x 32/8 at 4k: 512 CTAs
    assert kvcache_mma.num_splits_heuristic(sms, sms, 64) == 1          # a CTA per SM already: no split


@pytest.mark.parametrize("max_seqlen_k", [0, 1, 63, 64, 65, 1000, 131072])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 128, 500])
@pytest.mark.parametrize("seqlen_q, group", [(1, 1), (1, 4), (4, 8), (3, 5)])
def test_the_plan_splits_the_keys_in_whole_tiles(max_seqlen_k, num_splits, seqlen_q, group):
    planned = kvcache_mma.plan(ml_dtypes.bfloat16, 128, mask_for(True), batch=3, seqlen_q=seqlen_q, group=group,
                               nheads_kv=2, max_seqlen_k=max_seqlen_k, paged=True, num_splits=num_splits)
    tiles = planned.tiles
    assert tiles == kvcache_mma.cache_tiles(128, seqlen_q * group)
    assert planned.split_keys % tiles.block_n == 0
    assert 1 <= planned.num_splits <= min(num_splits, kvcache_mma.MAX_SPLITS)
    assert planned.num_splits * planned.split_keys >= max_seqlen_k
    assert (planned.num_splits - 1) * planned.split_keys < max(max_seqlen_k, 1)  # no split past the end
    m_blocks = math.ceil(seqlen_q * group / tiles.block_m)
    assert planned.grid == (m_blocks * planned.num_splits, 2, 3)
    assert planned.spec.name.endswith("_split" if planned.num_splits > 1 else "_whole")


def test_the_tiles_fit_an_h200_sm_and_name_their_kernels():
    specs = kvcache_mma.specializations()
    assert len({s.name for s in specs}) == len(specs)
    assert len({s.expression for s in specs}) == len(specs)
    for spec in specs:
        assert spec.source_file in ("flash_fwd_kvcache_mma.cu", "flash_fwd_combine.cu")
        assert spec.smem_bytes <= 227 * 1024
    user = next(m for m in VARIANT_KINDS if m.score.user is not None)
    user = user.with_score(user.score.without_block_map)
    for dt, rows, mask in itertools.product((64, 128, 256), (1, 16, 17, 64), (None, user)):
        tiles = kvcache_mma.cache_tiles(dt, rows, mask)
        if mask is not None:  # the compile check builds the tiles modifiers take
            assert kvcache_mma.specialization("bfloat16", dt, mask, tiles, False, True).name in {s.name for s in specs}
        assert tiles.block_n % (16 * tiles.key_warps) == 0
        assert tiles.key_warps == 1 or tiles.row_warps == 1
        assert kvcache_mma.smem_bytes(dt, tiles) == 2 * dt * (16 * tiles.row_warps + 2 * tiles.stages * tiles.block_n)


def test_the_packed_rows_pick_the_tiles():
    assert kvcache_mma.cache_tiles(128, 16).row_warps == 1    # one decode query of 16 heads per kv head
    assert kvcache_mma.cache_tiles(128, 17).row_warps == 4    # more rows: four strips share the tiles
    # user modifiers at d64 decode: two key warps (four spill 8 bytes with the compile check's)
    user = next(m for m in VARIANT_KINDS if m.score.user is not None)
    assert kvcache_mma.cache_tiles(64, 4, user) == kvcache_mma.CacheTiles(1, 2, 64, 4)
    assert kvcache_mma.cache_tiles(64, 4) == kvcache_mma.CacheTiles(1, 4, 64, 4)
    assert kvcache_mma.cache_tiles(64, 17, user) == kvcache_mma.cache_tiles(64, 17)


# --- the NumPy twin -----------------------------------------------------------------------------

@settings(max_examples=30)
@given(problem=kvcache_problems(windows=True, max_capacity=300, max_seqlen_q=4, max_new=4),
       num_splits=st.integers(1, 9))
def test_the_numpy_backend_splits_as_asked(problem, num_splits):
    before = problem.inputs()
    o, lse = cupyflash.flash_attn_with_kvcache(**problem.inputs(), return_lse=True, backend="numpy",
                                               num_splits=num_splits, **problem.kwargs)
    assert_kvcache_close(problem, o, lse, inputs=before)


@pytest.mark.parametrize("key_warps, block_n", [(1, 16), (2, 32), (4, 64), (4, 16)])
@pytest.mark.parametrize("num_splits", [1, 3, 40])
def test_the_twin_with_variants_key_shares_and_splits(key_warps, block_n, num_splits):
    problem = KVCacheProblem(cache_seqlens=(0, 1, 37, 130), seqlen_q=3, seqlen_new=2, capacity=136, page_size=8,
                             spare=2, shuffle=True, nheads_kv=2, group=3, headdim=16, causal=True, softmax_scale=None,
                             magnitude=1.0, dtype=np.float32, seed=5, window_size=(50, 0))
    rng = np.random.default_rng(1)
    variant = {"softcap": 6.0, "alibi_slopes": rng.uniform(0.05, 0.4, (4, 6)).astype(np.float32),
               "sink": rng.uniform(-1, 2, 6).astype(np.float32)}
    inputs = problem.inputs()
    sequences = reference.kvcache_sequences(problem.batch, inputs["k_cache"], inputs["v_cache"], inputs["k"],
                                            inputs["v"], cache_seqlens=inputs["cache_seqlens"],
                                            block_table=inputs["block_table"])
    from cupyflash.scores import check_variant

    v = check_variant(variant["softcap"], variant["alibi_slopes"], variant["sink"], problem.batch, problem.nheads)
    o, lse = numpy_backend.kvcache_forward(inputs["q"], sequences, softmax_scale=problem.headdim ** -0.5,
                                           causal=True, window_size=(50, 0), variant=v, num_splits=num_splits,
                                           block_n=block_n, key_warps=key_warps)
    assert_kvcache_close(problem, o, lse, inputs=problem.inputs(), variant=variant)

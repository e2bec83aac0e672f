"""flash_attn_with_kvcache on the CPU: the in-place append byte for byte (the whole cache against a
copy with only the appended slots changed), attention over contiguous and paged caches of every
page size (1, odd, 16, 64, 256) against the float64 reference, causal/window alignment to the end of
the updated cache, the reference's kv-cache functions against plain indexing, and every rejected
input."""
from __future__ import annotations

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given

import cupyflash
from cupyflash import reference
from cupyflash.testing import KVCacheProblem, assert_kvcache_close, poisoned_outputs
from cupyflash.testing.strategies import kvcache_problems
from kvcache_checks import assert_same_bytes, expected_caches

CPU_COST = 2e6


def call(problem, inputs, backend="numpy", **extra):
    return cupyflash.flash_attn_with_kvcache(**inputs, return_softmax_lse=True, backend=backend, **problem.kwargs,
                                             **extra)


def check(problem, **extra):
    inputs, before = problem.inputs(), problem.inputs()
    with poisoned_outputs():
        o, lse = call(problem, inputs, **extra)
    assert_kvcache_close(problem, o, lse, inputs=before)
    k_expected, v_expected = expected_caches(before)
    assert_same_bytes("k_cache", inputs["k_cache"], k_expected)
    assert_same_bytes("v_cache", inputs["v_cache"], v_expected)
    return o, lse


@given(kvcache_problems(windows=True, max_cost=CPU_COST))
def test_appends_in_place_and_matches_the_reference(problem):
    check(problem)


@given(kvcache_problems(max_cost=CPU_COST, distinct_v=True))
def test_appends_in_place_and_matches_the_reference_with_a_head_dim_of_v_of_its_own(problem):
    inputs = problem.inputs()
    assert inputs["v_cache"].shape == problem.v_cache_shape
    o, _ = check(problem)
    assert o.shape == problem.o_shape


def problem_with(**changes):
    base = KVCacheProblem(cache_seqlens=(5, 0, 17), seqlen_q=2, seqlen_new=2, capacity=48, page_size=16, spare=3,
                          shuffle=True, nheads_kv=2, group=3, headdim=24, causal=True, softmax_scale=None,
                          magnitude=1.0, dtype=np.float32, seed=7)
    return replace(base, **changes)


@pytest.mark.parametrize("page_size", [1, 3, 5, 16, 17, 64, 256])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32], ids=["fp16", "bf16", "fp32"])
def test_every_page_size(page_size, dtype):
    pages = max(-(-40 // page_size), 1)
    problem = problem_with(page_size=page_size, capacity=pages * page_size, dtype=dtype,
                           cache_seqlens=(min(page_size, 30), 0, min(2 * page_size + 1, pages * page_size - 2)))
    check(problem)


def test_paged_and_contiguous_caches_give_the_same_results():
    """The same tokens in pages (odd page size, shuffled table) and in rows: the same attention, the
    same tokens appended."""
    problem = problem_with(page_size=5, capacity=45, cache_seqlens=(4, 30, 43), seqlen_new=2)
    paged = problem.inputs()
    table = paged["block_table"]
    rows = {name: paged[name][table].reshape((problem.batch, problem.capacity) + paged[name].shape[2:])
            for name in ("k_cache", "v_cache")}
    o_paged, lse_paged = call(problem, paged)
    o_rows, lse_rows = call(problem, dict(paged, block_table=None, **rows))
    np.testing.assert_allclose(o_paged, o_rows, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse_paged, lse_rows, rtol=1e-6)
    for name, cache in rows.items():
        assert_same_bytes(name, paged[name][table].reshape(cache.shape), cache)


@pytest.mark.parametrize("seqlen_q,causal", [(1, True), (1, False), (3, True)])
def test_queries_are_aligned_to_the_end_of_the_updated_cache(seqlen_q, causal):
    """Query i sees key j iff j <= i + seqlen_k - seqlen_q, seqlen_k counting the appended tokens: one
    decode query sees its whole sequence, causal or not."""
    problem = problem_with(seqlen_q=seqlen_q, seqlen_new=seqlen_q, causal=causal, page_size=None, capacity=40,
                           cache_seqlens=(3, 0, 20), shuffle=False)
    o, lse = check(problem)
    inputs = problem.inputs()
    for b, length in enumerate(problem.seqlens_k):
        cached = problem.cache_seqlens[b]
        keys = np.concatenate([inputs["k_cache"][b, :cached], inputs["k"][b]])
        values = np.concatenate([inputs["v_cache"][b, :cached], inputs["v"][b]])
        o_b, _ = cupyflash.flash_attn_func(inputs["q"][b:b + 1], keys[None], values[None], causal=causal,
                                           return_lse=True, backend="numpy")
        np.testing.assert_allclose(o[b], o_b[0], rtol=1e-5, atol=1e-6)
        if seqlen_q == 1:
            o_full = cupyflash.flash_attn_func(inputs["q"][b:b + 1], keys[None], values[None], backend="numpy")
            np.testing.assert_allclose(o[b], o_full[0], rtol=1e-5, atol=1e-6)


def test_without_new_tokens_nothing_is_written():
    problem = problem_with(seqlen_new=0)
    inputs = problem.inputs()
    assert inputs["k"] is None
    check(problem)


def test_without_cache_seqlens_the_whole_cache_is_the_sequence():
    for page_size in (None, 4):
        problem = problem_with(seqlen_new=0, page_size=page_size, capacity=12, cache_seqlens=(12, 12, 12))
        inputs = problem.inputs()
        o = cupyflash.flash_attn_with_kvcache(inputs["q"], inputs["k_cache"], inputs["v_cache"],
                                              cache_batch_idx=inputs["cache_batch_idx"],
                                              block_table=inputs["block_table"], backend="numpy", **problem.kwargs)
        assert_kvcache_close(problem, o)


def test_cache_seqlens_as_an_int():
    check(problem_with(cache_seqlens=(9, 9, 9), seqlens_as_int=True))


def test_append_through_a_strided_view_writes_the_base_in_place():
    """A cache that is a view with gaps (every other head of a larger buffer, rows reversed): the
    append writes its slots of the base array and nothing else of it."""
    problem = problem_with(page_size=None, capacity=20, cache_seqlens=(4, 0, 11), spare=0, shuffle=False)
    inputs, before = problem.inputs(), problem.inputs()
    rng = np.random.default_rng(0)
    bases = []
    for name in ("k_cache", "v_cache"):
        cache = inputs[name]
        base = rng.standard_normal((cache.shape[0], cache.shape[1], 2 * cache.shape[2], cache.shape[3]))
        base = base.astype(cache.dtype)
        view = base[::-1, :, ::2]
        view[...] = cache
        inputs[name] = view
        bases.append(base)
    expected_bases = [b.copy() for b in bases]
    k_expected, v_expected = expected_caches(before)
    expected_bases[0][::-1, :, ::2] = k_expected
    expected_bases[1][::-1, :, ::2] = v_expected
    o, lse = call(problem, inputs)
    assert_kvcache_close(problem, o, lse, inputs=before)
    assert_same_bytes("k base", bases[0], expected_bases[0])
    assert_same_bytes("v base", bases[1], expected_bases[1])


def test_num_splits_is_accepted_and_changes_nothing():
    problem = problem_with(seqlen_new=0)
    results = [call(problem, problem.inputs(), num_splits=n) for n in (0, 1, 3)]
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


def test_lse_names_and_shapes():
    problem = problem_with(seqlen_new=0)
    inputs = problem.inputs()
    o = cupyflash.flash_attn_with_kvcache(**inputs, backend="numpy")
    o2, lse = cupyflash.flash_attn_with_kvcache(**inputs, return_lse=True, backend="numpy")
    assert o.shape == problem.q_shape and lse.shape == problem.lse_shape == (3, 6, 2)
    np.testing.assert_array_equal(o, o2)


@pytest.mark.parametrize("changes", [dict(seqlen_q=0, seqlen_new=0), dict(cache_seqlens=(), seqlen_new=0),
                                     dict(cache_seqlens=(0, 0, 0), seqlen_new=0), dict(cache_seqlens=(0, 0, 0))])
def test_empty_calls(changes):
    problem = problem_with(**changes)
    o, lse = check(problem)
    assert o.shape == problem.q_shape and lse.shape == problem.lse_shape


# --- the reference's kv-cache functions against plain indexing -----------------------------------------

@given(kvcache_problems(dtypes=["float64"], max_cost=2e5))
def test_reference_reads_the_cache_through_the_block_table(problem):
    inputs = problem.inputs()
    sequences = reference.kvcache_sequences(problem.batch, inputs["k_cache"], inputs["v_cache"], inputs["k"],
                                            inputs["v"], cache_seqlens=inputs["cache_seqlens"],
                                            cache_batch_idx=inputs["cache_batch_idx"],
                                            block_table=inputs["block_table"])
    for b, (keys, values) in enumerate(sequences):
        cached = problem.cache_seqlens[b]
        if problem.page_size is None:
            row = b if inputs["cache_batch_idx"] is None else inputs["cache_batch_idx"][b]
            old_k, old_v = inputs["k_cache"][row, :cached], inputs["v_cache"][row, :cached]
        else:  # the pages in order, joined, cut at the cached length
            pages = inputs["block_table"][b]
            old_k = inputs["k_cache"][pages].reshape((-1,) + inputs["k_cache"].shape[2:])[:cached]
            old_v = inputs["v_cache"][pages].reshape((-1,) + inputs["v_cache"].shape[2:])[:cached]
        new_k = inputs["k"][b] if problem.seqlen_new else old_k[:0]
        new_v = inputs["v"][b] if problem.seqlen_new else old_v[:0]
        np.testing.assert_array_equal(keys, np.concatenate([old_k, new_k]))
        np.testing.assert_array_equal(values, np.concatenate([old_v, new_v]))
        assert not np.isnan(keys).any()  # slots outside the sequence are NaN in these caches
    o, lse = reference.kvcache_attention(**inputs, **problem.kwargs)
    for b, (keys, values) in enumerate(sequences):
        o_b, lse_b = reference.attention(inputs["q"][b:b + 1], keys[None], values[None], **problem.kwargs)
        np.testing.assert_array_equal(o[b], o_b[0])
        np.testing.assert_array_equal(lse[b], lse_b[0])


def test_reference_append_touches_only_the_appended_slots():
    problem = problem_with(page_size=3, capacity=30, cache_seqlens=(2, 0, 25), seqlen_new=3)
    inputs = problem.inputs()
    after = reference.kvcache_appended(inputs["k_cache"], inputs["k"], cache_seqlens=inputs["cache_seqlens"],
                                       block_table=inputs["block_table"])
    changed = ~((after == inputs["k_cache"]) | (np.isnan(after) & np.isnan(inputs["k_cache"]))).all(axis=(2, 3))
    expected = np.zeros(changed.shape, bool)
    for b, cached in enumerate(problem.cache_seqlens):
        for p in range(cached, cached + problem.seqlen_new):
            expected[inputs["block_table"][b, p // 3], p % 3] = True
    np.testing.assert_array_equal(changed, expected)


# --- rejected inputs, before anything is written --------------------------------------------------------

CONTIGUOUS = replace(problem_with(), page_size=None, shuffle=True)


def rejected(problem=None, **changes):
    """A call on problem_with()'s inputs (or ``problem``'s) with ``changes``: each value replaces an
    argument, or a callable maps it; the call must leave the caches as they were."""
    problem = problem_with() if problem is None else problem
    inputs = problem.inputs()
    options = {}
    for name, change in changes.items():
        if name in inputs:
            inputs[name] = change(inputs[name]) if callable(change) else change
        else:
            options[name] = change
    before = {name: inputs[name].copy() for name in ("k_cache", "v_cache")}

    def run():
        try:
            cupyflash.flash_attn_with_kvcache(**inputs, backend="numpy", **{**problem.kwargs, **options})
        finally:  # nothing may have been written, whatever was refused
            for name, cache in before.items():
                assert_same_bytes(name, inputs[name], cache)

    return run


def contiguous(**changes):
    return rejected(CONTIGUOUS, **changes)


def read_only(x):
    x = x.copy()
    x.flags.writeable = False
    return x


ERRORS = [
    ("cache_seqlens int64", rejected(cache_seqlens=lambda s: s.astype(np.int64)), TypeError,
     "cache_seqlens must have dtype int32"),
    ("cache_seqlens 2-D", rejected(cache_seqlens=lambda s: s[None]), ValueError, "cache_seqlens must be 1-D"),
    ("cache_seqlens short", rejected(cache_seqlens=lambda s: s[:2]), ValueError,
     r"cache_seqlens must have shape \(batch,\) = \(3,\); got \(2,\)"),
    ("cache_seqlens negative", rejected(cache_seqlens=np.array([5, -1, 3], np.int32)), ValueError,
     r"cache_seqlens must be >= 0; got cache_seqlens\[1\] = -1"),
    ("cache_seqlens negative int", rejected(cache_seqlens=-2), ValueError, "cache_seqlens must be >= 0"),
    ("cache_seqlens a list", rejected(cache_seqlens=[5, 0, 17]), TypeError, "cache_seqlens must be an array"),
    ("cache_seqlens float", rejected(cache_seqlens=5.0), TypeError, "cache_seqlens must be an array"),
    ("cache_seqlens missing with k", rejected(cache_seqlens=None), ValueError,
     "k and v are appended at cache_seqlens: pass cache_seqlens"),
    ("append beyond the pages", rejected(cache_seqlens=np.array([5, 0, 47], np.int32)), ValueError,
     r"the cache is too small for the append: sequence 2 has 47 cached tokens \+ 2 new ones = 49 > its 3 pages "
     "of 16 tokens"),
    ("cached beyond the pages", rejected(k=None, v=None, cache_seqlens=np.array([5, 49, 3], np.int32)), ValueError,
     r"cache_seqlens\[1\] = 49 exceeds its 3 pages of 16 tokens"),
    ("append beyond the rows", contiguous(cache_seqlens=np.array([5, 47, 0], np.int32)), ValueError,
     r"sequence 1 has 47 cached tokens \+ 2 new ones = 49 > a cache of 48 tokens per sequence"),
    ("block_table entry too large", rejected(block_table=lambda t: np.where(t == t[2, 1], 99, t).astype(np.int32)),
     ValueError, r"block_table\[2, 1\] = 99 is not a page of k_cache \(0 .. 11\)"),
    ("block_table entry negative", rejected(block_table=lambda t: np.where(t == t[0, 0], -1, t).astype(np.int32)),
     ValueError, r"block_table\[0, 0\] = -1 is not a page of k_cache"),
    ("block_table int64", rejected(block_table=lambda t: t.astype(np.int64)), TypeError,
     "block_table must have dtype int32"),
    ("block_table 1-D", rejected(block_table=lambda t: t.reshape(-1)), ValueError, "block_table must be 2-D"),
    ("block_table rows", rejected(block_table=lambda t: t[:2]), ValueError,
     r"block_table must have shape \(batch, max_blocks_per_seq\) with batch = 3"),
    ("two sequences append into one slot", rejected(block_table=lambda t: np.array([t[0], t[0], t[2]], np.int32),
                                                    cache_seqlens=np.array([5, 5, 17], np.int32)),
     ValueError, r"sequences \[0, 1\] would append into the same cache slot"),
    ("append over another's cached token", rejected(block_table=lambda t: np.array([t[0], t[0], t[2]], np.int32),
                                                    cache_seqlens=np.array([9, 5, 17], np.int32)),
     ValueError, "sequence 1 would append over a cached token"),
    ("cache_batch_idx with block_table", rejected(cache_batch_idx=np.arange(3, dtype=np.int32)), ValueError,
     "cache_batch_idx and block_table cannot be combined"),
    ("cache_batch_idx out of range", contiguous(cache_batch_idx=np.array([0, 6, 1], np.int32)), ValueError,
     r"cache_batch_idx\[1\] = 6 is not a row of k_cache \(0 .. 5\)"),
    ("cache_batch_idx negative", contiguous(cache_batch_idx=np.array([0, -1, 1], np.int32)), ValueError,
     r"cache_batch_idx\[1\] = -1 is not a row"),
    ("cache_batch_idx int64", contiguous(cache_batch_idx=lambda i: i.astype(np.int64)), TypeError,
     "cache_batch_idx must have dtype int32"),
    ("cache_batch_idx shape", contiguous(cache_batch_idx=lambda i: i[:1]), ValueError,
     r"cache_batch_idx must have shape \(batch,\)"),
    ("cache_batch_idx repeats a row", contiguous(cache_batch_idx=np.array([2, 2, 0], np.int32),
                                                 cache_seqlens=np.array([5, 5, 5], np.int32)),
     ValueError, "would append into the same cache slot"),
    ("fewer rows than sequences", contiguous(cache_batch_idx=None, k_cache=lambda c: c[:2], v_cache=lambda c: c[:2]),
     ValueError, "k_cache has 2 rows for a batch of 3 sequences"),
    ("k without v", rejected(v=None), ValueError, "k and v must be given together"),
    ("k batch", rejected(k=lambda x: x[:2], v=lambda x: x[:2]), ValueError, r"k must have the batch size of q \(3\)"),
    ("k heads", rejected(k=lambda x: x[:, :, :1], v=lambda x: x[:, :, :1]), ValueError,
     r"k must have the \(nheads_kv, headdim\) of k_cache \(2, 24\)"),
    ("k 3-D", rejected(k=lambda x: x[0], v=lambda x: x[0]), ValueError, "k must have 4 dimensions"),
    ("k/v shapes", rejected(v=lambda x: x[:, :1]), ValueError, r"k and v must have the same \(batch, seqlen_new, nheads_kv\)"),
    ("k dtype", rejected(k=lambda x: x.astype(np.float64)), TypeError, "k has dtype float64"),
    ("cache dtype", rejected(v_cache=lambda x: x.astype(np.float16)), TypeError, "v_cache has dtype float16"),
    ("cache shapes", rejected(v_cache=lambda x: x[:, :8]), ValueError, "k_cache and v_cache must have the same shape but for the head dim"),
    ("cache 3-D", rejected(k_cache=lambda x: x[0], v_cache=lambda x: x[0]), ValueError,
     "k_cache must have 4 dimensions"),
    ("q 3-D", rejected(q=lambda x: x[0]), ValueError, r"q must have 4 dimensions \(batch, seqlen, nheads, headdim\)"),
    ("headdim", rejected(q=lambda x: x[..., :8]), ValueError, "q and k_cache must have the same headdim"),
    ("GQA", rejected(q=lambda x: x[:, :, :5]), ValueError, r"nheads of q \(5\) must be a multiple"),
    ("page size 0", rejected(k_cache=lambda x: x[:, :0], v_cache=lambda x: x[:, :0]), ValueError,
     "needs page_size >= 1"),
    ("read-only cache", rejected(k_cache=read_only), ValueError, "k_cache is read-only"),
    ("num_splits negative", rejected(num_splits=-1), ValueError, "num_splits must be >= 0"),
    ("num_splits float", rejected(num_splits=2.0), TypeError, "num_splits must be an int"),
    ("softcap", rejected(softcap=-50.0), ValueError, "softcap must be a finite float >= 0"),
    ("sink shape", rejected(sink=np.ones(3, np.float32)), ValueError, "sink must have shape"),
    ("causal", rejected(causal=None), TypeError, "causal must be a bool"),
    ("return_softmax_lse", rejected(return_softmax_lse="yes"), TypeError, "return_softmax_lse must be a bool"),
    ("window", rejected(window_size=(1,)), ValueError, "window_size must be a pair"),
    ("scale", rejected(softmax_scale=np.inf), ValueError, "softmax_scale must be finite"),
]


@pytest.mark.parametrize("label,run,error,message", ERRORS, ids=[e[0] for e in ERRORS])
def test_rejects_before_writing(label, run, error, message):
    with pytest.raises(error, match=message):
        run()


def test_unknown_backend_is_rejected():
    problem = problem_with()
    with pytest.raises(ValueError, match="backend must be one of"):
        cupyflash.flash_attn_with_kvcache(**problem.inputs(), backend="paged")


def test_cached_keys_are_checked_for_overflowing_scores_before_the_append():
    problem = problem_with(dtype=np.float32)
    inputs = problem.inputs()
    before = problem.inputs()
    row = inputs["block_table"][2, 0]
    inputs["k_cache"][row, 3] = 1e37  # a cached key of sequence 2: q.k overflows float32 at this scale
    with pytest.raises(ValueError, match="can overflow the float32 scores"):
        cupyflash.flash_attn_with_kvcache(**inputs, softmax_scale=10.0, backend="numpy")
    before["k_cache"][row, 3] = 1e37
    assert_same_bytes("k_cache", inputs["k_cache"], before["k_cache"])
    # NaN in slots no sequence holds is not read by the check
    cupyflash.flash_attn_with_kvcache(**problem.inputs(), softmax_scale=10.0, backend="numpy")


# --- the strategy reaches the edges it promises ----------------------------------------------------

EDGES = {"empty cache": lambda p: 0 in p.cache_seqlens, "full cache": lambda p: p.capacity in p.seqlens_k,
         "append": lambda p: p.seqlen_new > 0}


@pytest.mark.parametrize("page_size", [None, 1, 3, 16, 256])
@pytest.mark.parametrize("edge", EDGES.values(), ids=EDGES.keys())
def test_strategy_draws_the_edges_of_each_page_size(page_size, edge):
    from hypothesis import Phase, find, settings

    quick = settings(phases=[Phase.generate], database=None, max_examples=500)  # found, not shrunk
    problem = find(kvcache_problems(page_sizes=(page_size,), max_cost=CPU_COST), edge, settings=quick)
    assert problem.page_size == page_size
    assert (problem.inputs()["block_table"] is None) == (page_size is None)


@pytest.mark.parametrize("bad,match", [(dict(page_sizes=(0,)), "page sizes must be >= 1"),
                                       (dict(page_sizes=()), "must not be empty"),
                                       (dict(max_capacity=0), "max_capacity must be >= 1")])
def test_strategy_rejects_bad_bounds(bad, match):
    with pytest.raises(ValueError, match=match):
        kvcache_problems(**bad)


def test_variants_over_a_ragged_cache():
    """softcap, per-sequence ALiBi slopes and a sink over cached + appended keys of different
    lengths, against the dense float64 reference of each sequence (keys from reference's
    kvcache_sequences)."""
    rng = np.random.default_rng(3)
    batch, h, hkv, d, capacity = 3, 4, 2, 8, 16
    q = rng.standard_normal((batch, 2, h, d))
    k_cache, v_cache = (rng.standard_normal((batch, capacity, hkv, d)) for _ in range(2))
    k, v = (rng.standard_normal((batch, 2, hkv, d)) for _ in range(2))
    lengths = np.array([5, 0, 9], np.int32)
    variant = dict(softcap=6.0, alibi_slopes=rng.uniform(0, 1, (batch, h)).astype(np.float32),
                   sink=rng.standard_normal(h).astype(np.float32))
    sequences = reference.kvcache_sequences(batch, k_cache, v_cache, k, v, cache_seqlens=lengths)
    o, lse = cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True,
                                               return_lse=True, backend="numpy", **variant)
    for b, (keys, values) in enumerate(sequences):
        o_ref, lse_ref = reference.attention(q[b:b + 1], keys[None], values[None], causal=True, softcap=6.0,
                                             alibi_slopes=variant["alibi_slopes"][b], sink=variant["sink"])
        np.testing.assert_allclose(o[b], o_ref[0], atol=1e-12)
        np.testing.assert_allclose(lse[b], lse_ref[0], atol=1e-12)


def test_user_modifiers_over_a_ragged_cache():
    """score_mod and mask_mod over cached + appended keys of different lengths: b is the sequence,
    kv_idx the cache position, the mask applied element by element (no block map); against the
    dense float64 reference of each sequence given its rows of the modifiers' tensors. The mask
    hides something."""
    import modifier_zoo as zoo

    rng = np.random.default_rng(4)
    batch, h, hkv, d, capacity, new = 3, 4, 2, 8, 16, 2
    q = rng.standard_normal((batch, new, h, d))
    k_cache, v_cache = (rng.standard_normal((batch, capacity, hkv, d)) for _ in range(2))
    k, v = (rng.standard_normal((batch, new, hkv, d)) for _ in range(2))
    lengths = np.array([5, 0, 9], np.int32)
    slopes = rng.uniform(0.05, 0.5, (batch, h)).astype(np.float32)
    doc_q = np.full((batch, new), 1, np.int32)
    doc_k = zoo.document_ids(rng, batch, capacity, 2)
    mods = dict(score_mod=cupyflash.ScoreMod(zoo.sequence_bias, slopes=slopes),
                mask_mod=cupyflash.MaskMod(zoo.documents, doc_q=doc_q, doc_k=doc_k))
    sequences = reference.kvcache_sequences(batch, k_cache, v_cache, k, v, cache_seqlens=lengths)
    o, lse = cupyflash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True,
                                               return_lse=True, backend="numpy", **mods)
    hidden = False
    for b, (keys, values) in enumerate(sequences):
        o_ref, lse_ref = reference.attention(
            q[b:b + 1], keys[None], values[None], causal=True,
            score_mod=cupyflash.ScoreMod(zoo.sequence_bias, slopes=slopes[b:b + 1]),
            mask_mod=cupyflash.MaskMod(zoo.documents, doc_q=doc_q[b:b + 1], doc_k=doc_k[b:b + 1]))
        np.testing.assert_allclose(o[b], o_ref[0], atol=1e-12)
        np.testing.assert_allclose(lse[b], lse_ref[0], atol=1e-12)
        hidden |= bool((doc_k[b, :len(keys)] != 1).any())
    assert hidden

"""flash_attn_varlen_func with block_table (flash-attn's paged varlen forward) on the NumPy twin:
packed queries over keys and values in pages, against reference.varlen_attention on the same keys
packed (and the unpaged varlen call for the variants): ragged and empty sequences, GQA, causal and
windows (each sequence its own bottom-right alignment although the queries share a padded row),
several page sizes, both forms (queries padded into rows; keys gathered, past the padding limit);
the errors. GPU: tests/test_paged_varlen_gpu.py.
"""
from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import reference

LENGTHS_Q = [3, 0, 6, 1]
LENGTHS_K = [5, 4, 6, 0]


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def paged(k, lengths, page_size, seed, spare=3):
    """k (total_k, nheads_kv, d) as pages (num_blocks, page_size, ...) in a shuffled order and the
    block table (batch, max_blocks) reaching each sequence's keys; unused slots NaN."""
    rng = np.random.default_rng(seed)
    per_sequence = max(1, -(-max(lengths) // page_size))
    count = len(lengths) * per_sequence + spare
    pages = np.full((count, page_size) + k.shape[1:], np.nan, k.dtype)
    table = rng.permutation(count)[: len(lengths) * per_sequence].reshape(len(lengths), per_sequence)
    start = 0
    for b, n in enumerate(lengths):
        for p in range(n):
            pages[table[b, p // page_size], p % page_size] = k[start + p]
        start += n
    return pages, table.astype(np.int32)


def _problem(seed=0, nheads=4, nheads_kv=2, headdim=8, dtype=np.float64):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((sum(LENGTHS_Q), nheads, headdim)).astype(dtype)
    k = rng.standard_normal((sum(LENGTHS_K), nheads_kv, headdim)).astype(dtype)
    v = rng.standard_normal((sum(LENGTHS_K), nheads_kv, headdim)).astype(dtype)
    return q, k, v


@pytest.fixture(params=["padded", "gathered"])
def form(request, monkeypatch):
    """Each form of the call forced: queries padded into rows (no limit), or keys gathered (limit 0)."""
    from cupyflash import kvcache

    monkeypatch.setattr(kvcache, "PAGED_VARLEN_MAX_PADDING", 10**9 if request.param == "padded" else 0)
    return request.param


@pytest.mark.parametrize("page_size", [1, 3, 4, 16])
@pytest.mark.parametrize("causal, window_size", [(False, (-1, -1)), (True, (-1, -1)), (True, (2, 0)), (False, (1, 2))])
def test_matches_the_reference(page_size, causal, window_size, form):
    q, k, v = _problem(seed=page_size)
    k_pages, table = paged(k, LENGTHS_K, page_size, seed=1)
    v_pages, _ = paged(v, LENGTHS_K, page_size, seed=1)
    cu_q, cu_k = _cu(LENGTHS_Q), _cu(LENGTHS_K)
    o, lse = cupyflash.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K),
                                              causal=causal, window_size=window_size, block_table=table,
                                              return_lse=True, backend="numpy")
    o_ref, lse_ref = reference.varlen_attention(q, k, v, cu_q, cu_k, causal=causal, window_size=window_size)
    assert o.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-12)


def test_variants_equal_the_unpaged_call(form):
    q, k, v = _problem(seed=5)
    k_pages, table = paged(k, LENGTHS_K, 2, seed=6)
    v_pages, _ = paged(v, LENGTHS_K, 2, seed=6)
    cu_q, cu_k = _cu(LENGTHS_Q), _cu(LENGTHS_K)
    options = dict(causal=True, softcap=2.5, alibi_slopes=np.array([0.3, 0.1, 0.7, 0.2], np.float32),
                   sink=np.array([0.5, -1.0, 0.0, 2.0], np.float32), return_lse=True, backend="numpy")
    got = cupyflash.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 6, 6, block_table=table, **options)
    want = cupyflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 6, **options)
    for g, w in zip(got, want):
        if form == "gathered":  # the same call on the same keys
            np.testing.assert_array_equal(g, w)
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


def test_the_padding_limit_picks_the_form(monkeypatch):
    """Past PAGED_VARLEN_MAX_PADDING padded rows per query the keys are gathered (no KV-cache call)."""
    from cupyflash import kvcache

    seen = []
    real = kvcache._attend
    monkeypatch.setattr(kvcache, "_attend", lambda *a, **k: seen.append(1) or real(*a, **k))
    q, k, v = _problem(seed=13)
    k_pages, table = paged(k, LENGTHS_K, 4, seed=14)
    v_pages, _ = paged(v, LENGTHS_K, 4, seed=14)
    args = (q, k_pages, v_pages, _cu(LENGTHS_Q), _cu(LENGTHS_K), 6, 6)
    cupyflash.flash_attn_varlen_func(*args, block_table=table, backend="numpy")  # 4 x 6 rows for 10 queries
    assert seen == []
    monkeypatch.setattr(kvcache, "PAGED_VARLEN_MAX_PADDING", 3)
    cupyflash.flash_attn_varlen_func(*args, block_table=table, backend="numpy")
    assert seen == [1]


def _call(**changes):
    q, k, v = _problem(seed=7)
    k_pages, table = paged(k, LENGTHS_K, 4, seed=8)
    v_pages, _ = paged(v, LENGTHS_K, 4, seed=8)
    arguments = dict(q=q, k=k_pages, v=v_pages, cu_seqlens_q=_cu(LENGTHS_Q), cu_seqlens_k=_cu(LENGTHS_K),
                     max_seqlen_q=6, max_seqlen_k=6, block_table=table, backend="numpy")
    arguments.update(changes)
    return cupyflash.flash_attn_varlen_func(**arguments)


@pytest.mark.parametrize("changes, message", [
    (dict(mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx), "does not take mask_mod"),
    (dict(dropout_p=0.1, seed=1), "does not take dropout_p"),
    (dict(block_table=np.zeros((3, 2), np.int32)), r"block_table must have shape \(batch, max_blocks_per_seq\)"),
    (dict(block_table=np.zeros((4, 1), np.int32)), "sequence 2 has 6 keys"),
    (dict(block_table=np.full((4, 2), 99, np.int32)), r"block_table\[0, 0\] = 99 is not a page"),
    (dict(max_seqlen_k=5), "more than max_seqlen_k = 5"),
])
def test_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        _call(**changes)


def test_no_queries():
    _, k, v = _problem(seed=9)
    k_pages, table = paged(k, LENGTHS_K, 4, seed=10)
    v_pages, _ = paged(v, LENGTHS_K, 4, seed=10)
    q = np.zeros((0, 4, 8))
    o, lse = cupyflash.flash_attn_varlen_func(q, k_pages, v_pages, np.zeros(5, np.int32), _cu(LENGTHS_K), 0, 6,
                                              block_table=table, return_lse=True, backend="numpy")
    assert o.shape == (0, 4, 8) and lse.shape == (4, 0)


def test_torch_front_end_forward_only():
    torch = pytest.importorskip("torch")
    from cupyflash.torch import flash_attn_varlen_func

    q, k, v = _problem(seed=11)
    k_pages, table = paged(k, LENGTHS_K, 4, seed=12)
    v_pages, _ = paged(v, LENGTHS_K, 4, seed=12)
    cu_q, cu_k = _cu(LENGTHS_Q), _cu(LENGTHS_K)
    want, want_lse = cupyflash.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 6, 6, causal=True,
                                                      block_table=table, return_lse=True, backend="numpy")
    tensors = [torch.from_numpy(x) for x in (q, k_pages, v_pages, cu_q, cu_k)]
    out, lse, s_dmask = flash_attn_varlen_func(*tensors, 6, 6, causal=True, return_attn_probs=True,
                                               block_table=torch.from_numpy(table))
    np.testing.assert_array_equal(out.numpy(), want)
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    assert s_dmask.numel() == 0
    tensors[0].requires_grad_()
    with pytest.raises(NotImplementedError, match="no backward"):
        flash_attn_varlen_func(*tensors, 6, 6, block_table=torch.from_numpy(table))
    with torch.no_grad():
        flash_attn_varlen_func(*tensors, 6, 6, block_table=torch.from_numpy(table))
        with pytest.raises(NotImplementedError, match="dropout_p with block_table"):
            flash_attn_varlen_func(*tensors, 6, 6, dropout_p=0.1, block_table=torch.from_numpy(table))

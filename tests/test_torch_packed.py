"""cupyflash.torch's packed-batch and kv-cache front ends on CPU tensors (the NumPy twin):
flash_attn_varlen_func against the float64 reference with gradcheck through o and the lse (empty
sequences, GQA, causal, windows), flash_attn_with_kvcache's in-place append (contiguous and paged
caches, an int cache_seqlens, cache_batch_idx) against the reference, fake shapes, opcheck of the
three operators, torch.compile, and the errors. The same calls on a GPU: tests/test_torch_gpu.py.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cupyflash import reference  # noqa: E402
from cupyflash.torch import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: E402

LENGTHS_Q, LENGTHS_K = [3, 0, 5, 2], [4, 3, 6, 0]  # an empty query run and an empty key run


def packed(lengths_q=LENGTHS_Q, lengths_k=LENGTHS_K, nheads=4, nheads_kv=2, headdim=8, dtype=torch.float64,
           requires_grad=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lengths_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lengths_k)]), dtype=torch.int32)
    shapes = [(sum(lengths_q), nheads, headdim)] + [(sum(lengths_k), nheads_kv, headdim)] * 2
    q, k, v = (torch.randn(s, generator=generator, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)
               for s in shapes)
    return q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k)


@pytest.mark.parametrize("causal, window_size", [(False, (-1, -1)), (True, (-1, -1)), (False, (2, 1))])
def test_varlen_matches_the_float64_reference(causal, window_size):
    q, k, v, cu_q, cu_k, max_q, max_k = packed(requires_grad=False)
    o, lse, s_dmask = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                             window_size=window_size, return_attn_probs=True)
    o_ref, lse_ref = reference.varlen_attention(q.numpy(), k.numpy(), v.numpy(), cu_q.numpy(), cu_k.numpy(),
                                                causal=causal, window_size=window_size)
    assert o.shape == q.shape and lse.shape == (q.shape[1], q.shape[0]) and s_dmask.numel() == 0
    np.testing.assert_allclose(o.numpy(), o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), lse_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_gradcheck_through_o_and_lse(causal):
    """Every sequence with queries has keys and (causal) no more queries than keys, so every row
    sees a key and the lse's finite differences exist; one sequence has keys but no queries."""
    q, k, v, cu_q, cu_k, max_q, max_k = packed(lengths_q=[3, 0, 2], lengths_k=[4, 3, 2])

    def out_and_lse(q, k, v):
        o, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, return_attn_probs=True)
        return o, lse

    assert torch.autograd.gradcheck(out_and_lse, (q, k, v))
    grads = torch.autograd.grad(out_and_lse(q, k, v)[0], (q, k, v), torch.ones_like(q))
    want = reference.varlen_attention_backward(np.ones(q.shape), *(x.detach().numpy() for x in (q, k, v)),
                                               cu_q.numpy(), cu_k.numpy(), causal=causal)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-10, atol=1e-10)


def test_varlen_fake_shapes_and_opcheck():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, cu_q, cu_k, max_q, max_k = packed()
    with FakeTensorMode(allow_non_fake_inputs=True):
        fq, fk, fv = (torch.empty(x.shape, dtype=torch.bfloat16) for x in (q, k, v))
        o, lse, _ = flash_attn_varlen_func(fq, fk, fv, cu_q, cu_k, max_q, max_k, return_attn_probs=True)
        assert o.shape == q.shape and o.dtype == torch.bfloat16
        assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    options = (max_q, max_k, 0.3, True, -1, 0, True)
    report = torch.library.opcheck(torch.ops.cupyflash.flash_attn_varlen_forward.default, (q, k, v, cu_q, cu_k, *options))
    assert set(report.values()) == {"SUCCESS"}, report
    o, lse = torch.ops.cupyflash.flash_attn_varlen_forward(*(t.detach() for t in (q, k, v)), cu_q, cu_k, *options)
    args = (torch.randn_like(o), *(t.detach() for t in (q, k, v)), o, lse, cu_q, cu_k, *options)
    report = torch.library.opcheck(torch.ops.cupyflash.flash_attn_varlen_backward.default, args)
    assert set(report.values()) == {"SUCCESS"}, report


def test_varlen_torch_compile_fullgraph_matches_eager():
    q, k, v, cu_q, cu_k, max_q, max_k = packed()

    def loss(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True).square().sum()

    eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    for a, b in zip(eager, torch.autograd.grad(compiled(q, k, v), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_varlen_dropout_draws_its_seed_from_torch_and_keeps_it_for_the_backward():
    """dropout_p: the seed is drawn from torch's default generator (torch.manual_seed repeats it),
    the result is cupyflash.flash_attn_varlen_func's with that seed, and the gradients its
    backward's with the same seed; a gradient through the lse is refused."""
    import cupyflash

    q, k, v, cu_q, cu_k, max_q, max_k = packed()
    torch.manual_seed(3)
    o = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.25, causal=True)
    torch.manual_seed(3)
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64).item())
    arrays = [x.detach().numpy() for x in (q, k, v)]
    sequences = (cu_q.numpy(), cu_k.numpy(), max_q, max_k)
    call = dict(dropout_p=0.25, seed=seed, causal=True, backend="numpy")
    o_want, lse = cupyflash.flash_attn_varlen_func(*arrays, *sequences, return_lse=True, **call)
    np.testing.assert_array_equal(o.detach().numpy(), o_want)
    do = torch.randn_like(o)
    o.backward(do)
    grads = cupyflash.flash_attn_varlen_backward(do.numpy(), *arrays, o_want, lse, *sequences, statistics="recomputed",
                                                 **call)
    for got, want in zip((q.grad, k.grad, v.grad), grads):
        np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-13)
    _, lse_t, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.25, return_attn_probs=True)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        lse_t.sum().backward()


def test_varlen_errors_name_the_argument():
    q, k, v, cu_q, cu_k, max_q, max_k = packed(requires_grad=False)
    cases = [
        (dict(cu_seqlens_q=cu_q.to(torch.int64)), TypeError, "cu_seqlens_q must have dtype torch.int32"),
        (dict(max_seqlen_q=torch.tensor(5)), TypeError, "max_seqlen_q must be a Python int"),
        (dict(max_seqlen_k=2), ValueError, "max_seqlen_k"),
        (dict(q=q[None]), ValueError, "q must have 3 dimensions"),
        (dict(block_table=torch.zeros((4, 1), dtype=torch.int32)), ValueError,
         "k must have 4 dimensions"),  # with a block table k and v are pages
    ]
    for change, error, message in cases:
        args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
        args.update(change)
        with pytest.raises(error, match=message):
            flash_attn_varlen_func(**args)


def _per_sequence(cu_q, cu_k):
    """(rows of q, rows of k) of each sequence of a packed batch."""
    return [(slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1])))
            for b in range(len(cu_q) - 1)]


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_sink_outputs_and_gradients_match_the_reference_sequence_by_sequence(causal):
    """A sink (gpt-oss: one logit per head in every row's denominator) through the packed front
    end: o, lse and the gradients of q, k, v and the sink against the dense float64 reference run
    on each sequence alone (an empty query run: no rows, no share of dsink; an empty key run: o = 0,
    lse = the sink)."""
    q, k, v, cu_q, cu_k, max_q, max_k = packed(lengths_q=[3, 0, 5, 2], lengths_k=[4, 3, 6, 0])
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float32, requires_grad=True)
    o, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, sink=sink,
                                       return_attn_probs=True)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    dq, dk, dv, dsink = torch.autograd.grad((o * do).sum(), (q, k, v, sink))
    want_dsink = np.zeros(4)
    for rows_q, rows_k in _per_sequence(cu_q, cu_k):
        if rows_q.stop == rows_q.start:
            continue
        arrays = [x.detach().numpy()[rows][None] for x, rows in ((q, rows_q), (k, rows_k), (v, rows_k))]
        kw = dict(causal=causal, sink=sink.detach().numpy())
        o_ref, lse_ref = reference.attention(*arrays, **kw)
        np.testing.assert_allclose(o.detach().numpy()[rows_q], o_ref[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse.detach().numpy()[:, rows_q], lse_ref[0], rtol=1e-12, atol=1e-12)
        g_q, g_k, g_v, g_sink = reference.attention_backward(do.numpy()[rows_q][None], *arrays, **kw)
        for got, want, rows in ((dq, g_q, rows_q), (dk, g_k, rows_k), (dv, g_v, rows_k)):
            # GQA: the reference's dk, dv already sum over the query heads sharing a kv head
            np.testing.assert_allclose(got.numpy()[rows], want[0], rtol=1e-10, atol=1e-10)
        want_dsink += g_sink
    np.testing.assert_allclose(dsink.numpy(), want_dsink, rtol=1e-5, atol=1e-6)  # dsink is float32


def test_varlen_sink_gradient_through_the_lse():
    """d(sum lse)/dsink_h = sum over h's rows of exp(sink_h - lse_hi), the sink's share of each row
    (a row with no key has lse = sink: its share is 1)."""
    q, k, v, cu_q, cu_k, max_q, max_k = packed(lengths_q=[3, 2, 4], lengths_k=[4, 0, 5])
    sink = torch.tensor([0.25, -0.5, 1.5, 0.0], dtype=torch.float32, requires_grad=True)
    _, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, sink=sink,
                                       return_attn_probs=True)
    [dsink] = torch.autograd.grad(lse.sum(), (sink,))
    lse64 = lse.detach().numpy()
    want = np.exp(sink.detach().numpy().astype(np.float64)[:, None] - lse64).sum(axis=1)
    np.testing.assert_allclose(dsink.numpy(), want, rtol=1e-5)


# --- kv cache ---------------------------------------------------------------------------------------

def caches(batch=3, capacity=12, nheads_kv=2, headdim=8, page_size=None, seed=1):
    generator = torch.Generator().manual_seed(seed)
    if page_size is None:
        shape = (batch, capacity, nheads_kv, headdim)
    else:
        shape = (batch * capacity // page_size + 1, page_size, nheads_kv, headdim)
    return [torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(2)]


@pytest.mark.parametrize("page_size", [None, 4, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_appends_in_place_and_matches_the_reference(page_size, causal):
    batch, seqlen_q, new, nheads, nheads_kv, headdim = 3, 2, 2, 4, 2, 8
    generator = torch.Generator().manual_seed(7)
    q = torch.randn((batch, seqlen_q, nheads, headdim), generator=generator, dtype=torch.float64)
    k_new, v_new = (torch.randn((batch, new, nheads_kv, headdim), generator=generator, dtype=torch.float64)
                    for _ in range(2))
    k_cache, v_cache = caches(batch, page_size=page_size)
    cache_seqlens = torch.tensor([5, 0, 9], dtype=torch.int32)
    block_table = None
    if page_size is not None:  # pages in a shuffled order, as a paged allocator hands them out
        per_seq = 12 // page_size
        order = torch.randperm(k_cache.shape[0], generator=generator)[:batch * per_seq]
        block_table = order.view(batch, per_seq).to(torch.int32)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    o, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens,
                                     block_table=block_table, causal=causal, return_softmax_lse=True)
    index = dict(cache_seqlens=cache_seqlens.numpy(),
                 block_table=None if block_table is None else block_table.numpy())
    for got, before, new_tokens in ((k_cache, before_k, k_new), (v_cache, before_v, v_new)):
        np.testing.assert_array_equal(got.numpy(), reference.kvcache_appended(before.numpy(), new_tokens.numpy(),
                                                                              **index))
    o_ref, lse_ref = reference.kvcache_attention(q.numpy(), before_k.numpy(), before_v.numpy(), k_new.numpy(),
                                                 v_new.numpy(), causal=causal, **index)
    np.testing.assert_allclose(o.numpy(), o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), lse_ref, rtol=1e-12, atol=1e-12)


def test_kvcache_sink_matches_the_reference():
    batch, nheads, nheads_kv, headdim = 3, 4, 2, 8
    generator = torch.Generator().manual_seed(11)
    q = torch.randn((batch, 2, nheads, headdim), generator=generator, dtype=torch.float64)
    k_new, v_new = (torch.randn((batch, 2, nheads_kv, headdim), generator=generator, dtype=torch.float64)
                    for _ in range(2))
    k_cache, v_cache = caches(batch)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    cache_seqlens = torch.tensor([5, 0, 9], dtype=torch.int32)
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float32)
    o, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens, causal=True,
                                     sink=sink, return_softmax_lse=True)
    o_ref, lse_ref = reference.kvcache_attention(q.numpy(), before_k.numpy(), before_v.numpy(), k_new.numpy(),
                                                 v_new.numpy(), cache_seqlens=cache_seqlens.numpy(), causal=True,
                                                 sink=sink.numpy())
    np.testing.assert_allclose(o.numpy(), o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), lse_ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match="sink must be a tensor"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, sink=sink.numpy())


def test_kvcache_int_seqlens_and_batch_index_without_append():
    batch, nheads, headdim = 2, 2, 8
    generator = torch.Generator().manual_seed(3)
    q = torch.randn((batch, 1, nheads, headdim), generator=generator, dtype=torch.float64)
    k_cache, v_cache = caches(4, nheads_kv=2)
    cache_batch_idx = torch.tensor([3, 1], dtype=torch.int32)
    before = k_cache.clone()
    o = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=7, cache_batch_idx=cache_batch_idx)
    assert torch.equal(k_cache, before)  # nothing appended, nothing written
    o_ref, _ = reference.kvcache_attention(q.numpy(), k_cache.numpy(), v_cache.numpy(),
                                           cache_seqlens=np.full(batch, 7, np.int32),
                                           cache_batch_idx=cache_batch_idx.numpy())
    np.testing.assert_allclose(o.numpy(), o_ref, rtol=1e-12, atol=1e-12)


def test_kvcache_bfloat16_caches_are_written_in_place():
    q = torch.randn((1, 1, 2, 8)).to(torch.bfloat16)
    k_cache, v_cache = (c.to(torch.bfloat16) for c in caches(1))
    k_new, v_new = (torch.randn((1, 1, 2, 8)).to(torch.bfloat16) for _ in range(2))
    flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=4)
    assert torch.equal(k_cache[0, 4], k_new[0, 0]) and torch.equal(v_cache[0, 4], v_new[0, 0])


def test_kvcache_fake_shapes_and_opcheck():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q = torch.randn((2, 3, 4, 8), dtype=torch.float64)
    k_cache, v_cache = caches(2)
    k_new, v_new = (torch.randn((2, 3, 2, 8), dtype=torch.float64) for _ in range(2))
    seqlens = torch.tensor([2, 5], dtype=torch.int32)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = [torch.empty(x.shape, dtype=torch.float16) for x in (q, k_cache, v_cache, k_new, v_new)]
        o, lse = flash_attn_with_kvcache(*fake, cache_seqlens=seqlens, return_softmax_lse=True)
        assert o.shape == q.shape and lse.shape == (2, 4, 3) and lse.dtype == torch.float32
    args = (q, k_cache, v_cache, k_new, v_new, seqlens, None, None, 0.35, True, -1, 0)
    report = torch.library.opcheck(torch.ops.cupyflash.flash_attn_with_kvcache.default, args,
                                   test_utils=("test_schema", "test_faketensor"))
    assert set(report.values()) == {"SUCCESS"}, report
    # with rotary tables and left-padded rows (the operator's optional tensors)
    theta = torch.rand((k_cache.shape[1], 2), dtype=torch.float64)
    kwargs = dict(rotary_cos=theta.cos(), rotary_sin=theta.sin(), rotary_interleaved=False,
                  cache_leftpad=torch.tensor([1, 0], dtype=torch.int32))
    report = torch.library.opcheck(torch.ops.cupyflash.flash_attn_with_kvcache.default, args, kwargs,
                                   test_utils=("test_schema", "test_faketensor"))
    assert set(report.values()) == {"SUCCESS"}, report


def test_kvcache_errors_name_the_argument():
    q = torch.randn((2, 1, 4, 8), dtype=torch.float64)
    k_cache, v_cache = caches(2)
    k_new = torch.randn((2, 1, 2, 8), dtype=torch.float64)
    cases = [
        (dict(k=k_new), ValueError, "k and v must be given together"),
        (dict(cache_seqlens=torch.tensor([1, 2])), TypeError, "cache_seqlens must have dtype torch.int32"),
        (dict(rotary_cos=torch.ones(1)), ValueError, "rotary_cos and rotary_sin must be given together"),
        (dict(rotary_cos=np.ones((4, 2)), rotary_sin=np.ones((4, 2))), TypeError, "rotary_cos must be a torch.Tensor"),
        (dict(cache_leftpad=torch.tensor([2, 0], dtype=torch.int32)), ValueError, r"cache_leftpad\[0\] = 2 must be in"),
        (dict(cache_leftpad=torch.zeros(2)), TypeError, "cache_leftpad must have dtype torch.int32"),
        (dict(k_cache=k_cache.float()), TypeError, "k_cache has dtype torch.float32"),
        (dict(num_splits=-1), ValueError, "num_splits must be >= 0"),
    ]
    for change, error, message in cases:
        args = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=torch.tensor([1, 2], dtype=torch.int32))
        args.update(change)
        with pytest.raises(error, match=message):
            flash_attn_with_kvcache(**args)


# --- variants through the packed and kv-cache front ends --------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_varlen_variants_with_autograd(causal):
    """softcap and per-sequence ALiBi slopes through torch's varlen function: o and the gradients
    against each sequence's dense float64 reference."""
    q, k, v, cu_q, cu_k, max_q, max_k = packed()
    slopes = torch.rand(4, 4, generator=torch.Generator().manual_seed(5)).to(torch.float32)
    o = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, softcap=3.0, alibi_slopes=slopes)
    do = torch.randn(o.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    o.backward(do)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(4):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        arrays = [x.detach().numpy() for x in (q[None, qs], k[None, ks], v[None, ks])]
        kw = dict(causal=causal, softcap=3.0, alibi_slopes=slopes[b].numpy())
        np.testing.assert_allclose(o.detach().numpy()[qs], reference.attention(*arrays, **kw)[0][0], atol=1e-10)
        dq, dk, dv = reference.attention_backward(do.numpy()[None, qs], *arrays, **kw)
        np.testing.assert_allclose(q.grad.numpy()[qs], dq[0], atol=1e-9)
        np.testing.assert_allclose(k.grad.numpy()[ks], dk[0], atol=1e-9)
        np.testing.assert_allclose(v.grad.numpy()[ks], dv[0], atol=1e-9)


def test_kvcache_variants_match_the_reference():
    batch, nheads, headdim = 3, 4, 8
    k_cache, v_cache = caches(batch=batch)
    generator = torch.Generator().manual_seed(9)
    q = torch.randn((batch, 2, nheads, headdim), generator=generator, dtype=torch.float64)
    lengths = torch.tensor([5, 0, 9], dtype=torch.int32)
    slopes = torch.rand(nheads, generator=generator).to(torch.float32)
    o = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True, softcap=6.0,
                                alibi_slopes=slopes)
    sequences = reference.kvcache_sequences(batch, k_cache.numpy(), v_cache.numpy(), cache_seqlens=lengths.numpy())
    for b, (keys, values) in enumerate(sequences):
        want, _ = reference.attention(q.numpy()[b:b + 1], keys[None], values[None], causal=True, softcap=6.0,
                                      alibi_slopes=slopes.numpy())
        np.testing.assert_allclose(o.numpy()[b], want[0], atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_user_modifiers_with_autograd(causal):
    """score_mod and mask_mod (keywords, tensors as torch tensors) through autograd on a packed
    batch: out and the gradients of q, k, v are cupyflash.flash_attn_varlen_func's and its
    backward's with the same modifiers (b the sequence), and the same with a block_mask made
    once for the call's shape."""
    import cupyflash
    import modifier_zoo as zoo

    q, k, v, cu_q, cu_k, max_q, max_k = packed()
    rng = np.random.default_rng(3)
    slopes = torch.tensor(rng.uniform(0.05, 0.5, (len(LENGTHS_Q), 4)).astype(np.float32))
    doc_q = torch.tensor(zoo.document_ids(rng, len(LENGTHS_Q), max_q, 2))
    doc_k = torch.tensor(zoo.document_ids(rng, len(LENGTHS_Q), max_k, 2))
    mods = dict(score_mod=cupyflash.ScoreMod(zoo.sequence_bias, slopes=slopes),
                mask_mod=cupyflash.MaskMod(zoo.documents, doc_q=doc_q, doc_k=doc_k))
    o = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, **mods)
    do = torch.randn(o.shape, dtype=o.dtype, generator=torch.Generator().manual_seed(1))
    o.backward(do)
    arrays = [x.detach().numpy() for x in (q, k, v)]
    numpy_mods = dict(score_mod=cupyflash.ScoreMod(zoo.sequence_bias, slopes=slopes.numpy()),
                      mask_mod=cupyflash.MaskMod(zoo.documents, doc_q=doc_q.numpy(), doc_k=doc_k.numpy()))
    sequences = (cu_q.numpy(), cu_k.numpy(), max_q, max_k)
    o_want, lse_want = cupyflash.flash_attn_varlen_func(*arrays, *sequences, causal=causal, return_lse=True,
                                                        backend="numpy", **numpy_mods)
    grads_want = cupyflash.flash_attn_varlen_backward(do.numpy(), *arrays, o_want, lse_want, *sequences, causal=causal,
                                                      backend="numpy", **numpy_mods)
    np.testing.assert_allclose(o.detach().numpy(), o_want, rtol=0, atol=1e-12)
    for x, want in zip((q, k, v), grads_want):
        np.testing.assert_allclose(x.grad.numpy(), want, rtol=0, atol=1e-12)
    block_mask = cupyflash.create_block_mask(mods["mask_mod"], len(LENGTHS_Q), 4, max_q, max_k, device="cpu")
    o_made = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, score_mod=mods["score_mod"],
                                    block_mask=block_mask)
    np.testing.assert_array_equal(o_made.detach().numpy(), o.detach().numpy())
    with pytest.raises(ValueError, match="softcap or alibi_slopes"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softcap=2.0, **mods)


def test_kvcache_user_modifiers_append_and_match_the_reference():
    """score_mod and mask_mod (torch tensors) in the kv-cache call: k, v appended in place, and out
    against the float64 reference of each sequence given its rows of the tensors (b the
    sequence, kv_idx the cache position)."""
    import cupyflash
    import modifier_zoo as zoo

    batch, nheads, headdim = 3, 4, 8
    k_cache, v_cache = caches(batch=batch)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    generator = torch.Generator().manual_seed(11)
    q = torch.randn((batch, 2, nheads, headdim), generator=generator, dtype=torch.float64)
    k, v = (torch.randn((batch, 2, 2, headdim), generator=generator, dtype=torch.float64) for _ in range(2))
    lengths = torch.tensor([5, 0, 9], dtype=torch.int32)
    rng = np.random.default_rng(11)
    slopes = rng.uniform(0.05, 0.5, (batch, nheads)).astype(np.float32)
    doc_q = np.ones((batch, 2), np.int32)
    doc_k = zoo.document_ids(rng, batch, k_cache.shape[1], 2)
    o = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True,
                                score_mod=cupyflash.ScoreMod(zoo.sequence_bias, slopes=torch.tensor(slopes)),
                                mask_mod=cupyflash.MaskMod(zoo.documents, doc_q=torch.tensor(doc_q),
                                                           doc_k=torch.tensor(doc_k)))
    assert not torch.equal(k_cache, k_before) and not torch.equal(v_cache, v_before)  # appended in place
    sequences = reference.kvcache_sequences(batch, k_before.numpy(), v_before.numpy(), k.numpy(), v.numpy(),
                                            cache_seqlens=lengths.numpy())
    for b, (keys, values) in enumerate(sequences):
        want, _ = reference.attention(q.numpy()[b:b + 1], keys[None], values[None], causal=True,
                                      score_mod=cupyflash.ScoreMod(zoo.sequence_bias, slopes=slopes[b:b + 1]),
                                      mask_mod=cupyflash.MaskMod(zoo.documents, doc_q=doc_q[b:b + 1],
                                                                 doc_k=doc_k[b:b + 1]))
        np.testing.assert_allclose(o.numpy()[b], want[0], atol=1e-12)

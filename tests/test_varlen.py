"""Packed variable-length batches on the CPU: flash_attn_varlen_func / _backward / _vjp on the NumPy
twin against the float64 reference (ragged lengths with zeros and ones, GQA, causal, windows), the
packing itself (each sequence is the dense problem of its rows), the reference's varlen functions
against the dense reference, and every rejected input."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given

import cupyflash
from cupyflash import reference
from cupyflash.testing import VarlenProblem, assert_varlen_close, poisoned_outputs
from cupyflash.testing.strategies import varlen_problems

# The CPU budget of one example: reference, baselines and the twin, forward and backward.
CPU_COST = 2e6


def run_varlen(problem, backend="numpy", **extra):
    q, k, v, do = problem.arrays()
    o, lse = cupyflash.flash_attn_varlen_func(q, k, v, *problem.sequences, return_lse=True, backend=backend,
                                              **problem.kwargs, **extra)
    grads = cupyflash.flash_attn_varlen_backward(do, q, k, v, o, lse, *problem.sequences, backend=backend,
                                                 **problem.kwargs)
    return o, lse, grads


@given(varlen_problems(windows=True, max_cost=CPU_COST))
def test_matches_the_reference(problem):
    o, lse, grads = run_varlen(problem)
    assert_varlen_close(problem, o, lse, grads)


@given(varlen_problems(max_cost=CPU_COST, distinct_v=True))
def test_matches_the_reference_with_a_head_dim_of_v_of_its_own(problem):
    q, k, v, do = problem.arrays()
    assert v.shape == problem.v_shape and do.shape == problem.o_shape
    o, lse, grads = run_varlen(problem)
    assert_varlen_close(problem, o, lse, grads)


@given(varlen_problems(max_cost=CPU_COST, max_group=4, dtypes=["float32"]))
def test_each_sequence_is_the_dense_problem_of_its_rows(problem):
    """The packing changes nothing: every sequence's o, lse and gradients are bitwise those of
    flash_attn_func on its rows alone; rows of the other sequences are not read."""
    q, k, v, do = problem.arrays()
    o, lse, (dq, dk, dv) = run_varlen(problem)
    for queries, keys in problem.ranges():
        parts = [x[None, queries] for x in (q, do)], [x[None, keys] for x in (k, v)]
        (q_b, do_b), (k_b, v_b) = parts
        o_b, lse_b = cupyflash.flash_attn_func(q_b, k_b, v_b, return_lse=True, backend="numpy", **problem.kwargs)
        grads_b = cupyflash.flash_attn_backward(do_b, q_b, k_b, v_b, o_b, lse_b, backend="numpy", **problem.kwargs)
        np.testing.assert_array_equal(o[queries], o_b[0])
        np.testing.assert_array_equal(lse[:, queries], lse_b[0])
        for packed, rows, dense in ((dq, queries, grads_b[0]), (dk, keys, grads_b[1]), (dv, keys, grads_b[2])):
            np.testing.assert_array_equal(packed[rows], dense[0])


@given(varlen_problems(max_cost=CPU_COST, windows=True))
def test_every_output_row_is_written(problem):
    """Outputs start as NaN (poisoned): sequences without keys get 0 and -inf, keys of sequences
    without queries get zero gradients, nothing is left unwritten."""
    with poisoned_outputs():
        o, lse, grads = run_varlen(problem)
    assert not np.isnan(o.astype(np.float64)).any() and not np.isnan(lse).any()
    assert all(not np.isnan(g.astype(np.float64)).any() for g in grads)
    for queries, keys in problem.ranges():
        if keys.stop == keys.start:
            assert (o[queries] == 0).all() and (lse[:, queries] == -np.inf).all() and (grads[0][queries] == 0).all()
        if queries.stop == queries.start:
            assert (grads[1][keys] == 0).all() and (grads[2][keys] == 0).all()


def test_lse_has_flash_attns_varlen_layout():
    problem = VarlenProblem((3, 0, 5), (4, 2, 6), nheads_kv=2, group=2, headdim=8, causal=True, softmax_scale=None,
                            magnitude=1.0, dtype=np.float32, seed=1)
    o, lse, _ = run_varlen(problem)
    assert o.shape == (8, 4, 8) and lse.shape == (4, 8) and lse.dtype == np.float32
    q, k, v, _ = problem.arrays()
    _, lse_last = cupyflash.flash_attn_func(q[None, 3:], k[None, 6:], v[None, 6:], causal=True, return_lse=True,
                                            backend="numpy")
    np.testing.assert_array_equal(lse[:, 3:], lse_last[0])  # (nheads, total_q): head-major, tokens packed


@pytest.mark.parametrize("seqlens_q,seqlens_k", [((), ()), ((0, 0), (0, 0)), ((0, 3), (2, 0)), ((1,), (0,))])
def test_empty_batches_and_sequences(seqlens_q, seqlens_k):
    problem = VarlenProblem(seqlens_q, seqlens_k, nheads_kv=1, group=2, headdim=4, causal=False, softmax_scale=None,
                            magnitude=1.0, dtype=ml_dtypes.bfloat16, seed=0)
    with poisoned_outputs():
        o, lse, (dq, dk, dv) = run_varlen(problem)
    assert o.shape == problem.q_shape and lse.shape == problem.lse_shape
    assert (o == 0).all() and (lse == -np.inf).all()
    assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()
    assert dk.shape == problem.kv_shape and dk.dtype == problem.dtype


def test_vjp_is_forward_and_backward():
    problem = VarlenProblem((5, 1, 7), (5, 1, 9), nheads_kv=1, group=3, headdim=16, causal=True, softmax_scale=0.3,
                            magnitude=1.0, dtype=np.float64, seed=2, window_size=(3, -1))
    q, k, v, do = problem.arrays()
    o, vjp = cupyflash.flash_attn_varlen_vjp(q, k, v, *problem.sequences, backend="numpy", **problem.kwargs)
    o_direct, lse, _ = run_varlen(problem)
    np.testing.assert_array_equal(o, o_direct)
    grads = cupyflash.flash_attn_varlen_backward(do, q, k, v, o, lse, *problem.sequences, backend="numpy",
                                                 statistics="recomputed", **problem.kwargs)  # the vjp's, float64
    for a, b in zip(vjp(do), grads):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match="return_lse"):
        cupyflash.flash_attn_varlen_vjp(q, k, v, *problem.sequences, return_lse=True)


def test_max_seqlen_may_exceed_every_length():
    problem = VarlenProblem((3, 2), (4, 4), nheads_kv=1, group=1, headdim=4, causal=False, softmax_scale=None,
                            magnitude=1.0, dtype=np.float32, seed=3)
    q, k, v, _ = problem.arrays()
    cu_q, cu_k, _, _ = problem.sequences
    loose = cupyflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 100, np.int64(7), backend="numpy")
    np.testing.assert_array_equal(loose, run_varlen(problem)[0])


# --- the reference's varlen functions against the dense reference ---------------------------------

@given(varlen_problems(dtypes=["float64"], max_cost=2e5, windows=True))
def test_reference_is_the_dense_reference_sequence_by_sequence(problem):
    q, k, v, do = problem.arrays()
    o, lse = reference.varlen_attention(q, k, v, problem.cu_seqlens_q, problem.cu_seqlens_k, **problem.kwargs)
    grads = reference.varlen_attention_backward(do, q, k, v, problem.cu_seqlens_q, problem.cu_seqlens_k,
                                                **problem.kwargs)
    for queries, keys in problem.ranges():
        o_b, lse_b = reference.attention(q[None, queries], k[None, keys], v[None, keys], **problem.kwargs)
        np.testing.assert_array_equal(o[queries], o_b[0])
        np.testing.assert_array_equal(lse[:, queries], lse_b[0])
        dense = reference.attention_backward(do[None, queries], q[None, queries], k[None, keys], v[None, keys],
                                             **problem.kwargs)
        for packed, rows, g in zip(grads, (queries, keys, keys), dense):
            np.testing.assert_array_equal(packed[rows], g[0])


def test_reference_with_equal_lengths_is_the_dense_batch():
    rng = np.random.default_rng(4)
    batch, seqlen_q, seqlen_k = 3, 6, 9
    q = rng.standard_normal((batch, seqlen_q, 4, 8))
    k, v = rng.standard_normal((2, batch, seqlen_k, 2, 8))
    do = rng.standard_normal(q.shape)
    cu_q = np.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=np.int32)
    cu_k = np.arange(0, (batch + 1) * seqlen_k, seqlen_k, dtype=np.int32)
    flat = [x.reshape((-1,) + x.shape[2:]) for x in (q, k, v, do)]
    o, lse = reference.varlen_attention(*flat[:3], cu_q, cu_k, causal=True)
    o_dense, lse_dense = reference.attention(q, k, v, causal=True)
    np.testing.assert_allclose(o, o_dense.reshape(o.shape), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(lse, np.moveaxis(lse_dense, 1, 0).reshape(lse.shape), rtol=1e-13)
    grads = reference.varlen_attention_backward(flat[3], *flat[:3], cu_q, cu_k, causal=True)
    dense = reference.attention_backward(do, q, k, v, causal=True)
    for g, d in zip(grads, dense):
        np.testing.assert_allclose(g, d.reshape(g.shape), rtol=1e-12, atol=1e-12)


def test_the_rule_fails_a_wrong_sequence():
    problem = VarlenProblem((4, 6), (5, 7), nheads_kv=1, group=2, headdim=8, causal=True, softmax_scale=None,
                            magnitude=1.0, dtype=np.float16, seed=5)
    o, lse, grads = run_varlen(problem)
    assert_varlen_close(problem, o, lse, grads)
    o = o.copy()
    o[4:] = o[4:][::-1]  # the second sequence's rows in the wrong order
    with pytest.raises(AssertionError, match=r"o \(float16\): max abs error"):
        assert_varlen_close(problem, o, lse, grads)


# --- rejected inputs, before anything runs -----------------------------------------------------------

def packed(seqlens_q=(3, 0, 2), seqlens_k=(4, 1, 2), h=2, hkv=1, d=8, dtype=np.float32):
    problem = VarlenProblem(seqlens_q, seqlens_k, nheads_kv=hkv, group=h // hkv, headdim=d, causal=False,
                            softmax_scale=None, magnitude=1.0, dtype=dtype, seed=0)
    q, k, v, do = problem.arrays()
    return dict(q=q, k=k, v=v, cu_seqlens_q=problem.cu_seqlens_q, cu_seqlens_k=problem.cu_seqlens_k,
                max_seqlen_q=problem.max_seqlen_q, max_seqlen_k=problem.max_seqlen_k), do


def call_forward(**changes):
    arguments, _ = packed()
    options = {}
    for name, change in changes.items():
        if name in arguments:
            arguments[name] = change(arguments[name]) if callable(change) else change
        else:
            options[name] = change
    order = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
    return lambda: cupyflash.flash_attn_varlen_func(*(arguments[n] for n in order), backend="numpy", **options)


FORWARD_ERRORS = [
    ("cu_seqlens_q int64", call_forward(cu_seqlens_q=lambda c: c.astype(np.int64)), TypeError,
     "cu_seqlens_q must have dtype int32"),
    ("cu_seqlens_k uint32", call_forward(cu_seqlens_k=lambda c: c.astype(np.uint32)), TypeError,
     "cu_seqlens_k must have dtype int32"),
    ("cu_seqlens_q float", call_forward(cu_seqlens_q=lambda c: c.astype(np.float32)), TypeError,
     "cu_seqlens_q must have dtype int32"),
    ("cu_seqlens_q a list", call_forward(cu_seqlens_q=lambda c: c.tolist()), TypeError,
     "cu_seqlens_q must be an array"),
    ("cu_seqlens_q 2-D", call_forward(cu_seqlens_q=lambda c: c[None]), ValueError, r"cu_seqlens_q must be 1-D"),
    ("cu_seqlens_q 0-D", call_forward(cu_seqlens_q=np.array(0, np.int32)), ValueError, r"cu_seqlens_q must be 1-D"),
    ("cu_seqlens_q empty", call_forward(cu_seqlens_q=np.zeros(0, np.int32), cu_seqlens_k=np.zeros(0, np.int32)),
     ValueError, "cu_seqlens_q must have batch \\+ 1 entries"),
    ("cu_seqlens lengths differ", call_forward(cu_seqlens_k=lambda c: np.append(c, c[-1]).astype(np.int32)),
     ValueError, "cu_seqlens_q and cu_seqlens_k must have the same length"),
    ("cu_seqlens_q not from 0", call_forward(cu_seqlens_q=np.array([1, 3, 3, 5], np.int32)), ValueError,
     r"cu_seqlens_q must start at 0; got cu_seqlens_q\[0\] = 1"),
    ("cu_seqlens_k decreasing", call_forward(cu_seqlens_k=np.array([0, 4, 3, 7], np.int32)), ValueError,
     r"cu_seqlens_k must be non-decreasing .* cu_seqlens_k\[2\] = 3 < cu_seqlens_k\[1\] = 4"),
    ("cu_seqlens_q short of q", call_forward(cu_seqlens_q=np.array([0, 3, 3, 4], np.int32)), ValueError,
     r"cu_seqlens_q\[-1\] = 4 must equal the number of tokens of q \(q.shape\[0\] = 5\)"),
    ("cu_seqlens_k past k", call_forward(cu_seqlens_k=np.array([0, 4, 5, 9], np.int32)), ValueError,
     r"cu_seqlens_k\[-1\] = 9 must equal the number of tokens of k \(k.shape\[0\] = 7\)"),
    ("max_seqlen_q too small", call_forward(max_seqlen_q=2), ValueError,
     "sequence 0 has 3 query tokens, more than max_seqlen_q = 2"),
    ("max_seqlen_k too small", call_forward(max_seqlen_k=3), ValueError,
     "sequence 0 has 4 key tokens, more than max_seqlen_k = 3"),
    ("max_seqlen_q negative", call_forward(max_seqlen_q=-1), ValueError, "max_seqlen_q must be >= 0"),
    ("max_seqlen_k float", call_forward(max_seqlen_k=4.0), TypeError, "max_seqlen_k must be an int"),
    ("max_seqlen_q bool", call_forward(max_seqlen_q=True), TypeError, "max_seqlen_q must be an int"),
    ("q 4-D", call_forward(q=lambda x: x[None]), ValueError,
     r"q must have 3 dimensions \(total_tokens, nheads, headdim\)"),
    ("k 2-D", call_forward(k=lambda x: x[:, 0]), ValueError, "k must have 3 dimensions"),
    ("k/v tokens differ", call_forward(v=lambda x: x[:3]), ValueError,
     r"k and v must have the same \(total_tokens, nheads\)"),
    ("headdim differs", call_forward(q=lambda x: x[..., :4]), ValueError, "q and k must have the same headdim"),
    ("nheads not a multiple", call_forward(q=lambda x: np.concatenate([x, x[:, :1]], axis=1),
                                           k=lambda x: np.concatenate([x, x], axis=1),
                                           v=lambda x: np.concatenate([x, x], axis=1)),
     ValueError, r"nheads of q \(3\) must be a multiple of nheads of k/v \(2\)"),
    ("dtype differs", call_forward(v=lambda x: x.astype(np.float64)), TypeError, "v has dtype float64"),
    ("int q", call_forward(q=lambda x: x.astype(np.int32)), TypeError, "q has dtype int32"),
    ("causal not bool", call_forward(causal=1), TypeError, "causal must be a bool"),
    ("bad window", call_forward(window_size=(-2, 0)), ValueError, "window_size must be a pair"),
    ("softcap negative", call_forward(softcap=-1.0), ValueError, "softcap must be a finite float >= 0"),
    ("slopes shape", call_forward(alibi_slopes=np.ones(5, np.float32)), ValueError, "alibi_slopes must have shape"),
    ("sink dtype", call_forward(sink=np.ones(2, np.float64)), TypeError, "sink must be float32"),
    ("softcap string", call_forward(softcap="0"), TypeError, "softcap must be a real number"),
    ("scale nan", call_forward(softmax_scale=np.nan), ValueError, "softmax_scale must be finite"),
]


@pytest.mark.parametrize("label,call,error,message", FORWARD_ERRORS, ids=[c[0] for c in FORWARD_ERRORS])
def test_forward_rejects(label, call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_unknown_backend_is_rejected():
    arguments, _ = packed()
    with pytest.raises(ValueError, match="backend must be one of"):
        cupyflash.flash_attn_varlen_func(*arguments.values(), backend="triton")


def backward_arguments():
    arguments, do = packed()
    o, lse = cupyflash.flash_attn_varlen_func(*arguments.values(), return_lse=True, backend="numpy")
    return dict(do=do, q=arguments["q"], k=arguments["k"], v=arguments["v"], o=o, lse=lse), arguments


BACKWARD_ERRORS = [
    ("do wrong shape", "do", lambda x: x[:4], ValueError, "do must have the output's shape"),
    ("o wrong dtype", "o", lambda x: x.astype(np.float16), TypeError, "o has dtype float16"),
    ("lse dense layout", "lse", lambda x: x[None], ValueError,
     r"lse must have shape \(nheads, total_q\) = \(2, 5\), flash-attn's varlen layout"),
    ("lse transposed", "lse", lambda x: np.ascontiguousarray(x.T), ValueError,
     r"lse must have shape \(nheads, total_q\)"),
    ("lse float64", "lse", lambda x: x.astype(np.float64), TypeError, "lse must have dtype float32"),
]


@pytest.mark.parametrize("label,name,change,error,message", BACKWARD_ERRORS, ids=[c[0] for c in BACKWARD_ERRORS])
def test_backward_rejects(label, name, change, error, message):
    arrays, arguments = backward_arguments()
    arrays[name] = change(arrays[name])
    sequences = [arguments[n] for n in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")]
    with pytest.raises(error, match=message):
        cupyflash.flash_attn_varlen_backward(*arrays.values(), *sequences, backend="numpy")


def test_backward_checks_the_sequences_too():
    arrays, arguments = backward_arguments()
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        cupyflash.flash_attn_varlen_backward(*arrays.values(), arguments["cu_seqlens_q"],
                                             np.array([0, 5, 4, 7], np.int32), 3, 5, backend="numpy")
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        cupyflash.flash_attn_varlen_backward(*arrays.values(), *list(arguments.values())[3:], backend="numpy",
                                             deterministic="yes")


def test_gpu_backend_without_device_says_so():
    if cupyflash.gpu_available():
        pytest.skip("a GPU is present")
    arguments, _ = packed()
    with pytest.raises(RuntimeError, match=r"^backend='cuda'.* CUDA device"):
        cupyflash.flash_attn_varlen_func(*arguments.values(), backend="cuda")


# --- the strategy reaches the edges it promises ----------------------------------------------------

@pytest.mark.parametrize("edge", [lambda p: 0 in p.seqlens_q, lambda p: 1 in p.seqlens_k, lambda p: p.group > 1],
                         ids=["empty sequence", "single key", "GQA"])
def test_strategy_draws_the_edges(edge):
    from hypothesis import Phase, find, settings

    quick = settings(phases=[Phase.generate], database=None, max_examples=500)  # found, not shrunk
    problem = find(varlen_problems(max_cost=CPU_COST), edge, settings=quick)
    assert problem.cu_seqlens_q.dtype == np.int32 and problem.cu_seqlens_q[-1] == problem.q_shape[0]


@pytest.mark.parametrize("bad,match", [(dict(min_batch=3, max_batch=2), "min_batch"),
                                       (dict(magnitudes=(0.0, 1.0)), "magnitudes must be positive"),
                                       (dict(dtypes=[]), "dtypes is empty")])
def test_strategy_rejects_bad_bounds(bad, match):
    with pytest.raises(ValueError, match=match):
        varlen_problems(**bad)


def ragged_batch(rng, seqlens_q, seqlens_k, h: int, hkv: int, d: int):
    """(cu_q, cu_k, q, k, v, do) of a packed float64 batch with these lengths, drawn from ``rng``."""
    cu_q = np.concatenate([[0], np.cumsum(seqlens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(seqlens_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], h, d))
    k, v = (rng.standard_normal((cu_k[-1], hkv, d)) for _ in range(2))
    return cu_q, cu_k, q, k, v, rng.standard_normal(q.shape)


def forward_and_backward(inputs, sequences, call):
    """(o, lse, (dq, dk, dv)) of flash_attn_varlen_func and its backward with the same options."""
    q, k, v, do = inputs
    o, lse = cupyflash.flash_attn_varlen_func(q, k, v, *sequences, return_lse=True, **call)
    return o, lse, cupyflash.flash_attn_varlen_backward(do, q, k, v, o, lse, *sequences, **call)


def sequences_with_queries(cu_q, cu_k):
    """(b, query rows, key rows) of each sequence that has queries."""
    for b in range(len(cu_q) - 1):
        if cu_q[b + 1] > cu_q[b]:
            yield b, slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])


def _assert_sequence_is_the_reference(inputs, results, qs, ks, kw):
    """The packed (o, lse, dq, dk, dv) rows of one sequence (queries qs, keys ks) against the dense
    float64 reference of that sequence with options ``kw``; returns the reference's gradients."""
    q, k, v, do = inputs
    o, lse, dq, dk, dv = results
    o_ref, lse_ref = reference.attention(q[None, qs], k[None, ks], v[None, ks], **kw)
    np.testing.assert_allclose(o[qs], o_ref[0], atol=1e-12)
    np.testing.assert_allclose(lse[:, qs], lse_ref[0], atol=1e-12)
    grads = reference.attention_backward(do[None, qs], q[None, qs], k[None, ks], v[None, ks], **kw)
    for got, want in zip((dq[qs], dk[ks], dv[ks]), grads[:3]):
        np.testing.assert_allclose(got, want[0], atol=1e-10)
    return grads


@pytest.mark.parametrize("causal", [False, True])
def test_variants_apply_per_sequence(causal):
    """softcap, ALiBi slopes per sequence ((batch, nheads): row b for sequence b) and a sink, in
    the forward and the backward (dsink summed over every sequence), against the dense float64
    reference of each sequence."""
    rng = np.random.default_rng(7)
    seqlens_q, seqlens_k, h, hkv, d = (3, 0, 5, 2), (4, 2, 6, 0), 4, 2, 8
    cu_q, cu_k, q, k, v, do = ragged_batch(rng, seqlens_q, seqlens_k, h, hkv, d)
    variant = dict(softcap=4.0, alibi_slopes=rng.uniform(0, 1, (4, h)).astype(np.float32),
                   sink=rng.standard_normal(h).astype(np.float32))
    sequences = (cu_q, cu_k, max(seqlens_q), max(seqlens_k))
    o, lse = cupyflash.flash_attn_varlen_func(q, k, v, *sequences, causal=causal, return_lse=True,
                                              backend="numpy", **variant)
    dq, dk, dv, dsink = cupyflash.flash_attn_varlen_backward(do, q, k, v, o, lse, *sequences, causal=causal,
                                                             backend="numpy", **variant)
    dsink_ref = np.zeros(h)
    for b in range(4):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        kw = dict(causal=causal, softcap=4.0, alibi_slopes=variant["alibi_slopes"][b], sink=variant["sink"])
        dsink_ref += _assert_sequence_is_the_reference((q, k, v, do), (o, lse, dq, dk, dv), qs, ks, kw)[3]
    np.testing.assert_allclose(dsink, dsink_ref, rtol=1e-5, atol=1e-6)  # dsink is float32


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_applies_per_sequence(causal):
    """dropout_p, seed, offset: sequence b draws batch entry b's mask of a dense call with its own
    lengths (cupyflash.dropout.dropout_mask(1, ..., first_sequence=b)), in the forward and the
    backward, against the dense float64 reference of each sequence given that mask; the vjp draws
    one seed for both directions, and the backward needs the forward's."""
    from cupyflash.dropout import dropout_mask

    rng = np.random.default_rng(11)
    seqlens_q, seqlens_k, h, hkv, d = (3, 0, 21, 17, 2), (4, 2, 30, 19, 0), 4, 2, 8
    cu_q, cu_k, q, k, v, do = ragged_batch(rng, seqlens_q, seqlens_k, h, hkv, d)
    p, seed, offset = 0.3, 2**40 + 5, 7
    sequences = (cu_q, cu_k, max(seqlens_q), max(seqlens_k))
    call = dict(causal=causal, dropout_p=p, seed=seed, offset=offset, backend="numpy")
    o, lse, (dq, dk, dv) = forward_and_backward((q, k, v, do), sequences, call)
    masks_differ = False
    for b, qs, ks in sequences_with_queries(cu_q, cu_k):
        mask = dropout_mask(1, h, seqlens_q[b], seqlens_k[b], p, seed, offset, first_sequence=b)
        masks_differ |= seqlens_k[b] > 0 and not np.array_equal(
            mask, dropout_mask(1, h, seqlens_q[b], seqlens_k[b], p, seed, offset))
        kw = dict(causal=causal, dropout_p=p, dropout_mask=mask)
        _assert_sequence_is_the_reference((q, k, v, do), (o, lse, dq, dk, dv), qs, ks, kw)
    assert masks_differ  # sequence b > 0 is not sequence 0's mask
    with pytest.raises(ValueError, match="needs the forward's seed"):
        cupyflash.flash_attn_varlen_backward(do, q, k, v, o, lse, *sequences, causal=causal, dropout_p=p,
                                             backend="numpy")
    # the vjp (recomputed statistics for float64) with the same seed: the gradients checked above
    o_vjp, vjp = cupyflash.flash_attn_varlen_vjp(q, k, v, *sequences, causal=causal, dropout_p=p, seed=seed,
                                                 offset=offset, backend="numpy")
    np.testing.assert_array_equal(o_vjp, o)
    for got, want in zip(vjp(do), (dq, dk, dv)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    # without a seed it draws one, a mask of its own
    o_drawn, _ = cupyflash.flash_attn_varlen_vjp(q, k, v, *sequences, causal=causal, dropout_p=p, backend="numpy")
    assert not np.array_equal(o_drawn, o)


def test_dropout_mask_of_a_later_sequence_is_the_batch_entry():
    from cupyflash.dropout import dropout_mask

    batch = dropout_mask(3, 2, 20, 24, 0.4, seed=9, offset=1)
    for b in range(3):
        assert np.array_equal(dropout_mask(1, 2, 20, 24, 0.4, seed=9, offset=1, first_sequence=b)[0], batch[b])


@pytest.mark.parametrize("causal", [False, True])
def test_user_modifiers_apply_per_sequence(causal):
    """score_mod and mask_mod in a packed batch see each sequence as batch entry b of a dense call:
    b is the sequence (a slope per (sequence, head), documents per sequence), q_idx and kv_idx
    count from its first row, and the block map is made for (batch, nheads, max_seqlen_q,
    max_seqlen_k). Forward, backward and the vjp (one block map for both) against the dense
    float64 reference of each sequence given its rows of the modifiers' tensors."""
    import modifier_zoo as zoo

    rng = np.random.default_rng(13)
    seqlens_q, seqlens_k, h, hkv, d = (3, 0, 21, 17, 2), (4, 2, 30, 19, 0), 4, 2, 8
    cu_q, cu_k, q, k, v, do = ragged_batch(rng, seqlens_q, seqlens_k, h, hkv, d)
    slopes = rng.uniform(0.05, 0.5, (len(seqlens_q), h)).astype(np.float32)
    doc_q = zoo.document_ids(rng, len(seqlens_q), max(seqlens_q), 3)
    doc_k = zoo.document_ids(rng, len(seqlens_q), max(seqlens_k), 3)
    score_mod = cupyflash.ScoreMod(zoo.sequence_bias, slopes=slopes)
    mask_mod = cupyflash.MaskMod(zoo.documents, doc_q=doc_q, doc_k=doc_k)
    sequences = (cu_q, cu_k, max(seqlens_q), max(seqlens_k))
    call = dict(causal=causal, score_mod=score_mod, mask_mod=mask_mod, backend="numpy")
    o, lse, (dq, dk, dv) = forward_and_backward((q, k, v, do), sequences, call)
    sees_another_document = False
    for b, qs, ks in sequences_with_queries(cu_q, cu_k):
        # sequence b alone: its rows of the tensors are batch entry 0 of a dense call
        kw = dict(causal=causal, score_mod=cupyflash.ScoreMod(zoo.sequence_bias, slopes=slopes[b:b + 1]),
                  mask_mod=cupyflash.MaskMod(zoo.documents, doc_q=doc_q[b:b + 1], doc_k=doc_k[b:b + 1]))
        _assert_sequence_is_the_reference((q, k, v, do), (o, lse, dq, dk, dv), qs, ks, kw)
        sees_another_document |= len(set(doc_q[b, :seqlens_q[b]]) | set(doc_k[b, :seqlens_k[b]])) > 1
    assert sees_another_document  # the mask hides something
    # the vjp makes the block map once, for both directions: the same results
    o_vjp, vjp = cupyflash.flash_attn_varlen_vjp(q, k, v, *sequences, **call)
    np.testing.assert_array_equal(o_vjp, o)
    for got, want in zip(vjp(do), (dq, dk, dv)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    # a block_mask made for the call's shape is taken; one made for another is refused
    made = cupyflash.create_block_mask(mask_mod, len(seqlens_q), h, max(seqlens_q), max(seqlens_k), device="cpu")
    o_made = cupyflash.flash_attn_varlen_func(q, k, v, *sequences, causal=causal, score_mod=score_mod,
                                              block_mask=made, backend="numpy")
    np.testing.assert_array_equal(o_made, o)
    other = cupyflash.create_block_mask(mask_mod, len(seqlens_q) - 1, h, max(seqlens_q), max(seqlens_k), device="cpu")
    with pytest.raises(ValueError, match="block_mask was made for"):
        cupyflash.flash_attn_varlen_func(q, k, v, *sequences, block_mask=other, backend="numpy")


# --- the order the packed launch issues its sequences in (varlen.issue_order) ----------------------

def _sequences(lengths_q, lengths_k, read=True):
    from cupyflash.varlen import check_sequences

    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    sequences = check_sequences(cu_q, cu_k, max(lengths_q, default=0), max(lengths_k, default=0),
                                int(cu_q[-1]), int(cu_k[-1]))
    return sequences if read else sequences._replace(cu_q=None, cu_k=None)


def test_issue_order_puts_the_most_pairs_first_and_keeps_ties_in_batch_order():
    from cupyflash.varlen import issue_order

    order = issue_order(_sequences([10, 300, 7, 300, 0, 64], [10, 200, 900, 200, 5, 64]))
    # pairs 100, 60000, 6300, 60000, 0, 4096: the two 60000s in batch order, the empty one last
    assert order.dtype == np.int32 and order.tolist() == [1, 3, 2, 5, 0, 4]


@pytest.mark.parametrize("lengths_q,lengths_k,read", [
    ([5, 4, 4, 0], [5, 4, 4, 1], True),   # already non-increasing: batch order, nothing uploaded
    ([3], [9], True),                      # one sequence
    ([], [], True),                        # none
    ([1, 500], [1, 500], False),           # lengths unread (capture): the kernels' batch order
], ids=["sorted", "one", "empty", "unread"])
def test_issue_order_is_none_where_the_grid_keeps_batch_order(lengths_q, lengths_k, read):
    from cupyflash.varlen import issue_order

    assert issue_order(_sequences(lengths_q, lengths_k, read)) is None


def test_issue_order_is_a_permutation(seed=0):
    from cupyflash.varlen import issue_order

    rng = np.random.default_rng(seed)
    for _ in range(50):
        n = int(rng.integers(2, 40))
        lengths_q, lengths_k = (rng.integers(0, 200, n).tolist() for _ in range(2))
        order = issue_order(_sequences(lengths_q, lengths_k))
        order = np.arange(n) if order is None else order
        assert sorted(order.tolist()) == list(range(n))
        pairs = np.asarray(lengths_q, np.int64)[order] * np.asarray(lengths_k, np.int64)[order]
        assert (np.diff(pairs) <= 0).all()


def test_set_packed_checks_the_sequence_order():
    from cupyflash.kernels.params import FWD_PARAMS, PackedBatch, set_packed

    params = np.zeros((), FWD_PARAMS)
    set_packed(params, None)  # a dense batch: the three pointers stay null
    assert int(params["sequence_order"]) == int(params["cu_seqlens_q"]) == 0

    class FakeDevice:  # what set_packed reads of a CuPy array, without a device
        def __init__(self, shape, dtype=np.int32, ptr=4096):
            self.shape, self.dtype = shape, np.dtype(dtype)
            self.flags = type("Flags", (), {"c_contiguous": True})()
            self.data = type("Data", (), {"ptr": ptr})()

    cu = FakeDevice((4,), ptr=256)
    set_packed(params, PackedBatch(cu, cu, 5, 5, FakeDevice((3,), ptr=512)))
    assert int(params["sequence_order"]) == 512 and int(params["cu_seqlens_k"]) == 256
    for bad, match in ((FakeDevice((4,)), "one entry per sequence"), (FakeDevice((3,), np.int64), "int32")):
        with pytest.raises(ValueError, match=match):
            set_packed(params, PackedBatch(cu, cu, 5, 5, bad))


def test_the_varlen_bench_table_shows_the_issue_orders_ab_and_reads_older_runs():
    from cupyflash.bench.varlen import table

    row = {"headdim": 64, "causal": True}
    for mode, scale in (("fwd", 1.0), ("bwd", 0.7)):
        row.update({f"varlen_{mode}_tflops": 300 * scale, f"varlen_device_cu_{mode}_tflops": 250 * scale,
                    f"dense_one_{mode}_tflops": 330 * scale, f"dense_mean_{mode}_tflops": 310 * scale})
    older = table({"rows": [row]})  # a run from before varlen-v2 has no batch-order timing
    assert "| 300.0 | - | - | 250.0 |" in older
    row.update(varlen_batch_order_fwd_tflops=280.0, varlen_batch_order_bwd_tflops=200.0)
    assert "| 300.0 | 280.0 | 1.071 | 250.0 |" in table({"rows": [row]})

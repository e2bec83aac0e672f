"""Packed variable-length batches on the GPU: flash_attn_varlen_func and its backward through every
kernel family (SIMT for every dtype, tensor cores for 16-bit) against the float64 reference under
the tolerance rule, ragged lengths with zeros and ones, GQA, causal and windows, outputs poisoned
with NaN; the score variants sequence by sequence against the dense reference. The GPU path is
one launch per kernel for the whole batch (the Packed mask policies, kernels reading cu_seqlens).
Marker ``gpu``."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings

import cupyflash
from cupyflash.testing import VarlenProblem, assert_varlen_close, poisoned_outputs
from cupyflash.testing.strategies import varlen_problems

pytestmark = pytest.mark.gpu

SIXTEEN_BIT = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]
ALL_DTYPES = SIXTEEN_BIT + [np.dtype(np.float32), np.dtype(np.float64)]
GPU_COST = 8e6  # the reference and baselines still run on the CPU
# Examples per property: each one is a float64 reference per sequence on the CPU, so fewer than
# the dense properties' 200 keep these files to a few minutes of device time.
EXAMPLES = 60


def run_on_device(problem, backend, deterministic=True, device_cu_seqlens=True):
    import cupy

    q, k, v, do = (cupy.asarray(x) for x in problem.arrays())
    cu_q, cu_k, max_q, max_k = problem.sequences
    if device_cu_seqlens:
        cu_q, cu_k = cupy.asarray(cu_q), cupy.asarray(cu_k)
    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True,
                                                  backend=backend, **problem.kwargs)
        grads = cupyflash.flash_attn_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, backend=backend,
                                                     deterministic=deterministic, **problem.kwargs)
    assert isinstance(o, cupy.ndarray) and isinstance(lse, cupy.ndarray)
    return o, lse, grads


def problems(dtypes, **options):
    """Packed batches of ``dtypes`` up to 300 tokens a sequence within the GPU cost."""
    return varlen_problems(dtypes=dtypes, max_seqlen=300, max_cost=GPU_COST, **options)


def check_on_device(problem, backend, **options):
    o, lse, grads = run_on_device(problem, backend, **options)
    assert_varlen_close(problem, o, lse, grads)


@settings(max_examples=EXAMPLES)
@given(problem=problems(ALL_DTYPES, windows=True, max_headdim=256))
def test_simt_matches_the_reference(problem):
    check_on_device(problem, "simt")


@settings(max_examples=EXAMPLES)
@given(problem=problems(SIXTEEN_BIT, windows=True, max_headdim=256))
def test_tensor_cores_match_the_reference(problem):
    check_on_device(problem, "mma")


@settings(max_examples=EXAMPLES // 2)
@given(problem=problems([np.dtype(np.float64)], windows=True, max_headdim=256))
def test_auto_float64_matches_the_reference(problem):
    """float64's default: the packed DMMA forward up to d128, SIMT past it; the SIMT backward."""
    check_on_device(problem, "auto")


@settings(max_examples=EXAMPLES // 2)
@given(problem=problems(SIXTEEN_BIT))
def test_atomic_dq_backward_matches_the_reference(problem):
    check_on_device(problem, "mma", deterministic=False, device_cu_seqlens=False)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_numpy_arrays_are_computed_on_the_device_and_come_back(dtype):
    problem = VarlenProblem((0, 1, 65, 200, 3), (7, 1, 129, 200, 0), nheads_kv=2, group=4, headdim=72, causal=True,
                            softmax_scale=None, magnitude=1.0, dtype=dtype, seed=11, window_size=(64, -1))
    q, k, v, do = problem.arrays()
    o, vjp = cupyflash.flash_attn_varlen_vjp(q, k, v, *problem.sequences, **problem.kwargs)
    grads = vjp(do)
    assert isinstance(o, np.ndarray) and all(isinstance(g, np.ndarray) for g in grads)
    assert_varlen_close(problem, o, grads=grads)


def test_many_sequences_of_one_token():
    """Decode-shaped packing: 300 sequences of one query over ragged keys."""
    rng = np.random.default_rng(5)
    seqlens_k = tuple(int(n) for n in rng.integers(0, 40, 300))
    problem = VarlenProblem((1,) * 300, seqlens_k, nheads_kv=1, group=8, headdim=64, causal=True,
                            softmax_scale=None, magnitude=1.0, dtype=ml_dtypes.bfloat16, seed=3)
    o, lse, grads = run_on_device(problem, "cuda")
    assert_varlen_close(problem, o, lse, grads)


def _check_sequences_against_dense_reference(problem, o, lse, grads, variant, slopes, masks=None, modifiers=None):
    """Each non-empty sequence of a packed result against the dense float64 reference with its own
    variant (its row of (batch, nheads) ALiBi slopes; ``masks(b, seqlen_q, seqlen_k)``: its
    dropout mask; ``modifiers(b)``: its score_mod / mask_mod as a dense batch of one): sequences
    are independent problems."""
    from cupyflash.testing import AttentionProblem, assert_attention_close

    q, k, v, do = problem.arrays()
    o, lse = cupy_get(o), cupy_get(lse)
    grads = [cupy_get(g) for g in grads]
    for b, (queries, keys) in enumerate(problem.ranges()):
        if queries.stop == queries.start or keys.stop == keys.start:
            continue
        dense = AttentionProblem(1, queries.stop - queries.start, keys.stop - keys.start, problem.nheads_kv,
                                 problem.group, problem.headdim, problem.causal, problem.softmax_scale,
                                 problem.magnitude, problem.dtype, problem.seed, problem.window_size)
        sequence_variant = dict(variant)
        if slopes is not None:
            sequence_variant["alibi_slopes"] = slopes[b:b + 1]
        if masks is not None:
            sequence_variant["dropout_mask"] = masks(b, dense.seqlen_q, dense.seqlen_k)
        if modifiers is not None:
            sequence_variant.update(modifiers(b))
        assert_attention_close(dense, o[None, queries], lse[None, :, queries],
                               (grads[0][None, queries], grads[1][None, keys], grads[2][None, keys]),
                               inputs=(q[None, queries], k[None, keys], v[None, keys], do[None, queries]),
                               variant=sequence_variant)


def cupy_get(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


@pytest.mark.parametrize("backend,dtype", [("mma", ml_dtypes.bfloat16), ("mma", np.float16), ("simt", np.float32),
                                           ("simt", np.float64)], ids=str)
@pytest.mark.parametrize("variant", ["softcap", "alibi", "softcap+alibi"])
def test_score_variants_per_sequence(backend, dtype, variant):
    """softcap and ALiBi ((batch, nheads) slopes: row b for sequence b, its diagonal the sequence's
    own) through the packed kernels, each sequence against the dense reference."""
    import cupy

    problem = VarlenProblem((0, 1, 65, 200, 3, 130), (7, 1, 129, 200, 0, 64), nheads_kv=2, group=2, headdim=64,
                            causal=True, softmax_scale=None, magnitude=1.0, dtype=dtype, seed=17,
                            window_size=(96, -1))
    rng = np.random.default_rng(2)
    slopes = rng.uniform(0.01, 0.5, (problem.batch, problem.nheads_kv * problem.group)).astype(np.float32)
    kwargs = {}
    if "softcap" in variant:
        kwargs["softcap"] = 8.0
    q, k, v, do = (cupy.asarray(x) for x in problem.arrays())
    cu_q, cu_k, max_q, max_k = problem.sequences
    call = dict(kwargs, alibi_slopes=cupy.asarray(slopes)) if "alibi" in variant else kwargs
    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_varlen_func(q, k, v, cupy.asarray(cu_q), cupy.asarray(cu_k), max_q, max_k,
                                                  return_lse=True, backend=backend, **problem.kwargs, **call)
        grads = cupyflash.flash_attn_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, backend=backend,
                                                     **problem.kwargs, **call)
    _check_sequences_against_dense_reference(problem, o, lse, grads, kwargs,
                                             slopes if "alibi" in variant else None)


@pytest.mark.parametrize("backend,dtype", [("mma", ml_dtypes.bfloat16), ("mma", np.float16), ("simt", np.float32),
                                           ("simt", np.float64), ("auto", np.float64)], ids=str)
@pytest.mark.parametrize("deterministic", [True, False])
def test_dropout_per_sequence(backend, dtype, deterministic):
    """dropout_p through the packed kernels (one launch: each CTA's sequence index picks its mask),
    each sequence against the dense reference given batch entry b's mask of a call with its
    lengths (cupyflash.dropout.dropout_mask(..., first_sequence=b)); "auto" float64 is the DMMA
    forward and the SIMT backward."""
    import cupy

    from cupyflash.dropout import dropout_mask

    problem = VarlenProblem((0, 1, 65, 200, 3, 130), (7, 1, 129, 200, 0, 64), nheads_kv=2, group=2, headdim=64,
                            causal=True, softmax_scale=None, magnitude=1.0, dtype=dtype, seed=19,
                            window_size=(96, -1))
    p, seed, offset = 0.2, 2**33 + 17, 3
    call = dict(dropout_p=p, seed=seed, offset=offset)
    q, k, v, do = (cupy.asarray(x) for x in problem.arrays())
    cu_q, cu_k, max_q, max_k = problem.sequences
    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_varlen_func(q, k, v, cupy.asarray(cu_q), cupy.asarray(cu_k), max_q, max_k,
                                                  return_lse=True, backend=backend, **problem.kwargs, **call)
        grads = cupyflash.flash_attn_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, backend=backend,
                                                     deterministic=deterministic, **problem.kwargs, **call)
    nheads = problem.nheads_kv * problem.group
    _check_sequences_against_dense_reference(
        problem, o, lse, grads, {"dropout_p": p}, None,
        masks=lambda b, sq, sk: dropout_mask(1, nheads, sq, sk, p, seed, offset, first_sequence=b))


@pytest.mark.parametrize("backend,dtype,deterministic", [
    ("mma", ml_dtypes.bfloat16, True), ("mma", ml_dtypes.bfloat16, False), ("mma", np.float16, True),
    ("simt", np.float32, True), ("auto", np.float32, True), ("simt", np.float64, True), ("auto", np.float64, True)],
    ids=str)
def test_user_modifiers_per_sequence(backend, dtype, deterministic):
    """score_mod and mask_mod through the packed kernels (one launch; each CTA's sequence is b, its
    indices count from the sequence's first row, its block map the sequence's): a slope per
    (sequence, head) and documents per sequence, with causal and a window, each sequence against
    the dense reference given its rows of the modifiers' tensors. "auto" float32 is the tf32
    forward, float64 the DMMA forward; the backward runs with the same modifiers."""
    import cupy

    import modifier_zoo as zoo

    problem = VarlenProblem((0, 1, 65, 200, 3, 130), (7, 1, 129, 200, 0, 64), nheads_kv=2, group=2, headdim=64,
                            causal=True, softmax_scale=None, magnitude=1.0, dtype=dtype, seed=29,
                            window_size=(150, -1))
    rng = np.random.default_rng(5)
    cu_q, cu_k, max_q, max_k = problem.sequences
    nheads = problem.nheads_kv * problem.group
    slopes = rng.uniform(0.005, 0.05, (problem.batch, nheads)).astype(np.float32)
    doc_q = zoo.document_ids(rng, problem.batch, max_q, 3)
    doc_k = zoo.document_ids(rng, problem.batch, max_k, 3)
    call = dict(score_mod=cupyflash.ScoreMod(zoo.sequence_bias, slopes=cupy.asarray(slopes)),
                mask_mod=cupyflash.MaskMod(zoo.documents, doc_q=cupy.asarray(doc_q), doc_k=cupy.asarray(doc_k)))
    q, k, v, do = (cupy.asarray(x) for x in problem.arrays())
    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_varlen_func(q, k, v, cupy.asarray(cu_q), cupy.asarray(cu_k), max_q, max_k,
                                                  return_lse=True, backend=backend, **problem.kwargs, **call)
        grads = cupyflash.flash_attn_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, backend=backend,
                                                     deterministic=deterministic, **problem.kwargs, **call)

    def modifiers(b):
        return {"score_mod": cupyflash.ScoreMod(zoo.sequence_bias, slopes=slopes[b:b + 1]),
                "mask_mod": cupyflash.MaskMod(zoo.documents, doc_q=doc_q[b:b + 1], doc_k=doc_k[b:b + 1])}

    _check_sequences_against_dense_reference(problem, o, lse, grads, {}, None, modifiers=modifiers)


@pytest.mark.parametrize("backend", ["mma", "simt"])
def test_dropout_with_no_keys_anywhere(backend):
    """A batch whose sequences have no keys computes nothing (o = 0, lse = -inf, zero gradients)
    with dropout as without it."""
    import cupy

    q = cupy.asarray(np.random.default_rng(0).standard_normal((5, 2, 64)).astype(ml_dtypes.bfloat16))
    k = v = cupy.zeros((0, 2, 64), ml_dtypes.bfloat16)
    cu_q, cu_k = np.array([0, 2, 5], np.int32), np.array([0, 0, 0], np.int32)
    o, lse = cupyflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 0, dropout_p=0.3, seed=1, return_lse=True,
                                              backend=backend)
    assert not cupy.asarray(o, np.float32).any() and bool(cupy.isneginf(lse).all())
    grads = cupyflash.flash_attn_varlen_backward(cupy.ones_like(q), q, k, v, o, lse, cu_q, cu_k, 3, 0, dropout_p=0.3,
                                                 seed=1, backend=backend)
    assert not cupy.asarray(grads[0], np.float32).any()


@pytest.mark.parametrize("backend", ["mma", "simt"])
def test_a_sink_per_sequence(backend):
    """The sink's lse (a sequence without keys: lse = sink) and dsink summed over every sequence,
    against the per-sequence path of the dense API."""
    import cupy

    problem = VarlenProblem((4, 0, 70, 9), (4, 5, 70, 0), nheads_kv=1, group=4, headdim=64, causal=False,
                            softmax_scale=None, magnitude=1.0, dtype=ml_dtypes.bfloat16, seed=23)
    sink = cupy.asarray(np.array([0.5, -1.0, 2.0, 0.0], np.float32))
    q, k, v, do = (cupy.asarray(x) for x in problem.arrays())
    cu_q, cu_k, max_q, max_k = problem.sequences
    o, lse = cupyflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, sink=sink, return_lse=True,
                                              backend=backend)
    *grads, dsink = cupyflash.flash_attn_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, sink=sink,
                                                         backend=backend)
    dsink_want = 0.0
    for queries, keys in problem.ranges():
        if queries.stop == queries.start:
            continue
        o_b, lse_b = cupyflash.flash_attn_func(q[None, queries], k[None, keys], v[None, keys], sink=sink,
                                               return_lse=True, backend=backend)
        # the dense call may take another kernel (a decode-shaped one the KV-cache kernel): the
        # same values up to the dtype's rounding, not the same bits
        np.testing.assert_allclose(cupy_get(o[queries]).astype(np.float32), cupy_get(o_b[0]).astype(np.float32),
                                   rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(cupy_get(lse[:, queries]), cupy_get(lse_b[0]), rtol=1e-5, atol=1e-5)
        *_, dsink_b = cupyflash.flash_attn_backward(do[None, queries], q[None, queries], k[None, keys],
                                                    v[None, keys], o_b, lse_b, sink=sink, backend=backend)
        dsink_want = dsink_want + dsink_b
    np.testing.assert_allclose(cupy_get(dsink), cupy_get(dsink_want), rtol=2e-2, atol=2e-2)
    assert all(bool(cupy.isfinite(g).all()) for g in grads)


def test_one_launch_per_kernel(monkeypatch):
    """The packed path launches each kernel once for the whole batch, whatever its sequence count."""
    import cupy

    from cupyflash.kernels import _module, mma_bwd, mma_fwd

    launched = []
    real = _module.launch

    def counting(spec, grid, args):
        launched.append((spec.name, grid))
        return real(spec, grid, args)

    for module in (mma_fwd, mma_bwd):
        monkeypatch.setattr(module, "launch", counting)
    problem = VarlenProblem((3,) * 40, (9,) * 40, nheads_kv=2, group=2, headdim=64, causal=True, softmax_scale=None,
                            magnitude=1.0, dtype=ml_dtypes.bfloat16, seed=4)
    q, k, v, do = (cupy.asarray(x) for x in problem.arrays())
    o, lse = cupyflash.flash_attn_varlen_func(q, k, v, *problem.sequences, causal=True, return_lse=True,
                                              backend="mma")
    cupyflash.flash_attn_varlen_backward(do, q, k, v, o, lse, *problem.sequences, causal=True, backend="mma")
    attention = [(name, grid) for name, grid in launched if "packed" in name]
    assert len(attention) == len([n for n, _ in launched if "preprocess" not in n and "convert" not in n]) >= 2
    assert all(grid[2] == 40 for _, grid in attention)


@pytest.mark.parametrize("backend,dtype", [("mma", ml_dtypes.bfloat16), ("simt", np.float32), ("auto", np.float64),
                                           ("auto", np.float32)], ids=str)
def test_the_issue_order_changes_no_bit(monkeypatch, backend, dtype):
    """The packed launch issues its sequences most pairs first (varlen.issue_order; slot z runs
    sequence order[z]): the same call in batch order gives the same bits, with everything a CTA
    keys by its sequence (ALiBi slopes, dropout's stream, a user mask's block map, the score_mod's
    tensors) and a deterministic backward. A kernel that took its slot for its sequence anywhere
    would read another sequence's slope, mask or block map here."""
    import cupy

    import modifier_zoo as zoo
    from cupyflash import varlen

    problem = VarlenProblem((0, 1, 65, 200, 3, 130), (7, 1, 129, 200, 0, 64), nheads_kv=2, group=2, headdim=64,
                            causal=True, softmax_scale=None, magnitude=1.0, dtype=dtype, seed=31,
                            window_size=(150, -1))
    cu_q, cu_k, max_q, max_k = problem.sequences
    nheads = problem.nheads_kv * problem.group
    rng = np.random.default_rng(6)
    doc_q, doc_k = zoo.document_ids(rng, problem.batch, max_q, 3), zoo.document_ids(rng, problem.batch, max_k, 3)
    slopes = cupy.asarray(rng.uniform(0.005, 0.05, (problem.batch, nheads)).astype(np.float32))
    calls = [dict(alibi_slopes=slopes, dropout_p=0.15, seed=2**31 + 5, offset=7),
             dict(score_mod=cupyflash.ScoreMod(zoo.sequence_bias, slopes=slopes),
                  mask_mod=cupyflash.MaskMod(zoo.documents, doc_q=cupy.asarray(doc_q), doc_k=cupy.asarray(doc_k)))]
    q, k, v, do = (cupy.asarray(x) for x in problem.arrays())
    # pairs per sequence 0, 1, 8385, 40000, 0, 8320: the order is not batch order
    assert varlen.issue_order(varlen.check_sequences(cu_q, cu_k, max_q, max_k, int(cu_q[-1]),
                                                     int(cu_k[-1]))).tolist() == [3, 2, 5, 1, 0, 4]
    for call in calls:
        results = []
        for order in ("most pairs first", "batch order"):
            if order == "batch order":
                monkeypatch.setattr(varlen, "issue_order", lambda sequences: None)
            with poisoned_outputs():
                o, lse = cupyflash.flash_attn_varlen_func(q, k, v, cupy.asarray(cu_q), cupy.asarray(cu_k), max_q,
                                                          max_k, return_lse=True, backend=backend,
                                                          **problem.kwargs, **call)
                grads = cupyflash.flash_attn_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k,
                                                             backend=backend, deterministic=True, **problem.kwargs,
                                                             **call)
            results.append([cupy.asnumpy(x) for x in (o, lse, *grads)])
            monkeypatch.undo()
        for name, first, second in zip(("o", "lse", "dq", "dk", "dv"), *results):
            assert np.array_equal(first, second, equal_nan=True), f"{name} differs between issue orders ({call})"
            assert not np.isnan(first).all(), name

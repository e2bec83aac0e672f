"""A V head dimension different from Q/K's (d_v != d_qk, DeepSeek MLA's 192/128) on the CPU.

FA3's semantics: q (batch, seqlen_q, nheads, d_qk), k (batch, seqlen_k, nheads_kv, d_qk), v (batch,
seqlen_k, nheads_kv, d_v); o, do (batch, seqlen_q, nheads, d_v); dq like q, dk like k, dv like v;
the default scale 1/sqrt(d_qk). Here: the float64 reference against a softmax written with einsum
and against finite differences; the NumPy twin through the public API (every option: masks,
windows, GQA, softcap, ALiBi, sinks, dropout, user modifiers, the 'auto' backend, the vjp) against
the reference under tolerance.py's rule, with NaN-poisoned outputs; varlen and the KV cache
(contiguous and paged, the append byte for byte); cupyflash.torch with autograd; and the shape
errors. The same on the GPU kernels: tests/test_headdim_v_gpu.py.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupyflash
from cupyflash import dispatch, reference
from cupyflash.backward_plans import own_forward_statistics
from cupyflash.dropout import dropout_mask
from cupyflash.testing import poisoned_outputs
from brute_force import numerical_gradient
from tolerance import (SIXTEEN_BIT, assert_close, flash_rounding_baseline, max_abs, output_rounding_allowance,
                       references_and_baselines, worse_baseline)
from variants import variant_kwargs
from windows import window_size

BF16 = np.dtype(ml_dtypes.bfloat16)
F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
DTYPES = (F16, BF16, F32, F64)
# (d_qk, d_v): MLA's and its transpose, each side at the extremes, head dims off the multiples of
# 8 the tensor cores want (40, 72; 1, 3), and one narrower V.
HEADDIM_PAIRS = [(192, 128), (128, 192), (64, 256), (256, 64), (40, 72), (8, 256), (1, 3), (128, 64)]
PAIR_IDS = [f"{a}-{b}" for a, b in HEADDIM_PAIRS]
# Head dims worth drawing often: the kernels' head-dim tiles and their neighbours, 1, MLA's.
FAVOURITE_HEADDIMS = (1, 2, 3, 7, 8, 9, 16, 40, 63, 64, 65, 72, 96, 127, 128, 129, 192, 255, 256)


# --- problems ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Problem:
    """q (batch, seqlen_q, nheads_kv * group, d_qk); k (batch, seqlen_k, nheads_kv, d_qk); v (batch,
    seqlen_k, nheads_kv, d_v); do (batch, seqlen_q, nheads, d_v); inputs standard normal times
    ``magnitude``, drawn from ``seed``."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads_kv: int
    group: int
    d_qk: int
    d_v: int
    dtype: np.dtype
    seed: int
    causal: bool = False
    window_size: tuple = (-1, -1)
    softmax_scale: float | None = None
    magnitude: float = 1.0

    @property
    def nheads(self) -> int:
        return self.nheads_kv * self.group

    @property
    def q_shape(self):
        return (self.batch, self.seqlen_q, self.nheads, self.d_qk)

    @property
    def k_shape(self):
        return (self.batch, self.seqlen_k, self.nheads_kv, self.d_qk)

    @property
    def v_shape(self):
        return (self.batch, self.seqlen_k, self.nheads_kv, self.d_v)

    @property
    def o_shape(self):
        return (self.batch, self.seqlen_q, self.nheads, self.d_v)

    @property
    def kwargs(self) -> dict:
        """softmax_scale, causal, window_size: the keywords of flash_attn_func and the reference."""
        return dict(softmax_scale=self.softmax_scale, causal=self.causal, window_size=tuple(self.window_size))

    def arrays(self):
        """(q, k, v, do) of ``dtype``, the same four arrays every call."""
        rng = np.random.default_rng(self.seed)
        return tuple((rng.standard_normal(shape) * self.magnitude).astype(self.dtype)
                     for shape in (self.q_shape, self.k_shape, self.v_shape, self.o_shape))


def problem(d_qk, d_v, dtype=F32, **changes) -> Problem:
    """One batch of 2, GQA (4 query heads on 2 kv heads), 67 queries on 75 keys: both sequence
    lengths cross the twin's 64-row blocks."""
    base = Problem(batch=2, seqlen_q=67, seqlen_k=75, nheads_kv=2, group=2, d_qk=d_qk, d_v=d_v,
                   dtype=np.dtype(dtype), seed=1000 * d_qk + d_v)
    return replace(base, **changes)


def _lse_dtype(dtype):
    return F64 if np.dtype(dtype) == F64 else F32


def _f64(x):
    return np.asarray(x).astype(np.float64)


# --- the check: tolerance.py's rule for o, lse, dq, dk, dv (and dsink) -------------------------------

def check_against_reference(inputs, o, lse, grads=None, *, dtype, options, dsink=None):
    """Shapes and dtypes of FA3's d_v semantics, then o, lse, (dq, dk, dv) and dsink against the
    float64 reference under the tolerance rule (tests/kernel_paths.py's check, with V's head dim).
    ``options``: the reference's keywords (softmax_scale, causal, window_size, the variant's,
    dropout_p and dropout_mask). Arrays may be NumPy or CuPy; rows that see no key must give o = 0
    and dq = 0."""
    from cupyflash.testing import as_numpy

    q, k, v, do = (as_numpy(x) for x in inputs)
    o, lse = as_numpy(o), as_numpy(lse)
    dtype = np.dtype(dtype)
    options = dict(dict(softmax_scale=None, causal=False, window_size=(-1, -1)), **options)
    batch, seqlen_q, nheads, _ = q.shape
    o_shape = q.shape[:3] + v.shape[3:]
    assert o.shape == o_shape and o.dtype == dtype, f"o: {o.shape} {o.dtype}, expected {o_shape} {dtype}"
    assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == _lse_dtype(dtype), f"lse: {lse.shape} {lse.dtype}"
    variant_options = {name: options[name] for name in ("softcap", "alibi_slopes", "sink", "score_mod", "mask_mod",
                                                        "dropout_p", "dropout_mask") if name in options}
    plain = not variant_options
    (o_ref, lse_ref, grads_ref), (o_std, lse_std, grads_std) = references_and_baselines(do, q, k, v, dtype=dtype,
                                                                                         **options)
    assert o_ref.shape == o_shape, f"the reference's o has shape {o_ref.shape}, expected {o_shape}"
    assert np.isfinite(_f64(o)).all(), "o: NaN or inf (an unwritten or poisoned entry)"
    assert (np.isneginf(lse) == np.isneginf(lse_ref)).all(), "lse = -inf exactly where the reference's is"
    visible = reference.visible_keys(seqlen_q, k.shape[1], options["causal"], options["window_size"])
    hidden_rows = ~visible.any(axis=1)
    assert (o[:, hidden_rows] == 0).all(), "rows that see no key output 0"
    assert_close("o", o, o_ref, o_std, dtype=dtype)
    assert_close("lse", lse, lse_ref, lse_std, dtype=dtype)
    if grads is None:
        return
    dq, dk, dv = (as_numpy(g) for g in grads)
    for name, grad, x in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert grad.shape == x.shape and grad.dtype == dtype, f"{name}: {grad.shape} {grad.dtype}, expected like {x.shape}"
        assert np.isfinite(_f64(grad)).all(), f"{name}: NaN or inf (an unwritten or poisoned entry)"
    for name, ref, x in zip(("dq", "dk", "dv"), grads_ref, (q, k, v)):
        assert ref.shape == x.shape, f"the reference's {name} has shape {ref.shape}, expected {x.shape}"
    assert (dq[:, hidden_rows] == 0).all(), "rows that see no key have dq = 0"
    baselines = list(grads_std[:3])
    if dtype in SIXTEEN_BIT and plain:  # the kernels' own operand rounding, as tests/test_api_gpu.py
        flash = flash_rounding_baseline(do, q, k, v, dtype=dtype, o=o, **options)
        baselines = [worse_baseline(r, s, f) for r, s, f in zip(grads_ref, baselines, flash)]
    grad_scale = max(max_abs(g) for g in grads_ref[:3])  # dq, dk may cancel to 0 while their terms do not
    # The allowance's dv term is P^T (e q), the dv of a backward whose do is e q (d_qk wide): k in
    # v's place makes those shapes agree, and dv does not depend on the values.
    allowances = output_rounding_allowance(do, q, k, k, o, o_ref, **options)
    for name, grad, ref, base, atol in zip(("dq", "dk", "dv"), (dq, dk, dv), grads_ref, baselines, allowances):
        assert_close(name, grad, ref, base, dtype=dtype, factor=3.0, scale=grad_scale, atol=atol)
    if dsink is not None:
        dsink, dsink_ref = as_numpy(dsink), grads_ref[3]
        assert dsink.shape == (nheads,) and dsink.dtype == F32
        # as kernel_paths.check_against_reference: dsink sums D = rowsum(do * o) over the rows
        p_sink = np.exp(_f64(options["sink"])[None, :, None] - lse_ref)
        e = np.moveaxis(np.sum(_f64(do) * (_f64(o) - o_ref), axis=-1), 1, 2)
        atol = float(np.abs(p_sink * e).sum(axis=(0, 2)).max())
        floor = 1e-5 * (1 + float(np.abs(dsink_ref).max()) + float(np.abs(p_sink).sum(axis=(0, 2)).max()))
        err = float(np.abs(_f64(dsink) - dsink_ref).max())
        assert err <= 3 * atol + floor, f"dsink: error {err:.3e} > 3 x {atol:.3e} + {floor:.3e}"


def run_api(inputs, backend="numpy", deterministic=True, **options):
    """(o, lse, grads) of flash_attn_func and flash_attn_backward under poisoned outputs; grads
    (dq, dk, dv) or, with a sink, (dq, dk, dv, dsink)."""
    q, k, v, do = inputs
    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_func(q, k, v, return_lse=True, backend=backend, **options)
        grads = cupyflash.flash_attn_backward(do, q, k, v, o, lse, backend=backend, deterministic=deterministic,
                                              **options)
    return o, lse, grads


def run_and_check(p: Problem, backend="numpy", variant=None, dropout=None, deterministic=True, inputs=None):
    """The public API on ``p`` (``variant``: softcap, alibi_slopes, sink; ``dropout``: (p, seed))
    checked against the reference; returns (o, lse, grads)."""
    inputs = p.arrays() if inputs is None else inputs
    variant = dict(variant or {})
    call = dict(p.kwargs, **variant)
    ref = dict(call)
    if dropout is not None:
        rate, seed = dropout
        call.update(dropout_p=rate, seed=seed)
        ref.update(dropout_p=rate, dropout_mask=dropout_mask(p.batch, p.nheads, p.seqlen_q, p.seqlen_k, rate, seed))
    o, lse, grads = run_api(inputs, backend, deterministic, **call)
    with_sink = variant.get("sink") is not None
    assert len(grads) == (4 if with_sink else 3)
    check_against_reference(inputs, o, lse, grads[:3], dtype=p.dtype, options=ref,
                            dsink=grads[3] if with_sink else None)
    return o, lse, grads


# --- the reference from its definition --------------------------------------------------------------

def einsum_attention(q, k, v, do, *, scale, causal):
    """(o, lse, dq, dk, dv) in float64 written straight from softmax(q k^T scale) v with einsum
    (GQA by repeating k and v, causal bottom-right, every row seeing a key): no code shared with
    cupyflash.reference."""
    q, k, v, do = (_f64(x) for x in (q, k, v, do))
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    k_h, v_h = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)  # query head h reads kv head h // group
    s = scale * np.einsum("bihd,bjhd->bhij", q, k_h)
    if causal:
        i, j = np.arange(seqlen_q)[:, None], np.arange(seqlen_k)[None, :]
        s = np.where(j <= i + seqlen_k - seqlen_q, s, -np.inf)
    top = s.max(axis=-1, keepdims=True)
    e = np.exp(s - top)
    p = e / e.sum(axis=-1, keepdims=True)
    lse = (top + np.log(e.sum(axis=-1, keepdims=True)))[..., 0]
    o = np.einsum("bhij,bjhd->bihd", p, v_h)
    dp = np.einsum("bihd,bjhd->bhij", do, v_h)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    dq = scale * np.einsum("bhij,bjhd->bihd", ds, k_h)

    def per_kv_head(x):  # the query heads of one kv head summed
        return x.reshape(batch, seqlen_k, nheads_kv, group, x.shape[-1]).sum(axis=3)

    dk = per_kv_head(scale * np.einsum("bhij,bihd->bjhd", ds, q))
    dv = per_kv_head(np.einsum("bhij,bihd->bjhd", p, do))
    return o, lse, dq, dk, dv


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d_qk, d_v", HEADDIM_PAIRS, ids=PAIR_IDS)
def test_reference_is_the_einsum_definition(d_qk, d_v, causal):
    p = problem(d_qk, d_v, F64, seqlen_q=6, seqlen_k=9, causal=causal)
    q, k, v, do = p.arrays()
    o, lse = reference.attention(q, k, v, causal=causal)  # the default scale: 1/sqrt(d_qk)
    grads = reference.attention_backward(do, q, k, v, causal=causal)
    expected = einsum_attention(q, k, v, do, scale=1 / np.sqrt(d_qk), causal=causal)
    assert o.shape == p.o_shape and lse.shape == (p.batch, p.nheads, p.seqlen_q)
    assert [g.shape for g in grads] == [p.q_shape, p.k_shape, p.v_shape]
    for name, got, want in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, *grads), expected):
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12, err_msg=name)
    # and not the scale of V's head dim
    if d_v != d_qk:
        o_other, _ = reference.attention(q, k, v, causal=causal, softmax_scale=1 / np.sqrt(d_v))
        assert not np.allclose(o_other, o, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("d_qk, d_v", [(1, 3), (3, 1), (2, 5)])
def test_reference_backward_matches_finite_differences(d_qk, d_v):
    p = problem(d_qk, d_v, F64, batch=1, seqlen_q=3, seqlen_k=4, causal=True)
    q, k, v, do = p.arrays()

    def loss():
        return float(np.sum(do * reference.attention(q, k, v, causal=True)[0]))

    for name, x, grad in zip(("dq", "dk", "dv"), (q, k, v), reference.attention_backward(do, q, k, v, causal=True)):
        np.testing.assert_allclose(grad, numerical_gradient(loss, x), rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("d_qk, d_v", [(192, 128), (40, 72), (1, 3)], ids=["192-128", "40-72", "1-3"])
def test_standard_attention_in_float64_is_the_reference(d_qk, d_v):
    """The tolerance rule's baseline (standard attention) takes d_v too: in float64 it is the
    reference, with a variant and a sink; in bfloat16 it has V's shapes and is close to it."""
    p = problem(d_qk, d_v, F64, seqlen_q=9, seqlen_k=11, causal=True)
    q, k, v, do = p.arrays()
    rng = np.random.default_rng(3)
    options = dict(softcap=5.0, alibi_slopes=rng.uniform(0, 0.5, p.nheads).astype(np.float32),
                   sink=rng.standard_normal(p.nheads).astype(np.float32), causal=True)
    o, lse = reference.attention(q, k, v, **options)
    o_std, lse_std = reference.standard_attention(q, k, v, dtype=F64, **options)
    np.testing.assert_allclose(o_std, o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse_std, lse, rtol=1e-12, atol=1e-12)
    grads = reference.attention_backward(do, q, k, v, **options)
    grads_std = reference.standard_attention_backward(do, q, k, v, dtype=F64, **options)
    assert len(grads) == len(grads_std) == 4
    for name, std, ref in zip(("dq", "dk", "dv", "dsink"), grads_std, grads):
        np.testing.assert_allclose(std, ref, rtol=1e-12, atol=1e-12, err_msg=name)
    o16, _ = reference.standard_attention(q, k, v, dtype=BF16, causal=True)
    g16 = reference.standard_attention_backward(do, q, k, v, dtype=BF16, causal=True)
    assert o16.shape == p.o_shape and [g.shape for g in g16] == [p.q_shape, p.k_shape, p.v_shape]
    np.testing.assert_allclose(_f64(o16), reference.attention(q, k, v, causal=True)[0], atol=0.05)


def test_reference_varlen_and_kvcache_functions_take_d_v():
    """reference.varlen_attention(_backward) and kvcache_attention are per-sequence dense
    references: o and dv with V's head dim, sequences without keys (or without cached tokens)
    giving o = 0."""
    d_qk, d_v = 24, 40
    rng = np.random.default_rng(8)
    seqlens_q, seqlens_k = (3, 0, 4, 2), (5, 2, 0, 6)
    cu_q, cu_k = np.cumsum((0,) + seqlens_q), np.cumsum((0,) + seqlens_k)
    q = rng.standard_normal((cu_q[-1], 4, d_qk))
    k = rng.standard_normal((cu_k[-1], 2, d_qk))
    v = rng.standard_normal((cu_k[-1], 2, d_v))
    do = rng.standard_normal((cu_q[-1], 4, d_v))
    o, lse = reference.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    dq, dk, dv = reference.varlen_attention_backward(do, q, k, v, cu_q, cu_k, causal=True)
    assert o.shape == (cu_q[-1], 4, d_v) and lse.shape == (4, cu_q[-1])
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for b in range(4):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if seqlens_q[b] == 0:
            assert (dk[ks] == 0).all() and (dv[ks] == 0).all()
            continue
        if seqlens_k[b] == 0:
            assert (o[qs] == 0).all() and (lse[:, qs] == -np.inf).all()
            continue
        o_b, lse_b = reference.attention(q[None, qs], k[None, ks], v[None, ks], causal=True)
        g_b = reference.attention_backward(do[None, qs], q[None, qs], k[None, ks], v[None, ks], causal=True)
        np.testing.assert_array_equal(o[qs], o_b[0])
        np.testing.assert_array_equal(lse[:, qs], lse_b[0])
        for packed, rows, dense in ((dq, qs, g_b[0]), (dk, ks, g_b[1]), (dv, ks, g_b[2])):
            np.testing.assert_array_equal(packed[rows], dense[0])

    k_cache = rng.standard_normal((3, 8, 2, d_qk))
    v_cache = rng.standard_normal((3, 8, 2, d_v))
    q1 = rng.standard_normal((2, 1, 4, d_qk))
    lengths = np.array([0, 5], np.int32)
    sequences = reference.kvcache_sequences(2, k_cache, v_cache, cache_seqlens=lengths, cache_batch_idx=[2, 0])
    assert [(s[0].shape, s[1].shape) for s in sequences] == [((0, 2, d_qk), (0, 2, d_v)), ((5, 2, d_qk), (5, 2, d_v))]
    o, lse = reference.kvcache_attention(q1, k_cache, v_cache, cache_seqlens=lengths, cache_batch_idx=[2, 0])
    assert o.shape == (2, 1, 4, d_v)
    assert (o[0] == 0).all() and (lse[0] == -np.inf).all()
    o_1, lse_1 = reference.attention(q1[1:], k_cache[None, 0, :5], v_cache[None, 0, :5])
    np.testing.assert_array_equal(o[1], o_1[0])
    np.testing.assert_array_equal(lse[1], lse_1[0])


# --- the NumPy twin through the public API -----------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d_qk, d_v", HEADDIM_PAIRS, ids=PAIR_IDS)
def test_twin_matches_reference(d_qk, d_v, dtype):
    """GQA, causal (bottom-right, seqlen_q < seqlen_k), blocks cut by both sequence lengths."""
    run_and_check(problem(d_qk, d_v, dtype, causal=True))


@pytest.mark.parametrize("dtype", [F16, F64], ids=["fp16", "fp64"])
@pytest.mark.parametrize("d_qk, d_v", [(192, 128), (128, 192), (40, 72), (1, 3)], ids=["192-128", "128-192", "40-72",
                                                                                      "1-3"])
def test_twin_matches_reference_without_mask_and_with_hidden_rows(d_qk, d_v, dtype):
    """No mask and MQA; then more queries than keys, causal: the first rows see no key (o = 0,
    lse = -inf, dq = 0)."""
    run_and_check(problem(d_qk, d_v, dtype, nheads_kv=1, group=3, seqlen_q=40, seqlen_k=70))
    o, lse, grads = run_and_check(problem(d_qk, d_v, dtype, seqlen_q=70, seqlen_k=30, causal=True))
    assert (lse[:, :, :40] == -np.inf).all() and (o[:, :40] == 0).all() and (grads[0][:, :40] == 0).all()


@pytest.mark.parametrize("d_qk, d_v", [(192, 128), (40, 72), (3, 1)], ids=["192-128", "40-72", "3-1"])
def test_windows_softcap_alibi_and_sink(d_qk, d_v):
    """The score variants together (dsink too) under a sliding window, and a window alone."""
    rng = np.random.default_rng(d_qk)
    p = problem(d_qk, d_v, BF16, window_size=(17, 5))
    variant = dict(softcap=5.0, alibi_slopes=rng.uniform(0, 0.3, (p.batch, p.nheads)).astype(np.float32),
                   sink=(2 * rng.standard_normal(p.nheads)).astype(np.float32))
    run_and_check(p, variant=variant)
    run_and_check(replace(p, dtype=F32, window_size=(-1, 9), causal=False))


@pytest.mark.parametrize("d_qk, d_v", [(192, 128), (72, 40), (1, 3)], ids=["192-128", "72-40", "1-3"])
def test_dropout(d_qk, d_v):
    """dropout_p with a seed against the reference given cupyflash.dropout_mask's mask; the vjp
    uses one drawn seed for both directions."""
    p = problem(d_qk, d_v, F32, causal=True)
    o, lse, _ = run_and_check(p, dropout=(0.3, 12345))
    q, k, v, do = p.arrays()
    o_again, vjp = cupyflash.flash_attn_vjp(q, k, v, dropout_p=0.3, seed=12345, causal=True, backend="numpy")
    assert np.array_equal(o_again, o)
    grads = cupyflash.flash_attn_backward(do, q, k, v, o, lse, dropout_p=0.3, seed=12345, causal=True,
                                          backend="numpy", statistics="recomputed")  # the vjp's, float32
    assert all(np.array_equal(a, b) for a, b in zip(vjp(do), grads))
    o_drawn, vjp_drawn = cupyflash.flash_attn_vjp(q, k, v, dropout_p=0.3, causal=True, backend="numpy")
    assert o_drawn.shape == p.o_shape and not np.array_equal(o_drawn, o)
    assert [g.shape for g in vjp_drawn(do)] == [p.q_shape, p.k_shape, p.v_shape]


def _tanh_cap(score, b, h, q_idx, kv_idx):
    return 7.5 * cupyflash.modifiers.tanh(score / 7.5)


def _band(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx <= 20) & (kv_idx - q_idx <= 6)


@pytest.mark.parametrize("d_qk, d_v", [(192, 128), (40, 72)], ids=["192-128", "40-72"])
def test_user_modifiers(d_qk, d_v):
    """A score_mod (a tanh cap) and a mask_mod (a band) on the twin; a block mask through the vjp."""
    p = problem(d_qk, d_v, BF16)
    inputs = p.arrays()
    o, lse, grads = run_api(inputs, score_mod=_tanh_cap, mask_mod=_band)
    check_against_reference(inputs, o, lse, grads, dtype=p.dtype,
                            options=dict(p.kwargs, score_mod=_tanh_cap, mask_mod=_band))
    q, k, v, do = inputs
    o_vjp, vjp = cupyflash.flash_attn_vjp(q, k, v, score_mod=_tanh_cap, mask_mod=_band, backend="numpy")
    assert np.array_equal(o_vjp.view(np.uint16), o.view(np.uint16))
    assert all(np.array_equal(a.view(np.uint16), b.view(np.uint16)) for a, b in zip(vjp(do), grads))


@pytest.mark.parametrize("d_qk, d_v", [(192, 128), (8, 256), (1, 3)], ids=["192-128", "8-256", "1-3"])
def test_default_scale_is_one_over_sqrt_d_qk_and_auto_is_the_twin(d_qk, d_v):
    """softmax_scale=None is 1/sqrt(d_qk) bit for bit (not 1/sqrt(d_v)); without a GPU 'auto' runs
    the twin (bit for bit; on a GPU machine it is checked against the reference); return_lse=False
    returns o alone, with V's head dim."""
    q, k, v, do = problem(d_qk, d_v, F32, seqlen_q=20, seqlen_k=30).arrays()
    o, lse = cupyflash.flash_attn_func(q, k, v, return_lse=True, backend="numpy")
    o_qk = cupyflash.flash_attn_func(q, k, v, softmax_scale=1 / np.sqrt(d_qk), backend="numpy")
    o_v = cupyflash.flash_attn_func(q, k, v, softmax_scale=1 / np.sqrt(d_v), backend="numpy")
    assert isinstance(o_qk, np.ndarray) and o_qk.shape == (2, 20, 4, d_v)
    assert np.array_equal(o_qk, o) and not np.allclose(o_v, o)
    o_auto, lse_auto = cupyflash.flash_attn_func(q, k, v, return_lse=True, backend="auto")
    g_auto = cupyflash.flash_attn_backward(do, q, k, v, o_auto, lse_auto, backend="auto")
    if dispatch.gpu_available():
        check_against_reference((q, k, v, do), o_auto, lse_auto, g_auto, dtype=F32, options={})
        return
    assert np.array_equal(o_auto, o) and np.array_equal(lse_auto, lse)
    g_twin = cupyflash.flash_attn_backward(do, q, k, v, o, lse, backend="numpy")
    assert all(np.array_equal(a, b) for a, b in zip(g_auto, g_twin))


@pytest.mark.parametrize("d_qk, d_v", [(192, 128), (64, 256)], ids=["192-128", "64-256"])
def test_vjp_is_the_forward_and_the_backward(d_qk, d_v):
    p = problem(d_qk, d_v, BF16, causal=True, window_size=(30, -1))
    q, k, v, do = p.arrays()
    o, vjp = cupyflash.flash_attn_vjp(q, k, v, backend="numpy", **p.kwargs)
    o_f, lse = cupyflash.flash_attn_func(q, k, v, return_lse=True, backend="numpy", **p.kwargs)
    assert o.shape == p.o_shape and np.array_equal(o.view(np.uint16), o_f.view(np.uint16))
    for a, b in zip(vjp(do), cupyflash.flash_attn_backward(do, q, k, v, o_f, lse, backend="numpy", **p.kwargs)):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_mla_layout_strided_views():
    """DeepSeek MLA's layout: k = [k_nope, k_rope] (192) and v (128) as views into one kv projection
    (batch, seqlen, heads, 128 + 192) with a contiguous last dim, q a view too: the results equal
    those of contiguous copies bit for bit."""
    rng = np.random.default_rng(11)
    batch, seqlen, nheads = 2, 70, 3
    kv = rng.standard_normal((batch, seqlen, nheads, 128 + 192)).astype(BF16)
    qbuf = rng.standard_normal((batch, seqlen, nheads, 2 * 192)).astype(BF16)
    q, k, v = qbuf[..., 192:], kv[..., 128:], kv[..., :128]
    do = rng.standard_normal((batch, seqlen, nheads, 128)).astype(BF16)
    assert not v.flags.c_contiguous and not k.flags.c_contiguous
    o, lse, grads = run_api((q, k, v, do), causal=True)
    copies = tuple(np.ascontiguousarray(x) for x in (q, k, v, do))
    o_c, lse_c, grads_c = run_api(copies, causal=True)
    assert np.array_equal(o.view(np.uint16), o_c.view(np.uint16)) and np.array_equal(lse, lse_c)
    assert all(np.array_equal(a.view(np.uint16), b.view(np.uint16)) for a, b in zip(grads, grads_c))
    check_against_reference(copies, o, lse, grads, dtype=BF16, options=dict(causal=True))


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences(seqlen_q, seqlen_k):
    p = problem(24, 40, F32, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    q, k, v, do = p.arrays()
    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_func(q, k, v, return_lse=True, backend="numpy")
        dq, dk, dv = cupyflash.flash_attn_backward(do, q, k, v, o, lse, backend="numpy")
    assert o.shape == p.o_shape and (o == 0).all() and (lse == -np.inf).all()
    assert (dq.shape, dk.shape, dv.shape) == (p.q_shape, p.k_shape, p.v_shape)
    assert not any((g != 0).any() for g in (dq, dk, dv))


# --- hypothesis: any (d_qk, d_v) in [1, 256], small shapes, every option ------------------------------

headdims = st.one_of(st.sampled_from(FAVOURITE_HEADDIMS), st.integers(1, 256))


@st.composite
def problems(draw, dtypes=DTYPES, max_seqlen=140, max_cost=5e6):
    """Problems with batch * nheads * seqlen_q * seqlen_k * (d_qk + d_v) <= ``max_cost``: large head
    dims get short sequences, small ones long sequences (across the twin's blocks); scores of a
    standard deviation of at most 4."""
    d_qk, d_v = draw(headdims, label="d_qk"), draw(headdims, label="d_v")
    batch, nheads_kv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from((1, 2, 3)))
    nheads = nheads_kv * group
    longest = int(min(max_seqlen, max(1, (max_cost / (batch * nheads * (d_qk + d_v))) ** 0.5)))
    seqlen_q, seqlen_k = draw(st.integers(1, longest), label="seqlen_q"), draw(st.integers(1, longest), label="seqlen_k")
    magnitude = draw(st.sampled_from((0.5, 1.0, 1.5)))
    factor = draw(st.one_of(st.none(), st.floats(0.1, 4.0 / magnitude**2)), label="scale_factor")
    scale = None if factor is None else factor / np.sqrt(d_qk)
    window = draw(st.one_of(st.just((-1, -1)), window_size(max_side=120)), label="window_size")
    return Problem(batch, seqlen_q, seqlen_k, nheads_kv, group, d_qk, d_v, draw(st.sampled_from(dtypes)),
                   draw(st.integers(0, 2**32 - 1)), draw(st.booleans()), window, scale, magnitude)


@given(problems(), st.sampled_from(("numpy", "auto")))
def test_property_any_headdims_match_reference(p, backend):
    run_and_check(p, backend=backend)


@settings(max_examples=20, suppress_health_check=[HealthCheck.large_base_example, HealthCheck.too_slow])
@given(problems(max_cost=2e6), st.data())
def test_property_any_headdims_with_variants_and_dropout(p, data):
    variant = data.draw(variant_kwargs(p.batch, p.nheads, at_least_one=False), label="variant")
    dropout = data.draw(st.one_of(st.none(), st.tuples(st.floats(0.05, 0.9), st.integers(0, 2**64 - 1))),
                        label="dropout")
    run_and_check(p, variant=variant, dropout=dropout)


# --- errors ------------------------------------------------------------------------------------------

def _arrays(*shapes, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


@pytest.mark.parametrize("v_shape", [(1, 7, 2, 8), (2, 6, 2, 8), (2, 7, 1, 8), (2, 7, 4, 8)],
                         ids=["batch", "seqlen", "nheads", "more heads"])
def test_k_and_v_must_agree_on_batch_seqlen_and_nheads(v_shape):
    q, k, v = _arrays((2, 5, 4, 16), (2, 7, 2, 16), v_shape)
    with pytest.raises(ValueError, match=r"\bv\b"):
        cupyflash.flash_attn_func(q, k, v, backend="numpy")
    with pytest.raises(ValueError, match=r"\bv\b"):
        cupyflash.flash_attn_vjp(q, k, v, backend="numpy")
    do, o = _arrays((2, 5, 4, 8), (2, 5, 4, 8))
    lse = np.zeros((2, 4, 5), np.float32)
    with pytest.raises(ValueError, match=r"\bv\b"):
        cupyflash.flash_attn_backward(do, q, k, v, o, lse, backend="numpy")


def test_k_must_have_the_head_dim_of_q():
    """k's last dim is q's (V's may differ): q 16 against k 12 is refused whatever v has."""
    for v_dim in (12, 16, 8):
        q, k, v = _arrays((2, 5, 4, 16), (2, 7, 2, 12), (2, 7, 2, v_dim))
        with pytest.raises(ValueError, match=r"(?i)head ?dim"):
            cupyflash.flash_attn_func(q, k, v, backend="numpy")


@pytest.mark.parametrize("d_v", [0, 257, 512])
def test_d_v_outside_one_to_256_is_refused(d_v):
    q, k, v = _arrays((1, 5, 2, 16), (1, 7, 2, 16), (1, 7, 2, d_v))
    with pytest.raises(ValueError, match=r"(?i)head ?dim|d_v|\bv\b"):
        cupyflash.flash_attn_func(q, k, v, backend="numpy")


def test_d_v_one_and_256_are_accepted():
    for d_v in (1, 256):
        q, k, v = _arrays((1, 5, 2, 16), (1, 7, 2, 16), (1, 7, 2, d_v))
        assert cupyflash.flash_attn_func(q, k, v, backend="numpy").shape == (1, 5, 2, d_v)


@pytest.mark.parametrize("name, shape", [("do", (2, 5, 4, 16)), ("o", (2, 5, 4, 16)), ("do", (2, 6, 4, 8)),
                                         ("o", (2, 5, 2, 8)), ("do", (1, 5, 4, 8))],
                         ids=["do d_qk", "o d_qk", "do seqlen", "o nheads", "do batch"])
def test_backward_do_and_o_must_have_the_shape_of_the_output(name, shape):
    """do and o are q.shape[:3] + (d_v,): here (2, 5, 4, 8), with d_qk = 16."""
    q, k, v, do = _arrays((2, 5, 4, 16), (2, 7, 2, 16), (2, 7, 2, 8), (2, 5, 4, 8))
    o, lse = cupyflash.flash_attn_func(q, k, v, return_lse=True, backend="numpy")
    given = {"do": do, "o": o}
    given[name] = _arrays(shape, seed=1)[0]
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        cupyflash.flash_attn_backward(given["do"], q, k, v, given["o"], lse, backend="numpy")
    if name == "do":
        _, vjp = cupyflash.flash_attn_vjp(q, k, v, backend="numpy")
        with pytest.raises(ValueError, match=r"\bdo\b"):
            vjp(given["do"])


def test_reference_refuses_v_of_another_length_or_heads():
    q, k = _arrays((1, 5, 2, 16), (1, 7, 2, 16))
    for v_shape in ((1, 6, 2, 8), (1, 7, 1, 8)):
        (v,) = _arrays(v_shape)
        with pytest.raises(ValueError):
            reference.attention(q, k, v)
    (v,) = _arrays((1, 7, 2, 8))
    with pytest.raises(ValueError, match=r"\bdo\b"):
        reference.attention_backward(_arrays((1, 5, 2, 16))[0], q, k, v)


# --- varlen ------------------------------------------------------------------------------------------

SEQLENS_Q = (5, 0, 17, 1, 70)
SEQLENS_K = (9, 3, 0, 17, 66)  # a sequence without queries, one without keys, blocks cut in the last


def varlen_inputs(d_qk, d_v, dtype, seed=0, nheads=4, nheads_kv=2):
    cu_q = np.cumsum((0,) + SEQLENS_Q).astype(np.int32)
    cu_k = np.cumsum((0,) + SEQLENS_K).astype(np.int32)
    q, k, v, do = _arrays((cu_q[-1], nheads, d_qk), (cu_k[-1], nheads_kv, d_qk), (cu_k[-1], nheads_kv, d_v),
                          (cu_q[-1], nheads, d_v), dtype=dtype, seed=seed)
    return (q, k, v, do), (cu_q, cu_k, max(SEQLENS_Q), max(SEQLENS_K))


def check_varlen(inputs, sequences, o, lse, grads, *, dtype, causal, bitwise_dense=False, backend="numpy"):
    """Every sequence against the dense reference of its rows (check_against_reference); rows of
    sequences without keys o = 0, lse = -inf, dq = 0; keys of sequences without queries dk = dv =
    0. ``bitwise_dense``: each sequence's results equal flash_attn_func's on its rows bit for bit."""
    from cupyflash.testing import as_numpy

    q, k, v, do = inputs
    cu_q, cu_k = sequences[:2]
    o, lse = as_numpy(o), as_numpy(lse)
    dq, dk, dv = (as_numpy(g) for g in grads)
    assert o.shape == q.shape[:2] + v.shape[2:] and lse.shape == (q.shape[1], q.shape[0])
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    for b in range(len(cu_q) - 1):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if qs.stop == qs.start:
            assert (dk[ks] == 0).all() and (dv[ks] == 0).all()
            continue
        if ks.stop == ks.start:
            assert (o[qs] == 0).all() and (lse[:, qs] == -np.inf).all() and (dq[qs] == 0).all()
            continue
        parts = (q[None, qs], k[None, ks], v[None, ks], do[None, qs])
        check_against_reference(parts, o[None, qs], lse[None, :, qs], (dq[None, qs], dk[None, ks], dv[None, ks]),
                                dtype=dtype, options=dict(causal=causal))
        if bitwise_dense:
            o_b, lse_b = cupyflash.flash_attn_func(*parts[:3], causal=causal, return_lse=True, backend=backend)
            g_b = cupyflash.flash_attn_backward(parts[3], *parts[:3], o_b, lse_b, causal=causal, backend=backend)
            assert np.array_equal(o[qs].view(np.uint8), as_numpy(o_b)[0].view(np.uint8))
            assert np.array_equal(lse[:, qs], as_numpy(lse_b)[0])
            for packed, rows, dense in ((dq, qs, g_b[0]), (dk, ks, g_b[1]), (dv, ks, g_b[2])):
                assert np.array_equal(packed[rows].view(np.uint8), as_numpy(dense)[0].view(np.uint8))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d_qk, d_v", [(192, 128), (128, 192), (40, 72), (1, 3)],
                         ids=["192-128", "128-192", "40-72", "1-3"])
def test_varlen_matches_the_reference(d_qk, d_v, dtype):
    inputs, sequences = varlen_inputs(d_qk, d_v, dtype, seed=d_qk + d_v)
    q, k, v, do = inputs
    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_varlen_func(q, k, v, *sequences, causal=True, return_lse=True, backend="numpy")
        grads = cupyflash.flash_attn_varlen_backward(do, q, k, v, o, lse, *sequences, causal=True, backend="numpy")
    check_varlen(inputs, sequences, o, lse, grads, dtype=dtype, causal=True, bitwise_dense=True)
    o_vjp, vjp = cupyflash.flash_attn_varlen_vjp(q, k, v, *sequences, causal=True, backend="numpy")
    assert np.array_equal(o_vjp.view(np.uint8), o.view(np.uint8))
    grads = cupyflash.flash_attn_varlen_backward(do, q, k, v, o, lse, *sequences, causal=True, backend="numpy",
                                                 statistics=own_forward_statistics(dtype))  # the vjp's
    assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(vjp(do), grads))


def test_varlen_with_variants():
    """softcap, ALiBi per sequence and a sink: each sequence against the dense reference with its
    slopes' row; dsink over all rows against the sum of the sequences' dsinks."""
    d_qk, d_v = 192, 128
    inputs, sequences = varlen_inputs(d_qk, d_v, F32, seed=5)
    q, k, v, do = inputs
    rng = np.random.default_rng(5)
    slopes = rng.uniform(0, 0.3, (len(SEQLENS_Q), 4)).astype(np.float32)
    sink = rng.standard_normal(4).astype(np.float32)
    options = dict(softcap=8.0, alibi_slopes=slopes, sink=sink, causal=True)
    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_varlen_func(q, k, v, *sequences, return_lse=True, backend="numpy", **options)
        *grads, dsink = cupyflash.flash_attn_varlen_backward(do, q, k, v, o, lse, *sequences, backend="numpy",
                                                             **options)
    cu_q, cu_k = sequences[:2]
    dsink_ref = np.zeros(4)
    for b in range(len(SEQLENS_Q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if SEQLENS_Q[b] == 0 or SEQLENS_K[b] == 0:
            continue
        parts = (q[None, qs], k[None, ks], v[None, ks], do[None, qs])
        own = dict(options, alibi_slopes=slopes[b:b + 1])
        check_against_reference(parts, o[None, qs], lse[None, :, qs],
                                (grads[0][None, qs], grads[1][None, ks], grads[2][None, ks]), dtype=F32, options=own)
        dsink_ref += reference.attention_backward(*parts[3:], *parts[:3], **own)[3]
    assert dsink.shape == (4,)
    np.testing.assert_allclose(dsink, dsink_ref, rtol=1e-4, atol=1e-4 * (1 + np.abs(dsink_ref).max()))


def test_varlen_errors():
    inputs, sequences = varlen_inputs(16, 8, F32)
    q, k, v, do = inputs
    for bad_v in (v[1:], v[:, :1]):  # another total_k, another nheads_kv
        with pytest.raises(ValueError, match=r"\bv\b"):
            cupyflash.flash_attn_varlen_func(q, k, bad_v, *sequences, backend="numpy")
    with pytest.raises(ValueError, match=r"(?i)head ?dim"):
        cupyflash.flash_attn_varlen_func(q, k[..., :12], v, *sequences, backend="numpy")
    o, lse = cupyflash.flash_attn_varlen_func(q, k, v, *sequences, return_lse=True, backend="numpy")
    assert o.shape == (q.shape[0], 4, 8)
    wrong = _arrays(q.shape, seed=2)[0]  # d_qk wide
    with pytest.raises(ValueError, match=r"\bdo\b"):
        cupyflash.flash_attn_varlen_backward(wrong, q, k, v, o, lse, *sequences, backend="numpy")
    with pytest.raises(ValueError, match=r"\bo\b"):
        cupyflash.flash_attn_varlen_backward(do, q, k, v, wrong, lse, *sequences, backend="numpy")


# --- the KV cache --------------------------------------------------------------------------------------

CACHED = (5, 0, 17)  # tokens already in each sequence's cache


def kvcache_inputs(d_qk, d_v, dtype, page_size=None, seqlen_q=2, seqlen_new=2, capacity=24, seed=0, cached=CACHED,
                   nheads=4, nheads_kv=2):
    """q, the caches (contiguous rows, or pages of ``page_size`` in a shuffled table with spare
    pages), the new k, v, cache_seqlens (``cached``); NaN in every slot no sequence holds (a
    kernel that read past a sequence's end would see it)."""
    rng = np.random.default_rng(seed)
    batch = len(cached)
    q = rng.standard_normal((batch, seqlen_q, nheads, d_qk)).astype(dtype)
    k_new = rng.standard_normal((batch, seqlen_new, nheads_kv, d_qk)).astype(dtype)
    v_new = rng.standard_normal((batch, seqlen_new, nheads_kv, d_v)).astype(dtype)
    rows_k = rng.standard_normal((batch, capacity, nheads_kv, d_qk)).astype(dtype)
    rows_v = rng.standard_normal((batch, capacity, nheads_kv, d_v)).astype(dtype)
    for b, n in enumerate(cached):
        rows_k[b, n:] = np.nan
        rows_v[b, n:] = np.nan
    inputs = dict(q=q, k=k_new, v=v_new, cache_seqlens=np.array(cached, np.int32), block_table=None)
    if page_size is None:
        inputs.update(k_cache=rows_k, v_cache=rows_v)
        return inputs
    pages = capacity // page_size
    order = rng.permutation(batch * pages + 3)  # three spare pages
    table = order[: batch * pages].reshape(batch, pages).astype(np.int32)
    k_cache = np.full((batch * pages + 3, page_size, nheads_kv, d_qk), np.nan, dtype)
    v_cache = np.full((batch * pages + 3, page_size, nheads_kv, d_v), np.nan, dtype)
    k_cache[table] = rows_k.reshape(batch, pages, page_size, nheads_kv, d_qk)
    v_cache[table] = rows_v.reshape(batch, pages, page_size, nheads_kv, d_v)
    inputs.update(k_cache=k_cache, v_cache=v_cache, block_table=table)
    return inputs


def _sequence_tokens(cache, table, b, length):
    """The first ``length`` tokens of sequence b: its row, or its pages in table order."""
    if table is None:
        return cache[b, :length]
    return cache[table[b]].reshape((-1,) + cache.shape[2:])[:length]


def _as_host(inputs):
    from cupyflash.testing import as_numpy

    return {name: None if x is None else as_numpy(x).copy() for name, x in inputs.items()}


def check_kvcache(before, after, o, lse, *, dtype, causal):
    """o, lse against the dense reference of each sequence's cached and new tokens (gathered here,
    not by the reference), queries aligned to the end; the caches after the call equal the ones
    before with exactly the appended slots written (NaN payloads of the empty slots included)."""
    from cupyflash.testing import as_numpy

    q, table = before["q"], before["block_table"]
    cached = [int(n) for n in before["cache_seqlens"]]
    o, lse = as_numpy(o), as_numpy(lse)
    assert o.shape == q.shape[:3] + before["v_cache"].shape[3:] and o.dtype == dtype
    for name, new in (("k_cache", "k"), ("v_cache", "v")):
        expected = before[name].copy()
        for b, n in enumerate(cached):
            for t in range(before[new].shape[1]):
                position = n + t
                if table is None:
                    expected[b, position] = before[new][b, t]
                else:
                    page_size = expected.shape[1]
                    expected[table[b, position // page_size], position % page_size] = before[new][b, t]
        got = as_numpy(after[name])
        assert got.shape == expected.shape and np.array_equal(got.view(np.uint8), expected.view(np.uint8)), name
        if table is None:  # the reference's append agrees
            appended = reference.kvcache_appended(before[name], before[new], cache_seqlens=before["cache_seqlens"])
            assert np.array_equal(appended.view(np.uint8), expected.view(np.uint8)), name
    for b, n in enumerate(cached):
        keys = np.concatenate([_sequence_tokens(before["k_cache"], table, b, n), before["k"][b]])
        values = np.concatenate([_sequence_tokens(before["v_cache"], table, b, n), before["v"][b]])
        assert not np.isnan(_f64(keys)).any() and not np.isnan(_f64(values)).any()
        parts = (q[b:b + 1], keys[None], values[None], np.zeros(o[b:b + 1].shape, dtype))
        check_against_reference(parts, o[b:b + 1], lse[b:b + 1], dtype=dtype, options=dict(causal=causal))
    o_ref, _ = reference.kvcache_attention(before["q"], before["k_cache"], before["v_cache"], before["k"], before["v"],
                                           cache_seqlens=before["cache_seqlens"], block_table=table, causal=causal)
    assert o_ref.shape == o.shape


@pytest.mark.parametrize("page_size", [None, 1, 3, 8], ids=["rows", "page1", "page3", "page8"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d_qk, d_v", [(192, 128), (128, 192), (40, 72), (1, 3)],
                         ids=["192-128", "128-192", "40-72", "1-3"])
def test_kvcache_appends_in_place_and_matches_the_reference(d_qk, d_v, dtype, page_size):
    inputs = kvcache_inputs(d_qk, d_v, dtype, page_size, seed=d_qk * d_v)
    before = _as_host(inputs)
    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_with_kvcache(**inputs, causal=True, return_softmax_lse=True, backend="numpy")
    check_kvcache(before, inputs, o, lse, dtype=dtype, causal=True)


def test_kvcache_without_new_tokens_and_an_empty_sequence():
    """No append (k, v None), one sequence with nothing cached: o = 0 and lse = -inf there."""
    inputs = kvcache_inputs(192, 128, F32, page_size=4)
    del inputs["k"], inputs["v"]
    o, lse = cupyflash.flash_attn_with_kvcache(**inputs, return_lse=True, backend="numpy")
    assert o.shape == (3, 2, 4, 128)
    assert (o[1] == 0).all() and (lse[1] == -np.inf).all()
    table = inputs["block_table"]
    for b in (0, 2):
        keys = _sequence_tokens(inputs["k_cache"], table, b, CACHED[b])[None]
        values = _sequence_tokens(inputs["v_cache"], table, b, CACHED[b])[None]
        parts = (inputs["q"][b:b + 1], keys, values, np.zeros((1, 2, 4, 128), np.float32))
        check_against_reference(parts, o[b:b + 1], lse[b:b + 1], dtype=F32, options={})


def test_kvcache_errors_leave_the_caches_unwritten():
    inputs = kvcache_inputs(16, 8, F32)
    before = _as_host(inputs)
    bad = [dict(v_cache=inputs["v_cache"][:, :, :1]),          # v_cache's nheads_kv is not k_cache's
           dict(v_cache=inputs["v_cache"][:, :20]),            # nor its seqlen_cache
           dict(v=inputs["v"][..., :4]),                       # new v of another head dim than v_cache
           dict(v=np.zeros(inputs["k"].shape, np.float32)),    # new v with k's (d_qk) head dim
           dict(k=np.zeros(inputs["v"].shape, np.float32)),    # new k with v's (d_v) head dim
           dict(v=inputs["v"][:, :1])]                         # new v of another length than new k
    for change in bad:
        with pytest.raises(ValueError):
            cupyflash.flash_attn_with_kvcache(**dict(inputs, **change), backend="numpy")
        for name in ("k_cache", "v_cache"):
            assert np.array_equal(inputs[name].view(np.uint8), before[name].view(np.uint8)), (change.keys(), name)
    with pytest.raises(ValueError, match=r"(?i)head ?dim"):  # q and k_cache differ in head dim
        cupyflash.flash_attn_with_kvcache(**dict(inputs, q=inputs["q"][..., :8]), backend="numpy")


# --- cupyflash.torch ----------------------------------------------------------------------------------

def _torch():
    return pytest.importorskip("torch")


def torch_qkv(d_qk, d_v, dtype=None, batch=1, seqlen_q=5, seqlen_k=7, nheads=4, nheads_kv=2, seed=0,
              requires_grad=True):
    torch = _torch()
    generator = torch.Generator().manual_seed(seed)
    shapes = [(batch, seqlen_q, nheads, d_qk), (batch, seqlen_k, nheads_kv, d_qk), (batch, seqlen_k, nheads_kv, d_v)]
    return [torch.randn(s, generator=generator, dtype=torch.float64).to(dtype or torch.float64)
            .requires_grad_(requires_grad) for s in shapes]


@pytest.mark.parametrize("with_variants", [False, True], ids=["plain", "softcap+alibi+sink"])
@pytest.mark.parametrize("d_qk, d_v", [(192, 128), (40, 72), (1, 3)], ids=["192-128", "40-72", "1-3"])
def test_torch_autograd_equals_cupyflash_bitwise(d_qk, d_v, with_variants):
    """cupyflash.torch.flash_attn_func on CPU tensors: o (V's head dim), lse and the gradients
    autograd returns are cupyflash's on the same arrays, bit for bit (dsink too)."""
    torch = _torch()
    from cupyflash.torch import flash_attn_func

    q, k, v = torch_qkv(d_qk, d_v, torch.float32, batch=2, seqlen_q=30, seqlen_k=40)
    variant = {}
    sink = None
    if with_variants:
        sink = torch.randn(4, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        variant = dict(softcap=6.0, alibi_slopes=torch.tensor([0.1, 0.2, 0.05, 0.3]), sink=sink)
    o, lse, _ = flash_attn_func(q, k, v, causal=True, deterministic=True, return_attn_probs=True, **variant)
    assert o.shape == (2, 30, 4, d_v) and o.dtype == torch.float32
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(2))
    o.backward(do)
    arrays = [t.detach().numpy() for t in (q, k, v)]
    np_variant = {name: (x.detach().numpy() if isinstance(x, torch.Tensor) else x) for name, x in variant.items()}
    o_ref, lse_ref = cupyflash.flash_attn_func(*arrays, causal=True, return_lse=True, backend="numpy", **np_variant)
    grads = cupyflash.flash_attn_backward(do.numpy(), *arrays, o_ref, lse_ref, causal=True, backend="numpy",
                                          statistics="recomputed", **np_variant)  # the autograd's, float32
    assert np.array_equal(o.detach().numpy(), o_ref) and np.array_equal(lse.detach().numpy(), lse_ref)
    for name, t, g in zip("qkv", (q, k, v), grads):
        assert t.grad.shape == t.shape and np.array_equal(t.grad.numpy(), g), f"d{name} differs"
    if with_variants:
        assert np.array_equal(sink.grad.numpy(), grads[3])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d_qk, d_v", [(3, 5), (5, 2)], ids=["3-5", "5-2"])
def test_torch_gradcheck_float64(d_qk, d_v, causal):
    torch = _torch()
    from cupyflash.torch import flash_attn_func

    q, k, v = torch_qkv(d_qk, d_v, seqlen_q=6, seqlen_k=4)
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attn_func(q, k, v, causal=causal), (q, k, v))
    expected, _ = reference.attention(*(x.detach().numpy() for x in (q, k, v)), causal=causal)
    np.testing.assert_allclose(flash_attn_func(q, k, v, causal=causal).detach().numpy(), expected,
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("d_qk, d_v", [(3, 5), (5, 2)], ids=["3-5", "5-2"])
def test_torch_gradcheck_through_the_lse(d_qk, d_v):
    """The lse's gradient adds scale dlse (P K) to dq and scale P^T (dlse q) to dk: products with
    K's head dim, not V's."""
    torch = _torch()
    from cupyflash.torch import flash_attn_func

    q, k, v = torch_qkv(d_qk, d_v, seqlen_q=4, seqlen_k=6)

    def out_and_lse(q, k, v):
        o, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        return o, lse

    assert torch.autograd.gradcheck(out_and_lse, (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: out_and_lse(q, k, v)[1], (q, k, v))


@pytest.mark.parametrize("d_qk, d_v", [(3, 5), (5, 2)], ids=["3-5", "5-2"])
def test_torch_varlen_gradcheck_with_the_lse(d_qk, d_v):
    """The packed front end's autograd, o and lse together (every row sees a key)."""
    torch = _torch()
    from cupyflash.torch import flash_attn_varlen_func

    generator = torch.Generator().manual_seed(d_qk)
    q = torch.randn((5, 2, d_qk), generator=generator, dtype=torch.float64, requires_grad=True)
    k = torch.randn((7, 1, d_qk), generator=generator, dtype=torch.float64, requires_grad=True)
    v = torch.randn((7, 1, d_v), generator=generator, dtype=torch.float64, requires_grad=True)
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 3, 7], dtype=torch.int32)

    def out_and_lse(q, k, v):
        o, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 4, causal=True, return_attn_probs=True)
        return o, lse

    assert out_and_lse(q, k, v)[0].shape == (5, 2, d_v)
    assert torch.autograd.gradcheck(lambda q, k, v: out_and_lse(q, k, v)[0], (q, k, v))
    assert torch.autograd.gradcheck(out_and_lse, (q, k, v))


def test_torch_meta_and_fake_tensors_have_v_shapes():
    torch = _torch()
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cupyflash.torch import flash_attn_func

    shapes = [(2, 33, 8, 192), (2, 17, 2, 192), (2, 17, 2, 128)]

    def check(tensors):
        o, lse, _ = flash_attn_func(*tensors, causal=True, return_attn_probs=True)
        assert (o.shape, lse.shape) == ((2, 33, 8, 128), (2, 8, 33))
        dq, dk, dv, dsink = torch.ops.cupyflash.flash_attn_backward(o, *tensors, o, lse, 0.125, True, -1, 0, True)
        assert [g.shape for g in (dq, dk, dv)] == shapes and dsink.shape == (0,)

    check([torch.empty(s, dtype=torch.bfloat16, device="meta") for s in shapes])
    with FakeTensorMode():
        check([torch.empty(s, dtype=torch.bfloat16) for s in shapes])


def test_torch_compile_fullgraph_matches_eager():
    """Dynamo and AOTAutograd trace through the fake kernels (o with V's head dim); aot_eager as in
    tests/test_torch.py."""
    torch = _torch()
    from cupyflash.torch import flash_attn_func

    q, k, v = torch_qkv(24, 16, seqlen_q=6, seqlen_k=6)

    def loss(q, k, v):
        return flash_attn_func(q, k, v, causal=True).square().sum()

    eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
    compiled_loss = torch.compile(loss, fullgraph=True, backend="aot_eager")
    compiled = torch.autograd.grad(compiled_loss(q, k, v), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))


def test_torch_varlen_and_kvcache_take_d_v():
    """The packed-batch front end with autograd and the kv-cache one, each against cupyflash's own
    call on the same arrays."""
    torch = _torch()
    from cupyflash.torch import flash_attn_varlen_func, flash_attn_with_kvcache

    inputs, (cu_q, cu_k, max_q, max_k) = varlen_inputs(40, 24, F32, seed=3)
    q, k, v, do = (torch.from_numpy(x).requires_grad_(name != "do") for name, x in zip(("q", "k", "v", "do"), inputs))
    o = flash_attn_varlen_func(q, k, v, torch.from_numpy(cu_q), torch.from_numpy(cu_k), max_q, max_k, causal=True)
    assert o.shape == (q.shape[0], 4, 24)
    o.backward(do)
    o_ref, lse_ref = cupyflash.flash_attn_varlen_func(*inputs[:3], cu_q, cu_k, max_q, max_k, causal=True,
                                                      return_lse=True, backend="numpy")
    grads = cupyflash.flash_attn_varlen_backward(inputs[3], *inputs[:3], o_ref, lse_ref, cu_q, cu_k, max_q, max_k,
                                                 causal=True, backend="numpy", statistics="recomputed")
    assert np.array_equal(o.detach().numpy(), o_ref)
    for t, g in zip((q, k, v), grads):
        assert np.array_equal(t.grad.numpy(), g)

    cache = kvcache_inputs(40, 24, F32, page_size=4, seed=4)
    expected = dict((name, None if x is None else x.copy()) for name, x in cache.items())
    o_ref = cupyflash.flash_attn_with_kvcache(**expected, causal=True, backend="numpy")
    tensors = {name: None if x is None else torch.from_numpy(x) for name, x in cache.items()}
    o = flash_attn_with_kvcache(tensors["q"], tensors["k_cache"], tensors["v_cache"], tensors["k"], tensors["v"],
                                cache_seqlens=tensors["cache_seqlens"], block_table=tensors["block_table"],
                                causal=True)
    assert o.shape == (3, 2, 4, 24) and np.array_equal(o.numpy(), o_ref)
    for name in ("k_cache", "v_cache"):
        assert np.array_equal(cache[name].view(np.uint8), expected[name].view(np.uint8)), name


def test_torch_errors_name_v():
    torch = _torch()
    from cupyflash.torch import flash_attn_func

    q, k, _ = torch_qkv(16, 8, requires_grad=False)
    for v_shape in ((1, 7, 1, 8), (1, 6, 2, 8), (2, 7, 2, 8)):
        with pytest.raises(ValueError, match=r"\bv\b"):
            flash_attn_func(q, k, torch.zeros(v_shape, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"(?i)head ?dim"):
        flash_attn_func(q, k[..., :12], torch.zeros((1, 7, 2, 8), dtype=torch.float64))

"""Dropout on every GPU kernel family, against the float64 reference given the mask that
cupyflash.dropout (the NumPy twin of kernels_cu/dropout.cuh) computes: a kernel whose Philox words
differed from the twin's in one element would miss the reference by that weight. NaN-poisoned
outputs, fresh random inputs per example; families as in test_variants_gpu.py.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from cupyflash.dropout import Dropout, dropout_mask
from cupyflash.testing.problem import AttentionProblem as AttentionCase, as_dtype
from kernel_paths import GPU_MAX_COST, MMA_SYNC_BWD, SMALL_COST, check_against_reference, mma_case, run_path
from strategies import make_inputs
from tolerance import SIXTEEN_BIT
from windows import window_size

pytestmark = pytest.mark.gpu


@st.composite
def _problem(draw, max_cost=GPU_MAX_COST, **kw):
    case = draw(mma_case(max_cost, **kw))
    p = draw(st.sampled_from((0.1, 0.5, 0.9)) | st.floats(0.01, 0.95))
    dropout = Dropout(p, draw(st.integers(0, 2**64 - 1)), draw(st.integers(0, 2**32 - 1)))
    return case, draw(window_size()), dropout


def _reference_kwargs(case, dropout):
    return {"dropout_p": dropout.p, "dropout_mask": dropout_mask(case.batch, case.nheads, case.seqlen_q, case.seqlen_k,
                                                                 dropout.p, dropout.seed, dropout.offset)}


@given(_problem(), st.booleans())
def test_dropout_matches_reference(problem, deterministic):
    """kernel_paths.run_path's kernels: SIMT for fp32, DMMA for fp64 up to d128 (SIMT past it), the
    tensor-core defaults for fp16/bf16."""
    case, window, dropout = problem
    q, k, v, do = make_inputs(case)
    o, lse, *grads = run_path(case, window, q, k, v, do, deterministic, variant={"dropout": dropout})
    check_against_reference(case, window, q, k, v, do, o, lse, grads, _reference_kwargs(case, dropout))


@given(_problem(SMALL_COST, dtypes=tuple(SIXTEEN_BIT)), st.sampled_from(MMA_SYNC_BWD))
# the gpu profile's find (2026-12-06): one key a row, so the reference's dq and standard attention's
# are 0 and D's error, rounded into bfloat16 twice (dS, then dq), was all of dq's (the rule now
# takes those roundings)
@example(problem=(AttentionCase(batch=1, seqlen_q=223, seqlen_k=1, nheads_kv=1, group=1, headdim=40, causal=False,
                                softmax_scale=None, magnitude=2.8284271247461903, dtype=as_dtype("bfloat16"), seed=1,
                                window_size=(-1, -1), headdim_v=40),
                  (-1, 0), Dropout(p=0.1, seed=0, offset=0, first_sequence=0)),
         path=("v5", True))
def test_mma_sync_kernels_with_dropout_match_reference(problem, path):
    """flash_fwd_mma and the mma.sync backward (sm_80's kernels), on whatever device runs the test."""
    case, window, dropout = problem
    q, k, v, do = make_inputs(case)
    o, lse, *grads = run_path(case, window, q, k, v, do, mma_sync=path, variant={"dropout": dropout})
    check_against_reference(case, window, q, k, v, do, o, lse, grads, _reference_kwargs(case, dropout))


@given(_problem(dtypes=tuple(SIXTEEN_BIT)), st.booleans())
def test_deterministic_backward_with_dropout_is_bitwise_repeatable(problem, mma_sync):
    case, window, dropout = problem
    q, k, v, do = make_inputs(case)
    path = ("v5", True) if mma_sync else None
    first = run_path(case, window, q, k, v, do, deterministic=True, mma_sync=path, variant={"dropout": dropout})
    again = run_path(case, window, q, k, v, do, deterministic=True, mma_sync=path, variant={"dropout": dropout})
    for a, b in zip(first, again):
        assert np.array_equal(a.view(np.uint16) if a.itemsize == 2 else a, b.view(np.uint16) if b.itemsize == 2 else b)


@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 300), st.integers(1, 300), st.floats(0.0, 0.99),
       st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1))
def test_mask_on_the_gpu_is_the_numpy_twins(batch, nheads, seqlen_q, seqlen_k, p, seed, offset):
    """dropout_mask(xp=cupy) compiles kernels_cu/dropout.cuh itself: the kernels' words, element by element."""
    import cupy

    on_gpu = dropout_mask(batch, nheads, seqlen_q, seqlen_k, p, seed, offset, xp=cupy).get()
    assert np.array_equal(on_gpu, dropout_mask(batch, nheads, seqlen_q, seqlen_k, p, seed, offset))


@given(_problem(), st.booleans())
def test_public_api_with_dropout_matches_reference(problem, deterministic):
    """flash_attn_func / flash_attn_backward with dropout_p, seed, offset on CuPy arrays; the
    vjp draws a seed once and uses it in both directions."""
    import cupy

    import cupyflash

    case, window, dropout = problem
    q, k, v, do = make_inputs(case)
    kwargs = dict(softmax_scale=case.softmax_scale, causal=case.causal, window_size=window, dropout_p=dropout.p,
                  seed=dropout.seed, offset=dropout.offset)
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    o, lse = cupyflash.flash_attn_func(qd, kd, vd, return_lse=True, **kwargs)
    grads = cupyflash.flash_attn_backward(cupy.asarray(do), qd, kd, vd, o, lse, deterministic=deterministic, **kwargs)
    check_against_reference(case, window, q, k, v, do, o.get(), lse.get(), [g.get() for g in grads],
                            _reference_kwargs(case, dropout))


@given(_problem(), st.data())
def test_dropout_with_score_variants_matches_reference(problem, data):
    """Dropout with softcap, ALiBi and a sink on the default kernels: the derivative's stash and
    the dropped elements' dS share flash_bwd_wgmma_dsplit's words (d256 on sm_90)."""
    from variants import variant_kwargs

    case, window, dropout = problem
    variant = data.draw(variant_kwargs(case.batch, case.nheads))
    q, k, v, do = make_inputs(case)
    o, lse, *grads = run_path(case, window, q, k, v, do, variant={**variant, "dropout": dropout})
    check_against_reference(case, window, q, k, v, do, o, lse, grads, {**variant, **_reference_kwargs(case, dropout)})

"""Packed variable-length batches on the GPU: flash_attn_varlen_func and its backward through every
kernel family (SIMT for every dtype, tensor cores for 16-bit) against the float64 reference under
the tolerance rule, ragged lengths with zeros and ones, GQA, causal and windows, outputs poisoned
with NaN. For now the GPU path is one dense launch per sequence (cupyflash/varlen.py); these tests
hold for the kernel path that reads cu_seqlens itself too. Marker ``gpu``."""
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
# Examples per property: each one is a launch per sequence and a float64 reference on the CPU, so
# fewer than the dense properties' 200 keep these files to a few minutes of device time.
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
    """Decode-shaped packing: 300 sequences of one query over ragged keys (one launch each, for now)."""
    rng = np.random.default_rng(5)
    seqlens_k = tuple(int(n) for n in rng.integers(0, 40, 300))
    problem = VarlenProblem((1,) * 300, seqlens_k, nheads_kv=1, group=8, headdim=64, causal=True,
                            softmax_scale=None, magnitude=1.0, dtype=ml_dtypes.bfloat16, seed=3)
    o, lse, grads = run_on_device(problem, "cuda")
    assert_varlen_close(problem, o, lse, grads)

"""flash_attn_with_kvcache on the GPU: CuPy caches appended in place (byte for byte, the whole cache
against a copy with only the appended slots changed, strided views and torch tensors included),
attention over contiguous and paged caches of every page size through every kernel family against
the float64 reference, outputs poisoned with NaN and every slot outside the sequences NaN. For now
the GPU path is one dense launch per sequence over gathered pages (cupyflash/kvcache.py). Marker
``gpu``."""
from __future__ import annotations

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings

import cupyflash
from cupyflash.testing import KVCacheProblem, assert_kvcache_close, poisoned_outputs
from cupyflash.testing.strategies import kvcache_problems
from kvcache_checks import assert_call_result, assert_same_bytes, expected_caches

pytestmark = pytest.mark.gpu

SIXTEEN_BIT = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]
ALL_DTYPES = SIXTEEN_BIT + [np.dtype(np.float32), np.dtype(np.float64)]
GPU_COST = 8e6
EXAMPLES = 60  # per property (a launch per sequence and a float64 reference on the CPU each)


def on_device(inputs, index_arrays_on_device=True):
    import cupy

    moved = {}
    for name, x in inputs.items():
        is_index = name in ("cache_seqlens", "cache_batch_idx", "block_table")
        moved[name] = x if x is None or np.ndim(x) == 0 or (is_index and not index_arrays_on_device) \
            else cupy.asarray(x)
    return moved


def check_on_device(problem, backend, index_arrays_on_device=True):
    before = problem.inputs()
    inputs = on_device(problem.inputs(), index_arrays_on_device)
    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_with_kvcache(**inputs, return_softmax_lse=True, backend=backend,
                                                   **problem.kwargs)
    assert_call_result(problem, before, inputs, o, lse)


@settings(max_examples=EXAMPLES)
@given(problem=kvcache_problems(dtypes=ALL_DTYPES, windows=True, max_capacity=1100, max_new=8, max_seqlen_q=8,
                                max_headdim=256, max_cost=GPU_COST))
def test_simt_appends_in_place_and_matches_the_reference(problem):
    check_on_device(problem, "simt", index_arrays_on_device=problem.seed % 2 == 0)


@settings(max_examples=EXAMPLES)
@given(problem=kvcache_problems(dtypes=SIXTEEN_BIT, windows=True, max_capacity=1100, max_new=8, max_seqlen_q=8,
                                max_headdim=256, max_group=8, max_cost=GPU_COST))
def test_tensor_cores_append_in_place_and_match_the_reference(problem):
    check_on_device(problem, "mma", index_arrays_on_device=problem.seed % 2 == 0)


def problem_with(**changes):
    base = KVCacheProblem(cache_seqlens=(5, 0, 300, 77), seqlen_q=1, seqlen_new=1, capacity=512, page_size=16,
                          spare=5, shuffle=True, nheads_kv=2, group=4, headdim=128, causal=True, softmax_scale=None,
                          magnitude=1.0, dtype=ml_dtypes.bfloat16, seed=17)
    return replace(base, **changes)


@pytest.mark.parametrize("page_size", [None, 1, 3, 16, 17, 64, 256])
@pytest.mark.parametrize("seqlen_new", [0, 1, 4])
def test_every_page_size(page_size, seqlen_new):
    capacity = 512 if page_size is None else -(-512 // page_size) * page_size
    check_on_device(problem_with(page_size=page_size, capacity=capacity, seqlen_new=seqlen_new,
                                 seqlen_q=max(seqlen_new, 1)), "cuda")


def test_strided_cupy_cache_views_are_written_in_place():
    """CuPy's index assignment into a view with gaps (every other head, rows reversed) writes the
    base buffer's slots and nothing else of it."""
    import cupy

    problem = problem_with(page_size=None, capacity=400, spare=0, shuffle=False, seqlen_new=3, seqlen_q=3)
    before = problem.inputs()
    inputs = on_device(problem.inputs())
    rng = np.random.default_rng(1)
    bases, expected_bases = [], []
    for name, expected in zip(("k_cache", "v_cache"), expected_caches(before)):
        cache = inputs[name]
        base_host = rng.standard_normal((cache.shape[0], cache.shape[1], 2 * cache.shape[2], cache.shape[3]))
        base_host = base_host.astype(cache.dtype)
        base_host[::-1, :, ::2] = before[name]
        base = cupy.asarray(base_host)
        inputs[name] = base[::-1, :, ::2]
        bases.append(base)
        base_host[::-1, :, ::2] = expected
        expected_bases.append(base_host)
    o, lse = cupyflash.flash_attn_with_kvcache(**inputs, return_lse=True, **problem.kwargs)
    assert_kvcache_close(problem, o, lse, inputs=before)
    for name, base, expected in zip(("k base", "v base"), bases, expected_bases):
        assert_same_bytes(name, base.get(), expected)


def test_numpy_caches_are_appended_on_the_host_and_attended_on_the_device():
    problem = problem_with(dtype=np.float32, seqlen_new=2, seqlen_q=2)
    before, inputs = problem.inputs(), problem.inputs()
    o, lse = cupyflash.flash_attn_with_kvcache(**inputs, return_lse=True, backend="cuda", **problem.kwargs)
    assert isinstance(o, np.ndarray)
    assert_kvcache_close(problem, o, lse, inputs=before)
    k_expected, v_expected = expected_caches(before)
    assert_same_bytes("k_cache", inputs["k_cache"], k_expected)
    assert_same_bytes("v_cache", inputs["v_cache"], v_expected)


def test_torch_cuda_caches_are_written_in_place():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    problem = problem_with(dtype=np.float16, seqlen_new=2, seqlen_q=2)
    before = problem.inputs()
    inputs = {name: x if x is None or np.ndim(x) == 0 else torch.from_numpy(np.array(x)).cuda()
              for name, x in problem.inputs().items()}
    o, lse = cupyflash.flash_attn_with_kvcache(**inputs, return_lse=True, **problem.kwargs)
    torch.cuda.synchronize()
    assert_kvcache_close(problem, o, lse, inputs=before)
    k_expected, v_expected = expected_caches(before)
    assert_same_bytes("k_cache", inputs["k_cache"].cpu().numpy(), k_expected)
    assert_same_bytes("v_cache", inputs["v_cache"].cpu().numpy(), v_expected)


@pytest.mark.parametrize("page_size", [None, 16, 256])
def test_decode_step_of_a_gqa_model(page_size):
    """One decode step at a model's shape: 8 sequences of ragged lengths up to 4k, 32 query heads on 8
    kv heads, d128, bf16, one new token each."""
    lengths = (4000, 1, 0, 2047, 300, 3999, 128, 1024)
    capacity = 4096
    problem = KVCacheProblem(cache_seqlens=lengths, seqlen_q=1, seqlen_new=1, capacity=capacity, page_size=page_size,
                             spare=7, shuffle=True, nheads_kv=8, group=4, headdim=128, causal=True,
                             softmax_scale=None, magnitude=1.0, dtype=ml_dtypes.bfloat16, seed=23)
    check_on_device(problem, "cuda")

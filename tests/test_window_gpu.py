"""Sliding windows on every GPU kernel family, against the float64 reference (tolerance.py's
rule), with NaN-poisoned outputs and fresh random inputs per example.

Families (kernel_paths.run_path): SIMT forwards for float32, and for float64 past d128 (DMMA up to
it), both backwards on the DMMA kernels up to d128 (float32 as tf32x3) and SIMT's past it; for float16/bfloat16 the device's default tensor-core
kernels (on sm_90: flash_fwd_wgmma and the v10 wgmma backward; on sm_80: flash_fwd_mma and the
mma.sync backward), and the mma.sync kernels of sm_80 on any device through their overrides:
``mma_fwd.forward(config=FwdConfig(...))`` (flash_fwd_mma) and ``mma_bwd.backward(version=...)``
("v5": v3's two kernels when deterministic, the fused kernel otherwise; "v3" without
determinism: the atomic dK/dV kernels that run where the fused one does not fit). Then the public
API, whose window reaches the same kernels.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from strategies import attention_case, make_inputs
from tolerance import SIXTEEN_BIT
from kernel_paths import MMA_SYNC_BWD, check_against_reference as _check, run_path as _run
from windows import window_size

pytestmark = pytest.mark.gpu
GPU_MAX_COST = 4e7
SMALL_COST = 4e6  # the override properties: small shapes, so 200 examples stay within the budget

def _mma_case(max_cost=GPU_MAX_COST, **kw):
    return attention_case(max_cost=max_cost, **kw).filter(
        lambda c: c.dtype not in SIXTEEN_BIT or (c.headdim % 8 == 0 and c.headdim <= 256))


def _bitwise(a, b):
    return np.array_equal(a.view(np.uint16) if a.itemsize == 2 else a, b.view(np.uint16) if b.itemsize == 2 else b)


@given(_mma_case(), window_size(), st.booleans())
def test_window_matches_reference(case, window, deterministic):
    """kernel_paths.run_path's kernels (the module's docstring), the tensor-core defaults for fp16/bf16."""
    q, k, v, do = make_inputs(case)
    o, lse, *grads = _run(case, window, q, k, v, do, deterministic)
    _check(case, window, q, k, v, do, o, lse, grads)


@given(_mma_case(SMALL_COST, dtypes=tuple(SIXTEEN_BIT)), window_size(), st.sampled_from(MMA_SYNC_BWD))
def test_mma_sync_kernels_with_window_match_reference(case, window, path):
    """flash_fwd_mma and the mma.sync backward (sm_80's kernels), on whatever device runs the test."""
    q, k, v, do = make_inputs(case)
    o, lse, *grads = _run(case, window, q, k, v, do, mma_sync=path)
    _check(case, window, q, k, v, do, o, lse, grads)


@given(_mma_case(dtypes=tuple(SIXTEEN_BIT)), window_size(), st.booleans())
def test_deterministic_backward_with_window_is_bitwise_repeatable(case, window, mma_sync):
    q, k, v, do = make_inputs(case)
    path = ("v5", True) if mma_sync else None
    first = _run(case, window, q, k, v, do, deterministic=True, mma_sync=path)
    for _ in range(3):
        again = _run(case, window, q, k, v, do, deterministic=True, mma_sync=path)
        for a, b in zip(first, again):
            assert _bitwise(a, b)


@given(_mma_case(), window_size(), st.booleans())
def test_public_api_with_window_matches_reference(case, window, deterministic):
    """flash_attn_func / flash_attn_backward with window_size on CuPy arrays (backend "auto")."""
    import cupy

    import cupyflash

    q, k, v, do = make_inputs(case)
    arrays = [cupy.asarray(x) for x in (q, k, v)]
    kwargs = dict(softmax_scale=case.softmax_scale, causal=case.causal, window_size=window)
    o, lse = cupyflash.flash_attn_func(*arrays, return_lse=True, **kwargs)
    grads = cupyflash.flash_attn_backward(cupy.asarray(do), *arrays, o, lse, deterministic=deterministic, **kwargs)
    _check(case, window, q, k, v, do, o.get(), lse.get(), [g.get() for g in grads])


@pytest.mark.parametrize("mma_sync", [None, *MMA_SYNC_BWD])
@pytest.mark.parametrize("window", [(1024, 0), (512, 512), (0, 0), (1, 1), (127, 128), (5000, -1)])
def test_long_window_matches_reference(window, mma_sync):
    """One long sequence (2k): many key blocks skipped at both ends, the walk starting deep."""
    import ml_dtypes

    from strategies import AttentionCase

    case = AttentionCase(1, 2048, 2048, 1, 2, 128, False, None, 1.0, np.dtype(ml_dtypes.bfloat16), 7)
    q, k, v, do = make_inputs(case)
    o, lse, *grads = _run(case, window, q, k, v, do, mma_sync=mma_sync)
    _check(case, window, q, k, v, do, o, lse, grads)

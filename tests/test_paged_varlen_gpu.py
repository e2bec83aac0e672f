"""flash_attn_varlen_func with block_table on the GPU: the KV-cache kernel (16-bit, head dims
multiples of 8) and the per-sequence path (float32, float64) against the float64 reference of the
same keys packed, under the tolerance rule (16-bit: against standard attention in that dtype, per
sequence), outputs NaN-poisoned; pages in a shuffled order, unused slots NaN. CPU:
tests/test_paged_varlen.py. Both forms of the call, forced: queries padded into rows (the KV-cache
kernel) and keys gathered (the packed varlen kernels).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupyflash
from cupyflash import reference
from cupyflash.testing import poisoned_outputs
from cupyflash.testing.tolerance import OUTPUT_FACTOR, assert_close
from test_paged_varlen import _cu, paged

pytestmark = pytest.mark.gpu

LENGTHS_Q = [1, 37, 0, 200, 64]
LENGTHS_K = [300, 37, 5, 700, 0]


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("page_size", [16, 7])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("form", ["padded", "gathered"])
def test_matches_the_reference(dtype, page_size, causal, form, monkeypatch):
    import cupy

    from cupyflash import kvcache

    monkeypatch.setattr(kvcache, "PAGED_VARLEN_MAX_PADDING", 10**9 if form == "padded" else 0)
    rng = np.random.default_rng(page_size)
    q = rng.standard_normal((sum(LENGTHS_Q), 8, 128)).astype(dtype)
    k = rng.standard_normal((sum(LENGTHS_K), 2, 128)).astype(dtype)
    v = rng.standard_normal((sum(LENGTHS_K), 2, 128)).astype(dtype)
    k_pages, table = paged(k, LENGTHS_K, page_size, seed=1)
    v_pages, _ = paged(v, LENGTHS_K, page_size, seed=1)
    cu_q, cu_k = _cu(LENGTHS_Q), _cu(LENGTHS_K)
    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_varlen_func(cupy.asarray(q), cupy.asarray(k_pages), cupy.asarray(v_pages),
                                                  cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K), causal=causal,
                                                  block_table=cupy.asarray(table), return_lse=True)
    o_ref, lse_ref = reference.varlen_attention(q, k, v, cu_q, cu_k, causal=causal)
    o_std, lse_std = o_ref.copy(), lse_ref.copy()
    for b in range(len(LENGTHS_Q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if LENGTHS_Q[b] and LENGTHS_K[b]:
            o_b, lse_b = reference.standard_attention(q[None, rows], k[None, keys], v[None, keys], causal=causal,
                                                      dtype=dtype)
            o_std[rows], lse_std[:, rows] = o_b[0], lse_b[0]
    assert_close("o", cupy.asnumpy(o), o_ref, o_std, dtype=dtype, factor=OUTPUT_FACTOR)
    assert_close("lse", cupy.asnumpy(lse), lse_ref, lse_std, dtype=dtype, factor=OUTPUT_FACTOR)

"""flash_attn_func's decode-shaped calls (at most 16 (query, head) rows per kv head) on the KV-cache
kernel (kernels_cu/flash_fwd_kvcache_mma.cu, api._decode_by_cache_kernel): against the float64
reference with outputs NaN-poisoned, with the kernel taken, and the dense kernels still taking
everything else. Marker ``gpu``."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupyflash
from cupyflash.kernels import kvcache_mma
from cupyflash.testing import AttentionProblem, assert_attention_close, poisoned_outputs

pytestmark = pytest.mark.gpu


@pytest.fixture
def launches(monkeypatch):
    seen = []
    forward = kvcache_mma.forward

    def spy(*args, **kwargs):
        seen.append(forward(*args, **kwargs))
        return seen[-1]
    monkeypatch.setattr(kvcache_mma, "forward", spy)
    return seen


def run(problem, variant=None):
    """``variant``: NumPy arrays (the reference's); the call gets them as CuPy arrays."""
    import cupy

    q, k, v, _ = (cupy.asarray(x) for x in problem.arrays())
    on_device = {name: cupy.asarray(x) if isinstance(x, np.ndarray) else x for name, x in (variant or {}).items()}
    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_func(q, k, v, return_lse=True, **problem.kwargs, **on_device)
    assert_attention_close(problem, o, lse, variant=variant)


@pytest.mark.parametrize("seqlen_q, group", [(1, 1), (1, 4), (1, 8), (2, 8), (4, 4), (16, 1)])
@pytest.mark.parametrize("seqlen_k", [1, 63, 1000, 9000])
@pytest.mark.parametrize("causal", [False, True])
def test_decode_shapes_take_the_cache_kernel(seqlen_q, group, seqlen_k, causal, launches):
    problem = AttentionProblem(batch=3, seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads_kv=2, group=group, headdim=128,
                               causal=causal, softmax_scale=None, magnitude=1.0, dtype=ml_dtypes.bfloat16, seed=seqlen_k)
    run(problem)
    assert len(launches) == 1


@pytest.mark.parametrize("variant", [{"softcap": 20.0}, {"alibi_slopes": np.linspace(0.05, 0.5, 8).astype(np.float32)}])
def test_decode_variants(variant, launches):
    problem = AttentionProblem(batch=2, seqlen_q=1, seqlen_k=3000, nheads_kv=2, group=4, headdim=64, causal=True,
                               softmax_scale=None, magnitude=1.0, dtype=np.float16, seed=4, window_size=(500, 0))
    run(problem, variant)
    assert launches


def test_more_rows_stay_on_the_dense_kernels(launches):
    problem = AttentionProblem(batch=1, seqlen_q=5, seqlen_k=700, nheads_kv=1, group=4, headdim=64, causal=True,
                               softmax_scale=None, magnitude=1.0, dtype=ml_dtypes.bfloat16, seed=1)
    run(problem)
    assert not launches

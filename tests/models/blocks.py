"""Inputs and plain-matmul references for one block of a kernel model."""
from __future__ import annotations

import math

import numpy as np


def seeded_rng(*key) -> np.random.Generator:
    return np.random.default_rng([7, *key])


def bwd_inputs(rng, seqlen_q, seqlen_k, headdim):
    q, do = (rng.standard_normal((seqlen_q, headdim)) / headdim ** 0.25 for _ in range(2))
    k, v = (rng.standard_normal((seqlen_k, headdim)) / headdim ** 0.25 for _ in range(2))
    lse, delta = rng.standard_normal((2, seqlen_q))
    return q, k, v, do, lse, delta


def bwd_reference(q, k, v, do, lse, delta, scale):
    p_t = np.exp2(np.minimum(k @ q.T * scale * math.log2(math.e) - lse[None, :] * math.log2(math.e), 0.0))
    ds_t = p_t * (v @ do.T - delta[None, :])
    return scale * ds_t @ q, p_t @ do, ds_t.T @ k  # dK, dV, dq_accum (unscaled: dq_convert scales)


def assert_float64_close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)

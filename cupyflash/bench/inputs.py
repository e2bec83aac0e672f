"""Random device inputs for a benchmark case.

Standard-normal values cast to the case's dtype: zeros would let hardware and kernels take
shortcuts (and make every softmax uniform), so the benchmark never times them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .shapes import ITEMSIZE, Case


def device_dtype(name: str):
    """NumPy dtype object of a benchmark dtype name ("bf16" -> ml_dtypes.bfloat16)."""
    if name == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"fp16": np.float16, "fp32": np.float32}[name])


@dataclass
class InputSet:
    """q, do: (B, Sq, H, D); k, v: (B, Sk, Hkv, D), all contiguous CuPy arrays."""

    q: object
    k: object
    v: object
    do: object


def set_bytes(case: Case) -> int:
    """Device bytes of one InputSet."""
    q = case.batch * case.seqlen_q * case.nheads * case.headdim
    kv = case.batch * case.seqlen_k * case.nheads_kv * case.headdim
    return 2 * (q + kv) * ITEMSIZE[case.dtype]


def make_input_sets(case: Case, n_sets: int, *, seed: int = 0) -> list[InputSet]:
    """``n_sets`` independent input sets, reproducible from ``seed``; created on the current
    CuPy stream."""
    import cupy

    dtype = device_dtype(case.dtype)
    q_shape = (case.batch, case.seqlen_q, case.nheads, case.headdim)
    kv_shape = (case.batch, case.seqlen_k, case.nheads_kv, case.headdim)
    def normal(rng, shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False)

    sets = []
    for index in range(n_sets):
        rng = cupy.random.default_rng(seed * 1000 + index)
        sets.append(InputSet(normal(rng, q_shape), normal(rng, kv_shape), normal(rng, kv_shape),
                             normal(rng, q_shape)))
    return sets

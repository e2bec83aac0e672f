"""Launcher of ``kernels_cu/merge_attention_states.cu`` (the LSE-rule merge of two attention
results); the public function, its checks and its NumPy twin are in ``cupyflash/merge.py``.

Specializations: o_a and o_b of one dtype (all four), and a float32 o_a with a 16-bit o_b (a
float32 running result that 16-bit partial results merge into, as the ring does). The result has
o_a's dtype; the math is float32 (float64 for float64).
"""
from __future__ import annotations

import math

import numpy as np

from ._module import Specialization, launch
from .constants import CTYPES, SHORT_NAMES, SIXTEEN_BIT
from .params import MERGE_PARAMS, pointer, set_rows

__all__ = ["ROWS_PER_BLOCK", "specialization", "specializations", "merge"]

ROWS_PER_BLOCK = 4  # one warp per row: kernels_cu/merge_attention_states.cu's MERGE_ROWS_PER_BLOCK
SOURCE = "merge_attention_states.cu"


def _pairs() -> list[tuple[str, str]]:
    """(dtype of o_a and of the result, dtype of o_b) of every specialization."""
    return [(name, name) for name in CTYPES] + [("float32", name) for name in SIXTEEN_BIT]


def specialization(dtype_a: str, dtype_b: str) -> Specialization:
    """The kernel for o_a of ``dtype_a`` (and the result) and o_b of ``dtype_b``, by dtype name."""
    if (dtype_a, dtype_b) not in _pairs():
        raise ValueError(f"merge_attention_states: no kernel for o_a {dtype_a} with o_b {dtype_b}; "
                         f"o_b must have o_a's dtype, or o_a float32 with a 16-bit o_b")
    # One dtype: merge_attention_states_<dt>. A float32 result of a 16-bit o_b:
    # merge_attention_states_<o_b's dt>_into_fp32 (the name's first dtype token is the input's).
    name = f"merge_attention_states_{SHORT_NAMES[dtype_b]}"
    if dtype_a != dtype_b:
        name += f"_into_{SHORT_NAMES[dtype_a]}"
    return Specialization(name, SOURCE, f"cf::merge_attention_states<{CTYPES[dtype_a]}, {CTYPES[dtype_b]}>",
                          32 * ROWS_PER_BLOCK, 0)


def specializations() -> list[Specialization]:
    """Every merge kernel (for the compile check)."""
    return [specialization(a, b) for a, b in _pairs()]


def _set_lse(params, name: str, lse) -> None:
    field = params[name]
    field["data"] = pointer(lse)
    field["batch_stride"], field["head_stride"], field["row_stride"] = (np.int64(s // lse.itemsize)
                                                                        for s in lse.strides)


def merge_params(o_a, lse_a, o_b, lse_b, o, lse) -> np.ndarray:
    """MergeParams of one call (a size-1 array of MERGE_PARAMS: CuPy passes its bytes by value)."""
    params = np.zeros(1, MERGE_PARAMS)
    for name, a in (("o_a", o_a), ("o_b", o_b), ("o", o)):
        set_rows(params, name, a)
    for name, a in (("lse_a", lse_a), ("lse_b", lse_b), ("lse", lse)):
        _set_lse(params, name, a)
    batch, seqlen, nheads, headdim = o.shape
    params["batch"], params["seqlen"] = np.int32(batch), np.int32(seqlen)
    params["nheads"], params["headdim"] = np.int32(nheads), np.int32(headdim)
    return params


def merge(o_a, lse_a, o_b, lse_b, o, lse) -> None:
    """o, lse = the merge of (o_a, lse_a) and (o_b, lse_b), on the current stream. CuPy arrays,
    checked by the caller: o's (batch, seqlen, nheads, headdim) with a contiguous last dimension
    (any other strides), lse's (batch, nheads, seqlen) of the accumulator dtype (any strides).
    o may be o_a and lse may be lse_a."""
    from .._dtypes import dtype_name

    batch, seqlen, nheads, _ = o.shape
    rows = batch * seqlen * nheads
    if rows == 0:
        return
    spec = specialization(dtype_name(o_a.dtype), dtype_name(o_b.dtype))
    launch(spec, (math.ceil(rows / ROWS_PER_BLOCK), 1, 1), (merge_params(o_a, lse_a, o_b, lse_b, o, lse),))

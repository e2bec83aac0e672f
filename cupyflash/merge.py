"""Merging attention results over disjoint key sets by the LSE rule.

Attention of a query over keys A ∪ B (disjoint) from the results over A and over B:

    lse = log(exp(lse_a) + exp(lse_b))
    o   = exp(lse_a - lse) · o_a + exp(lse_b - lse) · o_b

Ring attention merges one such partial result per step; a split-KV decode merges its splits.

- ``merge_attention_states``: the public function; CuPy arrays run the CUDA kernel
  (``kernels_cu/merge_attention_states.cu``), NumPy arrays its NumPy twin.
- ``merge_attention_states_numpy``: the twin, the kernel's steps in the kernel's order and
  precision (float32 math; float64 for float64).
- ``merge_attention_states_reference``: float64 from the formula above (``np.logaddexp``), sharing
  no code with the twin, for tests.

Edge cases, the same in all three: a side with lse = -inf saw no key; its weight is exactly 0 and
its o is not read (both -inf: o = 0, lse = -inf). A side with a finite lse is always read, so a
NaN in its o reaches the result even where its weight underflows to 0, as in a single pass over
both key sets. A NaN lse gives NaN lse and o; an lse of +inf gives lse = +inf and a NaN o.
"""
from __future__ import annotations

import numpy as np

from ._dtypes import dtype_name, is_16bit, lse_dtype

__all__ = ["merge_attention_states", "merge_attention_states_numpy", "merge_attention_states_reference"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _kind(x, name: str) -> str:
    if isinstance(x, np.ndarray):
        return "numpy"
    if type(x).__module__.split(".")[0] == "cupy":
        return "cupy"
    raise TypeError(f"merge_attention_states: {name} must be a NumPy or CuPy array, got {type(x).__name__}")


def _check(o_a, lse_a, o_b, lse_b, out, lse_out):
    """The array module and the result dtypes, or a ValueError/TypeError naming the argument."""
    arrays = {"o_a": o_a, "lse_a": lse_a, "o_b": o_b, "lse_b": lse_b}
    if out is not None:
        arrays["out"] = out
    if lse_out is not None:
        arrays["lse_out"] = lse_out
    kinds = {_kind(x, name) for name, x in arrays.items()}
    if len(kinds) != 1:
        raise TypeError("merge_attention_states: the arrays must all be NumPy or all CuPy")
    if o_a.ndim != 4:
        raise ValueError(f"merge_attention_states: o_a must be (batch, seqlen, nheads, headdim), got shape {o_a.shape}")
    if o_b.shape != o_a.shape:
        raise ValueError(f"merge_attention_states: o_b {o_b.shape} must have o_a's shape {o_a.shape}")
    batch, seqlen, nheads, _ = o_a.shape
    name_a, name_b = dtype_name(o_a.dtype), dtype_name(o_b.dtype)
    if not (name_a == name_b or (name_a == "float32" and is_16bit(o_b.dtype))):
        raise ValueError(f"merge_attention_states: o_a is {name_a} and o_b {name_b}; o_b must have o_a's dtype, "
                         "or o_a float32 with a 16-bit o_b")
    acc = lse_dtype(o_a.dtype)
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b), ("lse_out", lse_out)):
        if lse is None:
            continue
        if lse.shape != (batch, nheads, seqlen):
            raise ValueError(f"merge_attention_states: {name} {lse.shape} must be (batch, nheads, seqlen) = "
                             f"{(batch, nheads, seqlen)}")
        if lse.dtype != acc:
            raise ValueError(f"merge_attention_states: {name} is {lse.dtype}, expected {acc} for {name_a} o")
    if out is not None and (out.shape != o_a.shape or out.dtype != o_a.dtype):
        raise ValueError(f"merge_attention_states: out {out.shape} {out.dtype} must have o_a's shape and dtype "
                         f"{o_a.shape} {o_a.dtype}")
    return kinds.pop(), acc


def merge_attention_states(o_a, lse_a, o_b, lse_b, *, out=None, lse_out=None):
    """(o, lse) of attention over the union of two disjoint key sets, from the results over each.

    o_a, o_b: (batch, seqlen, nheads, headdim); lse_a, lse_b: (batch, nheads, seqlen), natural log,
    float32 (float64 for float64 o), as ``flash_attn_func(..., return_lse=True)`` returns them.
    o_b has o_a's dtype, or o_a is float32 and o_b 16-bit (a float32 running result). The math is
    float32 (float64 for float64); o has o_a's dtype. ``out`` / ``lse_out``: where to write (they
    may be o_a / lse_a: accumulation in place; a CuPy ``out`` needs a contiguous last dimension).
    CuPy arrays run the CUDA kernel on the current stream, NumPy arrays the NumPy twin. Any strides.
    """
    kind, acc = _check(o_a, lse_a, o_b, lse_b, out, lse_out)
    if kind == "numpy":
        return merge_attention_states_numpy(o_a, lse_a, o_b, lse_b, out=out, lse_out=lse_out)
    import cupy

    from .kernels import merge as merge_kernel

    o_a, o_b = (x if x.strides[-1] == x.itemsize or x.shape[-1] <= 1 else cupy.ascontiguousarray(x)
                for x in (o_a, o_b))
    if out is None:
        out = cupy.empty(o_a.shape, o_a.dtype)
    elif out.strides[-1] != out.itemsize and out.shape[-1] > 1:
        raise ValueError("merge_attention_states: a CuPy out needs a contiguous last dimension")
    if lse_out is None:
        lse_out = cupy.empty(lse_a.shape, acc)
    merge_kernel.merge(o_a, lse_a, o_b, lse_b, out, lse_out)
    return out, lse_out


def merge_attention_states_numpy(o_a, lse_a, o_b, lse_b, *, out=None, lse_out=None):
    """The NumPy twin of the kernel: its steps, in its order and its accumulator precision.
    Arrays as for ``merge_attention_states`` (NumPy, unchecked)."""
    acc = lse_dtype(o_a.dtype)
    lse_a, lse_b = lse_a.astype(acc, copy=False), lse_b.astype(acc, copy=False)
    # The kernel's selection, not np.maximum: with a NaN the other side may be chosen, and that
    # NaN still makes its own exponential NaN below.
    m = np.where(lse_a > lse_b, lse_a, lse_b)
    m_ref = np.where(np.isfinite(m), m, acc.type(0))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        e_a = np.exp2((lse_a - m_ref) * acc.type(LOG2E))
        e_b = np.exp2((lse_b - m_ref) * acc.type(LOG2E))
        total = e_a + e_b
        lse = m_ref + np.log2(total) * acc.type(LN2)
        w_a, w_b = e_a / total, e_b / total

    def weighted(w, lse_side, o_side):
        # (batch, nheads, seqlen) -> (batch, seqlen, nheads, 1); a side that saw no key is not read.
        read = np.moveaxis(lse_side != -np.inf, 1, 2)[..., None]
        with np.errstate(invalid="ignore", over="ignore"):
            return np.where(read, np.moveaxis(w, 1, 2)[..., None] * o_side.astype(acc), acc.type(0))

    o = weighted(w_a, lse_a, o_a) + weighted(w_b, lse_b, o_b)
    if out is None:
        out = np.empty(o_a.shape, o_a.dtype)
    if lse_out is None:
        lse_out = np.empty(lse_a.shape, acc)
    out[...] = o.astype(out.dtype)
    lse_out[...] = lse
    return out, lse_out


def merge_attention_states_reference(o_a, lse_a, o_b, lse_b):
    """The merge in float64 from its formula: lse = logaddexp(lse_a, lse_b), o = the sum over the
    sides whose lse is not -inf of exp(lse_side - lse) o_side (0 when neither is)."""
    o_a, o_b, lse_a, lse_b = (np.asarray(x).astype(np.float64) for x in (o_a, o_b, lse_a, lse_b))
    with np.errstate(invalid="ignore"):  # logaddexp(inf, inf) and NaN inputs warn
        lse = np.logaddexp(lse_a, lse_b)
    o = np.zeros(o_a.shape)
    for lse_side, o_side in ((lse_a, o_a), (lse_b, o_b)):
        with np.errstate(invalid="ignore"):
            weight = np.moveaxis(np.exp(lse_side - lse), 1, 2)[..., None]
        seen = np.moveaxis(lse_side != -np.inf, 1, 2)[..., None]
        o = o + np.where(seen, weight * o_side, 0.0)
    return o, lse

"""Packed layouts: q, k and v stacked in one array (``qkv``), or k and v in one (``kv``) — flash-attn
2.8's flash_attn_qkvpacked_func, flash_attn_kvpacked_func and their varlen forms.

A packed array is unpacked into views (no copy: each view keeps the packed array's strides, which
the kernels take as they are) and computed by flash_attn_func / flash_attn_varlen_func with the
same options; the vjps stack the gradients back into the packed layout, one array.

    qkv (batch, seqlen, 3, nheads, headdim)        dense, q, k, v of one shape (no GQA, as flash-attn)
    kv  (batch, seqlen_k, 2, nheads_kv, headdim)   dense, with q (batch, seqlen_q, nheads, headdim)
    qkv (total, 3, nheads, headdim)                packed batch (varlen), one cu_seqlens
    kv  (total_k, 2, nheads_kv, headdim)           packed batch, with q (total_q, nheads, headdim)
"""
from __future__ import annotations

import numpy as np

from . import _arrays as A
from .api import flash_attn_func, flash_attn_vjp
from .varlen import flash_attn_varlen_func, flash_attn_varlen_vjp

__all__ = ["flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_qkvpacked_vjp", "flash_attn_kvpacked_vjp",
           "flash_attn_varlen_qkvpacked_vjp", "flash_attn_varlen_kvpacked_vjp"]

# the layouts: (name, dimensions, the axis that holds the stacked tensors, what it holds)
_QKV = ("qkv", 5, 2, ("q", "k", "v"), "(batch, seqlen, 3, nheads, headdim)")
_KV = ("kv", 5, 2, ("k", "v"), "(batch, seqlen_k, 2, nheads_kv, headdim)")
_VARLEN_QKV = ("qkv", 4, 1, ("q", "k", "v"), "(total, 3, nheads, headdim)")
_VARLEN_KV = ("kv", 4, 1, ("k", "v"), "(total_k, 2, nheads_kv, headdim)")


def _unpack(packed, layout) -> tuple:
    """The stacked tensors of ``packed`` as views along the layout's axis (an array of the module it
    came in: NumPy, or CuPy for device arrays)."""
    name, ndim, axis, parts, shape = layout
    x = A.take_array(packed, name, A.array_kind(packed, name))
    if x.ndim != ndim or x.shape[axis] != len(parts):
        raise ValueError(f"{name} must be {shape} ({', '.join(parts)} stacked on axis {axis}); "
                         f"got shape {tuple(x.shape)}")
    index = (slice(None),) * axis
    return tuple(x[index + (i,)] for i in range(len(parts)))


def _packed_gradients(gradients, count: int, axis: int):
    """(d packed, *rest): the first ``count`` gradients stacked on ``axis`` (one array), the rest
    (dsink) as they are."""
    xp = np if isinstance(gradients[0], np.ndarray) else A._cupy()
    return (xp.stack(gradients[:count], axis=axis),) + tuple(gradients[count:])


def _packed_vjp(vjp, count: int, axis: int):
    def packed_vjp(do):
        gradients = _packed_gradients(vjp(do), count, axis)
        return gradients if len(gradients) > 1 else gradients[0]

    return packed_vjp


def _kv_gradients(vjp, axis: int):
    def kv_vjp(do):
        dq, *rest = vjp(do)
        return (dq,) + _packed_gradients(rest, 2, axis)

    return kv_vjp


def flash_attn_qkvpacked_func(qkv, **options):
    """flash_attn_func over q, k, v stacked in ``qkv`` (batch, seqlen, 3, nheads, headdim); the
    options and the result are flash_attn_func's."""
    return flash_attn_func(*_unpack(qkv, _QKV), **options)


def flash_attn_kvpacked_func(q, kv, **options):
    """flash_attn_func over q (batch, seqlen_q, nheads, headdim) and k, v stacked in ``kv`` (batch,
    seqlen_k, 2, nheads_kv, headdim), nheads a multiple of nheads_kv (GQA); the options and the
    result are flash_attn_func's."""
    return flash_attn_func(q, *_unpack(kv, _KV), **options)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, **options):
    """flash_attn_varlen_func over a packed batch with q, k, v stacked in ``qkv`` (total, 3, nheads,
    headdim): every sequence has as many keys as queries, ``cu_seqlens`` (batch + 1,) int32 and
    ``max_seqlen`` serve both; the options and the result are flash_attn_varlen_func's."""
    return flash_attn_varlen_func(*_unpack(qkv, _VARLEN_QKV), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  **options)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options):
    """flash_attn_varlen_func over q (total_q, nheads, headdim) and k, v stacked in ``kv`` (total_k,
    2, nheads_kv, headdim); the options and the result are flash_attn_varlen_func's."""
    return flash_attn_varlen_func(q, *_unpack(kv, _VARLEN_KV), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, **options)


def flash_attn_qkvpacked_vjp(qkv, **options):
    """(o, vjp) with vjp(do) -> dqkv, shaped like qkv (with a ``sink``: (dqkv, dsink)); the options
    are flash_attn_vjp's."""
    o, vjp = flash_attn_vjp(*_unpack(qkv, _QKV), **options)
    return o, _packed_vjp(vjp, 3, _QKV[2])


def flash_attn_kvpacked_vjp(q, kv, **options):
    """(o, vjp) with vjp(do) -> (dq, dkv), dkv shaped like kv (with a ``sink``: (dq, dkv, dsink));
    the options are flash_attn_vjp's."""
    o, vjp = flash_attn_vjp(q, *_unpack(kv, _KV), **options)
    return o, _kv_gradients(vjp, _KV[2])


def flash_attn_varlen_qkvpacked_vjp(qkv, cu_seqlens, max_seqlen, **options):
    """(o, vjp) with vjp(do) -> dqkv, shaped like qkv (with a ``sink``: (dqkv, dsink)); the options
    are flash_attn_varlen_vjp's."""
    o, vjp = flash_attn_varlen_vjp(*_unpack(qkv, _VARLEN_QKV), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                   **options)
    return o, _packed_vjp(vjp, 3, _VARLEN_QKV[2])


def flash_attn_varlen_kvpacked_vjp(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options):
    """(o, vjp) with vjp(do) -> (dq, dkv), dkv shaped like kv (with a ``sink``: (dq, dkv, dsink)); the
    options are flash_attn_varlen_vjp's."""
    o, vjp = flash_attn_varlen_vjp(q, *_unpack(kv, _VARLEN_KV), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, **options)
    return o, _kv_gradients(vjp, _VARLEN_KV[2])

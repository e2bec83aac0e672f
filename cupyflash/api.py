"""Public API: flash_attn_func, flash_attn_backward, flash_attn_vjp.

Layout (batch, seqlen, nheads, headdim) for q, k, v, o; lse is (batch, nheads, seqlen_q), natural
log. CuPy arrays in → CuPy out on the current stream; NumPy in → NumPy out (computed on the GPU when
one is usable); DLPack / CUDA-array-interface objects (torch, JAX) → zero-copy in, CuPy out.
"""
from __future__ import annotations

import numpy as np

from . import _arrays as A
from . import dispatch, testing
from ._dtypes import lse_dtype


def _convert(arrays: dict, on_gpu: bool) -> tuple[dict, bool]:
    """Arrays moved to the compute side, and whether results go back to NumPy."""
    kinds = {name: A.array_kind(x, name) for name, x in arrays.items()}
    host_out = all(kind in ("numpy", "foreign_host") for kind in kinds.values())
    convert = A.to_cupy if on_gpu else A.to_numpy
    converted = {name: A.last_dim_contiguous(convert(x, name)) for name, x in arrays.items()}
    return converted, host_out


def _on_gpu(backend: str) -> bool:
    if backend == "numpy":
        return False
    if backend == "auto":
        return dispatch.gpu_available()
    if not dispatch.gpu_available():
        raise RuntimeError(f"backend={backend!r} needs a CUDA device and none is usable "
                           "(use backend='numpy' or 'auto')")
    return True


def _empty(shape, dtype, fill=None):
    import cupy

    if testing.poison_enabled():
        return cupy.full(shape, np.nan, dtype=dtype)
    if fill is not None:
        return cupy.full(shape, fill, dtype=dtype)
    return cupy.empty(shape, dtype=dtype)


def _to_host(results, host_out: bool):
    if not host_out:
        return results
    return tuple(r.get() if hasattr(r, "get") and not isinstance(r, np.ndarray) else r for r in results)


def _to_device(results):
    import cupy

    return tuple(cupy.asarray(r) for r in results)


def _mma_ready(x, headdim_padded: int):
    """x as the tensor-core kernels need it: last dim padded to a multiple of 8, 16-byte rows."""
    import cupy

    aligned_strides = all(stride % (8 * x.itemsize) == 0
                          for size, stride in zip(x.shape[:3], x.strides[:3]) if size > 1)
    if x.shape[-1] == headdim_padded and aligned_strides and x.data.ptr % 16 == 0:
        return x
    padded = cupy.zeros(x.shape[:-1] + (headdim_padded,), dtype=x.dtype)
    padded[..., : x.shape[-1]] = x
    return padded


def flash_attn_func(q, k, v, *, softmax_scale=None, causal=False, return_lse=False, backend="auto"):
    """Exact attention softmax(q kᵀ · scale) v, computed tile by tile without materialising S.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim) with
    nheads % nheads_kv == 0 (GQA/MQA). ``causal`` masks bottom-right aligned: query i sees key j iff
    j <= i + seqlen_k - seqlen_q; a row that sees no key outputs 0 and has lse = -inf.
    Returns o (like q), or (o, lse) with lse (batch, nheads, seqlen_q) float32 (float64 for float64).
    backend: 'auto' (tensor cores for 16-bit, SIMT otherwise, NumPy without a GPU), 'cuda',
    'mma', 'simt' or 'numpy'.
    """
    backend = A.check_backend(backend)
    causal = A.check_flag(causal, "causal")
    return_lse = A.check_flag(return_lse, "return_lse")
    on_gpu = _on_gpu(backend)
    arrays, host_out = _convert({"q": q, "k": k, "v": v}, on_gpu)
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    dtype = A.check_dtype(arrays)
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim = A.check_qkv_shapes(q, k, v)
    scale = A.resolve_scale(softmax_scale, headdim)
    A.same_device(arrays)
    which = dispatch.choose(backend, dtype, headdim, "fwd")

    if which == "numpy":
        from . import numpy_backend

        o, lse = numpy_backend.forward(q, k, v, softmax_scale=scale, causal=causal)
        if not host_out:
            o, lse = _to_device((o, lse))
    else:
        o, lse = _forward_gpu(which, q, k, v, scale, causal)
        o, lse = _to_host((o, lse), host_out)
    return (o, lse) if return_lse else o


def _forward_gpu(which, q, k, v, scale, causal):
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k = k.shape[1]
    lse = _empty((batch, nheads, seqlen_q), lse_dtype(q.dtype))
    if seqlen_k == 0 or seqlen_q == 0 or batch == 0 or nheads == 0:
        lse.fill(-np.inf)
        o = _empty(q.shape, q.dtype)
        o.fill(0)
        return o, lse
    kernels = dispatch.family(which, "fwd")
    if which == "mma":
        padded = dispatch.mma_headdim(headdim)
        qp, kp, vp = (_mma_ready(x, padded) for x in (q, k, v))
        o = _empty(qp.shape, q.dtype)
        kernels.forward(qp, kp, vp, o, lse, softmax_scale=scale, causal=causal)
        if padded != headdim:
            o = o[..., :headdim].copy()
        return o, lse
    o = _empty(q.shape, q.dtype)
    kernels.forward(q, k, v, o, lse, softmax_scale=scale, causal=causal)
    return o, lse


def flash_attn_backward(do, q, k, v, o, lse, *, softmax_scale=None, causal=False, backend="auto",
                        deterministic=True):
    """Gradients (dq, dk, dv) of flash_attn_func from the saved o and lse (P is recomputed).

    For GQA, dk and dv sum over the query heads that share a kv head. ``deterministic=True`` gives
    bitwise-reproducible results (no atomics); ``False`` lets the tensor-core kernels accumulate dq
    with atomics.
    """
    backend = A.check_backend(backend)
    causal = A.check_flag(causal, "causal")
    deterministic = A.check_flag(deterministic, "deterministic")
    on_gpu = _on_gpu(backend)
    arrays, host_out = _convert({"do": do, "q": q, "k": k, "v": v, "o": o, "lse": lse}, on_gpu)
    do, q, k, v, o, lse = (arrays[n] for n in ("do", "q", "k", "v", "o", "lse"))
    dtype = A.check_dtype({"q": q, "k": k, "v": v, "do": do, "o": o})
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim = A.check_qkv_shapes(q, k, v)
    A.check_backward_arrays(do, o, lse, q.shape, dtype)
    scale = A.resolve_scale(softmax_scale, headdim)
    A.same_device(arrays)
    which = dispatch.choose(backend, dtype, headdim, "bwd")

    if which == "numpy":
        from . import numpy_backend

        grads = numpy_backend.backward(do, q, k, v, o, lse, softmax_scale=scale, causal=causal)
        return grads if host_out else _to_device(grads)
    grads = _backward_gpu(which, do, q, k, v, o, lse, scale, causal, deterministic)
    return _to_host(grads, host_out)


def _backward_gpu(which, do, q, k, v, o, lse, scale, causal, deterministic):
    import cupy

    headdim = q.shape[3]
    if min(q.shape[0], q.shape[1], q.shape[2], k.shape[1]) == 0:
        return (cupy.zeros(q.shape, q.dtype), cupy.zeros(k.shape, k.dtype), cupy.zeros(v.shape, v.dtype))
    kernels = dispatch.family(which, "bwd")
    if which == "mma":
        padded = dispatch.mma_headdim(headdim)
        dop, qp, kp, vp, op = (_mma_ready(x, padded) for x in (do, q, k, v, o))
        dq, dk, dv = _empty(qp.shape, q.dtype), _empty(kp.shape, k.dtype), _empty(vp.shape, v.dtype)
        kernels.backward(dop, qp, kp, vp, op, cupy.ascontiguousarray(lse), dq, dk, dv,
                         softmax_scale=scale, causal=causal, deterministic=deterministic)
        if padded != headdim:
            dq, dk, dv = (g[..., :headdim].copy() for g in (dq, dk, dv))
        return dq, dk, dv
    dq, dk, dv = _empty(q.shape, q.dtype), _empty(k.shape, k.dtype), _empty(v.shape, v.dtype)
    kernels.backward(do, q, k, v, o, cupy.ascontiguousarray(lse), dq, dk, dv,
                     softmax_scale=scale, causal=causal, deterministic=deterministic)
    return dq, dk, dv


def flash_attn_vjp(q, k, v, **options):
    """(o, vjp) with vjp(do) -> (dq, dk, dv): autodiff of attention without a framework.

    ``options`` are flash_attn_func's (softmax_scale, causal, backend); ``deterministic`` goes to
    the backward.
    """
    deterministic = options.pop("deterministic", True)
    if "return_lse" in options:
        raise TypeError("flash_attn_vjp does not take return_lse (the lse is kept for the backward)")
    o, lse = flash_attn_func(q, k, v, return_lse=True, **options)

    def vjp(do):
        return flash_attn_backward(do, q, k, v, o, lse, deterministic=deterministic, **options)

    return o, vjp

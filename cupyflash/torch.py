"""PyTorch front end: flash-attn's ``flash_attn_func``, ``flash_attn_varlen_func`` and
``flash_attn_with_kvcache``, the packed forms of the first two (``flash_attn_qkvpacked_func``,
``flash_attn_kvpacked_func``, ``flash_attn_varlen_qkvpacked_func``,
``flash_attn_varlen_kvpacked_func``), an SDPA-shaped helper, and ring-flash-attn's
``ring_flash_attn_func`` (context parallelism, cupyflash.distributed), on cupyflash.

    from cupyflash.torch import flash_attn_func        # instead of: from flash_attn import ...
    out = flash_attn_func(q, k, v, causal=True)         # (batch, seqlen, nheads, headdim)

flash-attn's three are opaque to ``torch.compile``: each direction is a custom operator
(``torch.ops.cupyflash.flash_attn_forward`` / ``flash_attn_backward``, ``flash_attn_varlen_forward``
/ ``flash_attn_varlen_backward``, ``flash_attn_with_kvcache``) with a fake implementation for
tracing; the dense and the varlen forward are differentiable (an autograd formula registered on
each), the kv-cache call is inference only and mutates its caches (``mutates_args``). The ring
is an autograd.Function (its communicator, a Python object, cannot be an operator's argument).

CUDA tensors go to the kernels zero-copy through DLPack, on torch's current stream of their
device; every buffer CuPy allocates meanwhile (outputs and temporaries) comes from torch's caching
allocator on that stream, so torch accounts for it and reuses it in stream order. Nothing is
copied to the host and nothing synchronises. CPU tensors run on cupyflash's NumPy twin (float64 is
exact enough for ``torch.autograd.gradcheck``).
"""
import contextlib
import functools
import math

import numpy as np
import torch

from . import api, capture, kvcache, varlen
from ._dtypes import bfloat16 as _numpy_bfloat16
from .masks import check_window
from .precision import check_precision

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_qkvpacked_func",
           "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func",
           "scaled_dot_product_attention", "ring_flash_attn_func"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# --- torch tensors <-> the arrays cupyflash computes on -------------------------------------------

class _StreamHandle:
    """A raw cudaStream_t presented through the CUDA stream protocol (CuPy's Stream.from_external)."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def _malloc_from_torch(size: int, device_id: int) -> int:
    if size == 0:
        return 0
    return torch.cuda.caching_allocator_alloc(size, device_id, torch.cuda.current_stream(device_id))


def _free_to_torch(ptr: int, device_id: int) -> None:
    if ptr:
        torch.cuda.caching_allocator_delete(ptr)


@functools.lru_cache(maxsize=None)
def _torch_allocator():
    import cupy

    return cupy.cuda.memory.PythonFunctionAllocator(_malloc_from_torch, _free_to_torch)


@contextlib.contextmanager
def _cupy_on_torch_stream(device: torch.device):
    """CuPy's current device, stream and allocator set to torch's for ``device``.

    Kernels launched inside are ordered with torch's work on its current stream. A buffer CuPy
    allocates inside belongs to torch's caching allocator on that stream: when the last reference
    (a torch tensor made from it by DLPack, or the CuPy array) goes, the block returns to torch's
    pool for reuse by later work on the same stream, exactly as a torch allocation would.
    """
    import cupy

    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index), \
            cupy.cuda.Stream.from_external(_StreamHandle(stream.cuda_stream)), \
            cupy.cuda.using_allocator(_torch_allocator().malloc), capture.graph_aware_allocator():
        yield


def _as_array(t: torch.Tensor):
    """t without a copy: a CuPy array for a CUDA tensor, a NumPy array for a CPU tensor."""
    t = t.detach()  # below autograd the inputs may still carry requires_grad, which DLPack refuses
    if t.device.type == "cuda":
        import cupy

        return cupy.from_dlpack(t)
    if t.dtype == torch.bfloat16:
        # NumPy has no bfloat16 of its own, so DLPack cannot carry it; ml_dtypes' type has the same bits.
        return t.view(torch.int16).numpy().view(_numpy_bfloat16)
    return t.numpy()


def _as_tensor(x) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        if x.dtype == _numpy_bfloat16:
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).contiguous()
        return torch.from_numpy(x).contiguous()
    return torch.from_dlpack(x).contiguous()


def _run(device: torch.device, compute, *tensors: torch.Tensor):
    """compute(*arrays, backend) on the arrays of ``tensors``; its results back as tensors."""
    if device.type == "cuda":
        with _cupy_on_torch_stream(device):
            results = compute(*(_as_array(t) for t in tensors), backend="cuda")
            return tuple(_as_tensor(r) for r in results)
    results = compute(*(_as_array(t) for t in tensors), backend="numpy")
    return tuple(_as_tensor(r) for r in results)


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _own_statistics(q: torch.Tensor) -> str:
    """The autograd's backward statistics: its o and lse are its own forward's
    (backward_plans.own_forward_statistics: "recomputed" for float32 and float64)."""
    return "saved" if q.dtype in (torch.float16, torch.bfloat16) else "recomputed"


# --- the operators ---------------------------------------------------------------------------------

def _variant_arrays(alibi_slopes, sink):
    """The variant's tensors as the API's keyword arguments (arrays on the tensors' side)."""
    out = {}
    if alibi_slopes is not None:
        out["alibi_slopes"] = _as_array(alibi_slopes.contiguous())
    if sink is not None:
        out["sink"] = _as_array(sink.contiguous())
    return out


@torch.library.custom_op("cupyflash::flash_attn_forward", mutates_args=())
def _forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool,
                window_left: int, window_right: int, deterministic: bool, softcap: float = 0.0,
                alibi_slopes: torch.Tensor | None = None,
                sink: torch.Tensor | None = None, dropout_p: float = 0.0,
                seed: int = 0, precision: str = "ieee") -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of cupyflash.flash_attn_func; ``deterministic`` is kept for the backward."""
    def compute(q, k, v, backend):
        return api.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                   window_size=(window_left, window_right), softcap=softcap,
                                   **_variant_arrays(alibi_slopes, sink), **_dropout_args(dropout_p, seed),
                                   return_lse=True, backend=backend, precision=precision)

    return _run(q.device, compute, q, k, v)


@_forward_op.register_fake
def _forward_fake(q, k, v, softmax_scale, causal, window_left, window_right, deterministic, softcap=0.0,
                  alibi_slopes=None, sink=None, dropout_p=0.0, seed=0, precision="ieee"):
    batch, seqlen_q, nheads, _ = q.shape
    o = q.new_empty((batch, seqlen_q, nheads, v.shape[3]))  # v's head dim
    lse = q.new_empty((batch, nheads, seqlen_q), dtype=_lse_dtype(q.dtype))
    return o, lse


@torch.library.custom_op("cupyflash::flash_attn_backward", mutates_args=())
def _backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                 lse: torch.Tensor, softmax_scale: float, causal: bool, window_left: int, window_right: int,
                 deterministic: bool, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                 sink: torch.Tensor | None = None, dropout_p: float = 0.0,
                 seed: int = 0, precision: str = "ieee",
                 statistics: str = "saved") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsink) of cupyflash.flash_attn_backward; dsink empty without a sink."""
    def compute(do, q, k, v, o, lse, backend):
        return api.flash_attn_backward(do, q, k, v, o, lse, softmax_scale=softmax_scale, causal=causal,
                                       window_size=(window_left, window_right), softcap=softcap,
                                       **_variant_arrays(alibi_slopes, sink), **_dropout_args(dropout_p, seed),
                                       backend=backend, deterministic=deterministic, precision=precision,
                                       statistics=statistics)

    grads = _run(q.device, compute, do, q, k, v, o, lse)
    return grads if sink is not None else (*grads, q.new_empty((0,), dtype=torch.float32))


@_backward_op.register_fake
def _backward_fake(do, q, k, v, o, lse, softmax_scale, causal, window_left, window_right, deterministic,
                   softcap=0.0, alibi_slopes=None, sink=None, dropout_p=0.0, seed=0, precision="ieee",
                   statistics="saved"):
    dsink = q.new_empty((0,) if sink is None else tuple(sink.shape), dtype=torch.float32)
    return (*(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v)), dsink)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, window_left, window_right, deterministic, softcap, alibi_slopes, sink, *drop = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.options = (softmax_scale, causal, window_left, window_right, deterministic, softcap, alibi_slopes, sink,
                   *drop)
    ctx.set_materialize_grads(False)  # an unused lse then brings None, not a tensor of zeros to add


def _backward_formula(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    scale, softcap, sink = ctx.options[0], ctx.options[5], ctx.options[7]
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv, dsink = _backward_op(do, q, k, v, o, lse, *ctx.options, statistics=_own_statistics(q))
    if dlse is not None:
        if softcap:
            # dlse/dS_ij = P_ij (1 - tanh^2): the attention-shaped products below would miss the factor.
            raise NotImplementedError("cupyflash.torch: a gradient through softmax_lse with softcap != 0 is not "
                                      "supported yet")
        if len(ctx.options) > 8 and ctx.options[8]:
            # dlse/dS_ij = P_ij, the softmax's: the products below would take the dropped-out weights.
            raise NotImplementedError("cupyflash.torch: a gradient through softmax_lse with dropout_p != 0 is not "
                                      "supported yet")
        dq, dk = _add_lse_gradient(dq, dk, q, k, dlse.transpose(1, 2).unsqueeze(-1), scale,
                                   lambda: _forward_op(q, k, k, *ctx.options)[0],
                                   lambda do_q, pk: _backward_op(do_q, q, k, k, pk, lse, *ctx.options)[2])
        if sink is not None:
            dsink = _add_sink_lse_gradient(dsink, sink, lse, dlse, head_axis=1)
    return (dq, dk, dv, None, None, None, None, None, None, None, (dsink if sink is not None else None), None, None,
            None)


def _add_sink_lse_gradient(dsink, sink, lse, dlse, head_axis: int):
    """dsink plus the lse's gradient: dlse_i/dsink = exp(sink - lse_i), the sink's share of row i
    (0 for a row of -inf lse); ``head_axis`` is lse's head axis, every other axis is summed."""
    shape = [1] * lse.dim()
    shape[head_axis] = -1
    share = torch.exp(sink.to(lse.dtype).view(shape) - lse) * (lse != -math.inf)
    rows = tuple(axis for axis in range(lse.dim()) if axis != head_axis)
    return dsink + (dlse.to(lse.dtype) * share).sum(dim=rows).to(dsink.dtype)


def _add_lse_gradient(dq, dk, q, k, dlse_rows, scale, attend_to_keys, dv_for):
    """(dq, dk) plus the lse's gradient. lse_i = log sum_j exp(scale q_i.k_j) has dlse_i/dS_ij =
    P_ij, which adds scale dlse_i (P K)_i to dq_i and scale (P^T (dlse q))_j to dk_j. P K is
    attention with K as the values (``attend_to_keys()``); P^T (dlse q) is the dv of a backward
    whose output gradient is dlse q (``dv_for(dlse q, P K)``: a backward with K as the values and
    P K as its output, whose shapes are q's whatever v's head dim; only its dv is taken, which
    does not depend on them). ``dlse_rows``: dlse laid out like q's
    rows with a trailing 1 (broadcast over headdim)."""
    acc = dlse_rows.dtype
    pk = attend_to_keys()
    dq = (dq.to(acc) + scale * dlse_rows * pk.to(acc)).to(q.dtype)
    pt_dlse_q = dv_for((dlse_rows * q.to(acc)).to(q.dtype), pk)
    dk = (dk.to(acc) + scale * pt_dlse_q.to(acc)).to(k.dtype)
    return dq, dk


_forward_op.register_autograd(_backward_formula, setup_context=_setup_context)


# --- packed variable-length batches (cupyflash.varlen) --------------------------------------------

@torch.library.custom_op("cupyflash::flash_attn_varlen_forward", mutates_args=())
def _varlen_forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                       causal: bool, window_left: int, window_right: int, deterministic: bool,
                       softcap: float = 0.0,
                       alibi_slopes: torch.Tensor | None = None,
                       sink: torch.Tensor | None = None, dropout_p: float = 0.0, seed: int = 0,
                       precision: str = "ieee") -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of cupyflash.flash_attn_varlen_func; lse is (nheads, total_q)."""
    def compute(q, k, v, cu_q, cu_k, backend):
        return varlen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k,
                                             softmax_scale=softmax_scale, causal=causal,
                                             window_size=(window_left, window_right), softcap=softcap,
                                             **_variant_arrays(alibi_slopes, sink), **_dropout_args(dropout_p, seed),
                                             return_lse=True, backend=backend, precision=precision)

    return _run(q.device, compute, q, k, v, cu_seqlens_q, cu_seqlens_k)


@_varlen_forward_op.register_fake
def _varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                         window_left, window_right, deterministic, softcap=0.0, alibi_slopes=None, sink=None,
                         dropout_p=0.0, seed=0, precision="ieee"):
    total_q, nheads, _ = q.shape
    return (q.new_empty((total_q, nheads, v.shape[2])), q.new_empty((nheads, total_q), dtype=_lse_dtype(q.dtype)))


@torch.library.custom_op("cupyflash::flash_attn_varlen_backward", mutates_args=())
def _varlen_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                        lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                        max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
                        window_right: int, deterministic: bool, softcap: float = 0.0,
                        alibi_slopes: torch.Tensor | None = None,
                        sink: torch.Tensor | None = None, dropout_p: float = 0.0, seed: int = 0,
                        precision: str = "ieee",
                        statistics: str = "saved") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsink) of cupyflash.flash_attn_varlen_backward; dsink empty without a sink."""
    def compute(do, q, k, v, o, lse, cu_q, cu_k, backend):
        return varlen.flash_attn_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, max_seqlen_q, max_seqlen_k,
                                                 softmax_scale=softmax_scale, causal=causal,
                                                 window_size=(window_left, window_right), softcap=softcap,
                                                 **_variant_arrays(alibi_slopes, sink),
                                                 **_dropout_args(dropout_p, seed), backend=backend,
                                                 deterministic=deterministic, precision=precision,
                                                 statistics=statistics)

    grads = _run(q.device, compute, do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
    return grads if sink is not None else (*grads, q.new_empty((0,), dtype=torch.float32))


@_varlen_backward_op.register_fake
def _varlen_backward_fake(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          softmax_scale, causal, window_left, window_right, deterministic, softcap=0.0,
                          alibi_slopes=None, sink=None, dropout_p=0.0, seed=0, precision="ieee", statistics="saved"):
    dsink = q.new_empty((0,) if sink is None else tuple(sink.shape), dtype=torch.float32)
    return (*(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v)), dsink)


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_left, window_right, deterministic, softcap,
     alibi_slopes, sink, *dropout_and_precision) = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
    ctx.options = (max_q, max_k, softmax_scale, causal, window_left, window_right, deterministic, softcap,
                   alibi_slopes, sink, *dropout_and_precision)
    ctx.set_materialize_grads(False)


def _varlen_backward_formula(ctx, do, dlse):
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    scale, sink = ctx.options[2], ctx.options[9]
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv, dsink = _varlen_backward_op(do, q, k, v, o, lse, cu_q, cu_k, *ctx.options,
                                            statistics=_own_statistics(q))
    if dlse is not None:  # as for the dense operator, sequence by sequence (P is block diagonal)
        if ctx.options[7]:
            raise NotImplementedError("cupyflash.torch: a gradient through softmax_lse with softcap != 0 is not "
                                      "supported yet")
        if len(ctx.options) > 10 and ctx.options[10]:  # dropout_p: as for the dense operator
            raise NotImplementedError("cupyflash.torch: a gradient through softmax_lse with dropout_p != 0 is not "
                                      "supported yet")
        dq, dk = _add_lse_gradient(dq, dk, q, k, dlse.transpose(0, 1).unsqueeze(-1), scale,
                                   lambda: _varlen_forward_op(q, k, k, cu_q, cu_k, *ctx.options)[0],
                                   lambda do_q, pk: _varlen_backward_op(do_q, q, k, k, pk, lse, cu_q, cu_k,
                                                                        *ctx.options)[2])
        if sink is not None:  # lse: (nheads, total_q)
            dsink = _add_sink_lse_gradient(dsink, sink, lse, dlse, head_axis=0)
    # q, k, v; cu_seqlens_q ... alibi_slopes; sink; dropout_p, seed, precision
    return (dq, dk, dv, *(None,) * 11, (dsink if sink is not None else None), None, None, None)


_varlen_forward_op.register_autograd(_varlen_backward_formula, setup_context=_varlen_setup_context)


# --- KV-cache inference (cupyflash.kvcache) --------------------------------------------------------

@torch.library.custom_op("cupyflash::flash_attn_with_kvcache", mutates_args=("k_cache", "v_cache"))
def _kvcache_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None,
                v: torch.Tensor | None, cache_seqlens: torch.Tensor | None, cache_batch_idx: torch.Tensor | None,
                block_table: torch.Tensor | None, softmax_scale: float, causal: bool, window_left: int,
                window_right: int, softcap: float = 0.0,
                alibi_slopes: torch.Tensor | None = None, num_splits: int = 0,
                precision: str = "ieee", sink: torch.Tensor | None = None, rotary_cos: torch.Tensor | None = None,
                rotary_sin: torch.Tensor | None = None, rotary_interleaved: bool = True,
                cache_leftpad: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of cupyflash.flash_attn_with_kvcache; k, v (when given) are appended to the caches
    in place, which DLPack (CUDA) and NumPy's views (CPU) share with the tensors."""
    return _kvcache_call(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale, causal,
                         window_left, window_right, softcap, alibi_slopes, num_splits, precision, sink, rotary_cos,
                         rotary_sin, rotary_interleaved, cache_leftpad)


def _kvcache_call(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale, causal,
                  window_left, window_right, softcap, alibi_slopes, num_splits, precision, sink, rotary_cos=None,
                  rotary_sin=None, rotary_interleaved=True, cache_leftpad=None, modifiers=None):
    """The operator's computation, and the eager call with user modifiers (``modifiers``:
    score_mod / mask_mod keywords, which an operator schema cannot carry)."""
    named = {"k": k, "v": v, "cache_seqlens": cache_seqlens, "cache_batch_idx": cache_batch_idx,
             "block_table": block_table, "rotary_cos": rotary_cos, "rotary_sin": rotary_sin,
             "cache_leftpad": cache_leftpad}
    present = [name for name, t in named.items() if t is not None]

    def compute(q, k_cache, v_cache, *given, backend):
        options = dict(zip(present, given))
        return kvcache.flash_attn_with_kvcache(q, k_cache, v_cache, options.pop("k", None), options.pop("v", None),
                                               softmax_scale=softmax_scale, causal=causal,
                                               window_size=(window_left, window_right), softcap=softcap,
                                               **_variant_arrays(alibi_slopes, sink), num_splits=num_splits,
                                               return_lse=True, backend=backend, precision=precision,
                                               rotary_interleaved=rotary_interleaved, **options, **(modifiers or {}))

    return _run(q.device, compute, q, k_cache, v_cache, *(named[name] for name in present))


@_kvcache_op.register_fake
def _kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale, causal,
                  window_left, window_right, softcap=0.0, alibi_slopes=None, num_splits=0, precision="ieee",
                  sink=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=True, cache_leftpad=None):
    batch, seqlen_q, nheads, _ = q.shape
    return (q.new_empty((batch, seqlen_q, nheads, v_cache.shape[3])),
            q.new_empty((batch, nheads, seqlen_q), dtype=_lse_dtype(q.dtype)))


# --- flash-attn's interface ------------------------------------------------------------------------

_DENSE = "(batch, seqlen, nheads, headdim)"
_PACKED = "(total_tokens, nheads, headdim)"


def _check_tensors(q, k, v, layout: str = _DENSE, names=("q", "k", "v"), same_batch: bool = True) -> None:
    """q, k, v: tensors of one supported dtype on one device, in ``layout`` (_DENSE or _PACKED),
    k and v of one shape but for the head dim (v's may differ), nheads a multiple of nheads_kv; in _DENSE and with ``same_batch`` (not
    for a kv cache, whose rows are not q's batch) one batch size. ``names`` name them in the errors."""
    ndim = 4 if layout == _DENSE else 3
    tensors = tuple(zip(names, (q, k, v)))
    for name, x in tensors:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
        if x.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {x.dtype}; expected one of "
                            f"{', '.join(str(d) for d in _DTYPES)}")
        if x.device.type not in ("cuda", "cpu", "meta"):
            raise ValueError(f"{name} is on {x.device}; cupyflash.torch takes CUDA or CPU tensors "
                             "(and meta tensors, for shapes)")
    q_name = names[0]
    for name, x in tensors[1:]:
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but {q_name} has {q.dtype}; {', '.join(names)} must share "
                            "one dtype")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but {q_name} is on {q.device}; {', '.join(names)} must share "
                             "one device")
    for name, x in tensors:
        if x.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions {layout}; got shape {tuple(x.shape)}")
    (k_name, _), (v_name, _) = tensors[1:]
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"{k_name} and {v_name} must have the same shape but for the head dim; got {k_name} "
                         f"{tuple(k.shape)} and {v_name} {tuple(v.shape)}")
    same_batch = same_batch and ndim == 4
    if k.shape[-1] != q.shape[-1] or (same_batch and k.shape[0] != q.shape[0]):
        raise ValueError(f"{q_name} and {k_name} must have the same {'batch size and headdim' if same_batch else 'headdim'}"
                         f"; got {q_name} {tuple(q.shape)} and {k_name} {tuple(k.shape)}")
    nheads, nheads_kv = q.shape[-2], k.shape[-2]
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        raise ValueError(f"nheads of {q_name} ({nheads}) must be a positive multiple of nheads of "
                         f"{k_name}/{v_name} ({nheads_kv}) (GQA/MQA)")


def _index_tensor(x, name: str, device: torch.device, optional: bool = True):
    """An int32 index tensor (flash-attn's dtype) on ``device`` or the CPU, or None."""
    if x is None:
        if optional:
            return None
        raise TypeError(f"{name} is required")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (int32); got {type(x).__name__}")
    if x.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32 (as flash-attn's); got {x.dtype}")
    if x.device != device and x.device.type != "cpu":
        raise ValueError(f"{name} is on {x.device} but q is on {device}")
    return x


def _max_seqlen(value, name: str) -> int:
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a Python int, not a tensor (as flash-attn takes it)")
    return varlen.check_count(value, name)


def _unsupported(**options) -> None:
    named = [name for name, unsupported in options.items() if unsupported]
    if named:
        raise NotImplementedError(f"cupyflash.torch does not support {', '.join(named)} yet")


def _dropout_args(dropout_p: float, seed: int) -> dict:
    """cupyflash's dropout arguments (none for dropout_p = 0)."""
    return dict(dropout_p=dropout_p, seed=seed) if dropout_p else {}


def _dropout_seed(dropout_p) -> int:
    """A seed for a call's dropout mask, drawn from torch's default CPU generator (so
    torch.manual_seed reproduces it; no device synchronisation), 0 without dropout."""
    if isinstance(dropout_p, torch.Tensor):
        raise TypeError("dropout_p must be a Python number, not a tensor")
    if not dropout_p:
        return 0
    return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())


def _check_variant_tensors(q, softcap, alibi_slopes, sink) -> None:
    """softcap a Python number; alibi_slopes and sink tensors on q's device (their shapes and
    dtypes are cupyflash's checks, scores.check_variant)."""
    if isinstance(softcap, torch.Tensor):
        raise TypeError("softcap must be a Python number, not a tensor")
    for name, t in (("alibi_slopes", alibi_slopes), ("sink", sink)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.device != q.device):
            raise TypeError(f"{name} must be a tensor on q's device ({q.device})")


def _scale(softmax_scale, headdim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(headdim)
    if isinstance(softmax_scale, torch.Tensor):
        raise TypeError("softmax_scale must be a Python number or None, not a tensor")
    return float(softmax_scale)


class _EagerAttention(torch.autograd.Function):
    """Attention whose forward and backward are cupyflash calls on arrays, differentiable in q, k,
    v and the sink. ``calls`` holds them: forward(q, k, v, *extra, sink, backend) -> (o, lse),
    backward(do, q, k, v, o, lse, *extra, sink, backend) -> (dq, dk, dv[, dsink]), ``extra`` the
    tensors both take (a packed batch's cu_seqlens) and ``lse_refusal`` what a gradient through lse
    is refused for. Not a custom operator: the calls hold Python objects (a user modifier, a ring
    communicator) that an operator schema cannot carry, so torch.compile breaks its graph here and
    runs them eagerly."""

    @staticmethod
    def forward(ctx, q, k, v, sink, calls):
        extra, sinks = calls.extra, () if sink is None else (sink.contiguous(),)

        def compute(q, k, v, *rest, backend):
            return calls.forward(q, k, v, *rest[:len(extra)], sink=rest[len(extra)] if sinks else None,
                                 backend=backend)

        o, lse = _run(q.device, compute, q, k, v, *extra, *sinks)
        ctx.save_for_backward(q, k, v, o, lse, sink)
        ctx.calls = calls
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, sink = ctx.saved_tensors
        calls = ctx.calls
        if dlse is not None:
            raise NotImplementedError(f"cupyflash.torch: a gradient through softmax_lse {calls.lse_refusal} is not "
                                      "supported yet")
        if do is None:
            return None, None, None, None, None
        extra, sinks = calls.extra, () if sink is None else (sink,)

        def compute(do, q, k, v, o, lse, *rest, backend):
            return calls.backward(do, q, k, v, o, lse, *rest[:len(extra)], sink=rest[len(extra)] if sinks else None,
                                  backend=backend)

        grads = _run(q.device, compute, do.contiguous(), q, k, v, o, lse, *extra, *sinks)
        return (*grads[:3], grads[3] if sink is not None else None, None)


class _ModifiedCalls:
    """The calls of attention with user modifiers (cupyflash.modifiers): flash_attn_func and its
    backward, or on a packed batch (``sequences`` = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k)) the varlen pair."""

    lse_refusal = "with score_mod / mask_mod"

    def __init__(self, options: dict, deterministic: bool, sequences=None):
        self.options, self.deterministic, self.sequences = options, deterministic, sequences
        self.extra = () if sequences is None else tuple(sequences[:2])

    def forward(self, q, k, v, *cu_seqlens, sink, backend):
        if self.sequences is None:
            return api.flash_attn_func(q, k, v, **self.options, sink=sink, return_lse=True, backend=backend)
        return varlen.flash_attn_varlen_func(q, k, v, *cu_seqlens, *self.sequences[2:], **self.options, sink=sink,
                                             return_lse=True, backend=backend)

    def backward(self, do, q, k, v, o, lse, *cu_seqlens, sink, backend):
        if self.sequences is None:
            return api.flash_attn_backward(do, q, k, v, o, lse, **self.options, sink=sink, backend=backend,
                                           deterministic=self.deterministic)
        return varlen.flash_attn_varlen_backward(do, q, k, v, o, lse, *cu_seqlens, *self.sequences[2:],
                                                 **self.options, sink=sink, backend=backend,
                                                 deterministic=self.deterministic)


def _modified_attention(q, k, v, sink, modifiers, softcap, alibi_slopes, options, deterministic, map_shape,
                        sequences=None):
    """(o, lse) of a call with user modifiers (score_mod, mask_mod, block_mask) through
    _EagerAttention: a mask_mod alone gets its block map made here, for ``map_shape`` (batch,
    nheads, seqlen_q, seqlen_k; a packed batch's sequences and longest lengths), once for the
    forward and the backward."""
    if softcap or alibi_slopes is not None:
        raise ValueError("cupyflash: score_mod does not combine with softcap or alibi_slopes; write the cap or "
                         "the bias into the score_mod")
    score_mod, mask_mod, block_mask = modifiers
    options = dict(options, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask)
    on_stream = _cupy_on_torch_stream(q.device) if q.device.type == "cuda" else contextlib.nullcontext()
    with on_stream:  # the block map's kernel reads the mask's tensors in torch's stream order
        if mask_mod is not None and block_mask is None:
            from .modifiers import BlockMask

            options.update(mask_mod=None, block_mask=BlockMask(mask_mod, *map_shape, device=q.device.type))
    return _EagerAttention.apply(q, k, v, sink, _ModifiedCalls(options, deterministic, sequences))


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, sink=None,
                    *, score_mod=None, mask_mod=None, block_mask=None, precision=None):
    """flash-attn 2's flash_attn_func, computed by cupyflash: softmax(q kᵀ · scale) v.

    q, k: (batch, seqlen_q, nheads, headdim), (batch, seqlen_k, nheads_kv, headdim); v: (batch,
    seqlen_k, nheads_kv, headdim_v), v's head dim free; nheads a multiple of nheads_kv (GQA/MQA; query head h reads kv head h // (nheads // nheads_kv)). Causal
    masking is aligned bottom-right: query i sees key j iff j <= i + seqlen_k - seqlen_q;
    ``window_size=(left, right)`` is flash-attn's sliding window (-1: unbounded; with ``causal`` the
    right side is 0); a row that sees no key outputs 0. dtypes float16, bfloat16, float32, float64; CUDA or CPU tensors.

    Returns out ((batch, seqlen_q, nheads, headdim_v), contiguous), or with ``return_attn_probs`` (out, softmax_lse, S_dmask):
    softmax_lse (batch, nheads, seqlen_q), float32 (float64 for float64), differentiable; S_dmask
    an empty tensor, as flash-attn returns it without dropout. ``deterministic=True`` makes the
    backward bitwise reproducible (cupyflash.flash_attn_backward's option of that name).
    ``softcap`` (c tanh(s / c) of the scaled scores), ``alibi_slopes`` ((nheads,) or (batch,
    nheads) float32, not differentiated, as in flash-attn) and ``sink`` ((nheads,) float32 logits
    in each row's softmax denominator, gpt-oss; differentiable) are cupyflash.flash_attn_func's.
    ``score_mod``, ``mask_mod`` and ``block_mask`` (keywords only) are cupyflash's user modifiers
    (cupyflash.modifiers), their tensors torch tensors on q's device (read, not differentiated);
    with them the call is an autograd.Function rather than a custom operator.
    ``dropout_p`` drops each attention weight with that probability (cupyflash.flash_attn_func's
    dropout): the mask's seed is drawn from torch's default generator (torch.manual_seed
    reproduces it) and kept for the backward; S_dmask stays empty.
    ``precision`` (keyword only; "ieee", the default, or "tf32") is cupyflash.flash_attn_func's: how
    float32 products are formed on tensor cores.
    Not supported yet, each a NotImplementedError: a gradient through softmax_lse with softcap != 0,
    with dropout_p != 0 or with modifiers.
    """
    precision = check_precision(precision)
    _check_tensors(q, k, v)
    seed = _dropout_seed(dropout_p)  # refuses a tensor
    dropout_p = float(dropout_p)
    scale = _scale(softmax_scale, q.shape[3])
    window_left, window_right = check_window(window_size)
    _check_variant_tensors(q, softcap, alibi_slopes, sink)
    if score_mod is not None or mask_mod is not None or block_mask is not None:
        o, lse = _modified_attention(q, k, v, sink, (score_mod, mask_mod, block_mask), softcap, alibi_slopes,
                                     dict(softmax_scale=scale, causal=bool(causal),
                                          window_size=(window_left, window_right), **_dropout_args(dropout_p, seed),
                                          precision=precision),
                                     bool(deterministic), (q.shape[0], q.shape[2], q.shape[1], k.shape[1]))
        return o if not return_attn_probs else (o, lse, q.new_empty((0,)))
    o, lse = _forward_op(q, k, v, scale, bool(causal), window_left, window_right, bool(deterministic),
                         float(softcap), alibi_slopes, sink, dropout_p, seed, precision)
    if not return_attn_probs:
        return o
    return o, lse, q.new_empty((0,))


# --- ring attention (cupyflash.distributed) ---------------------------------------------------------

class _RingCalls:
    """The calls of ring attention over ``comm`` (cupyflash.distributed): every rank of the ring
    makes them, the forward and later the backward, in step (the ring's transfers are collective)."""

    lse_refusal = "of ring attention"
    extra = ()

    def __init__(self, comm, options: dict, deterministic: bool):
        self.comm, self.options, self.deterministic = comm, options, deterministic

    def forward(self, q, k, v, *, sink, backend):
        from .distributed import ring

        return ring.ring_flash_attn_func(q, k, v, comm=self.comm, **self.options, sink=sink, return_lse=True,
                                         backend=backend)

    def backward(self, do, q, k, v, o, lse, *, sink, backend):
        from .distributed import ring

        return ring.ring_flash_attn_backward(do, q, k, v, o, lse, comm=self.comm, **self.options, sink=sink,
                                             backend=backend, deterministic=self.deterministic)


_RING_COMMS: dict = {}  # (torch process group, device) -> its NcclRingComm (made once: a collective call)


def _ring_comm(comm, group, device: torch.device, differentiable: bool):
    if comm is not None:
        if group is not None:
            raise ValueError("cupyflash.torch.ring_flash_attn_func: pass comm or group, not both")
        from .distributed import LocalRingComm

        if differentiable and device.type == "cuda" and isinstance(comm, LocalRingComm):
            # torch runs every CUDA backward of a process on one autograd thread per device, so
            # the simulated ranks' backward steps, each waiting for the others', would run one
            # after another and wait forever
            raise NotImplementedError("cupyflash.torch.ring_flash_attn_func: a LocalRing's ranks share one process, "
                                      "whose CUDA backward torch runs on one thread: the ring's collective steps "
                                      "cannot meet there. Use one process per GPU (a torch process group or an "
                                      "NcclRingComm), or cupyflash.distributed's functions on CuPy arrays")
        return comm
    if device.type != "cuda":
        raise ValueError("cupyflash.torch.ring_flash_attn_func: CPU tensors need a comm (a "
                         "cupyflash.distributed.LocalRing's, which simulates the ranks); a torch process group "
                         "means NCCL, which needs CUDA tensors")
    key = (id(group), device.index)
    if key not in _RING_COMMS:
        from .distributed import NcclRingComm

        with torch.cuda.device(device):  # from_torch joins on torch's current device: q's
            _RING_COMMS[key] = (group, NcclRingComm.from_torch(group))  # the group kept alive with its id
    return _RING_COMMS[key][1]


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                         softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None,
                         *, comm=None, sink=None, layout="zigzag"):
    """Ring attention (context parallelism) with autograd, in ring-flash-attn's calling form:
    every rank of ``group`` (a torch.distributed process group, None: the world; NCCL through
    CuPy, made once per group by the first call, collectively) or of ``comm`` (a
    cupyflash.distributed communicator: an NcclRingComm, or a LocalRing's for ranks simulated in
    one process) calls it on its shard of the sequence, sharded by ``layout`` ("zigzag", the
    balanced layout for causal masks, or "contiguous"; cupyflash.distributed.zigzag_shard), and
    later runs the backward with the others.

    q: (batch, seqlen / P, nheads, headdim), k, v: (batch, seqlen / P, nheads_kv, headdim); out like
    q (this rank's rows). ``causal``, ``window_size``, ``softcap``, ``alibi_slopes`` (not
    differentiated, as in flash-attn) and ``sink`` are the whole sequence's, as flash_attn_func
    takes them (cupyflash.distributed.ring_flash_attn_func); the
    sink's gradient is this rank's share (the sum over its rows): a data-parallel reduction over
    the ring's ranks sums them, as it does for any parameter every rank holds. Returns out, or with
    ``return_attn_probs`` (out, softmax_lse, an empty tensor). Not supported, a NotImplementedError:
    dropout_p != 0 (docs/context-parallelism.md, "What composes"), a gradient
    through softmax_lse, and a LocalRing's ranks on CUDA tensors with gradients (torch runs a
    process's CUDA backward on one thread, where the ranks' collective steps cannot meet; CPU
    tensors run theirs on the calling threads).
    """
    _check_tensors(q, k, v)
    _unsupported(dropout_p=float(dropout_p) != 0.0)
    _check_variant_tensors(q, softcap, alibi_slopes, sink)
    window_left, window_right = check_window(window_size)
    options = dict(softmax_scale=_scale(softmax_scale, q.shape[3]), causal=bool(causal),
                   window_size=(window_left, window_right), softcap=float(softcap), layout=layout)
    if alibi_slopes is not None:  # read by the steps' kernels, never differentiated
        options["alibi_slopes"] = _as_array(alibi_slopes.contiguous())
    differentiable = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, sink))
    o, lse = _EagerAttention.apply(q, k, v, sink, _RingCalls(_ring_comm(comm, group, q.device, differentiable),
                                                             options, bool(deterministic)))
    return o if not return_attn_probs else (o, lse, q.new_empty((0,)))


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, sink=None,
                           score_mod=None, mask_mod=None, block_mask=None, precision=None):
    """flash-attn 2's flash_attn_varlen_func, computed by cupyflash: attention over a packed batch.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_kv, headdim), v's headdim free (out has
    it). cu_seqlens_q,
    cu_seqlens_k: (batch + 1,) torch.int32 cumulative lengths (on q's device or the CPU; a CUDA
    one is read back once, a synchronisation); max_seqlen_q, max_seqlen_k: Python ints bounding
    every sequence. Each sequence is its own problem with its own bottom-right causal alignment
    and window; empty sequences are allowed. Differentiable in q, k, v (and through the lse).

    Returns out (like q), or with ``return_attn_probs`` (out, softmax_lse, S_dmask): softmax_lse
    (nheads, total_q), float32 (float64 for float64); S_dmask an empty tensor. ``softcap``,
    ``alibi_slopes`` ((nheads,) or (batch, nheads) float32, row b for sequence b; not
    differentiated) and ``sink`` (keyword only: (nheads,) float32 logits in every row's softmax
    denominator, differentiable) are cupyflash.flash_attn_varlen_func's. ``dropout_p`` drops each
    attention weight with that probability (cupyflash.flash_attn_varlen_func's dropout, the seed
    drawn from torch's default generator and kept for the backward, as flash_attn_func's); S_dmask
    stays empty. ``block_table`` (batch, max_blocks_per_seq) int32: k and v are then pages
    (num_blocks, page_size, nheads_kv, headdim) of a paged cache (flash-attn's paged varlen,
    cupyflash.flash_attn_varlen_func's), forward only: with gradients required it is a
    NotImplementedError (call it under torch.no_grad()). Not supported yet, each a
    NotImplementedError: a gradient through softmax_lse with softcap != 0, dropout_p != 0 or
    modifiers. ``precision``
    (keyword only) is cupyflash.flash_attn_func's. ``score_mod``, ``mask_mod`` and ``block_mask``
    (keywords only) are cupyflash.flash_attn_varlen_func's user modifiers (b the sequence, indices
    from its first row; a block map for (batch, nheads, max_seqlen_q, max_seqlen_k)), as
    flash_attn_func here takes them.
    """
    precision = check_precision(precision)
    if block_table is not None:
        return _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                             causal, window_size, softcap, alibi_slopes, return_attn_probs, block_table, sink,
                             precision, dict(score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask))
    seed = _dropout_seed(dropout_p)  # refuses a tensor
    dropout_p = float(dropout_p)
    _check_variant_tensors(q, softcap, alibi_slopes, sink)
    _check_tensors(q, k, v, _PACKED)
    cu_q = _index_tensor(cu_seqlens_q, "cu_seqlens_q", q.device, optional=False)
    cu_k = _index_tensor(cu_seqlens_k, "cu_seqlens_k", q.device, optional=False)
    max_q, max_k = _max_seqlen(max_seqlen_q, "max_seqlen_q"), _max_seqlen(max_seqlen_k, "max_seqlen_k")
    scale = _scale(softmax_scale, q.shape[2])
    window_left, window_right = check_window(window_size)
    if score_mod is not None or mask_mod is not None or block_mask is not None:
        o, lse = _modified_attention(q, k, v, sink, (score_mod, mask_mod, block_mask), softcap, alibi_slopes,
                                     dict(softmax_scale=scale, causal=bool(causal),
                                          window_size=(window_left, window_right), **_dropout_args(dropout_p, seed),
                                          precision=precision),
                                     bool(deterministic), (cu_q.shape[0] - 1, q.shape[1], max_q, max_k),
                                     (cu_q, cu_k, max_q, max_k))
        return o if not return_attn_probs else (o, lse, q.new_empty((0,)))
    o, lse = _varlen_forward_op(q, k, v, cu_q, cu_k, max_q, max_k, scale, bool(causal), window_left, window_right,
                                bool(deterministic), float(softcap), alibi_slopes, sink, dropout_p, seed, precision)
    if not return_attn_probs:
        return o
    return o, lse, q.new_empty((0,))


# --- packed layouts: flash-attn's qkvpacked / kvpacked functions -------------------------------------
# The packed tensor is unbound into views (no copy; the kernels read their strides) and computed by
# the unpacked function; autograd's backward of unbind stacks the three (two) gradients into one
# tensor shaped like the packed input, as flash-attn's packed backward returns it.

def _unbind(packed, name: str, ndim: int, axis: int, count: int, shape: str):
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(packed).__name__}")
    if packed.dim() != ndim or packed.shape[axis] != count:
        raise ValueError(f"{name} must be {shape}; got shape {tuple(packed.shape)}")
    return packed.unbind(dim=axis)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                              **keywords):
    """flash-attn 2's flash_attn_qkvpacked_func: flash_attn_func over q, k, v stacked in ``qkv``
    (batch, seqlen, 3, nheads, headdim); the gradient is one tensor shaped like qkv. Every argument,
    the keyword-only ones too (sink, score_mod, mask_mod, block_mask, precision), and the result are
    flash_attn_func's."""
    q, k, v = _unbind(qkv, "qkv", 5, 2, 3, "(batch, seqlen, 3, nheads, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, **keywords)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                             **keywords):
    """flash-attn 2's flash_attn_kvpacked_func: flash_attn_func over q (batch, seqlen_q, nheads,
    headdim) and k, v stacked in ``kv`` (batch, seqlen_k, 2, nheads_kv, headdim), GQA allowed; kv's
    gradient is one tensor shaped like kv. Arguments and result: flash_attn_func's."""
    k, v = _unbind(kv, "kv", 5, 2, 2, "(batch, seqlen_k, 2, nheads_kv, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, **keywords)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, **keywords):
    """flash-attn 2's flash_attn_varlen_qkvpacked_func: flash_attn_varlen_func over a packed batch
    with q, k, v stacked in ``qkv`` (total, 3, nheads, headdim), ``cu_seqlens`` and ``max_seqlen``
    serving queries and keys. Arguments and result: flash_attn_varlen_func's."""
    q, k, v = _unbind(qkv, "qkv", 4, 1, 3, "(total, 3, nheads, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  **keywords)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, **keywords):
    """flash-attn 2's flash_attn_varlen_kvpacked_func: flash_attn_varlen_func over q (total_q,
    nheads, headdim) and k, v stacked in ``kv`` (total_k, 2, nheads_kv, headdim). Arguments and
    result: flash_attn_varlen_func's."""
    k, v = _unbind(kv, "kv", 4, 1, 2, "(total_k, 2, nheads_kv, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, **keywords)


def _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                  window_size, softcap, alibi_slopes, return_attn_probs, block_table, sink, precision, modifiers):
    """flash_attn_varlen_func with a block_table: eager, forward only (flash-attn has no backward
    for paged varlen either)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    _unsupported(**{"dropout_p with block_table": float(dropout_p) != 0.0,
                    "score_mod / mask_mod / block_mask with block_table": any(m is not None for m in modifiers.values())})
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, sink) if t is not None):
        raise NotImplementedError("flash_attn_varlen_func with block_table (paged varlen) has no backward, as in "
                                  "flash-attn; call it under torch.no_grad() or on detached tensors")
    _check_variant_tensors(q, softcap, alibi_slopes, sink)
    cu_q = _index_tensor(cu_seqlens_q, "cu_seqlens_q", q.device, optional=False)
    cu_k = _index_tensor(cu_seqlens_k, "cu_seqlens_k", q.device, optional=False)
    table = _index_tensor(block_table, "block_table", q.device)
    max_q, max_k = _max_seqlen(max_seqlen_q, "max_seqlen_q"), _max_seqlen(max_seqlen_k, "max_seqlen_k")
    window = check_window(window_size)

    present = [(name, t) for name, t in (("alibi_slopes", alibi_slopes), ("sink", sink)) if t is not None]

    def compute(q, k, v, cu_q, cu_k, table, *variant, backend):
        options = {name: array for (name, _), array in zip(present, variant)}
        return varlen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale,
                                             causal=bool(causal), window_size=window, softcap=float(softcap),
                                             dropout_p=float(dropout_p), block_table=table, return_lse=True,
                                             backend=backend, precision=precision, **options, **modifiers)

    o, lse = _run(q.device, compute, q, k, v, cu_q, cu_k, table, *(t for _, t in present))
    return (o, lse, q.new_empty((0,))) if return_attn_probs else o


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            sink=None, score_mod=None, mask_mod=None, precision=None):
    """flash-attn 2's flash_attn_with_kvcache, computed by cupyflash (inference: no autograd).

    q: (batch, seqlen_q, nheads, headdim); k_cache, v_cache: (batch_cache, seqlen_cache,
    nheads_kv, headdim), or (num_blocks, page_size, nheads_kv, headdim) with ``block_table``
    (batch, max_blocks_per_seq) int32 (any page size). k, v (optional, together): (batch,
    seqlen_new, nheads_kv, headdim), v_cache and v with a head dim of their own (out has it),
    appended to the caches IN PLACE at each sequence's
    cache_seqlens (an int or (batch,) int32), then q attends to each sequence's cache_seqlens[b]
    + seqlen_new keys, causal / window aligned to the end of the updated cache.
    ``cache_batch_idx`` (batch,) int32 picks the cache row of each sequence. Returns out (like q),
    or (out, softmax_lse) with ``return_softmax_lse`` (softmax_lse (batch, nheads, seqlen_q)).
    ``softcap``, ``alibi_slopes`` ((nheads,) or (batch, nheads) float32) and ``sink`` (keyword
    only: (nheads,) float32 logits in every row's softmax denominator) are
    cupyflash.flash_attn_with_kvcache's. ``rotary_cos`` / ``rotary_sin`` ((seqlen_ro, rotary_dim / 2),
    q's dtype and device, with k and v) rotate the new keys and the queries as flash-attn does
    (cupyflash.rotary: positions from cache_seqlens; ``rotary_interleaved`` GPT-J pairs, else
    GPT-NeoX halves). ``cache_leftpad`` ((batch,) int32, contiguous caches) is each sequence's first
    cache position, as in flash-attn. ``num_splits`` is the split-KV count
    (cupyflash.flash_attn_with_kvcache's: 0 picks it).
    ``precision`` (keyword only) is cupyflash.flash_attn_func's. ``score_mod`` and ``mask_mod``
    (keywords only) are cupyflash.flash_attn_with_kvcache's user modifiers (b the sequence, kv_idx
    the cache position, the mask element by element); with them the call runs eagerly, not as
    the custom operator (torch.compile breaks its graph there).
    """
    precision = check_precision(precision)
    _check_variant_tensors(q, softcap, alibi_slopes, sink)
    _check_tensors(q, k_cache, v_cache, names=("q", "k_cache", "v_cache"), same_batch=False)
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new tokens to append) or both be None")
    if k is not None:
        _check_tensors(q, k, v)
    varlen.check_count(num_splits, "num_splits")
    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        # on the host: the checked kv-cache call reads the lengths on the host anyway, so a device
        # tensor would cost a copy and a synchronisation per decode step; under CUDA-graph capture
        # on the device, where nothing may come from the host (cupyflash.capture)
        capturing = q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        cache_seqlens = torch.full((q.shape[0],), varlen.check_count(cache_seqlens, "cache_seqlens"),
                                   dtype=torch.int32, device=q.device if capturing else "cpu")
    cache_seqlens = _index_tensor(cache_seqlens, "cache_seqlens", q.device)
    cache_batch_idx = _index_tensor(cache_batch_idx, "cache_batch_idx", q.device)
    cache_leftpad = _index_tensor(cache_leftpad, "cache_leftpad", q.device)
    block_table = _index_tensor(block_table, "block_table", q.device)
    scale = _scale(softmax_scale, q.shape[3])
    window_left, window_right = check_window(window_size)
    for name, table in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if table is not None and not isinstance(table, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(table).__name__}")
        if table is not None and table.device != q.device:
            raise ValueError(f"{name} is on {table.device} but q is on {q.device}")
    arguments = (q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, scale, bool(causal),
                 window_left, window_right, float(softcap), alibi_slopes, int(num_splits), precision, sink,
                 rotary_cos, rotary_sin, bool(rotary_interleaved), cache_leftpad)
    if score_mod is not None or mask_mod is not None:
        o, lse = _kvcache_call(*arguments, modifiers=dict(score_mod=score_mod, mask_mod=mask_mod))
    else:
        o, lse = _kvcache_op(*arguments)
    return (o, lse) if return_softmax_lse else o


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False, *, precision=None):
    """torch.nn.functional.scaled_dot_product_attention's call for 4-d (batch, nheads, seqlen, headdim)
    tensors, computed by cupyflash.

    ``is_causal`` is SDPA's top-left mask (query i sees key j iff j <= i), which equals cupyflash's
    bottom-right mask when seqlen_q == seqlen_k; other lengths with is_causal raise
    NotImplementedError. ``attn_mask`` (broadcastable to (batch, nheads, seqlen_q, seqlen_k), on
    query's device) is SDPA's: a bool mask (True: attend) becomes a mask_mod reading it, with its
    block map (blocks it hides are skipped); a float mask is added to the scaled scores by a
    score_mod (not differentiated: a float mask that requires grad raises NotImplementedError).
    A row the mask hides entirely outputs 0. ``dropout_p`` is flash_attn_func's: cupyflash's own
    mask (cupyflash.dropout), its seed drawn from torch's default generator, not SDPA's mask.
    ``enable_gqa`` allows key/value with fewer heads. The backward is deterministic when torch.are_deterministic_algorithms_enabled().
    ``precision`` (keyword only; "ieee", the default, or "tf32") is cupyflash.flash_attn_func's: how
    float32 products are formed on tensor cores.
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a 4-d tensor (batch, nheads, seqlen, headdim); got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError(f"key has {key.shape[1]} heads and query {query.shape[1]}; pass enable_gqa=True "
                         "for grouped-query attention")
    if is_causal and query.shape[2] != key.shape[2]:
        raise NotImplementedError("is_causal with seqlen_q != seqlen_k: SDPA aligns the mask top-left, "
                                  "cupyflash bottom-right (use flash_attn_func for bottom-right)")
    modifiers = {}
    if attn_mask is not None:
        if is_causal:
            raise ValueError("attn_mask and is_causal cannot be combined (as in SDPA): put the causal mask into "
                             "attn_mask, or pass is_causal alone")
        modifiers = _sdpa_mask(attn_mask, (query.shape[0], query.shape[1], query.shape[2], key.shape[2]), query)
    out = flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), dropout_p=dropout_p,
                          softmax_scale=scale, causal=bool(is_causal),
                          deterministic=torch.are_deterministic_algorithms_enabled(), precision=precision,
                          **modifiers)
    return out.transpose(1, 2)


def _sdpa_mask(attn_mask, shape, query) -> dict:
    """SDPA's attn_mask as cupyflash modifiers: {"mask_mod": ...} for a bool mask, {"score_mod": ...}
    for a float one. The mask keeps its own (broadcast) shape, as 4-d with leading 1s; an index
    into a dimension of size 1 that broadcasts is multiplied by 0 (a constant of the modifier)."""
    from .modifiers import MaskMod, ScoreMod

    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor; got {type(attn_mask).__name__}")
    if attn_mask.device != query.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {query.device}")
    if not 2 <= attn_mask.dim() <= 4:
        raise ValueError(f"attn_mask must have 2 to 4 dimensions (as in SDPA), broadcastable to (batch, nheads, seqlen_q, "
                         f"seqlen_k) = {shape}; got shape {tuple(attn_mask.shape)}")
    mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    if any(size not in (1, want) for size, want in zip(mask.shape, shape)):
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (batch, nheads, "
                         f"seqlen_q, seqlen_k) = {shape}")
    fb, fh, fq, fk = (1 if size == want else 0 for size, want in zip(mask.shape, shape))
    if attn_mask.dtype == torch.bool:
        def sdpa_mask(b, h, q_idx, kv_idx, mask):
            return mask[b * fb, h * fh, q_idx * fq, kv_idx * fk]

        return dict(mask_mod=MaskMod(sdpa_mask, mask=mask.contiguous()))
    if not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask must be bool or floating; got {attn_mask.dtype}")
    if attn_mask.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError("a gradient for a float attn_mask: cupyflash adds it as a constant bias (pass "
                                  "attn_mask.detach())")

    def sdpa_bias(score, b, h, q_idx, kv_idx, bias):
        return score + bias[b * fb, h * fh, q_idx * fq, kv_idx * fk]

    bias_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    bias = mask.detach().to(bias_dtype)
    # A finite "minus infinity" (torch.finfo(dtype).min, the usual padding value) would overflow to
    # -inf once the kernels scale the score to log2 units, turning a row it hides entirely into a
    # row that sees no key (0) where SDPA averages the values; -1e30 hides a key as surely and
    # stays finite through the scaling. Real -inf entries stay -inf.
    bias = torch.where(torch.isneginf(bias), bias, bias.clamp(min=-_SDPA_MASKED))
    return dict(score_mod=ScoreMod(sdpa_bias, bias=bias.contiguous()))


_SDPA_MASKED = 1e30  # the most negative finite bias kept (see _sdpa_mask)

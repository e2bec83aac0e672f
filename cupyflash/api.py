"""Public API: flash_attn_func, flash_attn_backward, flash_attn_vjp.

Layout (batch, seqlen, nheads, headdim) for q, k, v, o (v and o may have a head dim of their own,
headdim_v); lse is (batch, nheads, seqlen_q), natural
log. CuPy arrays in → CuPy out on the current stream; NumPy in → NumPy out (computed on the GPU when
one is usable); DLPack / CUDA-array-interface objects (torch, JAX) → zero-copy in, CuPy out.
"""
from __future__ import annotations

import numpy as np

from . import _arrays as A
from . import capture, dispatch, testing
from ._dtypes import lse_dtype
from .masks import check_window
from .modifiers import check_modifiers
from .dropout import check_dropout, draw_seed_once
from .scores import check_variant
from .backward_plans import check_statistics, own_forward_statistics

MAX_GRID_YZ = 65535
"""Most batch entries, and most query heads, one kernel launch takes: the kernels put heads in
the grid's y and batch in its z dimension, which CUDA limits to 65535. Larger calls run in chunks
(``_chunks``), on every backend."""


def _take(arrays: dict) -> tuple[dict, bool]:
    """The arguments as NumPy or CuPy arrays, where they are (checks need only their shapes and
    dtypes), and whether results go back to NumPy."""
    kinds = {name: A.array_kind(x, name) for name, x in arrays.items()}
    host_out = all(kind in ("numpy", "foreign_host") for kind in kinds.values())
    return {name: A.take_array(x, name, kinds[name]) for name, x in arrays.items()}, host_out


def _refuse_host_under_capture(arrays: dict, backend: str) -> None:
    """Under CUDA-graph capture every array is on the device and the backend a GPU one
    (cupyflash.capture): the error otherwise, before anything is queued."""
    capture.refuse_host_arrays((name for name, x in arrays.items() if isinstance(x, np.ndarray)), backend)


def _move(arrays: dict, on_gpu: bool) -> dict:
    """Checked arrays moved to the compute side, each with a contiguous last dimension."""
    convert = A.to_cupy if on_gpu else A.to_numpy
    return {name: A.last_dim_contiguous(convert(x, name)) for name, x in arrays.items()}


def _on_gpu(backend: str) -> bool:
    if backend == "numpy":
        return False
    if backend == "auto":
        return dispatch.gpu_available()
    if not dispatch.gpu_available():
        raise RuntimeError(f"backend={backend!r}: {dispatch.no_device_reason() or 'no CUDA device'}; "
                           "use backend='numpy' or 'auto'")
    return True


def _empty(shape, dtype, fill=None, xp=None):
    """An output buffer (CuPy unless ``xp`` says otherwise); NaN under testing.poisoned_outputs."""
    if xp is None:
        import cupy as xp
    if testing.poison_enabled():
        return xp.full(shape, np.nan, dtype=dtype)
    if fill is not None:
        return xp.full(shape, fill, dtype=dtype)
    return xp.empty(shape, dtype=dtype)


def _array_module(x):
    return np if isinstance(x, np.ndarray) else A._cupy()


def _chunks(batch: int, nheads: int, nheads_kv: int, limit: int) -> list[tuple[slice, slice, slice]]:
    """(batch, query heads, kv heads) slices of the launches that cover a call, each with at most
    ``limit`` batch entries and query heads. Head chunks are whole GQA groups (query heads
    g G .. (g + 1) G - 1 with kv head g, G = nheads / nheads_kv), so each kv head's dk, dv sum
    stays in one chunk, unless one group alone has more than ``limit`` query heads: then it is
    split and the backward adds the parts (_backward_in_chunks)."""
    group = nheads // nheads_kv
    if group <= limit:
        kv_step = min(nheads_kv, limit // group)
        heads = [(slice(g * group, min(g + kv_step, nheads_kv) * group), slice(g, min(g + kv_step, nheads_kv)))
                 for g in range(0, nheads_kv, kv_step)]
    else:
        heads = [(slice(h, min(h + limit, (g + 1) * group)), slice(g, g + 1))
                 for g in range(nheads_kv) for h in range(g * group, (g + 1) * group, limit)]
    return [(slice(b, min(b + limit, batch)), h, kv) for b in range(0, batch, limit) for h, kv in heads]


def _forward_in_chunks(compute, q, k, v, variant):
    """``compute(q, k, v, variant) -> (o, lse)`` over the whole call: one call, or one per chunk of
    _chunks(..., MAX_GRID_YZ) on views of q, k, v (and the chunk's part of the variant's per-head
    arrays), each chunk's fresh (C-contiguous) o and lse copied into place."""
    batch, seqlen_q, nheads, _ = q.shape
    chunks = _chunks(batch, nheads, k.shape[2], MAX_GRID_YZ)
    if len(chunks) == 1:
        return compute(q, k, v, variant)
    xp = _array_module(q)
    o = _empty(q.shape[:3] + v.shape[3:], q.dtype, xp=xp)
    lse = _empty((batch, nheads, seqlen_q), lse_dtype(q.dtype), xp=xp)
    for b, h, kv in chunks:
        o[b, :, h], lse[b, h] = compute(q[b, :, h], k[b, :, kv], v[b, :, kv], variant.sliced(b, h).to(xp))
    return o, lse


def _backward_in_chunks(compute, do, q, k, v, o, lse, variant):
    """``compute(do, q, k, v, o, lse, variant) -> (dq, dk, dv)`` over the whole call, chunked as
    _forward_in_chunks (a chunk's lse is a strided view; the launchers make it contiguous). Where
    one GQA group spans several chunks, its dk, dv parts are added in the accumulator dtype and
    rounded once: one more rounding per part than a single launch."""
    batch, _, nheads, _ = q.shape
    nheads_kv = k.shape[2]
    chunks = _chunks(batch, nheads, nheads_kv, MAX_GRID_YZ)
    if len(chunks) == 1:
        return compute(do, q, k, v, o, lse, variant)
    xp = _array_module(q)
    dq = _empty(q.shape, q.dtype, xp=xp)
    split_groups = nheads // nheads_kv > MAX_GRID_YZ
    if split_groups:
        dk, dv = xp.zeros(k.shape, lse_dtype(q.dtype)), xp.zeros(v.shape, lse_dtype(q.dtype))
    else:
        dk, dv = _empty(k.shape, k.dtype, xp=xp), _empty(v.shape, v.dtype, xp=xp)
    for b, h, kv in chunks:
        dq_c, dk_c, dv_c = compute(do[b, :, h], q[b, :, h], k[b, :, kv], v[b, :, kv], o[b, :, h], lse[b, h],
                                   variant.sliced(b, h).to(xp))
        dq[b, :, h] = dq_c
        if split_groups:
            dk[b, :, kv] += dk_c
            dv[b, :, kv] += dv_c
        else:
            dk[b, :, kv], dv[b, :, kv] = dk_c, dv_c
    if split_groups:
        dk, dv = dk.astype(k.dtype), dv.astype(v.dtype)
    return dq, dk, dv


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


@capture.graph_safe
def flash_attn_func(q, k, v, *, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, sink=None, score_mod=None, mask_mod=None, block_mask=None,
                    return_lse=False, backend="auto", seed=None, offset=0, precision=None):
    """Exact attention softmax(q kᵀ · scale) v, computed tile by tile without materialising S.

    q: (batch, seqlen_q, nheads, headdim); k: (batch, seqlen_k, nheads_kv, headdim); v: (batch,
    seqlen_k, nheads_kv, headdim_v), headdim_v any of 1..256 like headdim (DeepSeek MLA's 192 / 128);
    nheads % nheads_kv == 0 (GQA/MQA). ``causal`` masks bottom-right aligned: query i sees key j iff
    j <= i + seqlen_k - seqlen_q. ``window_size=(left, right)`` is flash-attn's sliding window
    (-1: that side unbounded): query i sees key j iff i + seqlen_k - seqlen_q - left <= j <=
    i + seqlen_k - seqlen_q + right; with ``causal`` the right side is 0. A row that sees no key
    outputs 0 and has lse = -inf. Key blocks outside the window are skipped, not masked.
    Variants (flash-attn 2.8's names; cupyflash.scores has the definitions): ``softcap`` c > 0
    replaces each scaled score z by c tanh(z / c); ``alibi_slopes`` ((nheads,) or (batch,
    nheads) float32) adds -slope |i + seqlen_k - seqlen_q - j|; ``sink`` ((nheads,) float32) is a
    logit per query head in every row's softmax denominator with no value row (gpt-oss), which
    lse includes (a row that sees no key then has lse = sink). User modifiers, compiled into the
    kernels at run time (cupyflash.modifiers): ``score_mod`` (a ScoreMod, or a function of
    (score, b, h, q_idx, kv_idx)) replaces each scaled score; ``mask_mod`` (a MaskMod, or a
    function of (b, h, q_idx, kv_idx)) hides the pairs it returns False for, on top of causal and
    window_size; ``block_mask`` (create_block_mask: a mask_mod with its block map, kept across
    calls) in its place lets the kernels skip the blocks it hides without remaking the map.
    ``dropout_p`` in [0, 1) drops each attention weight with that probability and scales the
    kept ones by 1 / (1 - dropout_p) (flash-attn's); the mask is a function of ``seed`` (uint64;
    None: a fresh random seed), ``offset`` (uint32) and the element's indices alone, the same in
    any backend and in the backward given the same seed and offset
    (cupyflash.dropout.dropout_mask returns it).
    ``precision`` ("ieee", the default, or "tf32"; PyTorch's names) is how float32 products are
    formed on tensor cores: "ieee" with products as precise as float32's (three tf32 products of
    split operands), "tf32" one product on operands rounded to tf32 (cupyflash.precision); other
    dtypes ignore it.
    Returns o (batch, seqlen_q, nheads, headdim_v), or (o, lse) with lse (batch, nheads, seqlen_q)
    float32 (float64 for float64).
    backend: 'auto' (tensor cores for float16, bfloat16, float32 and float64 up to headdim 128,
    SIMT for float64 past it, NumPy without a GPU), 'cuda', 'mma', 'simt' or 'numpy'.
    """
    backend = A.check_backend(backend)
    causal = A.check_flag(causal, "causal")
    window = check_window(window_size)
    return_lse = A.check_flag(return_lse, "return_lse")
    on_gpu = _on_gpu(backend)
    arrays, host_out = _take({"q": q, "k": k, "v": v})
    _refuse_host_under_capture(arrays, backend)
    dtype = A.check_dtype(arrays)
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim = A.check_qkv_shapes(*arrays.values())
    which = dispatch.choose(backend, dtype, max(headdim, arrays["v"].shape[3]), "fwd")
    mods = check_modifiers(score_mod, mask_mod, block_mask, batch=batch, nheads=nheads, seqlen_q=seqlen_q,
                           seqlen_k=seqlen_k, on_gpu=which != "numpy")
    variant = check_variant(softcap, alibi_slopes, sink, batch, nheads, mods, check_dropout(dropout_p, seed, offset),
                            precision)
    scale = A.resolve_scale(softmax_scale, headdim)
    A.same_device(arrays)
    empty = batch * seqlen_q * nheads * seqlen_k == 0
    if not empty:
        A.check_scores_fit(arrays["q"], arrays["k"], scale)
    q, k, v = _move(arrays, on_gpu).values()
    xp = np if which == "numpy" else A._cupy()
    variant = variant.to(xp)

    if empty:  # nothing to launch; every row (if any) sees no key
        o, lse = seeing_no_key(q, v, variant, xp)
    elif which == "numpy":
        from . import numpy_backend

        o, lse = _forward_in_chunks(
            lambda q, k, v, variant: numpy_backend.forward(q, k, v, softmax_scale=scale, causal=causal,
                                                           window_size=window, variant=variant),
            q, k, v, variant)
    else:
        o, lse = _forward_in_chunks(
            lambda q, k, v, variant: _forward_gpu(which, q, k, v, scale, causal, window, variant), q, k, v, variant)
    o, lse = _to_device((o, lse)) if which == "numpy" and not host_out else _to_host((o, lse), host_out)
    return (o, lse) if return_lse else o


def seeing_no_key(q, v, variant, xp):
    """(o, lse) of rows that see no key: o = 0 (q's rows, v's head dim), lse = -inf, or the sink
    where there is one."""
    batch, seqlen_q, nheads, _ = q.shape
    lse = xp.full((batch, nheads, seqlen_q), -np.inf, lse_dtype(q.dtype))
    if variant.sink is not None:
        lse[...] = variant.sink.astype(lse.dtype)[None, :, None]
    return xp.zeros(q.shape[:3] + v.shape[3:], q.dtype), lse


def _decode_by_cache_kernel(q, k, v, scale, causal, window, variant):
    """(o, lse) of a decode-shaped call (at most 16 (query, head) rows per kv head: one query
    token, or a few with GQA) from the KV-cache kernel (kernels/kvcache_mma.py), which packs a kv
    head's query heads into one tile and splits the keys across CTAs, treating k and v as a
    contiguous cache of one row per sequence; None where it does not apply (user modifiers, a head
    dim that is not a multiple of 8, strides or alignment the kernel cannot take)."""
    from .kernels import kvcache_mma
    from .masks import mask_for

    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv, headdim_v = k.shape[1], k.shape[2], v.shape[3]
    if variant.mods is not None or variant.dropout.on or not kvcache_mma.supports(q.dtype, headdim) \
            or not kvcache_mma.supports(q.dtype, headdim_v):
        return None
    if seqlen_q * (nheads // nheads_kv) > 16 or seqlen_k == 0:
        return None
    for a in (q, k, v):
        if a.strides[3] != a.itemsize or any((s // a.itemsize) % 8 for s in a.strides[:3]) or a.data.ptr % 16:
            return None
    import cupy

    o = _empty(q.shape[:3] + (headdim_v,), q.dtype)
    lse = _empty((batch, nheads, seqlen_q), lse_dtype(q.dtype))
    kvcache_mma.forward(q, k, v, o, lse, seqlens_k=cupy.full(batch, seqlen_k, np.int32),
                        block_table=cupy.arange(batch, dtype=np.int32).reshape(batch, 1), page_size=seqlen_k,
                        paged=False, max_seqlen_k=seqlen_k, softmax_scale=scale,
                        mask=mask_for(causal, window, variant.score), variant=variant)
    return o, lse


def _forward_gpu(which, q, k, v, scale, causal, window, variant):
    batch, seqlen_q, nheads, headdim = q.shape
    if which == "mma":
        decoded = _decode_by_cache_kernel(q, k, v, scale, causal, window, variant)
        if decoded is not None:
            return decoded
    lse = _empty((batch, nheads, seqlen_q), lse_dtype(q.dtype))
    kernels = dispatch.family(which, "fwd")
    if which == "mma":
        qp, kp, vp = (_mma_ready(x, dispatch.mma_headdim(x.shape[3])) for x in (q, k, v))
        o = _empty(qp.shape[:3] + vp.shape[3:], q.dtype)
        kernels.forward(qp, kp, vp, o, lse, softmax_scale=scale, causal=causal, window_size=window, variant=variant)
        if o.shape[3] != v.shape[3]:
            o = o[..., :v.shape[3]].copy()
        return o, lse
    o = _empty(q.shape[:3] + v.shape[3:], q.dtype)
    kernels.forward(q, k, v, o, lse, softmax_scale=scale, causal=causal, window_size=window, variant=variant)
    return o, lse


@capture.graph_safe
def flash_attn_backward(do, q, k, v, o, lse, *, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, sink=None, score_mod=None, mask_mod=None, block_mask=None,
                        backend="auto", deterministic=True, seed=None, offset=0, precision=None, statistics="saved"):
    """Gradients (dq, dk, dv) of flash_attn_func from the saved o and lse (P is recomputed); with a
    ``sink``, (dq, dk, dv, dsink), dsink (nheads,) float32.

    For GQA, dk and dv sum over the query heads that share a kv head. ``deterministic=True`` gives
    bitwise-reproducible results (no atomics); ``False`` lets the tensor-core kernels accumulate dq
    with atomics. ``causal``, ``window_size``, ``softcap``, ``alibi_slopes``, ``sink`` and the
    modifiers (``score_mod``, ``mask_mod`` / ``block_mask``) must be the forward's; the chain
    rule through score_mod uses its traced derivative. dsink = -sum over batch and rows of exp(sink - lse) rowsum(do * o).
    With ``dropout_p`` > 0, ``seed`` and ``offset`` must be the forward's (there is no default seed).
    ``precision`` is checked as flash_attn_func's; the float32 backward forms every product as three
    tf32 products of split operands (up to headdim 128; in float32 on CUDA cores past it), at "ieee"
    accuracy whichever is asked. ``statistics="recomputed"`` (float32 and
    float64) makes the backward walk each row's keys first and take lse and D = sum_j P_ij dP_ij from
    its own scores, not from o and lse, so that a saturated softmax cancels exactly as in standard
    attention (flash_attn_vjp and the torch autograd do so); "saved" is right where o and lse are
    not this call's own, as in ring attention, whose rows see keys of other calls.
    """
    backend = A.check_backend(backend)
    causal = A.check_flag(causal, "causal")
    window = check_window(window_size)
    deterministic = A.check_flag(deterministic, "deterministic")
    on_gpu = _on_gpu(backend)
    arrays, host_out = _take({"do": do, "q": q, "k": k, "v": v, "o": o, "lse": lse})
    _refuse_host_under_capture(arrays, backend)
    dtype = A.check_dtype({name: arrays[name] for name in ("q", "k", "v", "do", "o")})
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim = A.check_qkv_shapes(
        arrays["q"], arrays["k"], arrays["v"])
    A.check_backward_arrays(arrays["do"], arrays["o"], arrays["lse"], arrays["q"].shape[:3] + arrays["v"].shape[3:],
                            dtype)
    which = dispatch.choose(backend, dtype, max(headdim, arrays["v"].shape[3]), "bwd")
    mods = check_modifiers(score_mod, mask_mod, block_mask, batch=batch, nheads=nheads, seqlen_q=seqlen_q,
                           seqlen_k=seqlen_k, on_gpu=which != "numpy")
    variant = check_variant(softcap, alibi_slopes, sink, batch, nheads, mods,
                            check_dropout(dropout_p, seed, offset, need_seed=True), precision,
                            check_statistics(statistics, dtype))
    scale = A.resolve_scale(softmax_scale, headdim)
    A.same_device(arrays)
    empty = batch * seqlen_q * nheads * seqlen_k == 0
    if not empty:
        A.check_scores_fit(arrays["q"], arrays["k"], scale)
    do, q, k, v, o, lse = _move(arrays, on_gpu).values()
    xp = np if which == "numpy" else A._cupy()
    variant = variant.to(xp)

    if empty:  # nothing to launch; no query row sees a key
        grads = tuple(xp.zeros(x.shape, dtype) for x in (q, k, v))
    elif which == "numpy":
        from . import numpy_backend

        grads = _backward_in_chunks(
            lambda *chunk: numpy_backend.backward(*chunk[:6], softmax_scale=scale, causal=causal, window_size=window,
                                                  variant=chunk[6]),
            do, q, k, v, o, lse, variant)
    else:
        grads = _backward_in_chunks(
            lambda *chunk: _backward_gpu(which, *chunk, scale, causal, window, deterministic), do, q, k, v, o, lse,
            variant)
    if variant.sink is not None:  # one formula for every family: the sink's row has no value
        from .scores import sink_grad

        grads = grads + (sink_grad(variant.sink, do, o, lse, xp=xp),)
    return _to_device(grads) if which == "numpy" and not host_out else _to_host(grads, host_out)


def _backward_gpu(which, do, q, k, v, o, lse, variant, scale, causal, window, deterministic):
    import cupy

    kernels = dispatch.family(which, "bwd")
    if which == "mma":
        dop, qp, kp, vp, op = (_mma_ready(x, dispatch.mma_headdim(x.shape[3])) for x in (do, q, k, v, o))
        dq, dk, dv = _empty(qp.shape, q.dtype), _empty(kp.shape, k.dtype), _empty(vp.shape, v.dtype)
        kernels.backward(dop, qp, kp, vp, op, cupy.ascontiguousarray(lse), dq, dk, dv,
                         softmax_scale=scale, causal=causal, deterministic=deterministic, window_size=window,
                         variant=variant)
        return tuple(g if g.shape == x.shape else g[..., :x.shape[3]].copy() for g, x in ((dq, q), (dk, k), (dv, v)))
    dq, dk, dv = _empty(q.shape, q.dtype), _empty(k.shape, k.dtype), _empty(v.shape, v.dtype)
    kernels.backward(do, q, k, v, o, cupy.ascontiguousarray(lse), dq, dk, dv,
                     softmax_scale=scale, causal=causal, deterministic=deterministic, window_size=window,
                     variant=variant)
    return dq, dk, dv


def flash_attn_vjp(q, k, v, **options):
    """(o, vjp) with vjp(do) -> (dq, dk, dv) (and dsink with a ``sink``): autodiff of attention
    without a framework.

    ``options`` are flash_attn_func's (dropout_p, softmax_scale, causal, window_size, softcap,
    alibi_slopes, sink, score_mod, mask_mod, block_mask, backend, seed, offset, precision); ``deterministic``
    and ``statistics`` go to the backward, statistics "recomputed" for float32 / float64 unless
    given (the o and lse are this forward's own). A mask_mod's block map is made once, by the forward, and kept for the
    backward; so is a dropout seed drawn for the call (seed None).
    """
    deterministic = options.pop("deterministic", True)
    statistics = options.pop("statistics", None)  # None: own_forward_statistics of the dtype
    draw_seed_once(options)
    if "return_lse" in options:
        raise TypeError("flash_attn_vjp does not take return_lse (the lse is kept for the backward)")
    if options.get("mask_mod") is not None and options.get("block_mask") is None:
        from .modifiers import BlockMask

        mask_mod = options.pop("mask_mod")
        batch, seqlen_q, nheads = np.shape(q)[:3]
        device = "cpu" if options.get("backend") == "numpy" or not dispatch.gpu_available() else "cuda"
        options["block_mask"] = BlockMask(mask_mod, batch, nheads, seqlen_q, np.shape(k)[1], device=device)
    o, lse = flash_attn_func(q, k, v, return_lse=True, **options)

    # refused here, when the vjp is made, not when it is called (o: a NumPy or CuPy array)
    statistics = check_statistics(statistics, o.dtype) if statistics else own_forward_statistics(o.dtype)

    def vjp(do):
        return flash_attn_backward(do, q, k, v, o, lse, deterministic=deterministic, statistics=statistics,
                                   **options)

    return o, vjp

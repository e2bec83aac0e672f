"""Ring attention: exact attention over a sequence sharded across P ranks.

Each rank keeps its query shard; the K/V shards travel around the ring, one hop per step, so that
after P steps every rank has attended to every key. Step t on rank r uses the K/V of rank
s = (r - t) mod P:

    forward, step t:  start sending the K/V held to r + 1 (receiving s - 1's from r - 1)
                      (o_t, lse_t) = flash_attn_func(q, K_s, V_s) on the rows / keys the mask sees
                      merge (o_t, lse_t) into the running (o, lse), float32, by the LSE rule
                      wait for the transfer

The transfer of the next K/V runs while this step computes (``overlap=False`` waits for it
before computing instead, to measure what the overlap hides).

The backward runs the same ring with the GLOBAL o and lse of the forward: with them, each step's
P = exp(S - lse) and D = rowsum(dO · O) are the whole sequence's, so cupyflash's own backward on
one (query shard, K/V shard) pair returns exact partial gradients, and dQ, dK, dV are their sums.
dQ accumulates on the rank; the dK/dV of the K/V held travel with it (float32): rank r adds its
part to the accumulator received from r - 1 and sends it on; after P steps each accumulator has
every rank's part and one last hop takes it home.

Causal masks use the zigzag layout (sharding.py): rank r holds chunks r and 2P - 1 - r of C rows.
Its query chunks against the key chunks of rank s:

    s == r:  chunks r, 2P-1-r against r, 2P-1-r  -> causal attention on the local 2C rows
    s <  r:  both query chunks see key chunk s only, entirely       -> q (2C) vs k[:C], no mask
    s >  r:  only chunk 2P-1-r sees anything: both key chunks      -> q[C:] vs k (2C), no mask

so every step after the first is a C x 2C block on every rank (balanced). ``layout="contiguous"``
(rank r holds rows r·S..(r+1)·S-1) is supported too: s < r full, s == r causal, s > r nothing —
correct, unbalanced (rank P-1 does P times rank 0's work). Without a mask the layout is irrelevant.

Sums run in a fixed order (step order, deterministic kernels), so results are bitwise repeatable
for a given P. Every rank must hold shards of one shape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .._dtypes import lse_dtype
from ..api import flash_attn_backward, flash_attn_func
from ..masks import check_window
from ..merge import merge_attention_states

__all__ = ["RingStep", "ring_schedule", "ring_flash_attn_func", "ring_flash_attn_backward", "ring_flash_attn_vjp"]

LAYOUTS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class RingStep:
    """One step of one rank: attention of its queries (``queries``: "all" or "second_half", the
    chunk 2P-1-r of a zigzag shard) to the keys of rank ``source`` (``keys``: "all" or
    "first_half", its chunk s), causal or not."""

    source: int
    queries: str = "all"
    keys: str = "all"
    causal: bool = False


def ring_schedule(rank: int, size: int, causal: bool, layout: str = "zigzag") -> list:
    """The P steps of ``rank``: a RingStep each, or None where its queries see none of the keys
    held (contiguous causal, s > r). The K/V move on every step either way."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    steps = []
    for t in range(size):
        source = (rank - t) % size
        if not causal:
            steps.append(RingStep(source))
        elif source == rank:
            steps.append(RingStep(source, causal=True))
        elif layout == "contiguous":
            steps.append(RingStep(source) if source < rank else None)
        elif source < rank:
            steps.append(RingStep(source, keys="first_half"))
        else:
            steps.append(RingStep(source, queries="second_half"))
    return steps


def _rows(which: str, length: int) -> slice:
    return slice(length // 2, length) if which == "second_half" else slice(0, length)


def _key_rows(which: str, length: int) -> slice:
    return slice(0, length // 2) if which == "first_half" else slice(0, length)


def _array_module_of(x) -> str:
    if isinstance(x, np.ndarray):
        return "numpy"
    return type(x).__module__.split(".")[0]


def _check(comm, arrays: dict, causal: bool, window_size, layout: str):
    """A TypeError or ValueError naming what the ring cannot take; nothing when it can."""
    for attr in ("rank", "size", "xp", "start_exchange"):
        if not hasattr(comm, attr):
            raise TypeError(f"comm must be a ring communicator (rank, size, xp, start_exchange), got {type(comm).__name__}")
    want = comm.xp.__name__.split(".")[0]
    for name, x in arrays.items():
        if _array_module_of(x) != want:
            raise TypeError(f"{name} is a {type(x).__module__}.{type(x).__name__}; this communicator moves {want} arrays")
    if check_window(window_size) != (-1, -1):
        raise ValueError("ring attention does not take a sliding window: a window's per-chunk masks are not "
                         "flash-attn windows (use the whole-sequence flash_attn_func, or halo exchange)")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: expected (batch, seqlen, heads, headdim) shards, "
                         "k and v of one shape")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {q.shape} and k {k.shape} differ in batch or headdim")
    if causal:
        if q.shape[1] != k.shape[1]:
            raise ValueError(f"causal ring attention is self-attention: q and k shards of one length, got "
                             f"{q.shape[1]} and {k.shape[1]}")
        if layout == "zigzag" and q.shape[1] % 2:
            raise ValueError(f"causal ring attention with the zigzag layout needs an even shard length (two "
                             f"chunks of seqlen / 2P rows), got {q.shape[1]} on rank {comm.rank}: shard with "
                             f"zigzag_shard, which needs the sequence length to be a multiple of 2P")


def _scale(softmax_scale, headdim: int) -> float:
    return 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)


def _kv_ring(xp, k, v):
    """The K/V held at step 0 (the caller's, only ever read) and two spare buffer pairs that the
    following steps receive into in turn."""
    held = (xp.ascontiguousarray(k), xp.ascontiguousarray(v))
    return held, [None, None]


def _next_kv(comm, xp, held, spare, t: int, overlap: bool):
    """Start the transfer of the K/V of step t + 1; (pending, where they arrive)."""
    if spare[t % 2] is None:
        spare[t % 2] = (xp.empty_like(held[0]), xp.empty_like(held[1]))
    pending = comm.start_exchange(held, spare[t % 2])
    if not overlap:
        pending.wait()
    return pending, spare[t % 2]


def ring_flash_attn_func(q, k, v, *, comm, softmax_scale=None, causal=False, window_size=(-1, -1),
                         layout="zigzag", return_lse=False, backend="auto", overlap=True):
    """Attention of this rank's query shard over the whole sharded sequence.

    q: (batch, seqlen_local, nheads, headdim), k, v: (batch, seqlen_local_k, nheads_kv, headdim)
    (GQA as flash_attn_func): this rank's shards, every rank's of one shape. ``comm``: a ring
    communicator (comm.py; its array module decides NumPy or CuPy arrays). ``causal``: the mask of
    the whole sequence, which must then be sharded by ``layout`` ("zigzag", default, or
    "contiguous"). Returns o (like q, this rank's rows), or (o, lse) with lse (batch, nheads,
    seqlen_local) float32 (float64 for float64). ``backend``: flash_attn_func's, for each step.
    ``overlap=False``: wait for each K/V transfer before computing (to measure the overlap).
    """
    _check(comm, {"q": q, "k": k, "v": v}, causal, window_size, layout)
    xp = comm.xp
    scale = _scale(softmax_scale, q.shape[3])
    acc = lse_dtype(q.dtype)
    steps = ring_schedule(comm.rank, comm.size, causal, layout)
    held, spare = _kv_ring(xp, k, v)
    o_acc = lse_acc = None
    for t, step in enumerate(steps):
        pending = arriving = None
        if t + 1 < len(steps):
            pending, arriving = _next_kv(comm, xp, held, spare, t, overlap)
        if step is not None:
            rows = _rows(step.queries, q.shape[1])
            keys = _key_rows(step.keys, held[0].shape[1])
            o_t, lse_t = flash_attn_func(q[:, rows], held[0][:, keys], held[1][:, keys], softmax_scale=scale,
                                         causal=step.causal, return_lse=True, backend=backend)
            if o_acc is None:  # step 0: this rank's own keys, every row
                o_acc, lse_acc = o_t.astype(acc), lse_t.astype(acc, copy=True)
            else:
                o_rows, lse_rows = o_acc[:, rows], lse_acc[:, :, rows]
                merge_attention_states(o_rows, lse_rows, o_t, lse_t, out=o_rows, lse_out=lse_rows)
        if pending is not None:
            pending.wait()
            held = arriving
    o = o_acc.astype(q.dtype, copy=False)
    return (o, lse_acc) if return_lse else o


def ring_flash_attn_backward(dout, q, k, v, out, softmax_lse, *, comm, softmax_scale=None, causal=False,
                             window_size=(-1, -1), layout="zigzag", backend="auto", deterministic=True,
                             overlap=True):
    """(dq, dk, dv) of this rank's shards, from ring_flash_attn_func's o and lse (this rank's).

    Arguments as ring_flash_attn_func's, with flash_attn_backward's order (dout, q, k, v, out,
    softmax_lse). Partial gradients accumulate in float32 (float64 for float64) and are rounded to
    the input dtype once; dk, dv of GQA sum over the query heads sharing a kv head, as always.
    """
    arrays = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "softmax_lse": softmax_lse}
    _check(comm, arrays, causal, window_size, layout)
    batch, seqlen, nheads, _ = q.shape
    if dout.shape != q.shape or out.shape != q.shape or softmax_lse.shape != (batch, nheads, seqlen):
        raise ValueError(f"dout {dout.shape} and out {out.shape} must have q's shape {q.shape}, softmax_lse "
                         f"{softmax_lse.shape} must be {(batch, nheads, seqlen)}")
    xp = comm.xp
    scale = _scale(softmax_scale, q.shape[3])
    acc = lse_dtype(q.dtype)
    steps = ring_schedule(comm.rank, comm.size, causal, layout)
    held, spare = _kv_ring(xp, k, v)
    dq_acc = xp.zeros(q.shape, acc)
    # Two (dk, dv) accumulators: the one of the K/V held, and the one arriving from rank r - 1.
    dkv = [(xp.zeros(k.shape, acc), xp.zeros(v.shape, acc)), None]
    dkv_pending = None
    for t, step in enumerate(steps):
        pending = arriving = None
        if t + 1 < len(steps):
            pending, arriving = _next_kv(comm, xp, held, spare, t, overlap)
        grads = None
        if step is not None:
            rows = _rows(step.queries, seqlen)
            keys = _key_rows(step.keys, held[0].shape[1])
            grads = flash_attn_backward(dout[:, rows], q[:, rows], held[0][:, keys], held[1][:, keys], out[:, rows],
                                        softmax_lse[:, :, rows], softmax_scale=scale, causal=step.causal,
                                        backend=backend, deterministic=deterministic)
        if dkv_pending is not None:
            dkv_pending.wait()  # the accumulator of the K/V held, with ranks r - t .. r - 1's parts
        dk_acc, dv_acc = dkv[t % 2]
        if grads is not None:
            dq_t, dk_t, dv_t = grads
            dq_acc[:, rows] += dq_t.astype(acc)
            dk_acc[:, keys] += dk_t.astype(acc)
            dv_acc[:, keys] += dv_t.astype(acc)
        if comm.size > 1:
            if dkv[(t + 1) % 2] is None:
                dkv[(t + 1) % 2] = (xp.empty_like(dk_acc), xp.empty_like(dv_acc))
            # After the last step this is the hop that takes each accumulator home.
            dkv_pending = comm.start_exchange((dk_acc, dv_acc), dkv[(t + 1) % 2])
            if not overlap:
                dkv_pending.wait()
        if pending is not None:
            pending.wait()
            held = arriving
    if dkv_pending is not None:
        dkv_pending.wait()
    dk_home, dv_home = dkv[len(steps) % 2] if comm.size > 1 else dkv[0]
    return (dq_acc.astype(q.dtype, copy=False), dk_home.astype(k.dtype, copy=False),
            dv_home.astype(v.dtype, copy=False))


def ring_flash_attn_vjp(q, k, v, *, comm, **options):
    """(o, vjp) with vjp(do) -> (dq, dk, dv), all this rank's shards: ring_flash_attn_func's
    options (softmax_scale, causal, layout, backend, overlap); ``deterministic`` goes to the
    backward."""
    deterministic = options.pop("deterministic", True)
    if "return_lse" in options:
        raise TypeError("ring_flash_attn_vjp does not take return_lse (the lse is kept for the backward)")
    o, lse = ring_flash_attn_func(q, k, v, comm=comm, return_lse=True, **options)

    def vjp(do):
        return ring_flash_attn_backward(do, q, k, v, o, lse, comm=comm, deterministic=deterministic, **options)

    return o, vjp

"""Calls without host synchronisation, and inside CUDA-graph capture.

By default a call checks the values of its index arrays before it launches anything:
cu_seqlens (varlen), cache_seqlens, block_table and cache_batch_idx (KV cache). Device arrays are
read back to the host for that, one synchronisation per call. The GPU then idles while Python
works: the varlen bench measured 0.5-0.8x of the same call with host cu_seqlens. A decode step
with such reads cannot be captured in a CUDA graph at all.

Two ways to do without the reads:

    with cupyflash.no_host_sync():          # eager calls, flash-attn's behaviour
        o = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k)

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:                            # capture: no_host_sync() holds by itself
        stream.begin_capture()
        o = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens)
        graph = stream.end_capture()
    graph.launch(stream)                    # replays; update seqlens etc. in place between replays

Either way, an index array on the device is used as it is. Its dtype, shape and layout are
checked, as flash-attn checks them, but not its values: lengths beyond max_seqlen, a
non-monotone cu_seqlens or a block_table entry outside the cache give undefined results, as in
flash-attn. Host (NumPy) index arrays are still checked (that reads nothing back): in full when
all of a call's index arrays are on the host, as far as their values allow beside a device one
(docs/varlen-kvcache.md, "Without host synchronisation, and CUDA graphs"). The
shapes that need host lengths are refused with an error that says so (the per-sequence paths:
float32/float64 KV caches, head dims that are not a multiple of 8, more than 65535 sequences).
The grids come from what the call is told, not from the values: a varlen call's from
max_seqlen_q and max_seqlen_k, a KV-cache call's from the cache's capacity, so a captured
decode step stays valid while its sequences grow.

Memory under capture. A captured graph writes to the same addresses at every replay, so no
later allocation may be handed the memory a captured call used. A call made while the current
stream captures therefore allocates from a CuPy memory pool of its own, which is kept for the
life of the process (its outputs, scratch and temporaries; a call's pool is about what the call
allocates, and every captured call keeps one). With cupyflash.torch the allocator is torch's,
whose graph pools keep such memory already, and it is left as it is (``graph_aware_allocator``).
Under capture every array must already be on the device (a host array's upload, or a result's
download, cannot be captured), and the capture mode must allow cudaMalloc: CuPy's default,
relaxed, does; torch.cuda.graph's allocator does its own.

no_host_sync() holds in its context (contextvars): code that runs in a copy of the context
(asyncio tasks, asyncio.to_thread) sees it, a plain thread started inside does not.
Warm a step up inside no_host_sync() before capturing it, so that the kernels the captured call
launches (its grid, its split count) are compiled and loaded before the capture.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import sys

__all__ = ["no_host_sync", "reads_allowed", "capturing", "under_capture", "graph_safe", "refuse_host_upload",
           "refuse_host_arrays", "graph_aware_allocator"]

# no_host_sync()'s depth; the decision of the public call under way, (reads allowed, capturing),
# or None outside one; whether the current allocator keeps captured memory itself (torch's).
_NO_SYNC = contextvars.ContextVar("cupyflash_no_host_sync", default=0)
_CALL = contextvars.ContextVar("cupyflash_call", default=None)
_GRAPH_AWARE = contextvars.ContextVar("cupyflash_graph_aware_allocator", default=False)
# Memory pools of the calls made under capture: the graphs that recorded them refer to their blocks.
_GRAPH_POOLS: list = []
# cudaErrorStreamCaptureUnsupported .. cudaErrorStreamCaptureWrongThread: a query that fails with
# one of these was made while a capture is under way.
_CAPTURE_ERRORS = range(900, 909)


@contextlib.contextmanager
def no_host_sync():
    """Inside, calls read no device array back to the host (the module docstring)."""
    token = _NO_SYNC.set(_NO_SYNC.get() + 1)
    try:
        yield
    finally:
        _NO_SYNC.reset(token)


@contextlib.contextmanager
def graph_aware_allocator():
    """Inside, CuPy's current allocator is one that keeps memory allocated under capture for the
    graph itself (cupyflash.torch's: torch's caching allocator and its graph pools), so captured
    calls do not switch to a pool of their own."""
    token = _GRAPH_AWARE.set(True)
    try:
        yield
    finally:
        _GRAPH_AWARE.reset(token)


def capturing() -> bool:
    """Whether CuPy's current stream is capturing a CUDA graph."""
    cupy = sys.modules.get("cupy")
    if cupy is None:  # nothing can be capturing through CuPy before it is imported
        return False
    try:
        return bool(cupy.cuda.get_current_stream().is_capturing())
    except Exception as exc:  # CUDARuntimeError: a capture forbids the query, or no device at all
        return getattr(exc, "status", None) in _CAPTURE_ERRORS


def reads_allowed() -> bool:
    """Whether the call under way may read device arrays back to the host: not inside
    no_host_sync(), not while the current stream captures."""
    state = _CALL.get()
    if state is not None:
        return state[0]
    return not _NO_SYNC.get() and not capturing()


def under_capture() -> bool:
    """capturing(), as decided at the start of the call under way."""
    state = _CALL.get()
    return state[1] if state is not None else capturing()


def graph_safe(fn):
    """A public function whose calls follow this module: whether reads are allowed is decided
    once per outermost call, and under capture the call allocates from a pool of its own (unless
    the allocator is graph-aware, graph_aware_allocator, or a MemoryAsyncPool's)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if _CALL.get() is not None:  # inside another public call (a vjp, a fallback)
            return fn(*args, **kwargs)
        capture = capturing()
        token = _CALL.set((not capture and not _NO_SYNC.get(), capture))
        try:
            if capture and not _GRAPH_AWARE.get() and not _stream_ordered_allocator(sys.modules["cupy"]):
                cupy = sys.modules["cupy"]
                pool = cupy.cuda.MemoryPool()
                _GRAPH_POOLS.append(pool)
                with cupy.cuda.using_allocator(pool.malloc):
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)
        finally:
            _CALL.reset(token)

    return call


def _stream_ordered_allocator(cupy) -> bool:
    """Whether CuPy's current allocator is a MemoryAsyncPool's: cudaMallocAsync, which a capture
    records as allocation nodes of the graph itself (and which a global-mode capture allows where
    it refuses cudaMalloc), so the call keeps it."""
    owner = getattr(cupy.cuda.get_allocator(), "__self__", None)
    async_pool = getattr(cupy.cuda, "MemoryAsyncPool", None)
    return async_pool is not None and isinstance(owner, async_pool)


def refuse_host_arrays(host_names, backend: str) -> None:
    """Under capture: the error for arrays that are on the host (``host_names``) or a NumPy
    backend, neither of which a graph can hold (an upload, a download, host computation)."""
    if not under_capture():
        return
    if backend == "numpy":
        raise ValueError("backend='numpy' cannot run inside a CUDA-graph capture: the NumPy twin computes on the host")
    names = list(host_names)
    if names:
        raise ValueError(f"{', '.join(names)} {'is a host array' if len(names) == 1 else 'are host arrays'}: inside "
                         "a CUDA-graph capture every array must already be on the device (a host-to-device copy, "
                         "or the copy of a result back, cannot be captured); pass CuPy arrays")


def refuse_host_upload(name: str) -> None:
    """A host index array cannot reach the device inside a capture (an upload is a synchronous
    copy, which capture forbids): the error that says what to pass instead."""
    if under_capture():
        raise ValueError(f"{name} is a host array, and a host-to-device copy cannot be captured in a CUDA graph: "
                         f"pass {name} as a device (CuPy) array, which a replay then reads as it is at the time")

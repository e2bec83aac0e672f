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
flash-attn. Host (NumPy) index arrays are still checked in full: that reads nothing back. The
shapes that need host lengths are refused with an error that says so (the per-sequence paths:
float32/float64 KV caches, head dims that are not a multiple of 8, more than 65535 sequences).
The grids come from what the call is told, not from the values: a varlen call's from
max_seqlen_q and max_seqlen_k, a KV-cache call's from the cache's capacity, so a captured
decode step stays valid while its sequences grow.

Memory under capture. A captured graph writes to the same addresses at every replay, so no
later allocation may be handed the memory a captured call used. A call made while the current
stream captures therefore allocates from a CuPy memory pool of its own, which is kept for the
life of the process (its outputs, scratch and temporaries; a call's pool is about what the call
allocates). With cupyflash.torch the allocator is torch's, whose graph pools keep such memory
already, and it is left as it is.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import threading

__all__ = ["no_host_sync", "reads_allowed", "capturing", "under_capture", "graph_safe", "refuse_host_upload"]

_local = threading.local()
# Memory pools of the calls made under capture: the graphs that recorded them refer to their blocks.
_GRAPH_POOLS: list = []
# cudaErrorStreamCaptureUnsupported .. cudaErrorStreamCaptureWrongThread: a query that fails with
# one of these was made while a capture is under way.
_CAPTURE_ERRORS = range(900, 909)


@contextlib.contextmanager
def no_host_sync():
    """Inside, calls read no device array back to the host (the module docstring)."""
    depth = getattr(_local, "no_sync", 0)
    _local.no_sync = depth + 1
    try:
        yield
    finally:
        _local.no_sync = depth


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
    state = getattr(_local, "call", None)
    if state is not None:
        return state[0]
    return not getattr(_local, "no_sync", 0) and not capturing()


def under_capture() -> bool:
    """capturing(), as decided at the start of the call under way."""
    state = getattr(_local, "call", None)
    return state[1] if state is not None else capturing()


def _uses_default_pool(cupy) -> bool:
    return cupy.cuda.get_allocator() == cupy.get_default_memory_pool().malloc


def graph_safe(fn):
    """A public function whose calls follow this module: whether reads are allowed is decided
    once per outermost call, and under capture with CuPy's default pool the call allocates from a
    pool of its own."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if getattr(_local, "call", None) is not None:  # inside another public call (a vjp, a fallback)
            return fn(*args, **kwargs)
        capture = capturing()
        _local.call = (not capture and not getattr(_local, "no_sync", 0), capture)
        try:
            if capture:
                cupy = sys.modules["cupy"]
                if _uses_default_pool(cupy):
                    pool = cupy.cuda.MemoryPool()
                    _GRAPH_POOLS.append(pool)
                    with cupy.cuda.using_allocator(pool.malloc):
                        return fn(*args, **kwargs)
            return fn(*args, **kwargs)
        finally:
            _local.call = None

    return call


def refuse_host_upload(name: str) -> None:
    """A host index array cannot reach the device inside a capture (an upload is a synchronous
    copy, which capture forbids): the error that says what to pass instead."""
    if under_capture():
        raise ValueError(f"{name} is a host array, and a host-to-device copy cannot be captured in a CUDA graph: "
                         f"pass {name} as a device (CuPy) array, which a replay then reads as it is at the time")

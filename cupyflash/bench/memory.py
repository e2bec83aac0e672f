"""``--memory``: extra peak device memory of one forward+backward, against seqlen.

How it is measured. The inputs (q, k, v, do) are allocated first, outside the count. For
cupyflash and for the standard materialised attention (``standard.py``, in CuPy), the region
runs under a counting allocator: CuPy's allocator is replaced, for this thread, by one serving
from a private ``MemoryPool``, and after every allocation the pool's live bytes are read; the
largest value is the peak (live bytes only change upward at an allocation, so sampling there
is exact). Sizes are the pool's, rounded up to 512 bytes. Memory a library allocates behind
CuPy's back (cuBLAS workspaces, module images) is not seen. Outputs (o, lse, dq, dk, dv) are
part of the peak, as are saved tensors and workspaces. Torch anchors are read from torch's
allocator (``max_memory_allocated`` minus the baseline), which is the same quantity.
"""
from __future__ import annotations

from contextlib import contextmanager

from .impls import STANDARD, Rejected
from .inputs import device_dtype, make_input_sets
from .results import MemoryRecord
from .runners import REJECTIONS, api


class _Skip(Exception):
    pass


class PeakCounter:
    """``cupy.cuda.set_allocator``-style allocator that records the peak of live bytes."""

    def __init__(self, pool):
        self.pool = pool
        self.peak_bytes = 0

    def malloc(self, nbytes: int):
        memory = self.pool.malloc(nbytes)
        self.peak_bytes = max(self.peak_bytes, self.pool.used_bytes())
        return memory


@contextmanager
def counting_allocator():
    """Allocations inside the block are counted (this thread only); yields the PeakCounter."""
    import cupy

    counter = PeakCounter(cupy.cuda.MemoryPool())
    try:
        with cupy.cuda.using_allocator(counter.malloc):
            yield counter
    finally:
        counter.pool.free_all_blocks()


def standard_score_bytes(case) -> int:
    """Bytes of one (B, H, Sq, Sk) float32 matrix of the standard implementation."""
    return 4 * case.batch * case.nheads * case.seqlen_q * case.seqlen_k


def _cupyflash_step(backend, case, s, scale, deterministic):
    fwd, bwd = api(backend, case, softmax_scale=scale, deterministic=deterministic)
    o, lse = fwd(s.q, s.k, s.v, return_lse=True)
    return (o, lse, *bwd(s.do, s.q, s.k, s.v, o, lse))


def _standard_step(case, s, scale):
    from .standard import standard_attention

    out = standard_attention(s.q, s.k, s.v, s.do, softmax_scale=scale, causal=case.causal)
    dtype = device_dtype(case.dtype)
    return tuple(out[name].astype(dtype) for name in ("o", "dq", "dk", "dv")) + (out["lse"],)


def _counted_peak(step, stream, *, warm_up: bool) -> int:
    """Run ``step`` counted (after one uncounted run that compiles, if asked)."""
    if warm_up:
        step()
        stream.synchronize()
    with counting_allocator() as counter:
        result = step()
        stream.synchronize()
        del result
    return counter.peak_bytes


def _peak_bytes(harness, impl, case, s) -> int:
    """Extra peak bytes of one forward+backward of ``impl`` (None: the standard attention)."""
    import cupy

    scale = harness.softmax_scale
    if impl is None:
        free = cupy.cuda.runtime.memGetInfo()[0] + cupy.get_default_memory_pool().free_bytes()
        need = 3 * standard_score_bytes(case)
        if need > free:
            raise _Skip(f"needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
        # Its CuPy kernels allocate nothing when compiled, so no warm-up (which would double
        # the longest steps of the sweep).
        return _counted_peak(lambda: _standard_step(case, s, scale), harness.stream,
                             warm_up=False)
    if impl.family == "cupyflash":
        try:
            return _counted_peak(
                lambda: _cupyflash_step(impl.backend, case, s, scale, harness.deterministic),
                harness.stream, warm_up=True)
        except REJECTIONS as exc:
            raise Rejected(f"{type(exc).__name__}: {exc}") from exc
    if harness.bridge is None:
        raise Rejected("torch is not available")
    from .torch_sdpa import sdpa_peak_bytes

    return sdpa_peak_bytes(harness.bridge, impl.backend, case, s, softmax_scale=scale)


def measure_memory(harness, cases, impls, progress) -> list[MemoryRecord]:
    """One record per (case, implementation), plus the standard attention of each case."""
    import cupy

    records = []
    for case in cases:
        with harness.stream:
            s = make_input_sets(case, 1, seed=harness.seed)[0]
        for impl in list(impls) + [None]:
            label, family = (STANDARD, STANDARD) if impl is None else (impl.label, impl.family)
            try:
                with harness.stream:
                    peak = _peak_bytes(harness, impl, case, s)
                record = MemoryRecord(case, label, family, "ok", peak)
            except _Skip as exc:
                record = MemoryRecord(case, label, family, "skipped", reason=str(exc))
            except Rejected as exc:
                record = MemoryRecord(case, label, family, "rejected", reason=str(exc))
            except cupy.cuda.memory.OutOfMemoryError as exc:
                record = MemoryRecord(case, label, family, "oom", reason=str(exc))
            except Exception as exc:
                record = MemoryRecord(case, label, family, "error",
                                      reason=f"{type(exc).__name__}: {exc}")
            records.append(record)
            harness.release_memory()
            figure = (f"{record.peak_bytes / 2**20:,.0f} MiB" if record.status == "ok"
                      else record.status)
            progress.step(f"memory {case.label()} · {label}: {figure}")
        del s
        harness.release_memory()
    return records

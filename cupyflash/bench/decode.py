"""``--decode``: one query token against a long KV cache, a bandwidth-bound problem.

The figure of merit is the K+V read bandwidth (bytes of K and V over the step's time), shown
next to a device-to-device copy measured in the same run, which counts bytes read plus
written: the copy is what the memory system delivers to a kernel that only streams.
"""
from __future__ import annotations

from .results import CopyRecord
from .timing import time_region

COPY_BYTES = 2 * 2**30


def measure_copy(harness, nbytes: int = COPY_BYTES) -> CopyRecord:
    """Time ``cudaMemcpyAsync`` device to device of ``nbytes`` (capped at 1/8 of free memory)."""
    import cupy

    free = cupy.cuda.runtime.memGetInfo()[0] + cupy.get_default_memory_pool().free_bytes()
    nbytes = int(min(nbytes, free // 8))
    with harness.stream:
        src = cupy.empty(nbytes, dtype=cupy.uint8)
        src.fill(0xA5)
        dst = cupy.empty_like(src)

        def run(_):
            dst.data.copy_from_device_async(src.data, nbytes, harness.stream)

        # One pair of buffers: at gigabytes, far beyond L2, there is nothing to rotate for.
        timing = time_region(run, 1, policy=harness.policy, stream=harness.stream)
    return CopyRecord(nbytes, timing)


def measure_decode(harness, cases, progress):
    """(measurements, copy record or None, notes)."""
    notes = []
    measurements = harness.run_cases(cases, progress, decode=True)
    try:
        copy = measure_copy(harness)
    except Exception as exc:
        copy = None
        notes.append(f"device-to-device copy not measured: {type(exc).__name__}: {exc}")
    harness.release_memory()
    progress.step("decode · device-to-device copy: "
                  + ("failed" if copy is None else f"{copy.tbps:.2f} TB/s"))
    return measurements, copy, notes

"""Device-side timing with CUDA events.

Each repeat is bracketed by its own pair of events and the median is reported. Two things keep
the events honest:

* a spin kernel holds the stream while the host enqueues every repeat, so the GPU never waits
  for Python between a start event and the work it brackets (launch overhead stays out of
  short cases); every repeat whose start event had already fired by the time its work was
  enqueued is counted as *host-bound*, and reported;
* callers rotate among several input sets, so a repeat does not find its inputs left in L2 by
  the previous one.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

# globaltimer counts nanoseconds on every architecture, so no clock rate is needed.
SPIN_SOURCE = r"""
extern "C" __global__ void cupyflash_bench_spin(unsigned long long duration_ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < duration_ns);
}
"""
SPIN_NAME = "cupyflash_bench_spin"
MAX_SPIN_S = 1.0


def percentile(values, q: float) -> float:
    """q-th percentile (0..100) with linear interpolation between order statistics."""
    data = sorted(values)
    if not data:
        raise ValueError("percentile of no values")
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


@dataclass(frozen=True)
class Timing:
    """Per-repeat device times of one measured region."""

    times_ms: tuple[float, ...]
    warmup: int
    input_sets: int
    host_bound_repeats: int = 0

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    def to_json(self) -> dict:
        t = self.times_ms
        return {
            "median_ms": self.median_ms,
            "min_ms": min(t),
            "max_ms": max(t),
            "p20_ms": percentile(t, 20),
            "p80_ms": percentile(t, 80),
            "repeats": len(t),
            "warmup": self.warmup,
            "input_sets": self.input_sets,
            "host_bound_repeats": self.host_bound_repeats,
            "times_ms": list(t),
        }

    @classmethod
    def from_json(cls, data: dict) -> Timing:
        """The Timing that to_json wrote; the statistics are recomputed from times_ms."""
        # float() also undoes results.json_safe, should a repeat have been written as "nan".
        return cls(tuple(float(t) for t in data["times_ms"]), warmup=data["warmup"],
                   input_sets=data["input_sets"], host_bound_repeats=data["host_bound_repeats"])


@dataclass(frozen=True)
class RepeatPolicy:
    """How long to measure: ``warmup`` calls (at least 1), then enough repeats for about
    target_s of device time, within bounds. Compilation (NVRTC, cuDNN plans) happens before,
    in the runner's preparing call."""

    warmup: int = 1
    target_s: float = 0.2
    min_repeats: int = 5
    max_repeats: int = 30

    def repeats_for(self, estimate_ms: float) -> int:
        if self.min_repeats == self.max_repeats:
            return self.min_repeats
        wanted = math.ceil(self.target_s * 1e3 / max(estimate_ms, 1e-3))
        return max(self.min_repeats, min(self.max_repeats, wanted))


FULL_POLICY = RepeatPolicy(warmup=1, target_s=0.2, min_repeats=5, max_repeats=30)
QUICK_POLICY = RepeatPolicy(warmup=1, target_s=0.1, min_repeats=5, max_repeats=20)


def rotation_count(set_bytes: int, l2_bytes: int, budget_bytes: int, *, l2_multiple: int = 4,
                   min_sets: int = 2, max_sets: int = 8) -> int:
    """How many input sets to rotate among: enough to cover l2_multiple x L2, never fewer than
    min_sets (so a repeat never reuses the inputs of the one before), within budget_bytes."""
    if set_bytes <= 0:
        raise ValueError("set_bytes must be positive")
    wanted = max(min_sets, math.ceil(l2_multiple * l2_bytes / set_bytes))
    affordable = max(1, budget_bytes // set_bytes)
    return int(max(1, min(wanted, max_sets, affordable)))


_spin_kernels: dict = {}


def _spin(stream, duration_s: float) -> None:
    import cupy
    import numpy as np

    device = cupy.cuda.Device().id
    kernel = _spin_kernels.get(device)
    if kernel is None:
        kernel = _spin_kernels[device] = cupy.RawKernel(SPIN_SOURCE, SPIN_NAME)
    with stream:
        kernel((1,), (1,), (np.uint64(int(duration_s * 1e9)),))


def time_region(run, n_sets: int, *, policy: RepeatPolicy, stream) -> Timing:
    """Time ``run(i)`` (which enqueues one region on ``stream`` using input set i) with CUDA
    events; returns every repeat's device time.

    The last warm-up call is timed alone: its device time sizes the repeat count, its host
    time the spin.
    """
    import cupy

    for i in range(policy.warmup - 1):
        run(i % n_sets)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    stream.synchronize()
    t0 = time.perf_counter()
    start.record(stream)
    run((policy.warmup - 1) % n_sets)
    end.record(stream)
    host_s = time.perf_counter() - t0
    end.synchronize()
    repeats = policy.repeats_for(cupy.cuda.get_elapsed_time(start, end))

    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(repeats)]
    _spin(stream, min(MAX_SPIN_S, 1.5 * repeats * host_s + 1e-3))
    host_bound = 0
    for r, (start, end) in enumerate(events):
        start.record(stream)
        run((policy.warmup + r) % n_sets)
        # If the GPU already passed the start event, it waited for the host inside this repeat.
        host_bound += int(start.done)
        end.record(stream)
    events[-1][1].synchronize()
    times = tuple(cupy.cuda.get_elapsed_time(s, e) for s, e in events)
    return Timing(times, policy.warmup, n_sets, host_bound)

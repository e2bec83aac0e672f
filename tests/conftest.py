"""Hypothesis profiles and the ``gpu`` marker.

Profiles (pick with the environment variable HYPOTHESIS_PROFILE): "dev" (default, quick), "ci"
(more examples, the CPU CI job), "gpu" (many examples on a device). Tests draw every input from
a seed that Hypothesis chooses (tests/strategies.py), so there is no shared random generator.

Tests marked ``gpu`` are skipped, with the reason, where no CUDA device is usable. CuPy imports
fine without a GPU; asking the runtime for devices is what fails there.
"""
from __future__ import annotations

import os

# Before NumPy loads: these tests multiply many small matrices, where OpenBLAS threads only
# spin-wait; on a busy 2-core runner they made the suite 2-6x slower and erratic. Export
# OPENBLAS_NUM_THREADS to override (it has no effect if NumPy was imported before this file).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("dev", max_examples=25, deadline=None, print_blob=True)
settings.register_profile("ci", max_examples=60, deadline=None, print_blob=True)
settings.register_profile(
    "gpu",
    max_examples=200,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def _why_no_cuda_device() -> str | None:
    """None if a CUDA device is usable through CuPy, else the reason it is not."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CuPy build that fails to load its libraries
        return f"CuPy is not importable: {exc}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError without a driver or device
        return f"no usable CUDA device: {exc}"
    if count == 0:
        return "no CUDA device"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = _why_no_cuda_device()
    if reason is not None:
        skip = pytest.mark.skip(reason=f"gpu test: {reason}")
        for item in gpu_items:
            item.add_marker(skip)

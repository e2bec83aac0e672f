"""Hypothesis profiles and the ``gpu`` marker.

Profiles (pick with the environment variable HYPOTHESIS_PROFILE): "dev" (default, quick), "ci"
(more examples, the CPU CI job), "gpu" (many examples on a device). Tests draw every input from
a seed that Hypothesis chooses (tests/strategies.py), so there is no shared random generator.

Tests marked ``gpu`` are skipped, with the library's own reason, where no CUDA device is usable
(CuPy imports fine without a GPU; asking the runtime for devices is what fails there). Tests marked
``compile_full`` (the compile check of every specialization, minutes on two cores) are skipped
unless ``-m`` names the marker or CUPYFLASH_COMPILE_FULL=1.
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
# CI draws the same examples on every run (derandomize): a landing is judged on the change, not on
# the draw; the dev and gpu profiles keep exploring, and what they find is pinned as an @example.
settings.register_profile("ci", max_examples=60, deadline=None, print_blob=True, derandomize=True)
settings.register_profile(
    "gpu",
    max_examples=200,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def _compile_full_selected(config) -> bool:
    return "compile_full" in (config.getoption("markexpr") or "") or os.environ.get("CUPYFLASH_COMPILE_FULL") == "1"


def pytest_collection_modifyitems(config, items):
    full_items = [item for item in items if item.get_closest_marker("compile_full") is not None]
    if full_items and not _compile_full_selected(config):
        skip = pytest.mark.skip(reason="compile check of every specialization: run with -m compile_full "
                                       "(or CUPYFLASH_COMPILE_FULL=1)")
        for item in full_items:
            item.add_marker(skip)
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    from cupyflash.dispatch import no_device_reason

    reason = no_device_reason()
    if reason is not None:
        skip = pytest.mark.skip(reason=f"gpu test: {reason}")
        for item in gpu_items:
            item.add_marker(skip)

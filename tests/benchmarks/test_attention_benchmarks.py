"""pytest-benchmark timings of cupyflash and the PyTorch SDPA anchors (GPU only).

    pytest tests/benchmarks -m benchmark_suite --benchmark-json=bench-0001.json
    pytest-benchmark compare bench-0001.json bench-0002.json --group-by=group

Each timed call enqueues one region (the same regions as ``python -m cupyflash bench``: see
cupyflash/bench/runners.py and torch_sdpa.py) and then synchronizes the stream, so these are
host wall-clock times of a complete call, launch overhead included: good for tracking one
implementation across commits. The device-side figures (CUDA events, TFLOP/s, ratios to the
anchors) come from ``python -m cupyflash bench``. Inputs rotate among several sets so that L2
does not keep the previous call's data; ``extra_info`` records FLOPs and TFLOP/s of the median.

Cupyflash backends: ``CUPYFLASH_BENCH_BACKENDS=simt,mma`` (default ``auto``). The suite only
runs when selected (``-m benchmark_suite`` or ``--benchmark-only``), so ``pytest -m gpu`` stays
a correctness run.
"""
from __future__ import annotations

import itertools
import os
from contextlib import ExitStack

import pytest

from cupyflash.bench import shapes
from cupyflash.bench.impls import Rejected, cupyflash_impls, torch_anchors
from cupyflash.bench.timing import FULL_POLICY

pytestmark = [pytest.mark.gpu, pytest.mark.benchmark_suite]

ROUNDS = 20
WARMUP_ROUNDS = 2

CASES = (
    shapes.expand(shapes.make_sweep(quick=True))  # bf16 d128, 1k and 4k, both masks, fwd/bwd
    + shapes.expand(shapes.make_sweep(dtypes=["fp16"], headdims=[128], seqlens=[4096],
                                      causal=(False,)))
    + shapes.expand(shapes.make_sweep(dtypes=["fp32"], headdims=[64], seqlens=[1024],
                                      causal=(False,)))
)
IMPLS = (cupyflash_impls(os.environ.get("CUPYFLASH_BENCH_BACKENDS", "auto").split(","))
         + torch_anchors())


@pytest.fixture(autouse=True)
def _only_when_selected(request):
    config = request.config
    selected = ("benchmark_suite" in (config.getoption("markexpr", "") or "")
                or config.getoption("benchmark_only", False))
    if not selected:
        pytest.skip("benchmark suite: select it with -m benchmark_suite (or --benchmark-only)")


@pytest.fixture(scope="module")
def harness():
    from cupyflash.bench.harness import Harness
    from cupyflash.bench.torch_sdpa import TorchBridge, load_torch

    h = Harness(impls=IMPLS, policy=FULL_POLICY, validate=False)
    torch, h.torch_reason = load_torch()
    if torch is not None:
        h.bridge = TorchBridge(torch, h.stream)
    yield h
    h.release_memory()


@pytest.fixture(scope="module")
def inputs_of(harness):
    """Input sets of one shape at a time (the cases are ordered so that shapes repeat)."""
    held = {}

    def get(case):
        if case.shape_key not in held:
            held.clear()
            harness.release_memory()
            held[case.shape_key] = harness.input_sets(case)
        return held[case.shape_key]

    yield get
    held.clear()


@pytest.mark.parametrize("impl", IMPLS, ids=lambda impl: impl.label)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.label().replace(" ", "-"))
def test_attention(benchmark, harness, inputs_of, case, impl):
    if impl.family == "torch" and harness.bridge is None:
        pytest.skip(f"torch anchors: {harness.torch_reason}")
    inputs = inputs_of(case)
    with harness.stream, ExitStack() as stack:
        try:
            run = stack.enter_context(harness.runner(impl, case, inputs))
        except Rejected as exc:
            pytest.skip(f"{impl.label} rejects {case.label()}: {exc}")
        sets = itertools.cycle(range(len(inputs)))

        def region():
            run(next(sets))
            harness.stream.synchronize()

        benchmark.group = case.label()
        benchmark.extra_info.update(impl=impl.label, backend=impl.backend, flops=case.flops,
                                    input_sets=len(inputs))
        benchmark.pedantic(region, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS, iterations=1)
    if benchmark.stats is not None:  # None under --benchmark-disable
        benchmark.extra_info["tflops_median"] = case.flops / benchmark.stats.stats.median / 1e12

"""dev/cta_timeline.py and kernels_cu/cta_timeline.cuh: the marked kernels compile with the timeline
on (NVRTC on the CPU) and keep its array; the statistics are the rows' intervals; on a GPU the
harness times the backward's kernels CTA by CTA and their walks are the plan's."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

from cupyflash.kernels import compile_check
from cupyflash.kernels._module import module_source

REPO = Path(__file__).resolve().parents[2]


def load_harness():
    spec = importlib.util.spec_from_file_location("cta_timeline", REPO / "dev" / "cta_timeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def marked_specs():
    """One specialization of each marked kernel: the 16-bit dK/dV and dQ, the float32 presplit dK/dV,
    the 16-bit forwards (one role, the window's; producer, the d128 row's)."""
    names = ("flash_bwd_wgmma_bf16_hdim128_causal_", "flash_bwd_dq_wgmma_bf16_hdim128_causal_",
             "flash_bwd_dkdv_tf32_wgmma_ws_fp32_hdim64_causal_bm32_bn64_s2_r0_apart_presplit",
             "flash_fwd_wgmma_bf16_hdim128_local_", "flash_fwd_wgmma_ws_bf16_hdim128_causal_")
    specs = compile_check.all_specializations()
    return [next(s for s in specs if s.name.startswith(n)) for n in names]


def test_the_marked_kernels_compile_with_the_timeline_and_keep_its_array():
    harness = load_harness()
    for spec in marked_specs():
        text = harness.timeline_source(module_source(spec.source_file, (spec.expression,)), 300)
        cubin, _, log = compile_check.compile_text(text, spec.source_file, [spec.expression], "90a")
        assert b"cf_cta_timeline" in cubin, spec.name
        assert "bytes spill stores" not in log or " 0 bytes spill stores" in log, (spec.name, log)
    # without the define, the array is not there at all (dev/compare_sass.py: nor any other change)
    cubin, _, _ = compile_check.compile_text(module_source(spec.source_file, (spec.expression,)),
                                             spec.source_file, [spec.expression], "90a")
    assert b"cf_cta_timeline" not in cubin, spec.name


def test_summarize_reads_the_intervals_of_the_rows():
    harness = load_harness()
    # two SMs, two CTAs each, 2 cycles a ns; CTA: sm, steps, ns in / out, clocks at the 4 marks
    rows = np.array([
        [0, 4, 1000, 1100, 0, 40, 160, 200, ],      # prologue 40, 30 a step, epilogue 40
        [0, 2, 1150, 1230, 300, 340, 400, 460],     # gap 50 ns after the first
        [1, 8, 1000, 1200, 0, 40, 280, 400],        # 30 a step
        [1, 0, 1300, 0, 500, 0, 0, 0],              # returned before its walk: no exit
        [1, 0, 1250, 1260, 90, 0, 100, 110],        # an empty walk: no first step, no prologue
    ], np.int64)
    s = harness.summarize(rows)
    assert s["ctas"] == 5 and s["early"] == 1
    assert s["ghz"] == pytest.approx((200 + 160 + 400 + 20) / (100 + 80 + 200 + 10))
    assert s["step_cycles"] == 30 and s["prologue_cycles"] == 40
    assert s["epilogue_cycles"] == 50  # median of 40, 60, 120, 10
    assert s["gap_ns"] == 50  # SM 0: 50; SM 1: the empty walk's 1250 - 1200 = 50
    assert s["steps_mean"] == pytest.approx(14 / 4)

    assert s["resident"] == 1


def test_summarize_takes_the_gap_from_the_last_exit_before_an_entry():
    """Two CTAs an SM (the window forward's tiles): a CTA that starts beside a running one has no
    gap; one that takes a freed place has the gap from the last exit before it."""
    harness = load_harness()
    rows = np.array([
        [0, 2, 1000, 1200, 0, 40, 340, 400],
        [0, 2, 1010, 1300, 20, 60, 500, 580],     # beside the first: no exit before it, no gap
        [0, 2, 1230, 1400, 460, 500, 740, 800],   # after the first's exit at 1200: gap 30
        [0, 2, 1320, 1500, 640, 680, 920, 980],   # after the second's at 1300: gap 20
    ], np.int64)
    s = harness.summarize(rows)
    assert s["resident"] == 2
    assert s["gap_ns"] == 25  # median of 30 and 20

@pytest.mark.gpu
def test_the_harness_times_a_document_backward_and_its_walks_are_the_plans(tmp_path, monkeypatch):
    import json
    import sys

    harness = load_harness()
    out = tmp_path / "timeline.json"
    monkeypatch.setattr(sys, "argv", ["cta_timeline.py", "128", "2048", "documents=512", "--json", str(out)])
    harness.main()
    kernels = json.loads(out.read_text())["kernels"]
    assert any(re.match(r"flash_bwd_wgmma_", k) for k in kernels), kernels
    for name, s in kernels.items():
        assert s["early"] == 0 and s["step_cycles"] > 0 and s["prologue_cycles"] > 0, (name, s)
        # documents of 512 tokens: a 128-key block's walk is its document's 512 queries
        if name.startswith("flash_bwd_wgmma_"):
            assert s["steps_mean"] == pytest.approx(512 / 64, rel=0.01), s


@pytest.mark.gpu
def test_the_harness_times_a_window_forward(tmp_path, monkeypatch):
    import json
    import sys

    harness = load_harness()
    out = tmp_path / "timeline.json"
    monkeypatch.setattr(sys, "argv", ["cta_timeline.py", "128", "4096", "fwd", "causal", "window=1024,0",
                                      "--json", str(out)])
    harness.main()
    kernels = json.loads(out.read_text())["kernels"]
    assert kernels and all(k.startswith("flash_fwd_wgmma") for k in kernels), kernels
    for name, s in kernels.items():
        assert s["step_cycles"] > 0 and s["prologue_cycles"] > 0 and s["steps_mean"] > 1, (name, s)



@pytest.mark.gpu
def test_the_harness_times_a_packed_causal_backward(tmp_path, monkeypatch):
    """``varlen``: the varlen bench's packed batch through the varlen API; its kernels are the packed
    ones, and CTAs past a short sequence's end leave early (they are counted, not timed)."""
    import json
    import sys

    harness = load_harness()
    out = tmp_path / "timeline.json"
    monkeypatch.setattr(sys, "argv", ["cta_timeline.py", "64", "16384", "causal", "varlen", "--json", str(out)])
    harness.main()
    kernels = json.loads(out.read_text())["kernels"]
    assert kernels and all("_packed" in k for k in kernels), kernels
    for name, s in kernels.items():
        assert s["ctas"] > s["early"] and s["step_cycles"] > 0 and s["steps_mean"] >= 1, (name, s)

"""The benchmark harness's pure parts, on the CPU: FLOP counting, shapes, statistics, tables,
Markdown and JSON, the command line, the no-GPU path, and the standard attention that serves as
memory baseline and float64 check. The device side runs only on a GPU (python -m cupyflash
bench; tests/benchmarks)."""
from __future__ import annotations

import io
import json
import math
import subprocess
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from cupyflash import reference
from cupyflash.bench import cli, shapes, standard, table, timing
from cupyflash.bench.environment import parse_nvidia_smi, summary_line
from cupyflash.bench.impls import Impl, cupyflash_impls, torch_anchors
from cupyflash.bench.progress import Progress, format_duration
from cupyflash.bench.results import CopyRecord, Measurement, MemoryRecord, Report, json_safe
from cupyflash.bench.shapes import Case

REPO = Path(__file__).resolve().parents[1]
CF = cupyflash_impls(["auto"])[0]
FA2, CUDNN, MEMEFF = torch_anchors()


def case(**changes) -> Case:
    base = dict(dtype="bf16", headdim=128, seqlen_q=4096, seqlen_k=4096, batch=4, nheads=16,
                nheads_kv=16, causal=False, mode="fwd")
    base.update(changes)
    return Case(**base)


def timed(ms: float, n: int = 5) -> timing.Timing:
    return timing.Timing(tuple([ms] * n), warmup=1, input_sets=2)


# --- FLOPs and shapes -------------------------------------------------------------------------

def test_flops_follow_the_papers_convention():
    fwd = shapes.attention_flops(1, 16, 16384, 16384, 128, causal=False)
    assert fwd == 4 * 16 * 16384**2 * 128
    assert shapes.attention_flops(1, 16, 16384, 16384, 128, causal=True) == fwd / 2
    assert shapes.attention_flops(1, 16, 16384, 16384, 128, causal=False, mode="bwd") == 2.5 * fwd
    assert shapes.attention_flops(1, 16, 16384, 16384, 128, causal=True,
                                  mode="fwd+bwd") == 3.5 * fwd / 2
    with pytest.raises(ValueError, match="mode"):
        shapes.attention_flops(1, 1, 1, 1, 1, causal=False, mode="backward")


def test_case_flops_and_decode_bytes():
    assert case().flops == 4 * 4 * 16 * 4096**2 * 128
    decode = shapes.decode_cases()[0]
    assert (decode.batch, decode.nheads, decode.nheads_kv, decode.seqlen_q) == (8, 32, 32, 1)
    assert decode.kv_bytes == 2 * 8 * 32768 * 32 * 128 * 2  # K and V, bf16
    assert shapes.decode_cases()[1].kv_bytes == decode.kv_bytes // 4  # 8 kv heads


@pytest.mark.parametrize("seqlen", [512, 1024, 4096, 16384])
@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_paper_shapes_fix_tokens_and_width(seqlen, headdim):
    batch, nheads = shapes.paper_shape(seqlen, headdim)
    assert batch * seqlen == 16384 and nheads * headdim == 2048


def test_paper_shape_edges():
    assert shapes.paper_shape(32768, 128) == (1, 16)  # at least one sequence
    assert shapes.paper_shape(3000, 128) == (5, 16)
    with pytest.raises(ValueError, match="multiple of headdim"):
        shapes.paper_shape(1024, 96 + 1)


def test_full_sweep_is_the_briefs():
    cases = shapes.expand(shapes.make_sweep())
    assert len(cases) == 72 + 24 + 24
    grid = {(c.dtype, c.headdim, c.seqlen_q) for c in cases}
    assert {(d, s) for t, d, s in grid if t == "bf16"} == {
        (d, s) for d in (64, 128, 256) for s in (512, 1024, 2048, 4096, 8192, 16384)}
    assert {(d, s) for t, d, s in grid if t == "fp16"} == {
        (128, s) for s in (512, 1024, 2048, 4096, 8192, 16384)}
    assert {(d, s) for t, d, s in grid if t == "fp32"} == {
        (d, s) for d in (64, 128) for s in (1024, 4096, 8192)}
    assert {(c.causal, c.mode) for c in cases} == {
        (c, m) for c in (False, True) for m in ("fwd", "bwd")}
    assert all(c.batch * c.seqlen_q == 16384 and c.nheads * c.headdim == 2048 for c in cases)


def test_quick_sweep_and_overrides():
    quick = shapes.expand(shapes.make_sweep(quick=True))
    assert [(c.dtype, c.headdim, c.seqlen_q) for c in quick[::4]] == [
        ("bf16", 128, 1024), ("bf16", 128, 4096)]
    assert len(quick) == 8
    fp32 = shapes.make_sweep(dtypes=["fp32"], headdims=[64])
    assert fp32.grids == {"fp32": shapes.Grid((64,), (1024, 4096, 8192))}
    gqa = shapes.expand(shapes.make_sweep(dtypes=["bf16"], headdims=[128], seqlens=[1024],
                                          nheads_kv=4, modes=["fwd+bwd"], causal=(True,)))
    assert [(c.nheads, c.nheads_kv, c.mode) for c in gqa] == [(16, 4, "fwd+bwd")]
    fixed = shapes.expand(shapes.make_sweep(dtypes=["fp16"], headdims=[64], seqlens=[100],
                                            batch=3, nheads=5, causal=(False,), modes=["fwd"]))
    assert [(c.batch, c.nheads) for c in fixed] == [(3, 5)]
    with pytest.raises(ValueError, match="not a multiple"):
        shapes.expand(shapes.make_sweep(dtypes=["bf16"], headdims=[128], nheads_kv=3))
    with pytest.raises(ValueError, match="unknown dtype"):
        shapes.make_sweep(dtypes=["fp8"])


def test_cases_sharing_inputs_are_adjacent():
    cases = shapes.expand(shapes.make_sweep())
    groups = shapes.group_by_shape(cases)
    assert len(groups) == len({c.shape_key for c in cases}) == 18 + 6 + 6
    assert all(len(g) == 4 for g in groups)


def test_sizes_parse_and_format():
    assert [shapes.parse_size(s) for s in ("512", "1k", "16K", "1m")] == [512, 1024, 16384, 2**20]
    assert [shapes.format_size(n) for n in (512, 1024, 16384, 1000)] == ["512", "1k", "16k", "1000"]
    for bad in ("", "k", "-1", "0", "1.5k"):
        with pytest.raises(ValueError):
            shapes.parse_size(bad)


def test_case_label_is_readable():
    assert case(causal=True).label() == "bf16 d128 s4096 b4 h16 causal fwd"
    assert shapes.decode_cases()[1].label() == "bf16 d128 sq1 sk32768 b8 h32/8 full fwd"


# --- timing bookkeeping -----------------------------------------------------------------------

def test_percentile_matches_numpy():
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    for q in (0, 20, 50, 80, 100):
        assert timing.percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_repeat_policy_bounds():
    policy = timing.RepeatPolicy(warmup=1, target_s=0.2, min_repeats=5, max_repeats=30)
    assert policy.repeats_for(0.01) == 30
    assert policy.repeats_for(10.0) == 20
    assert policy.repeats_for(500.0) == 5
    assert timing.RepeatPolicy(min_repeats=7, max_repeats=7).repeats_for(0.01) == 7


def test_rotation_count():
    l2 = 60 * 2**20
    assert timing.rotation_count(256 * 2**20, l2, 2**40) == 2  # large sets: still two
    assert timing.rotation_count(16 * 2**20, l2, 2**40) == 8  # small sets: capped
    assert timing.rotation_count(100 * 2**20, l2, 2**40) == 3
    assert timing.rotation_count(4 * 2**30, l2, 6 * 2**30) == 1  # only one fits the budget


class FakeCupy:
    """Just enough of cupy.cuda for time_region: events stamped by a fake device clock."""

    def __init__(self, start_done: bool):
        self.clock = 0.0
        self.spins = []
        outer = self

        class Event:
            def __init__(self, *args, **kwargs):
                self.t = None

            def record(self, stream=None):
                self.t = outer.clock

            def synchronize(self):
                pass

            @property
            def done(self):
                return start_done

        class Device:
            id = 0

        class RawKernel:
            def __init__(self, code, name):
                assert name == timing.SPIN_NAME

            def __call__(self, grid, block, args):
                outer.spins.append(int(args[0]))

        self.cuda = SimpleNamespace(Event=Event, Device=Device,
                                    get_elapsed_time=lambda s, e: e.t - s.t)
        self.RawKernel = RawKernel


class FakeStream:
    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("start_done", [False, True])
def test_time_region_rotates_inputs_and_times_each_repeat(monkeypatch, start_done):
    fake = FakeCupy(start_done)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(timing, "_spin_kernels", {})
    used = []

    def run(i):
        used.append(i)
        fake.clock += 2.0 + i  # "device milliseconds": set 1 is slower than set 0

    policy = timing.RepeatPolicy(warmup=2, target_s=0.016, min_repeats=3, max_repeats=50)
    result = timing.time_region(run, 2, policy=policy, stream=FakeStream())
    # warm-up: set 0 untimed, set 1 timed alone (3 ms -> 16 ms / 3 ms -> 6 repeats)
    assert used == [0, 1] + [0, 1] * 3
    assert result.times_ms == (2.0, 3.0) * 3
    assert result.median_ms == 2.5
    assert result.input_sets == 2 and result.warmup == 2
    assert result.host_bound_repeats == (6 if start_done else 0)
    assert len(fake.spins) == 1 and 1e6 <= fake.spins[0] <= timing.MAX_SPIN_S * 1e9


def test_spin_kernel_compiles_with_nvrtc():
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    try:
        program = nvrtc.createProgram(timing.SPIN_SOURCE, "spin.cu", [], [])
        nvrtc.compileProgram(program, ["-arch=sm_80"])
    except Exception as exc:  # NVRTC library missing on this machine
        pytest.skip(f"NVRTC unavailable: {exc}")
    assert nvrtc.getCUBIN(program)


def test_timing_json_has_every_repeat():
    t = timing.Timing((1.0, 3.0, 2.0, 4.0, 5.0), warmup=1, input_sets=2, host_bound_repeats=1)
    data = t.to_json()
    assert data["times_ms"] == [1.0, 3.0, 2.0, 4.0, 5.0]
    assert (data["median_ms"], data["min_ms"], data["max_ms"]) == (3.0, 1.0, 5.0)
    assert data["repeats"] == 5
    assert data["host_bound_repeats"] == 1


# --- standard attention and validation --------------------------------------------------------

def inputs(b, sq, sk, h, hkv, d, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    q, do = (rng.standard_normal((b, sq, h, d)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((b, sk, hkv, d)).astype(dtype) for _ in range(2))
    return q, k, v, do


@pytest.mark.parametrize("sq,sk,h,hkv,causal", [
    (7, 7, 2, 2, False), (7, 7, 2, 2, True), (5, 9, 4, 2, True),  # bottom-right: sees extra keys
    (9, 5, 3, 1, True),  # rows 0..3 see no key
    (6, 11, 2, 1, False)])
def test_standard_attention_matches_reference(sq, sk, h, hkv, causal):
    q, k, v, do = inputs(2, sq, sk, h, hkv, 8)
    out = standard.standard_attention(q, k, v, do, softmax_scale=0.3, causal=causal)
    o, lse = reference.attention(q, k, v, softmax_scale=0.3, causal=causal)
    grads = reference.attention_backward(do, q, k, v, softmax_scale=0.3, causal=causal)
    np.testing.assert_allclose(out["o"], o, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(out["lse"]), np.isinf(lse))
    np.testing.assert_allclose(out["lse"][np.isfinite(lse)], lse[np.isfinite(lse)], atol=1e-12)
    for name, ref in zip(("dq", "dk", "dv"), grads):
        assert out[name].shape == ref.shape
        np.testing.assert_allclose(out[name], ref, atol=1e-12)


def test_standard_attention_accumulates_16bit_in_float32():
    q, k, v, do = inputs(1, 4, 4, 1, 1, 8, dtype=np.float16)
    out = standard.standard_attention(q, k, v, do)
    assert {x.dtype for x in out.values()} == {np.dtype(np.float32)}


def test_rel_error():
    a = np.array([[1.0, -np.inf], [2.0, 3.0]])
    assert standard.rel_error(a, a) == 0.0
    assert standard.rel_error(np.array([1.0, 1.0]), np.array([1.0, 0.0])) == pytest.approx(1.0)
    assert standard.rel_error(np.array([1.0, 0.0]), np.array([1.0, -np.inf])) == math.inf
    assert standard.rel_error(np.array([np.inf]), np.array([-np.inf])) == math.inf


def test_validation_accepts_the_reference_and_catches_a_wrong_head():
    q, k, v, do = inputs(2, 6, 6, 4, 2, 8)
    o, lse = reference.attention(q, k, v, causal=True)
    dq, dk, dv = reference.attention_backward(do, q, k, v, causal=True)
    good = {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    verdict = standard.validate(good, q, k, v, do, dtype="fp32", causal=True)
    assert verdict["ok"] and set(verdict["errors"]) == {"o", "lse", "dq", "dk", "dv"}
    assert max(verdict["errors"].values()) < 1e-12
    wrong = dict(good, dv=dv.copy())
    wrong["dv"][0, :, 1] = wrong["dv"][0, :, 0]  # the validated kv head is the last one
    verdict = standard.validate(wrong, q, k, v, do, dtype="fp32", causal=True)
    assert not verdict["ok"] and verdict["errors"]["dv"] > 1e-2
    forward_only = standard.validate({"o": o, "lse": lse}, q, k, v, dtype="bf16", causal=True)
    assert forward_only["ok"] and set(forward_only["errors"]) == {"o", "lse"}


# --- the device side, run on the CPU with NumPy standing in for CuPy ----------------------------

def numpy_as_cupy():
    """Just enough of CuPy, backed by NumPy and the host clock, for Harness.run_cases."""
    fake = types.ModuleType("cupy")
    fake.ndarray = type("NotACupyArray", (), {})

    class Stream(FakeStream):
        ptr = 1

        def __init__(self, non_blocking=False):
            pass

    class Event:
        done = False

        def __init__(self, *args, **kwargs):
            self.t = None

        def record(self, stream=None):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

    class Pool:
        def free_bytes(self):
            return 0

        def free_all_blocks(self):
            pass

    fake.cuda = SimpleNamespace(
        Stream=Stream, Event=Event,
        Device=lambda: SimpleNamespace(id=0, attributes={"L2CacheSize": 2**20}),
        get_elapsed_time=lambda start, end: (end.t - start.t) * 1e3,
        runtime=SimpleNamespace(memGetInfo=lambda: (2**30, 2**31)))
    fake.get_default_memory_pool = Pool
    fake.random = SimpleNamespace(default_rng=np.random.default_rng)
    fake.RawKernel = lambda code, name: (lambda grid, block, args: None)
    fake.get_array_module = lambda *arrays: np
    return fake


def test_harness_end_to_end_with_the_numpy_twin(monkeypatch, tmp_path):
    """The whole measuring path (inputs, runners of every mode, validation against float64,
    timing, rejections, tables, JSON, Markdown) with cupyflash's NumPy backend as the
    implementation and NumPy arrays as the device arrays."""
    from cupyflash.bench.harness import Harness

    monkeypatch.setitem(sys.modules, "cupy", numpy_as_cupy())
    monkeypatch.setattr(timing, "_spin_kernels", {})
    twin = Impl("cupyflash[numpy]", "cupyflash", "numpy", "the NumPy twin")
    unknown = Impl("cupyflash[nope]", "cupyflash", "nope", "no such backend")
    cases = shapes.expand(shapes.make_sweep(
        dtypes=["bf16", "fp32"], headdims=[16], seqlens=[40], batch=1, nheads=4, nheads_kv=2,
        modes=["fwd", "bwd", "fwd+bwd"]))
    policy = timing.RepeatPolicy(warmup=1, min_repeats=3, max_repeats=3)
    harness = Harness(impls=[twin, unknown, FA2], policy=policy)
    log = io.StringIO()
    results = harness.run_cases(cases, Progress(3 * len(cases), stream=log))

    assert len(results) == 3 * len(cases) == 36
    ours = [m for m in results if m.impl is twin]
    assert all(m.ok and m.valid for m in ours), [(m.case.label(), m.reason) for m in ours]
    for m in ours:
        expected = {"o", "lse"} | ({"dq", "dk", "dv"} if m.case.mode != "fwd" else set())
        assert set(m.validation["errors"]) == expected
        assert max(m.validation["errors"].values()) < standard.VALIDATION_TOLERANCE[m.case.dtype]
        assert len(m.timing.times_ms) == 3 and m.timing.input_sets == 8 and m.tflops > 0
    assert all(m.status == "rejected" and "backend must be one of" in m.reason
               for m in results if m.impl is unknown)
    assert all(m.status == "rejected" and "torch is not available" in m.reason
               for m in results if m.impl is FA2)
    assert log.getvalue().count("\n") == 36 and "TFLOP/s" in log.getvalue()

    rep = Report(environment=report().environment, config={}, throughput=results)
    doc = tmp_path / "benchmarks.md"
    original = (REPO / "docs" / "benchmarks.md").read_text()
    doc.write_text(original)
    args = SimpleNamespace(json=str(tmp_path / "b.json"), markdown=str(doc), plot=None)
    cli.write_outputs(rep, args, err=io.StringIO())
    data = json.loads((tmp_path / "b.json").read_text())
    assert len(data["throughput"]) == 36
    assert "| fp32 | 16 | 40 | 1×4/2 | yes | fwd+bwd |" in doc.read_text()
    # a section the run did not measure is left as it was
    begin, end = "<!-- cupyflash-bench:memory:begin -->", "<!-- cupyflash-bench:memory:end -->"
    section = lambda text: text[text.index(begin):text.index(end)]
    assert section(doc.read_text()) == section(original)


def test_cli_run_end_to_end_with_the_numpy_twin(monkeypatch, tmp_path, capsys):
    """main() past the GPU check: "auto" resolves to the NumPy twin where no GPU is usable."""
    import cupyflash.dispatch
    from cupyflash.bench import harness

    monkeypatch.setitem(sys.modules, "cupy", numpy_as_cupy())
    monkeypatch.setattr(timing, "_spin_kernels", {})
    monkeypatch.setattr(cupyflash.dispatch, "gpu_available", lambda: False)
    monkeypatch.setattr(harness, "gpu_unavailable_reason", lambda: None)
    out = tmp_path / "b.json"
    status = cli.main(["--quick", "--no-torch", "--headdim", "16", "--seqlen", "48", "--batch",
                       "1", "--nheads", "2", "--repeats", "2", "--json", str(out), "--quiet"])
    captured = capsys.readouterr()
    assert status == cli.EXIT_OK, captured.err
    assert "Throughput, TFLOP/s" in captured.out and "--no-torch" in captured.out
    assert captured.out.splitlines()[-1] == ("cupyflash bench: 4 of 4 timings done, 0 failed "
                                             "validation, 0 cupyflash errors")
    data = json.loads(out.read_text())
    assert [m["status"] for m in data["throughput"]] == ["ok"] * 4
    assert data["config"]["options"]["no_torch"] is True
    assert data["environment"]["versions"]["cupyflash"] == "0.1.0"


def test_peak_counter_samples_after_each_allocation():
    from cupyflash.bench.memory import PeakCounter

    class Pool:
        live = 0

        def malloc(self, nbytes):
            self.live += nbytes
            return nbytes

        def used_bytes(self):
            return self.live

    pool = Pool()
    counter = PeakCounter(pool)
    counter.malloc(512)
    counter.malloc(1024)
    pool.live -= 1536  # both freed
    counter.malloc(1024)
    assert counter.peak_bytes == 1536


# --- implementations --------------------------------------------------------------------------

def test_implementations():
    assert [i.label for i in cupyflash_impls(["auto", "simt", "mma"])] == [
        "cupyflash", "cupyflash[simt]", "cupyflash[mma]"]
    with pytest.raises(ValueError, match="host"):
        cupyflash_impls(["numpy"])
    with pytest.raises(ValueError, match="twice"):
        cupyflash_impls(["mma", "mma"])
    assert [a.backend for a in torch_anchors()] == [
        "FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"]
    assert [a.label for a in torch_anchors(["cudnn", "FA2"])] == ["FA2", "cuDNN"]
    with pytest.raises(ValueError, match="unknown anchor"):
        torch_anchors(["FA3"])


def test_torch_rejection_reason_collects_torch_warnings():
    from cupyflash.bench.torch_sdpa import rejection_reason

    warned = [SimpleNamespace(message=UserWarning("Flash attention kernel not used because:")),
              SimpleNamespace(message=UserWarning("Flash attention only supports  fp16 and bf16"))]
    reason = rejection_reason(RuntimeError("No available kernel. Aborting execution.\nmore"),
                              warned)
    assert reason == ("RuntimeError: No available kernel. Aborting execution.; Flash attention "
                      "kernel not used because:; Flash attention only supports fp16 and bf16")


def test_load_torch_reports_why_not(monkeypatch):
    from cupyflash.bench.torch_sdpa import load_torch

    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    torch, reason = load_torch()
    assert torch is None and "torch not importable" in reason


# --- results, tables, Markdown, JSON ----------------------------------------------------------

def sample_measurements():
    c1, c2 = case(), case(causal=True, mode="bwd")
    return [
        Measurement(c1, CF, "ok", timing=timed(2.0), validation={"ok": True, "errors": {}}),
        Measurement(c1, FA2, "ok", timing=timed(1.0)),
        Measurement(c1, MEMEFF, "rejected", "RuntimeError: No available kernel"),
        Measurement(c2, CF, "ok", timing=timed(4.0),
                    validation={"ok": False, "errors": {"dq": math.inf}}),
        Measurement(c2, FA2, "error", "RuntimeError: boom"),
        Measurement(c2, MEMEFF, "ok", timing=timed(8.0)),
    ]


def test_measurement_figures():
    m = sample_measurements()[0]
    assert m.tflops == pytest.approx(case().flops / 2e-3 / 1e12)
    d = Measurement(shapes.decode_cases()[0], CF, "ok", timing=timed(1.0))
    assert d.kv_tbps == pytest.approx(4 * 2**30 / 1e-3 / 1e12)
    assert Measurement(case(), FA2, "rejected", "no").tflops is None


def test_throughput_table_cells_and_ratios():
    ms = sample_measurements()
    t = table.throughput_table(ms)
    header, rows = t.header, t.rows
    assert t.left == 6
    assert header == ["dtype", "d", "seqlen", "B×H", "causal", "mode", "cupyflash", "FA2",
                      "mem-eff", "cupyflash/FA2", "cupyflash/mem-eff"]
    tf = case().flops / 1e-3 / 1e12  # FA2 at 1 ms
    assert rows[0] == ["bf16", "128", "4k", "4×16", "no", "fwd", f"{tf / 2:,.1f}", f"{tf:,.1f}",
                       "—", "0.50", "—"]
    bwd_cf, bwd_eff = ms[3].tflops, ms[5].tflops
    assert rows[1][6:] == [f"{bwd_cf:,.1f}!", "err", f"{bwd_eff:,.1f}", "—", "2.00"]
    lines = table.render_text(t).splitlines()
    assert len({len(line) for line in lines[:2]}) == 1  # header as wide as the rule
    assert lines[2].index(" no ") + 1 == lines[0].index("causal")  # keys left-aligned
    assert lines[2].index("—") + 1 == lines[0].index("mem-eff") + len("mem-eff")  # figures right
    md = table.render_markdown(t)
    assert md.splitlines()[1] == "|" + "---|" * 6 + "---:|" * (len(header) - 6)
    assert md.count("\n") == len(rows) + 1


def test_decode_and_memory_tables():
    dc = shapes.decode_cases()[:1]
    copy = CopyRecord(2**30, timed(0.5))
    assert copy.tbps == pytest.approx(2 * 2**30 / 0.5e-3 / 1e12)
    ms = [Measurement(dc[0], CF, "ok", timing=timed(2.0)),
          Measurement(dc[0], CUDNN, "ok", timing=timed(1.0))]
    t = table.decode_table(ms, copy)
    header, rows = t.header, t.rows
    assert header[-2:] == ["cupyflash/cuDNN", "cupyflash/copy"]
    assert rows[0][:4] == ["bf16", "128", "8×32", "32k"] and rows[0][-2] == "0.50"
    assert rows[0][-1] == f"{ms[0].kv_tbps / copy.tbps:.2f}"
    mc = shapes.memory_cases([1024, 16384])
    recs = [MemoryRecord(mc[0], "cupyflash", "cupyflash", "ok", 10 * 2**20),
            MemoryRecord(mc[0], "FA2", "torch", "ok", 12 * 2**20),
            MemoryRecord(mc[0], "standard", "standard", "ok", 100 * 2**20),
            MemoryRecord(mc[1], "cupyflash", "cupyflash", "ok", 160 * 2**20),
            MemoryRecord(mc[1], "FA2", "torch", "rejected", reason="no"),
            MemoryRecord(mc[1], "standard", "standard", "oom", reason="out of memory")]
    t = table.memory_table(recs)
    assert t.header == ["dtype", "d", "seqlen", "B×H", "causal", "cupyflash", "FA2", "standard",
                        "standard/cupyflash"]
    assert t.rows == [["bf16", "128", "1k", "1×16", "yes", "10", "12", "100", "10.00"],
                      ["bf16", "128", "16k", "1×16", "yes", "160", "—", "OOM", "—"]]


def report():
    env = {"date": "2026-11-29T00:00:00+00:00",
           "versions": {"cupyflash": "0.1.0", "cupy": "14.2.0", "nvrtc": "13.0", "torch": None},
           "gpu": {"name": "NVIDIA H200", "sm_count": 132, "compute_capability": "90",
                   "nvidia_smi": None}}
    return Report(environment=env, config={}, throughput=sample_measurements(),
                  notes=["PyTorch anchors disabled (--no-torch): cupyflash alone."])


def test_json_is_strict_and_complete():
    data = report().to_json()
    text = json.dumps(data, allow_nan=False)
    back = json.loads(text)
    assert back["schema"] == "cupyflash-bench/1"
    assert len(back["throughput"]) == 6
    first = back["throughput"][0]
    assert first["impl"] == "cupyflash" and first["timing"]["times_ms"] == [2.0] * 5
    assert first["flops"] == case().flops and first["dtype"] == "bf16"
    assert back["throughput"][3]["validation"]["errors"]["dq"] == "inf"
    assert back["throughput"][2]["reason"].startswith("RuntimeError")
    assert json_safe([-math.inf, math.nan, 1.5]) == ["-inf", "nan", 1.5]
    assert report().validation_failures == [sample_measurements()[3]]


SIMT = cupyflash_impls(["simt"])[0]
FA3 = Impl("FA3", "torch", "FLASH_ATTENTION_3", "")  # unknown to this version


def full_report():
    """Every section filled, with the awkward values: no timing, failed statuses, inf in a
    validation, no peak, an implementation this version does not know."""
    dc = shapes.decode_cases()[:2]
    mc = shapes.memory_cases([1024, 16384])
    decode = [Measurement(dc[0], CF, "ok", timing=timed(2.0),
                          validation={"ok": True, "errors": {"o": 1e-3}, "tolerance": 0.02}),
              Measurement(dc[0], SIMT, "ok", timing=timing.Timing((3.0, 2.5, 4.0), 2, 1, 1)),
              Measurement(dc[1], CUDNN, "ok", timing=timed(1.0)),
              Measurement(dc[1], FA3, "error", "RuntimeError: no such backend")]
    memory = [MemoryRecord(mc[0], "cupyflash", "cupyflash", "ok", 10 * 2**20),
              MemoryRecord(mc[0], "standard", "standard", "ok", 100 * 2**20),
              MemoryRecord(mc[1], "FA2", "torch", "rejected", reason="no"),
              MemoryRecord(mc[1], "standard", "standard", "oom", reason="out of memory"),
              MemoryRecord(mc[1], "mem-eff", "torch", "skipped")]
    full = report()
    full.config = {"options": {"seqlen": (1024, 16384), "quick": True, "batch": None},
                   "policy": {"warmup": 1, "target_s": 0.2}}
    full.memory, full.decode, full.copy = memory, decode, CopyRecord(2**30, timed(0.5))
    return full


def test_report_json_round_trip():
    data = full_report().to_json()
    back = Report.from_json(json.loads(json.dumps(data, allow_nan=False)))
    assert back.to_json() == data
    assert back.throughput[0].case == case() and back.throughput[0].impl == CF
    assert [m.impl for m in back.decode] == [CF, SIMT, CUDNN, FA3]  # descriptions recovered
    assert back.decode[1].timing == timing.Timing((3.0, 2.5, 4.0), 2, 1, 1)
    assert back.throughput[2].timing is None and back.throughput[1].validation is None
    assert back.memory[4].peak_bytes is None and back.copy.tbps == full_report().copy.tbps
    assert [m.impl.label for m in back.validation_failures] == ["cupyflash"]


def test_report_from_json_rejects_another_schema():
    data = full_report().to_json()
    with pytest.raises(ValueError, match="cupyflash-bench/2"):
        Report.from_json({**data, "schema": "cupyflash-bench/2"})
    data.pop("schema")
    with pytest.raises(ValueError, match="schema: None"):
        Report.from_json(data)


def test_text_report_mentions_environment_and_legend():
    text = table.text_report(report())
    assert text.splitlines()[0].startswith("NVIDIA H200 (132 SMs, sm_90) · cupyflash 0.1.0")
    assert "Throughput, TFLOP/s" in text and table.LEGEND in text and "--no-torch" in text


def test_markdown_fill_replaces_only_measured_sections():
    sections = table.markdown_sections(report())
    assert set(sections) == {"environment", "throughput"}
    assert "#### bf16" in sections["throughput"]
    doc = table.standalone_markdown({})
    assert doc.count("Not measured in this run.") == len(table.SECTION_NAMES)
    filled, missing = table.fill_markdown(doc, sections)
    assert missing == []
    assert filled.count("Not measured in this run.") == 2  # decode, memory untouched
    assert "| bf16 | 128 | 4k |" in filled
    again, _ = table.fill_markdown(filled, sections)
    assert again == filled  # idempotent
    _, missing = table.fill_markdown("# nothing marked\n", sections)
    assert missing == ["environment", "throughput"]


def test_docs_benchmarks_md_has_every_section_marker():
    doc = (REPO / "docs" / "benchmarks.md").read_text()
    for name in table.SECTION_NAMES:
        begin, end = table.markers(name)
        assert doc.count(begin) == 1 and doc.count(end) == 1 and doc.index(begin) < doc.index(end)


def test_write_markdown_appends_missing_sections(tmp_path):
    path = tmp_path / "bench.md"
    path.write_text("# Results\n")
    err = io.StringIO()
    cli.write_markdown(path, {"memory": "a table"}, err=err)
    begin, end = table.markers("memory")
    assert path.read_text() == f"# Results\n\n{begin}\na table\n{end}\n"
    assert "appended" in err.getvalue()
    cli.write_markdown(path, {"memory": "new table"}, err=err)
    assert "new table" in path.read_text() and "a table\n" not in path.read_text()


# --- environment, progress, plot --------------------------------------------------------------

def test_nvidia_smi_parsing():
    line = "NVIDIA H200, 580.65, 1980, 1980, 3201, 3201, 700.00, P0, 35\n"
    info = parse_nvidia_smi(line)
    assert info["name"] == "NVIDIA H200" and info["clocks.max.sm"] == "1980"
    assert parse_nvidia_smi("") is None and parse_nvidia_smi("a, b\n") is None
    env = report().environment
    env["gpu"]["nvidia_smi"] = info
    assert "SM clock 1980/1980 MHz" in summary_line(env)


def test_library_versions_without_gpu():
    from cupyflash.bench.environment import library_versions

    versions = library_versions()
    assert versions["numpy"] == np.__version__ and versions["cupyflash"] == "0.1.0"


def test_progress_lines():
    out = io.StringIO()
    now = iter([0.0, 30.0, 60.0])
    progress = Progress(3, stream=out, clock=lambda: next(now))
    progress.step("first")
    progress.step("second")
    assert out.getvalue().splitlines() == ["[1/3 0:30, ~1:00 left] first",
                                           "[2/3 1:00, ~0:30 left] second"]
    assert format_duration(3725) == "62:05"
    quiet = io.StringIO()
    Progress(1, stream=quiet, enabled=False).step("x")
    assert quiet.getvalue() == ""


def test_plot_without_matplotlib(monkeypatch, tmp_path):
    from cupyflash.bench import plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert "matplotlib is not installed" in plot.plot_throughput(sample_measurements(),
                                                                 tmp_path / "a.png")
    assert not (tmp_path / "a.png").exists()
    assert plot.memory_plot_path("out/bench.png") == Path("out/bench-memory.png")


def test_plot_panels_and_png(tmp_path):
    from cupyflash.bench import plot

    ms = sample_measurements()
    rows, cols = plot.panels(ms)
    assert rows == [("bf16", 128)] and cols == [(False, "fwd"), (True, "bwd")]
    assert plot.series(ms, rows[0], cols[1]) == {"cupyflash": [(4096, ms[3].tflops)],
                                                 "mem-eff": [(4096, ms[5].tflops)]}
    pytest.importorskip("matplotlib")
    assert plot.plot_throughput(ms, tmp_path / "t.png") is None
    recs = [MemoryRecord(c, "cupyflash", "cupyflash", "ok", 2**20 * c.seqlen_q)
            for c in shapes.memory_cases([1024, 2048])]
    assert plot.plot_memory(recs, tmp_path / "m.png") is None
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


# --- command line -----------------------------------------------------------------------------

def parse(*argv):
    return cli.build_parser().parse_args(list(argv))


def test_cli_lists_accept_commas_spaces_and_repeats():
    args = parse("--dtype", "bf16,fp16", "--dtype", "float32", "bf16", "--seqlen", "1k", "4K,512",
                 "--mode", "fwd+bwd", "--headdim", "64,128", "--backends", "simt,mma")
    assert args.dtype == ["bf16", "fp16", "fp32"]
    assert args.seqlen == [1024, 4096, 512]
    assert args.mode == ["fwd+bwd"] and args.headdim == [64, 128]
    assert args.backends == ["simt", "mma"]


def test_cli_plan_defaults_and_options():
    plan = cli.make_plan(parse())
    assert len(plan.throughput) == 120 and not plan.memory and not plan.decode
    assert [i.label for i in plan.impls()] == ["cupyflash", "FA2", "cuDNN", "mem-eff"]
    assert plan.policy == timing.FULL_POLICY
    plan = cli.make_plan(parse("--quick", "--causal", "yes", "--no-torch", "--repeats", "7",
                               "--memory", "--decode"))
    assert len(plan.throughput) == 4 and all(c.causal for c in plan.throughput)
    assert plan.anchors == [] and plan.policy.min_repeats == plan.policy.max_repeats == 7
    assert [c.seqlen_q for c in plan.memory] == [1024, 4096]
    assert all(c.mode == "fwd+bwd" and c.causal and c.batch == 1 for c in plan.memory)
    assert len(plan.decode) == 3
    assert plan.steps() == 4 + 3 + 1 + 2 * 2
    plan = cli.make_plan(parse("--skip-throughput", "--decode", "--dtype", "fp16"))
    assert plan.throughput == [] and {c.dtype for c in plan.decode} == {"fp16"}
    with pytest.raises(ValueError, match="nothing to run"):
        cli.make_plan(parse("--skip-throughput"))


def test_cli_help_and_usage_errors(capsys):
    assert cli.main(["--help"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m cupyflash bench")
    for option in ("--dtype", "--memory", "--decode", "--quick", "--no-torch", "--markdown"):
        assert option in out
    assert cli.main(["--dtype", "fp8"]) == cli.EXIT_USAGE
    assert "unknown dtype 'fp8'" in capsys.readouterr().err
    assert cli.main(["--causal", "maybe"]) == cli.EXIT_USAGE
    assert cli.main(["--backends", "numpy"]) == cli.EXIT_USAGE
    assert "runs on the host" in capsys.readouterr().err


def test_cli_list_needs_no_gpu(capsys):
    assert cli.main(["--list", "--quick", "--decode"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "throughput: 8 cases" in out and "decode: 3 cases" in out
    assert "bf16 d128 s4096 b4 h16 causal bwd" in out


def test_cli_without_gpu_exits_cleanly(monkeypatch, capsys):
    from cupyflash.bench import harness

    monkeypatch.setattr(harness, "gpu_unavailable_reason", lambda: "CUDARuntimeError: no driver")
    assert cli.main(["--quick"]) == cli.EXIT_NO_GPU
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "no usable CUDA device (CUDARuntimeError: no driver)" in captured.err
    assert "--list" in captured.err


def saved_report(tmp_path) -> Path:
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(full_report().to_json(), indent=1, allow_nan=False) + "\n")
    return path


def test_cli_from_json_renders_without_running(monkeypatch, tmp_path, capsys):
    from cupyflash.bench import harness

    def no_measuring(*args, **kwargs):
        raise AssertionError("--from-json must not measure")

    monkeypatch.setattr(harness, "gpu_unavailable_reason", no_measuring)
    monkeypatch.setattr(cli, "make_plan", no_measuring)
    monkeypatch.setattr(cli, "run_plan", no_measuring)
    saved, doc, out = saved_report(tmp_path), tmp_path / "bench.md", tmp_path / "out.json"
    doc.write_text(table.standalone_markdown({}))
    # The sweep options, even an invalid combination, are ignored.
    status = cli.main(["--from-json", str(saved), "--markdown", str(doc), "--json", str(out),
                       "--skip-throughput", "--dtype", "fp32", "--quick"])
    captured = capsys.readouterr()
    assert status == cli.EXIT_OK, captured.err
    assert captured.out == (f"cupyflash bench: rendered {out}, {doc} from {saved} "
                            "(nothing measured)\n")
    text = doc.read_text()
    assert "Not measured in this run." not in text
    for name, filled in table.markdown_sections(full_report()).items():
        begin, end = table.markers(name)
        assert f"{begin}\n{filled.rstrip()}\n{end}" in text
    assert "| bf16 | 128 | 4k |" in text and "NVIDIA H200" in text
    assert out.read_text() == saved.read_text()


def test_cli_from_json_usage_errors(tmp_path, capsys):
    saved = saved_report(tmp_path)
    assert cli.main(["--from-json", str(saved)]) == cli.EXIT_USAGE
    assert "--from-json needs --markdown, --plot or --json" in capsys.readouterr().err
    md = ["--markdown", str(tmp_path / "b.md")]
    assert cli.main(["--from-json", str(tmp_path / "missing.json"), *md]) == cli.EXIT_USAGE
    assert "cannot read" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": "cupyflash-bench/9"}))
    assert cli.main(["--from-json", str(other), *md]) == cli.EXIT_USAGE
    assert "'cupyflash-bench/9'" in capsys.readouterr().err
    other.write_text(json.dumps({"schema": "cupyflash-bench/1", "throughput": []}))
    assert cli.main(["--from-json", str(other), *md]) == cli.EXIT_USAGE
    assert "malformed report (KeyError" in capsys.readouterr().err
    other.write_text("{not json")
    assert cli.main(["--from-json", str(other), *md]) == cli.EXIT_USAGE
    assert not (tmp_path / "b.md").exists()


def test_python_dash_m_entry_points():
    for argv in (["-m", "cupyflash.bench", "--list", "--quick"],
                 ["-m", "cupyflash", "bench", "--list", "--quick"]):
        done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=REPO,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        assert "throughput: 8 cases" in done.stdout


BLOCKER = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "matplotlib"):
            raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, Block())
import importlib, pkgutil, cupyflash.bench as b
for m in pkgutil.iter_modules(b.__path__):
    if m.name != "__main__":
        importlib.import_module("cupyflash.bench." + m.name)
from cupyflash.bench.cli import main
assert main(["--list", "--quick"]) == 0
assert "torch" not in sys.modules and "matplotlib" not in sys.modules
print("ok")
"""


def test_bench_imports_without_torch_and_matplotlib():
    done = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")


FROM_JSON_WITHOUT_GPU_LIBRARIES = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("cupy", "cupy_backends", "torch"):
            raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, Block())
from cupyflash.bench.cli import main
assert main(["--from-json", sys.argv[1], "--markdown", sys.argv[2], "--plot", sys.argv[3]]) == 0
assert not {"cupy", "torch"} & set(sys.modules)
print("ok")
"""


def test_from_json_needs_neither_cupy_nor_torch(tmp_path):
    argv = [str(saved_report(tmp_path)), str(tmp_path / "b.md"), str(tmp_path / "b.png")]
    done = subprocess.run([sys.executable, "-c", FROM_JSON_WITHOUT_GPU_LIBRARIES, *argv],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")
    assert "cupyflash-bench:memory:begin" in (tmp_path / "b.md").read_text()


def test_decode_loop_table_and_bytes():
    from cupyflash.bench import decode_loop

    row = {"batch": 8, "cached": 4096, "capacity": 8192, "page_size": 16, "layers": 32, "heads": 32, "heads_kv": 8,
           "headdim": 128, "steps": 40, "checked_ms": 9.5, "no_host_sync_ms": 3.25, "graph_ms": 2.0,
           "graph_device_ms": 1.9, "step_bytes": 1, "graph_device_tbps": 3.5, "floor_ms": 1.6}
    text = decode_loop.table({"copy_tbps": 4.2, "rows": [row]})
    assert "| 8 | 4096 | paged 16 | 9.500 | 3.250 | 2.000 | 1.900 | 3.50 | 1.600 |" in text
    # K + V of 32 layers, 8 sequences of 4096 tokens, 8 kv heads of 128 bf16 values
    model = object.__new__(decode_loop._Model)
    model.batch = 8
    assert model.step_bytes(4096) == 32 * 2 * 8 * 4096 * 8 * 128 * 2

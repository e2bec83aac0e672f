"""dev/mma_bwd.py, the tensor-core backward's superseded versions and candidates: numbered, each
with a note and a perf-log entry that exists; its last version is the shipped plan on every device;
the sm_80 paths that the window tests run on any device through ``version=`` are sm_80's plan;
``mma_bwd.backward(version=...)`` launches a version's kernels; the tuner times the plan and then
every entry; on a GPU every entry that fits the device matches the float64 reference."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from cupyflash import backward_plans, cli
from cupyflash._dtypes import SUPPORTED
from cupyflash.backward_plans import BACKWARD_KERNELS, plan_backward
from cupyflash.bench import tune
from cupyflash.kernels import mma_bwd, mma_fwd
from cupyflash.masks import Causal, Local, NoMask
from cupyflash.scores import Score
from test_docs import heading_anchors

REPO = Path(__file__).resolve().parents[2]
DEVICES = (("80", 163 * 1024), ("80", 227 * 1024), ("86", 99 * 1024), ("90", 227 * 1024), (None, None))
MASKS = (NoMask(), Causal(), Local(100, 3))


@pytest.fixture(scope="module")
def dev():
    module = tune.load_dev_backward()
    assert module is not None, "a source checkout has dev/mma_bwd.py"
    return module


def _unnoted(row):
    return row._replace(perf_log="")


def test_versions_are_numbered_with_a_note_and_a_perf_log_entry(dev):
    anchors = heading_anchors(REPO / dev.PERF_LOG)
    numbers = sorted([int(v.name[1:]) for v in dev.VERSIONS] + [int(n[1:]) for n in dev.REJECTED])
    assert numbers == list(range(1, len(numbers) + 1)) and dev.LAST_VERSION == dev.VERSIONS[-1].name
    for version in dev.VERSIONS:
        assert version.note and version.perf_log in anchors, version.name
    assert all(anchor in anchors for _, anchor in dev.REJECTED.values())
    assert dev.CANDIDATES_PERF_LOG in anchors
    with pytest.raises(ValueError, match="unknown backward version 'v8'"):
        dev.kernels("v8", "90", None, SUPPORTED["float16"], 64, NoMask(), True)


def test_the_last_version_is_the_plan_on_every_device(dev):
    for (arch, smem), dt, mask, deterministic in itertools.product(DEVICES, backward_plans.D_TILES, MASKS,
                                                                   (True, False)):
        planned = plan_backward(arch, SUPPORTED["bfloat16"], dt, mask, smem, deterministic)
        assert _unnoted(planned.kernels) == dev.kernels(dev.LAST_VERSION, arch, smem, SUPPORTED["bfloat16"], dt,
                                                        mask, deterministic), (arch, smem, dt, mask)


def test_the_last_version_is_the_plan_of_a_packed_causal_batch_on_sm90(dev):
    """v16: a packed causal batch on sm_90 d128 on the producer pair, with the score variants v12's
    row took and those it did not (softcap). (Elsewhere a packed batch's rows follow _without_spills'
    routes, which dev/ does not model.)"""
    for dt, score, deterministic in itertools.product((128,), (Score(), Score(alibi=True), Score(softcap=True)),
                                                      (True, False)):
        mask = Causal(score=score, packed=True)
        planned = plan_backward("90", SUPPORTED["bfloat16"], dt, mask, 227 * 1024, deterministic)
        assert _unnoted(planned.kernels) == dev.kernels(dev.LAST_VERSION, "90", 227 * 1024, SUPPORTED["bfloat16"],
                                                        dt, mask, deterministic), (dt, score, deterministic)


def test_the_window_tests_overrides_run_sm80s_plan_on_sm90(dev):
    """tests/test_window_gpu.py runs sm_80's kernels on an sm_90 device: "v5" is sm_80's plan, and
    "v3" without determinism the dK/dV kernel with atomic dQ that sm_80 runs where the fused kernel
    does not fit."""
    for smem, dt, mask, deterministic in itertools.product((163 * 1024, 227 * 1024), backward_plans.D_TILES, MASKS,
                                                           (True, False)):
        sm80 = plan_backward("80", SUPPORTED["float16"], dt, mask, smem, deterministic).kernels
        assert dev.kernels("v5", "90", smem, SUPPORTED["float16"], dt, mask, deterministic) == _unnoted(sm80)
        no_fused = plan_backward("80", SUPPORTED["float16"], dt, mask, 0, False).kernels
        assert dev.kernels("v3", "90", smem, SUPPORTED["float16"], dt, mask, False) == _unnoted(no_fused)


def test_a_version_is_what_the_launcher_runs(dev, monkeypatch):
    monkeypatch.setattr(mma_fwd, "current_arch", lambda: "90")
    monkeypatch.setattr(mma_fwd, "current_smem_optin", lambda: 227 * 1024)
    for version, dt, deterministic in itertools.product([v.name for v in dev.VERSIONS], (64, 128, 256),
                                                        (True, False)):
        got = mma_bwd.plan(SUPPORTED["bfloat16"], dt, Causal(), deterministic, version)
        assert got.kernels == dev.kernels(version, "90", 227 * 1024, SUPPORTED["bfloat16"], dt, Causal(),
                                          deterministic)
    monkeypatch.setattr(mma_bwd, "DEV_VERSION", "v7")
    assert mma_bwd.plan(SUPPORTED["bfloat16"], 128, NoMask(), True).dq_add == "fixed"
    assert mma_bwd.plan(SUPPORTED["bfloat16"], 128, NoMask(), True, "v6").dq_add == "ordered"
    with pytest.raises(ValueError, match="the ordered dQ adds need every key block"):
        mma_bwd.plan(SUPPORTED["bfloat16"], 128, Local(10, 0), True, "v4", fused=(64, 128, 4, 2, 2, 1))


def test_shipped_notes_and_candidates(dev):
    """A version with a shipped note runs some plan row's kernels, one without runs kernels that no
    row runs (its own change); no candidate is a plan row's tiles."""
    rows = {_unnoted(r) for entries in BACKWARD_KERNELS.values() for r in entries}
    for version in dev.VERSIONS:
        runs = {dev.kernels(version.name, arch, smem, SUPPORTED["float16"], dt, NoMask(), deterministic)
                for (arch, smem), dt, deterministic in itertools.product(DEVICES, (64, 128, 256), (True, False))}
        assert runs - rows if not version.shipped else runs & rows, version.name
    shipped = {(dt, r.dkdv_tiles) for (_, dt, _), entries in BACKWARD_KERNELS.items() for r in entries}
    shipped |= {(dt, r.dq_tiles) for (_, dt, _), entries in BACKWARD_KERNELS.items() for r in entries}
    for table in (dev.FUSED_CANDIDATES, dev.DQ_WGMMA_CANDIDATES, dev.WGMMA_NONE_CANDIDATES, dev.DQ_CANDIDATES_V2):
        assert not {(dt, c) for dt, cs in table.items() for c in cs} & shipped
    # a window pair changes at least one of the two kernels' tiles
    assert all({(dt, wgmma), (dt, dq)} - shipped for dt, pairs in dev.WINDOW_SPLIT_CANDIDATES.items()
               for wgmma, dq in pairs)


def test_the_tuner_times_the_plan_then_every_dev_entry(dev, monkeypatch):
    monkeypatch.setattr(mma_fwd, "current_arch", lambda: "90")
    monkeypatch.setattr(mma_fwd, "current_smem_optin", lambda: 227 * 1024)
    entries = tune._bwd_candidates(128, dev)
    assert [kwargs for _, kwargs in entries[:2]] == [dict(deterministic=True), dict(deterministic=False)]
    assert entries[0][0].startswith("default wgmma_ws(64, 128, 3, True) none dq + dq_wgmma_ws(128, 64, 3, True)")
    assert entries[2:] == dev.entries(128, "90")
    labels = [label for label, _ in entries]
    assert any(label.startswith("v7 wgmma(64, 128) fixed") for label in labels)
    assert tune._bwd_candidates(128, None) == entries[:2]


def test_without_dev_the_backward_tuner_times_the_plan_and_says_why(tmp_path, monkeypatch, capsys):
    from cupyflash.bench import harness

    assert tune.load_dev_backward(tmp_path) is None
    monkeypatch.setattr(harness, "gpu_unavailable_reason", lambda: None)
    timed = []
    monkeypatch.setattr(tune, "_check_bwd", lambda kwargs, headdim, dtype, causal: 0.5)
    monkeypatch.setattr(tune, "_time_backward", lambda kwargs, *rest: timed.append(kwargs) or 1.0)
    argv = ["tune", "--direction", "bwd", "--headdim", "64", "--seqlen", "1024", "--quiet"]
    assert cli.main(argv + ["--dev", str(tmp_path)]) == cli.EXIT_OK
    assert f"{tmp_path} has no mma_bwd.py" in capsys.readouterr().err
    assert timed == [dict(deterministic=True)] * 2 + [dict(deterministic=False)] * 2  # causal and not


@pytest.mark.gpu
@pytest.mark.parametrize("headdim", [64, 96, 128, 256])
def test_every_dev_backward_entry_that_fits_matches_the_reference(dev, headdim):
    """The tuner's float64 check (error within 2x standard attention's in bf16, both masks; a
    deterministic entry also bitwise repeated) for the plan and every version and candidate whose
    kernels fit the device."""
    import cupy

    from cupyflash.kernels._module import _max_smem_optin, runs_on_device

    dtype, smem = SUPPORTED["bfloat16"], _max_smem_optin(cupy.cuda.Device().id)
    checked = []
    for label, kwargs in tune._bwd_candidates(headdim, dev):
        options = {k: kwargs[k] for k in ("dq_config", "fused", "wgmma", "wgmma_ws", "dq_ws") if k in kwargs}
        plan = mma_bwd.plan(dtype, headdim, NoMask(), kwargs["deterministic"], kwargs.get("version"), **options)
        if not all(runs_on_device(launch.spec) and launch.spec.smem_bytes <= smem for launch in plan.launches):
            continue
        ratios = [tune._check_bwd(kwargs, headdim, dtype, causal) for causal in (False, True)]
        # a causal window too (the tuner's --window), except where the ordered dQ adds would meet it
        # in the fused kernel (which refuses a window at compile time; the plans never send it one)
        if not (kwargs.get("fused") and kwargs["deterministic"]):
            ratios.append(tune._check_bwd(kwargs, headdim, dtype, True, window=(40, 0)))
        assert max(ratios) <= 1, (label, ratios)
        checked.append(label)
    assert checked and checked[0].startswith("default")

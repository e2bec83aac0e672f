"""dev/mma_fwd.py, the tensor-core forward's superseded versions and candidates: numbered, each
with a note and a perf-log entry that exists, the shipped ones equal to their FORWARD_TILES rows,
the rest never a row; the tuner finds them from a source checkout and says so when they are not
there; on a GPU every entry that fits the device matches the float64 reference."""
from __future__ import annotations

from pathlib import Path

import pytest

from cupyflash import cli, plans
from cupyflash._dtypes import SUPPORTED
from cupyflash.bench import tune
from cupyflash.kernels import mma_fwd
from test_docs import heading_anchors

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dev():
    module = tune.load_dev_forward()
    assert module is not None, "a source checkout has dev/mma_fwd.py"
    return module


def test_versions_are_numbered_with_a_note_and_a_perf_log_entry(dev):
    anchors = heading_anchors(REPO / dev.PERF_LOG)
    assert [v.name for v in dev.VERSIONS] == [f"v{i}" for i in range(1, len(dev.VERSIONS) + 1)]
    for version in dev.VERSIONS:
        assert version.note and version.perf_log in anchors, version.name
        assert set(version.tiles) == set(mma_fwd.D_TILES), version.name
    assert dev.CANDIDATES_PERF_LOG in anchors


def test_shipped_versions_are_their_rows_and_the_rest_is_not_shipped(dev):
    v5, v6, v7 = (next(v for v in dev.VERSIONS if v.name == name) for name in ("v5", "v6", "v7"))
    for dt in mma_fwd.D_TILES:
        assert v5.tiles[dt] == plans.FORWARD_TILES[("mma", plans.LARGE_SMEM, dt)]
        assert v7.tiles[dt] == plans.FORWARD_TILES[("mma", plans.SM90, dt)]
    assert v5.tiles[64] == plans.FORWARD_TILES[("mma", plans.PORTABLE, 64)]
    # v6 still runs sm_90's d64 and d256 (v7's there too) and d128's one-role rows (dropout, v's own tile)
    assert v6.tiles[128] == plans.ONE_ROLE_FORWARD_TILES[("mma", plans.SM90, 128)]
    assert [v.name for v in dev.VERSIONS if v.shipped] == ["v5", "v6", "v7"]
    shipped = {(dt, tiles) for (family, _, dt), tiles in plans.FORWARD_TILES.items() if family == "mma"}
    for dt, candidates in dev.CANDIDATES.items():
        assert not {(dt, c) for c in candidates} & shipped


def test_every_entry_is_a_launchable_plan(dev):
    """Each entry names a specialization of a shipped kernel that fits an sm_90 block."""
    for dt in mma_fwd.D_TILES:
        for label, tiles in dev.entries(dt):
            plan = plans.forward_plan(SUPPORTED["bfloat16"], dt, True, tiles)
            assert plan.spec.source_file in ("flash_fwd_mma.cu", "flash_fwd_wgmma.cu", "flash_fwd_wgmma_ws.cu"), label
            assert plan.spec.smem_bytes <= 227 * 1024 and plan.d_tile == dt, label


def test_the_tuner_times_the_plan_then_every_dev_entry_once(dev, monkeypatch):
    monkeypatch.setattr(mma_fwd, "current_arch", lambda: "90")
    monkeypatch.setattr(mma_fwd, "current_smem_optin", lambda: 227 * 1024)
    configs = tune._configs(128, SUPPORTED["bfloat16"], dev)
    assert configs[0] == ("default+v7", plans.FORWARD_TILES[("mma", plans.SM90, 128)])
    assert len({c for _, c in configs}) == len(configs)
    assert {c for _, c in configs} == {c for _, c in dev.entries(128)}
    labels = [label for label, _ in configs]
    assert "v1+v2" in labels and labels.count("cand") == len(dev.CANDIDATES[128])
    assert tune._configs(128, SUPPORTED["bfloat16"], None) == [("default", configs[0][1])]


def test_without_dev_the_tuner_times_the_plan_and_says_why(tmp_path, monkeypatch, capsys):
    from cupyflash.bench import harness

    assert tune.load_dev_forward(tmp_path) is None
    assert tune.dev_dir() == REPO / "dev"
    monkeypatch.setattr(harness, "gpu_unavailable_reason", lambda: None)
    timed = []
    monkeypatch.setattr(tune, "_check", lambda config, headdim, dtype, causal, window=(-1, -1): 0.5)
    monkeypatch.setattr(tune, "_time_forward", lambda config, *rest, window=(-1, -1): timed.append(config) or 1.0)
    monkeypatch.setattr(tune, "dev_dir", lambda: None)  # as in an installed wheel
    assert cli.main(["tune", "--headdim", "64", "--seqlen", "1024", "--quiet"]) == cli.EXIT_OK
    err = capsys.readouterr().err
    assert "this installation has no dev/ folder" in err and "timing the shipped plan only" in err
    assert set(timed) == {mma_fwd.plan(SUPPORTED["bfloat16"], 64, False).tiles}
    assert cli.main(["tune", "--headdim", "64", "--seqlen", "1024", "--quiet", "--dev", str(tmp_path)]) == cli.EXIT_OK
    assert f"{tmp_path} has no mma_fwd.py" in capsys.readouterr().err


def _fits_this_device(spec) -> bool:
    import cupy

    from cupyflash.kernels._module import _max_smem_optin, runs_on_device

    return runs_on_device(spec) and spec.smem_bytes <= _max_smem_optin(cupy.cuda.Device().id)


@pytest.mark.gpu
@pytest.mark.parametrize("headdim", [64, 96, 128, 256])
def test_every_dev_entry_that_fits_matches_the_reference(dev, headdim):
    """The tuner's float64 check (error within 2x standard attention's in bf16, both masks) for
    every version and candidate that fits the device; at least one entry fits each head dim."""
    dtype = SUPPORTED["bfloat16"]
    checked = []
    for label, tiles in tune._configs(mma_fwd.d_tile(headdim), dtype, dev):
        if not _fits_this_device(plans.forward_plan(dtype, headdim, False, tiles).spec):
            continue
        ratios = [tune._check(tiles, headdim, dtype, causal) for causal in (False, True)]
        assert max(ratios) <= 1, (label, tiles, ratios)
        checked.append(label)
    assert checked and checked[0].startswith("default")

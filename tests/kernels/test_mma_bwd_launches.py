"""mma_bwd.backward's launches, without a GPU: backward() on stand-in arrays with ``launch`` and
CuPy's allocations recorded (launch_fakes), for dev/mma_bwd.py's versions and the plans. Every
call launches its plan's specializations with the plan's grids in the plan's order, each with one
argument, the call's BwdParams (the kernels' only parameter), which holds the call's arrays,
shape, window and scales and the buffers its dQ mode needs (launch_fakes.assert_backward_launches);
and which kernels each version runs where, with which tiles, is what it was."""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import pytest

from cupyflash import backward_plans, masks
from cupyflash.bench.tune import load_dev_backward
from cupyflash.kernels import dq_fixed, mma_bwd, mma_fwd
from cupyflash.kernels.constants import LOG2E
from launch_fakes import FakeArray, Launch, LaunchRecorder, assert_backward_launches, rows_of, rows_want

DEV_BWD = load_dev_backward()  # the backward's versions and candidates: dev/mma_bwd.py
SHAPE = dict(b=2, sq=100, sk=70, h=4, hkv=2)
B, SQ, SK, H, HKV = (SHAPE[x] for x in ("b", "sq", "sk", "h", "hkv"))


class Call(NamedTuple):
    launches: list[Launch]
    plan: object
    arrays: dict
    recorder: LaunchRecorder

    @property
    def params(self) -> np.void:
        return self.launches[-1].params

    def specs(self) -> list:
        return [launch.spec for launch in self.launches]

    def specs_and_grids(self) -> list:
        return [(launch.spec, launch.grid) for launch in self.launches]

    def launch(self, role: str) -> Launch:
        [found] = [launch for launch, planned in zip(self.launches, self.plan.launches) if planned.role == role]
        return found


def record_backward(monkeypatch, version, d, deterministic, fused=None, window_size=(-1, -1)) -> Call:
    """backward() (causal, fp16, SHAPE, softmax_scale 0.1) on stand-in arrays: its launches, the
    plan it ran, its arrays; every launch checked against the plan and the call
    (assert_backward_launches)."""
    recorder = LaunchRecorder(monkeypatch)
    q, o, do, dq = (FakeArray((B, SQ, H, d), np.float16) for _ in range(4))
    k, v, dk, dv = (FakeArray((B, SK, HKV, d), np.float16) for _ in range(4))
    lse = FakeArray((B, H, SQ), np.float32)
    mma_bwd.backward(do, q, k, v, o, lse, dq, dk, dv, softmax_scale=0.1, causal=True, deterministic=deterministic,
                     version=version, fused=fused, window_size=window_size)
    mask = masks.mask_for(True, window_size)
    plan = mma_bwd.plan(np.float16, d, mask, deterministic, version, fused=fused)
    arrays = dict(q=q, k=k, v=v, o=o, do=do, lse=lse, dq=dq, dk=dk, dv=dv)
    assert_backward_launches(recorder, recorder.launches, plan, do, q, k, v, o, lse, dq, dk, dv, softmax_scale=0.1,
                             mask=mask)
    return Call(recorder.launches, plan, arrays, recorder)


def test_bwd_specializations_are_named_once():
    specs = mma_bwd.specializations()
    assert len({s.name for s in specs}) == len(specs) == len({s.expression for s in specs})
    assert mma_bwd.supports(np.float16, 8) and mma_bwd.supports(np.float16, 256)
    assert not mma_bwd.supports(np.float16, 260) and not mma_bwd.supports(np.float16, 12)
    # float32 up to d128: tf32x3 on the DMMA backward's kernels (test_flash_bwd_dmma.py)
    assert mma_bwd.supports(np.float32, 64) and not mma_bwd.supports(np.float32, 136)


@pytest.mark.parametrize("version,d", [("v1", 96), ("v2", 96), ("v2", 64), ("v3", 96), ("v3", 200)])
@pytest.mark.parametrize("deterministic", [True, False])
def test_bwd_launches_pass_the_call_in_one_struct(deterministic, version, d, monkeypatch):
    """The two-kernel versions: D, then the version's dK/dV kernel over the key blocks, then the dQ
    kernel (deterministic) or the dQ convert after atomic adds; one BwdParams for all three."""
    call = record_backward(monkeypatch, version, d, deterministic)
    assert [launch.role for launch in call.plan.launches] == ["preprocess", "dkdv",
                                                              "dq" if deterministic else "convert"]
    kernel, tiles = DEV_BWD.dkdv_tiles(d, version, not deterministic)
    dkdv = call.launch("dkdv")
    assert dkdv.spec == mma_bwd.dkdv_spec(np.float16, d, True, "none" if deterministic else "atomic", kernel)
    assert dkdv.grid[0] == math.ceil(SK / tiles[2])
    assert (call.params["dq_accum"]["data"] == 0) == deterministic


@pytest.mark.parametrize("arch,smem", [("90", 227 * 1024), ("80", 163 * 1024), ("86", 99 * 1024), (None, None)])
@pytest.mark.parametrize("window", [(-1, -1), (100, 3)], ids=["causal", "window100_3"])
def test_every_plan_launches_with_one_struct(arch, smem, window, monkeypatch):
    """The plans themselves (no version), on each device class, at every head-dim tile and between
    tiles, deterministic or not: every launch gets the call's BwdParams with the buffers of the
    plan's dQ mode (record_backward checks each call)."""
    monkeypatch.setattr(mma_fwd, "current_arch", lambda: arch)
    monkeypatch.setattr(mma_fwd, "current_smem_optin", lambda: smem)
    modes = set()
    for d in (40, 64, 96, 128, 200, 256):
        for deterministic in (True, False):
            modes.add(record_backward(monkeypatch, None, d, deterministic, window_size=window).plan.dq_add)
    # sm_90's 16-bit backward adds no dQ atomically since v15 (the producer pair either way)
    assert "none" in modes and ("atomic" in modes) == (arch != "90")


@pytest.mark.parametrize("corrupt", [None, "dq_of_another_array", "no_delta_for_dq", "two_arguments",
                                     "forward_struct", "window"])
def test_the_struct_checks_can_fail(corrupt, monkeypatch):
    """assert_backward_launches has teeth: the dK/dV kernel given another array for dq, the dQ
    kernel given no D, a second argument, the forward's struct, or another window fail it (the
    launches as the launcher makes them pass)."""
    from cupyflash.kernels import params

    recorder = LaunchRecorder(monkeypatch)
    record = recorder._record

    def corrupted(spec, grid, args):
        p = np.frombuffer(bytearray(args[0].tobytes()), args[0].dtype)
        if corrupt == "dq_of_another_array" and "dkdv" in spec.name:
            params.set_rows(p, "dq", FakeArray((B, SQ, H, 96), np.float16))
        elif corrupt == "no_delta_for_dq" and "_dq_mma" in spec.name:
            p["delta"] = 0
        elif corrupt == "window" and "_dq_mma" in spec.name:
            p["window_left"] = 7
        elif corrupt == "forward_struct" and "dkdv" in spec.name:
            p = np.zeros(1, params.FWD_PARAMS)
        record(spec, grid, (p, np.int32(0)) if corrupt == "two_arguments" else (p,))

    monkeypatch.setattr(mma_bwd, "launch", corrupted)
    q, o, do, dq = (FakeArray((B, SQ, H, 96), np.float16) for _ in range(4))
    k, v, dk, dv = (FakeArray((B, SK, HKV, 96), np.float16) for _ in range(4))
    lse = FakeArray((B, H, SQ), np.float32)
    mma_bwd.backward(do, q, k, v, o, lse, dq, dk, dv, softmax_scale=0.1, causal=True, version="v1")
    plan = mma_bwd.plan(np.float16, 96, masks.Causal(), True, "v1")
    assert [launch.spec for launch in recorder.launches] == [launch.spec for launch in plan.launches]

    def check():
        assert_backward_launches(recorder, recorder.launches, plan, do, q, k, v, o, lse, dq, dk, dv,
                                 softmax_scale=0.1, mask=masks.Causal())
    if corrupt is None:
        check()
    else:
        with pytest.raises(AssertionError):
            check()


def _assert_fused_launches(call: Call, d, deterministic, config):
    """D, flash_bwd_fused_mma with `config`, then flash_bwd_dq_convert; the float32 dq_accum of
    (batch, seqlen_q, nheads, d_tile) that the convert reads, the counters only when ordered."""
    specs = call.specs()
    assert specs[0] == backward_plans.preprocess_spec(np.float16)
    assert specs[1:] == [mma_bwd.fused_spec(np.float16, d, True, "ordered" if deterministic else "atomic", config),
                         mma_bwd.convert_spec(np.float16)]
    dt = mma_bwd.d_tile(d)
    bm, bn = config[:2]
    fused, convert = call.launch("dkdv"), call.launch("convert")
    assert fused.grid == (math.ceil(SK / bn), HKV, B)
    p = fused.params
    accum = call.recorder.allocation(int(p["dq_accum"]["data"]))
    assert accum.shape == (B, SQ, H, dt) and accum.dtype == np.float32
    assert rows_of(p, "dq_accum") == rows_want(accum)
    if deterministic:
        assert call.recorder.allocation(int(p["dq_semaphore"])).shape == (B, H, math.ceil(SQ / bm))
    else:
        assert p["dq_semaphore"] == 0
    assert (p["seqlen_q"], p["seqlen_k"], p["nheads"], p["group"], p["headdim"]) == (SQ, SK, H, H // HKV, d)
    assert p["scale_log2_f64"] == np.float64(0.1) * LOG2E and p["scale_log2"] == np.float32(np.float64(0.1) * LOG2E)
    assert p["scale_f64"] == np.float64(0.1) and p["scale"] == np.float32(0.1)
    assert (p["window_left"], p["window_right"]) == (-1, 0)  # the causal policy's window (mask.cuh)
    assert rows_of(convert.params, "dq_accum") == rows_of(p, "dq_accum") and convert.params["scale"] == p["scale"]


@pytest.mark.parametrize("smem", [163 * 1024, 227 * 1024])
@pytest.mark.parametrize("d", [64, 96, 200])
@pytest.mark.parametrize("deterministic", [True, False])
def test_bwd_windows_on_the_mma_sync_path_launch_local_kernels(deterministic, d, smem, monkeypatch):
    """A window on the sm_80 path (v10 falls back to v5): every launch but D and the convert is a
    Local specialization that specializations() lists (so the compile check covers it), the window
    is in the struct; the same kernels as without a window otherwise, except v1's dK/dV kernel for
    v2's with the atomic dQ (mma_bwd.DKDV_CONFIG_V2's note)."""
    monkeypatch.setattr(mma_fwd, "current_arch", lambda: "80")
    monkeypatch.setattr(mma_fwd, "current_smem_optin", lambda: smem)
    listed = {spec.name for spec in mma_bwd.specializations()}
    plain = record_backward(monkeypatch, "v10", d, deterministic)
    windowed = record_backward(monkeypatch, "v10", d, deterministic, window_size=(100, 3))
    assert len(windowed.launches) == len(plain.launches)
    assert (windowed.params["window_left"], windowed.params["window_right"]) == (100, 0)  # causal: right 0
    for launch, plain_launch, planned in zip(windowed.launches, plain.launches, windowed.plan.launches):
        spec, plain_spec = launch.spec, plain_launch.spec
        if planned.role in ("preprocess", "convert"):
            assert spec == plain_spec
            continue
        assert "_local_" in spec.name and spec.name in listed
        expected = plain_spec.name.replace("_causal_", "_local_")
        if "dkdv_mma_v2" in expected and "dqatomic" in expected:
            assert spec == mma_bwd.dkdv_spec(np.float16, d, masks.Local(100, 0), "atomic", "v1")
        else:
            assert spec.name == expected and launch.grid == plain_launch.grid


def test_bwd_ordered_dq_adds_take_no_window(monkeypatch):
    """The ordered dQ adds need every key block: a window with v4's deterministic path runs v3's
    kernels, and an explicit ordered fused configuration is refused."""
    monkeypatch.setattr(mma_fwd, "current_arch", lambda: "80")
    monkeypatch.setattr(mma_fwd, "current_smem_optin", lambda: 227 * 1024)
    v4 = record_backward(monkeypatch, "v4", 96, True, window_size=(64, 64))
    v3 = record_backward(monkeypatch, "v3", 96, True, window_size=(64, 64))
    assert v4.specs() == v3.specs()
    with pytest.raises(ValueError, match="ordered"):
        mma_bwd.fused_spec(np.float16, 128, masks.Local(64, 64), "ordered")
    with pytest.raises(ValueError, match="ordered"):
        record_backward(monkeypatch, "v4", 96, True, fused=mma_bwd.FUSED_CONFIG[128], window_size=(64, 64))


@pytest.mark.parametrize("d", [64, 96, 200])
@pytest.mark.parametrize("deterministic", [True, False])
def test_bwd_v4_launches_the_fused_kernel_with_one_struct(deterministic, d, monkeypatch):
    """version="v4" on a GPU with 227 KiB per block: flash_bwd_fused_mma and flash_bwd_dq_convert
    where FUSED_CONFIG has the head-dim tile (v3's kernels elsewhere), and with any table entry
    passed as ``fused``. The counters exist only when ordered."""
    monkeypatch.setattr(mma_fwd, "current_smem_optin", lambda: 227 * 1024)
    call = record_backward(monkeypatch, "v4", d, deterministic)
    config = mma_bwd.FUSED_CONFIG.get(mma_bwd.d_tile(d))
    if config is not None:
        _assert_fused_launches(call, d, deterministic, config)
    else:
        v3 = record_backward(monkeypatch, "v3", d, deterministic)
        assert call.specs_and_grids() == v3.specs_and_grids()
    for config in DEV_BWD.FUSED_CANDIDATES.get(mma_bwd.d_tile(d), ()):
        _assert_fused_launches(record_backward(monkeypatch, "v1", d, deterministic, fused=config), d, deterministic,
                               config)


@pytest.mark.parametrize("deterministic", [True, False])
def test_bwd_v4_falls_back_to_v3_where_shared_memory_is_short(deterministic, monkeypatch):
    """With sm_80's 163 KiB per block, head dim 256 (the fused kernel's d256 tiles need more) runs
    v3's kernels; other head dims run the fused kernel where their tiles fit."""
    monkeypatch.setattr(mma_fwd, "current_smem_optin", lambda: 163 * 1024)
    assert DEV_BWD.fused_config(200, 163 * 1024) is None
    for d in (64, 96, 200):
        v4 = record_backward(monkeypatch, "v4", d, deterministic)
        if DEV_BWD.fused_config(d, 163 * 1024) is None:
            v3 = record_backward(monkeypatch, "v3", d, deterministic)
            assert v4.specs_and_grids() == v3.specs_and_grids()
            assert not any("fused" in spec.name for spec in v4.specs())
        else:
            _assert_fused_launches(v4, d, deterministic, DEV_BWD.fused_config(d, 163 * 1024))


@pytest.mark.parametrize("version", ["v6", "v7", "v9", "v10"])
@pytest.mark.parametrize("d", [64, 96, 200])
@pytest.mark.parametrize("deterministic", [True, False])
def test_bwd_wgmma_versions_launch_the_wgmma_kernel_on_sm90(deterministic, d, version, monkeypatch):
    """version="v6"/"v7"/"v9"/"v10" on an sm_90 device: flash_bwd_wgmma (flash_bwd_wgmma_dsplit at d256).
    Atomic dQ when not deterministic (then flash_bwd_dq_convert); when deterministic, v6 orders
    the float adds (v3's kernels at the head-dim tiles not in WGMMA_ORDERED_D_TILES) and v7 adds
    fixed point (flash_bwd_kv_bounds and flash_bwd_preprocess_fixed before, flash_bwd_dq_convert_fixed
    after; v3's kernels outside WGMMA_FIXED_D_TILES); v9 the same with a panel-major dq_accum
    (dq_fixed.accum_panels) at WGMMA_PANEL_D_TILES; v10 the kernel for dK and dV only (DqAdd::none),
    then flash_bwd_dq_wgmma over the query blocks, writing dq itself (no convert) at
    WGMMA_SPLIT_D_TILES. Every kernel of a call gets its BwdParams. On sm_80 all are v5."""
    monkeypatch.setattr(mma_fwd, "current_smem_optin", lambda: 227 * 1024)
    monkeypatch.setattr(mma_fwd, "current_arch", lambda: "90")
    call = record_backward(monkeypatch, version, d, deterministic)
    dt = mma_bwd.d_tile(d)
    dq_add = "atomic" if not deterministic else {"v6": "ordered", "v7": "fixed", "v9": "fixed_panels",
                                                  "v10": "none"}[version]
    if version == "v10" and not deterministic and dt in DEV_BWD.WGMMA_SPLIT_ATOMIC_D_TILES:
        dq_add = "none"  # the split kernels beat the float atomics there
    p = call.params
    if dq_add == "none":
        assert dt in DEV_BWD.WGMMA_SPLIT_D_TILES
        spec, dq_spec = mma_bwd.wgmma_spec(np.float16, d, True, "none"), mma_bwd.dq_wgmma_spec(np.float16, d, True)
        assert call.specs()[1:] == [spec, dq_spec]
        assert spec.arch == dq_spec.arch == "90a" and ("dsplit" in spec.name) == (dt == 256)
        dkdv, dq = call.launch("dkdv"), call.launch("dq")
        assert dkdv.grid == (math.ceil(SK / mma_bwd.WGMMA_CONFIG[dt][1]), HKV, B)
        assert dq.grid == (math.ceil(SQ / mma_bwd.DQ_WGMMA_CONFIG[dt][0]), H, B)
        assert int(p["dk"]["data"]) == call.arrays["dk"].data.ptr and int(p["dv"]["data"]) == call.arrays["dv"].data.ptr
        assert int(p["dq"]["data"]) == call.arrays["dq"].data.ptr and p["dq_accum"]["data"] == 0  # dq itself
        assert dq.params["delta"] == dkdv.params["delta"] != 0  # both kernels read the same D = rowsum(dO o O)
    elif (dq_add == "ordered" and dt not in DEV_BWD.WGMMA_ORDERED_D_TILES) or (
            dq_add == "fixed" and dt not in DEV_BWD.WGMMA_FIXED_D_TILES) or (
            dq_add == "fixed_panels" and dt not in DEV_BWD.WGMMA_PANEL_D_TILES):
        v3 = record_backward(monkeypatch, "v3", d, deterministic)
        assert call.specs_and_grids() == v3.specs_and_grids()
    else:
        bm, bn = mma_bwd.WGMMA_CONFIG[dt]
        spec = mma_bwd.wgmma_spec(np.float16, d, True, dq_add)
        fixed = dq_add in ("fixed", "fixed_panels")
        if fixed:
            expected = [dq_fixed.kv_bounds_spec(np.float16, dt), dq_fixed.preprocess_spec(np.float16, dt), spec,
                        dq_fixed.convert_spec(np.float16)]
        else:
            expected = [backward_plans.preprocess_spec(np.float16), spec, mma_bwd.convert_spec(np.float16)]
        assert call.specs() == expected
        assert spec.arch == "90a" and ("dsplit" in spec.name) == (dt == 256)
        assert call.launch("dkdv").grid == (math.ceil(SK / bn), HKV, B)
        if dq_add == "ordered":
            assert call.recorder.allocation(int(p["dq_semaphore"])).shape == (B, H, math.ceil(SQ / bm))
        else:
            assert p["dq_semaphore"] == 0
        accum = call.recorder.allocation(int(p["dq_accum"]["data"]))
        assert accum.dtype == (np.int64 if fixed else np.float32)
        # every kernel reads element (b, m, h, c) of dQ at b sb + m ss + h sh + (c / 64) sp + c % 64
        strides = (*rows_of(p, "dq_accum")[1:], int(p["dq_accum_panel_stride"]))
        if dq_add == "fixed_panels":  # (batch, head x panel, rows in whole query blocks, 64)
            rows = math.ceil(SQ / bm) * bm
            assert accum.shape == (B, H * dt // 64, rows, 64)
            assert strides == (H * dt // 64 * rows * 64, 64, dt // 64 * rows * 64, rows * 64)
        else:
            assert accum.shape == (B, SQ, H, dt)
            assert strides == (SQ * H * dt, H * dt, dt, 64)
        if fixed:  # the rows' fixed-point scales
            assert call.recorder.allocation(int(p["dq_row_scale"])).shape == (B, H, SQ)
        else:
            assert p["dq_row_scale"] == 0 and p["kv_bound"] == 0
    monkeypatch.setattr(mma_fwd, "current_arch", lambda: "80")
    ours, v5 = (record_backward(monkeypatch, v, d, deterministic) for v in (version, "v5"))
    assert ours.specs_and_grids() == v5.specs_and_grids()


@pytest.mark.parametrize("smem_optin", [227 * 1024, 163 * 1024], ids=["sm90", "sm80"])
@pytest.mark.parametrize("d", [64, 96, 200])
def test_bwd_v5_launches_v3_when_deterministic_and_v4_otherwise(d, smem_optin, monkeypatch):
    """The default version: deterministic=True launches exactly v3's kernels (the two-kernel path;
    the ordered fused kernel measured slower), deterministic=False exactly what v4 launches."""
    monkeypatch.setattr(mma_fwd, "current_smem_optin", lambda: smem_optin)
    for deterministic, same_as in ((True, "v3"), (False, "v4")):
        v5 = record_backward(monkeypatch, "v5", d, deterministic)
        other = record_backward(monkeypatch, same_as, d, deterministic)
        assert v5.specs_and_grids() == other.specs_and_grids()
        assert not (deterministic and any("fused" in spec.name for spec in v5.specs()))


@pytest.mark.parametrize("bad", ["dk_headdim", "dq_stride", "dv_pointer"])
def test_the_backward_refuses_outputs_its_epilogue_would_overrun(bad, monkeypatch):
    """The 16-bit kernels store dQ, dK and dV as whole 16-byte chunks of a row (stage_acc,
    store_tile): an output whose head dim or strides are not multiples of 8 elements, or whose
    pointer is not 16-byte aligned, is refused before any launch, not overrun."""
    recorder = LaunchRecorder(monkeypatch)
    q, o, do, dq = (FakeArray((B, SQ, H, 64), np.float16) for _ in range(4))
    k, v, dk, dv = (FakeArray((B, SK, HKV, 64), np.float16) for _ in range(4))
    lse = FakeArray((B, H, SQ), np.float32)
    if bad == "dk_headdim":
        dk = FakeArray((B, SK, HKV, 60), np.float16)
    elif bad == "dq_stride":
        dq.strides = (dq.strides[0], 2 * (H * 64 + 4), 2 * 64, 2)
    else:
        dv.data.ptr += 8
    with pytest.raises(ValueError, match=r"\bd[qkv]\b"):
        mma_bwd.backward(do, q, k, v, o, lse, dq, dk, dv, softmax_scale=0.1, causal=True)
    assert not recorder.launches


def test_the_backward_asks_no_stride_of_a_dimension_of_size_one(monkeypatch):
    """The API passes an array on unpadded when the strides of its dimensions longer than 1 fit
    (api._mma_ready); a size-1 dimension's stride is never stepped by, so the layout check must not
    refuse it either (a do of one sequence whose batch stride is odd, e.g. from as_strided)."""
    recorder = LaunchRecorder(monkeypatch)
    q, o, do, dq = (FakeArray((1, SQ, H, 64), np.float16) for _ in range(4))
    k, v, dk, dv = (FakeArray((1, SK, HKV, 64), np.float16) for _ in range(4))
    lse = FakeArray((1, H, SQ), np.float32)
    do.strides = (2 * 7, *do.strides[1:])
    mma_bwd.backward(do, q, k, v, o, lse, dq, dk, dv, softmax_scale=0.1, causal=True)
    assert recorder.launches

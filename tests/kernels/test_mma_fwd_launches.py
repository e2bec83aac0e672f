"""mma_fwd.forward's launch, without a GPU: on an sm_90 device it launches flash_fwd_wgmma, on
others flash_fwd_mma, the plan's specialization with its grid and one argument, the call's
FwdParams (the kernels' only parameter) with its arrays, shape, window and scale."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cupyflash import plans
from cupyflash.kernels import mma_fwd
from cupyflash.masks import mask_for
from launch_fakes import FakeArray, LaunchRecorder, assert_forward_launch

B, SQ, SK, H, HKV = 2, 100, 70, 4, 2


@pytest.mark.parametrize("window", [(-1, 0), (30, 2)], ids=["causal", "window30_2"])
def test_fwd_wgmma_launch_passes_the_call_in_one_struct(window, monkeypatch):
    causal, window_size = window == (-1, 0), window if window != (-1, 0) else (-1, -1)
    mask = mask_for(causal, window_size)
    recorder = LaunchRecorder(monkeypatch, [mma_fwd])
    for arch, smem, kernel in (("90", 227 * 1024, "flash_fwd_wgmma"), ("80", 163 * 1024, "flash_fwd_mma")):
        monkeypatch.setattr(mma_fwd, "current_arch", lambda: arch)
        monkeypatch.setattr(mma_fwd, "current_smem_optin", lambda: smem)
        for d in (64, 96, 200):
            q, o = FakeArray((B, SQ, H, d), np.float16), FakeArray((B, SQ, H, d), np.float16)
            k, v = FakeArray((B, SK, HKV, d), np.float16), FakeArray((B, SK, HKV, d), np.float16)
            lse = FakeArray((B, H, SQ), np.float32)
            mma_fwd.forward(q, k, v, o, lse, softmax_scale=0.1, causal=causal, window_size=window_size)
            [launch] = recorder.take()
            plan = plans.plan_forward(arch, np.float16, d, mask, smem)
            assert launch.spec.name.startswith(kernel) and launch.spec == plan.spec
            assert launch.grid == (math.ceil(SQ / plan.block_m), H, B)
            assert_forward_launch(launch, q, k, v, o, lse, softmax_scale=0.1, mask=mask)


@pytest.mark.parametrize("bad", ["o_headdim", "q_headdim", "k_stride", "v_pointer"])
def test_the_forward_refuses_arrays_its_chunks_would_overrun(bad, monkeypatch):
    """The forward's loads and its epilogue (store_o) move whole 16-byte chunks of a row below the
    head dim: an array whose head dim or strides are not multiples of 8 elements, or whose pointer
    is not 16-byte aligned, is refused before any launch, not overrun."""
    recorder = LaunchRecorder(monkeypatch, [mma_fwd])
    q, o = FakeArray((B, SQ, H, 64), np.float16), FakeArray((B, SQ, H, 64), np.float16)
    k, v = FakeArray((B, SK, HKV, 64), np.float16), FakeArray((B, SK, HKV, 64), np.float16)
    lse = FakeArray((B, H, SQ), np.float32)
    if bad == "o_headdim":
        o = FakeArray((B, SQ, H, 60), np.float16)
    elif bad == "q_headdim":
        q, k = FakeArray((B, SQ, H, 60), np.float16), FakeArray((B, SK, HKV, 60), np.float16)
    elif bad == "k_stride":
        k.strides = (k.strides[0], 2 * (HKV * 64 + 4), 2 * 64, 2)
    else:
        v.data.ptr += 8
    with pytest.raises(ValueError, match=r"\b[qkvo]\b"):
        mma_fwd.forward(q, k, v, o, lse, softmax_scale=0.1, causal=True)
    assert not recorder.take()


def test_the_forward_asks_no_stride_of_a_dimension_of_size_one(monkeypatch):
    """A size-1 dimension's stride is never stepped by (its index is always 0), so an odd one
    there (one head of a q sliced from a wider array, as api._mma_ready passes it on) is not
    refused."""
    recorder = LaunchRecorder(monkeypatch, [mma_fwd])
    q, o = FakeArray((B, SQ, 1, 64), np.float16), FakeArray((B, SQ, 1, 64), np.float16)
    k, v = FakeArray((B, SK, 1, 64), np.float16), FakeArray((B, SK, 1, 64), np.float16)
    lse = FakeArray((B, 1, SQ), np.float32)
    q.strides = (*q.strides[:2], 2 * 3, 2)
    mma_fwd.forward(q, k, v, o, lse, softmax_scale=0.1, causal=True)
    assert recorder.take()


def test_a_bfloat16_softcap_forward_takes_the_cap_as_its_row_maximum_where_the_plan_says(monkeypatch):
    """softcap-fixed-max: on sm_90 at d128 the producer kernel runs a bfloat16 softcap call with
    Score.fixed_max (the cap's bound as every row's maximum) for a cap up to 33.27
    (plans.takes_fixed_max: 2 c log2(e) <= 96), the same tiles with the running maximum for a
    wider cap, for float16, and on the kernels that do not ask for it (sm_80, d64; softcap with
    ALiBi: test_plans); the launch passes the call's cap either way."""
    from cupyflash._dtypes import SUPPORTED
    from cupyflash.scores import Variant

    recorder = LaunchRecorder(monkeypatch, [mma_fwd])
    c_max = plans.FIXED_MAX_LOG2_RANGE / (2 * np.log2(np.e))
    cases = [("90", 227 * 1024, 128, "bfloat16", 30.0, True), ("90", 227 * 1024, 128, "bfloat16", c_max * 0.999, True),
             ("90", 227 * 1024, 128, "bfloat16", c_max * 1.001, False), ("90", 227 * 1024, 128, "float16", 30.0, False),
             ("90", 227 * 1024, 64, "bfloat16", 30.0, False), ("80", 163 * 1024, 128, "bfloat16", 30.0, False)]
    for arch, smem, d, dtype, cap, fixed in cases:
        monkeypatch.setattr(mma_fwd, "current_arch", lambda: arch)
        monkeypatch.setattr(mma_fwd, "current_smem_optin", lambda: smem)
        dt = SUPPORTED[dtype]
        q, o = FakeArray((B, SQ, H, d), dt), FakeArray((B, SQ, H, d), dt)
        k, v = FakeArray((B, SK, HKV, d), dt), FakeArray((B, SK, HKV, d), dt)
        lse = FakeArray((B, H, SQ), np.float32)
        mma_fwd.forward(q, k, v, o, lse, softmax_scale=0.1, causal=True, variant=Variant(softcap=cap))
        [launch] = recorder.take()
        assert ("_softcap_fixedmax_" in launch.spec.name) == fixed, (arch, d, dtype, cap, launch.spec.name)
        assert "_softcap_" in launch.spec.name
        assert ("ScoreMod<true, false, false, false, true>" in launch.spec.expression) == fixed
        assert launch.args[0]["variant"]["softcap"] == np.float32(cap)

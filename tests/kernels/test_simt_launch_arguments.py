"""The SIMT family's launches, without a GPU: forward, backward preprocess, dK/dV and dQ run on
stand-in arrays with ``launch`` recorded; each passes one struct, FwdParams for the forward and
BwdParams for the backward (the kernels' only parameter), holding the call's arrays, shape,
window and scales, and the backward's three launches one struct."""
import ml_dtypes
import numpy as np
import pytest

from cupyflash import backward_plans, plans
from cupyflash.kernels import simt
from cupyflash.masks import mask_for
from launch_fakes import FakeArray, LaunchRecorder, assert_backward_launches, assert_forward_launch


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ml_dtypes.bfloat16, np.float16], ids=str)
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("window", [(-1, 0), (30, 5)], ids=["causal", "window30_5"])
def test_simt_launches_pass_the_call_in_one_struct(dtype, deterministic, window, monkeypatch):
    recorder = LaunchRecorder(monkeypatch, [simt])
    b, sq, sk, h, hkv, d = 2, 100, 70, 4, 2, 40
    acc = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    q, o, do, dq = (FakeArray((b, sq, h, d), dtype) for _ in range(4))
    k, v, dk, dv = (FakeArray((b, sk, hkv, d), dtype) for _ in range(4))
    lse = FakeArray((b, h, sq), acc)
    causal, window_size = window == (-1, 0), window if window != (-1, 0) else (-1, -1)
    mask = mask_for(causal, window_size)

    simt.forward(q, k, v, o, lse, softmax_scale=0.1, causal=causal, window_size=window_size)
    [fwd] = recorder.take()
    plan = plans.plan_forward(None, dtype, d, mask, None, family="simt")
    assert (fwd.spec, fwd.grid) == (plan.spec, (-(-sq // plan.block_m), h, b))
    assert fwd.spec.name.startswith("flash_fwd_simt")
    assert_forward_launch(fwd, q, k, v, o, lse, softmax_scale=0.1, mask=mask)

    simt.backward(do, q, k, v, o, lse, dq, dk, dv, softmax_scale=0.1, causal=causal, deterministic=deterministic,
                  window_size=window_size)
    launches = recorder.launches
    assert [s.spec.name.split("_")[1:3] for s in launches] == [["bwd", "preprocess"], ["bwd", "dkdv"], ["bwd", "dq"]]
    plan = backward_plans.plan_backward(None, dtype, d, mask, None, True, family="simt")
    assert plan.dq_add == "none"  # the SIMT backward is always deterministic
    assert_backward_launches(recorder, launches, plan, do, q, k, v, o, lse, dq, dk, dv, softmax_scale=0.1, mask=mask)

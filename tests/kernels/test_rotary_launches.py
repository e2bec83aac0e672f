"""kernels/rotary.py's launch on the CPU (launch_fakes): one launch over (sequence, token) x head with
one RotaryParams of the call's arrays, and the kernel's thread count the launcher's. The kernel's
arithmetic against the array code, bit for bit: tests/test_rotary_gpu.py."""
from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from cupyflash.kernels import rotary
from cupyflash.kernels._module import kernels_dir
from cupyflash.kernels.params import ROTARY_PARAMS
from launch_fakes import FakeArray, LaunchRecorder


def _rows(field, a):
    item = a.itemsize
    return (int(field["data"]), int(field["batch_stride"]), int(field["row_stride"]), int(field["head_stride"])) == (
        a.data.ptr, a.strides[0] // item, a.strides[1] // item, a.strides[2] // item)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("per_token", [True, False])
def test_rotate_launch(interleaved, per_token, monkeypatch):
    recorder = LaunchRecorder(monkeypatch, [rotary])
    x = FakeArray((3, 2, 8, 128), ml_dtypes.bfloat16)
    cos, sin = FakeArray((500, 32), ml_dtypes.bfloat16), FakeArray((500, 32), ml_dtypes.bfloat16)
    starts = FakeArray((3,), np.int32)
    out = rotary.rotate(x, cos, sin, starts, per_token=per_token, interleaved=interleaved)
    [launch] = recorder.take()
    assert launch.spec == rotary.specialization(np.dtype(ml_dtypes.bfloat16), interleaved)
    assert launch.grid == (3 * 2, 8, 1) and launch.args[0].dtype == ROTARY_PARAMS
    [p] = launch.args[0]
    assert _rows(p["x"], x) and _rows(p["out"], out) and out.shape == x.shape
    assert (int(p["cos"]), int(p["sin"]), int(p["starts"])) == (cos.data.ptr, sin.data.ptr, starts.data.ptr)
    assert (int(p["batch"]), int(p["tokens"]), int(p["heads"]), int(p["headdim"]), int(p["half"])) == (3, 2, 8, 128, 32)
    assert int(p["per_token"]) == int(per_token)


def test_the_kernels_thread_count_is_the_launchers():
    source = (kernels_dir() / "flash_rotary.cu").read_text()
    assert int(re.search(r"ROTARY_THREADS = (\d+)", source).group(1)) == rotary.THREADS


def test_every_dtype_and_pair_layout_has_a_kernel():
    names = {spec.name for spec in rotary.specializations()}
    assert names == {f"flash_rotary_{d}_{p}" for d in ("fp16", "bf16", "fp32", "fp64")
                     for p in ("interleaved", "halves")}

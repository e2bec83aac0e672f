"""Why no CUDA device is usable, in one wording: the library's errors and the GPU tests' skips."""
import numpy as np
import pytest

import cupyflash
from cupyflash import dispatch

cupy = pytest.importorskip("cupy")


@pytest.fixture
def fresh_reason():
    dispatch.no_device_reason.cache_clear()
    dispatch.gpu_available.cache_clear()
    yield
    dispatch.no_device_reason.cache_clear()
    dispatch.gpu_available.cache_clear()


def _runtime_error(*args):
    raise cupy.cuda.runtime.CUDARuntimeError(35)  # cudaErrorInsufficientDriver, as without a driver


@pytest.mark.parametrize("driver, expected", [
    (False, "no CUDA device (no NVIDIA driver on this machine)"),
    (True, "no CUDA device usable (cudaErrorInsufficientDriver: "),
])
def test_a_failing_runtime_is_no_cuda_device(fresh_reason, monkeypatch, driver, expected):
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", _runtime_error)
    monkeypatch.setattr(dispatch, "_driver_installed", lambda: driver)
    assert dispatch.no_device_reason().startswith(expected)
    assert not dispatch.gpu_available()


@pytest.mark.parametrize("count, expected", [(0, "no CUDA device"), (1, None)])
def test_the_device_count_decides(fresh_reason, monkeypatch, count, expected):
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", lambda: count)
    assert dispatch.no_device_reason() == expected
    assert dispatch.gpu_available() == (count > 0)


def test_a_cuda_backend_without_a_device_says_why(fresh_reason, monkeypatch):
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", _runtime_error)
    monkeypatch.setattr(dispatch, "_driver_installed", lambda: False)
    q = np.zeros((1, 4, 1, 8), np.float32)
    for backend in ("cuda", "simt"):
        with pytest.raises(RuntimeError, match=r"no CUDA device \(no NVIDIA driver on this machine\); "
                                               r"use backend='numpy' or 'auto'"):
            cupyflash.flash_attn_func(q, q, q, backend=backend)
    assert cupyflash.flash_attn_func(q, q, q, backend="auto").shape == q.shape


@pytest.mark.gpu
def test_a_device_is_usable_without_a_reason(fresh_reason):
    assert dispatch.no_device_reason() is None
    assert dispatch.gpu_available()

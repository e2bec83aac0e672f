"""Which implementation runs a call: the kernel family (tensor cores, SIMT) or the NumPy twin.

``auto`` picks the tensor-core family for float16/bfloat16 on a GPU, for float32 (tf32 tensor
cores, cupyflash.precision; the backward up to headdim 128) and for float64 up to headdim 128
(DMMA, forward and backward), the SIMT family for the float32 backward and float64 past headdim
128, and the NumPy twin when no CUDA device is usable.
"""
from __future__ import annotations

import functools

import numpy as np

from . import backward_plans, plans
from .plans import mma_headdim  # noqa: F401 (the API pads head dims through dispatch.mma_headdim)


@functools.lru_cache(maxsize=None)
def no_device_reason() -> str | None:
    """None when CuPy imports and sees a CUDA device, else why not (it starts "no CUDA device")."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CuPy build that fails to load its libraries
        return f"no CUDA device usable: CuPy is not importable ({exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError; without a driver CUDA calls it "insufficient"
        if not _driver_installed():
            return "no CUDA device (no NVIDIA driver on this machine)"
        return f"no CUDA device usable ({exc})"
    return None if count > 0 else "no CUDA device"


def _driver_installed() -> bool:
    import ctypes
    import sys

    try:
        ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    except OSError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    return no_device_reason() is None


def _mma_module(direction: str):
    """The tensor-core family module for 'fwd' or 'bwd', or None when it is not built in."""
    try:
        if direction == "fwd":
            from .kernels import mma_fwd as module
        else:
            from .kernels import mma_bwd as module
    except ImportError:
        return None
    return module


def choose(backend: str, dtype, headdim: int, direction: str) -> str:
    """'mma', 'simt' or 'numpy' for a call with this backend request, dtype and head dimension."""
    if backend == "numpy":
        return "numpy"
    if backend == "auto" and not gpu_available():
        return "numpy"
    if not gpu_available():
        raise RuntimeError(f"backend={backend!r}: {no_device_reason() or 'no CUDA device'}; "
                           "use backend='numpy' or 'auto'")
    if direction == "fwd":  # the forward's family is its plan's (cupyflash.plans)
        mma_ok = plans.forward_family(dtype, headdim) == "mma"
    else:
        mma = _mma_module(direction)
        mma_ok = mma is not None and backward_plans.backward_family(dtype, headdim) == "mma"
    if backend == "mma":
        if not mma_ok:
            dtypes = ("float16/bfloat16/float32 with headdim <= 256 and float64 with headdim <= 128"
                      if direction == "fwd" else
                      "float16/bfloat16 with headdim <= 256 and float32/float64 with headdim <= 128")
            raise ValueError(f"backend='mma' (tensor cores) supports {dtypes}; "
                             f"got {np.dtype(dtype)} with headdim {headdim}")
        return "mma"
    if backend == "simt":
        return "simt"
    return "mma" if mma_ok else "simt"  # auto / cuda


def family(name: str, direction: str):
    if name == "simt":
        from .kernels import simt

        return simt
    if name == "mma":
        return _mma_module(direction)
    raise ValueError(name)

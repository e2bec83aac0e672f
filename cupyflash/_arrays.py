"""Argument checking and array conversion, before anything is launched.

Every error names the argument and what was expected. Arrays come in three kinds: CuPy (results
stay CuPy, on the current stream), NumPy (results come back as NumPy), and foreign device arrays
exposing ``__dlpack__`` / ``__cuda_array_interface__`` such as torch or JAX (taken zero-copy,
results are CuPy).
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from ._dtypes import SUPPORTED, dtype_name, lse_dtype

MAX_HEADDIM = 256
BACKENDS = ("auto", "cuda", "simt", "mma", "numpy")


def _cupy():
    try:
        import cupy
    except ImportError:  # pragma: no cover - depends on the install
        return None
    return cupy


def array_kind(x, name: str) -> str:
    """'cupy', 'numpy' or 'foreign'; TypeError for things that are not arrays."""
    cupy = _cupy()
    if cupy is not None and isinstance(x, cupy.ndarray):
        return "cupy"
    if isinstance(x, np.ndarray):
        return "numpy"
    if hasattr(x, "__cuda_array_interface__"):
        return "foreign"
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        device_type = x.__dlpack_device__()[0]
        return "foreign" if int(device_type) in (2, 3, 13) else "foreign_host"  # CUDA, CUDA host, managed
    raise TypeError(f"{name} must be an array (NumPy, CuPy, or DLPack / CUDA-array-interface capable), "
                    f"got {type(x).__name__}")


def to_numpy(x, name: str) -> np.ndarray:
    kind = array_kind(x, name)
    if kind == "numpy":
        return x
    if kind == "cupy":
        return x.get()
    if kind == "foreign_host":
        return np.from_dlpack(x)
    return to_cupy(x, name).get()


def to_cupy(x, name: str):
    cupy = _cupy()
    kind = array_kind(x, name)
    if kind == "cupy":
        return x
    if kind in ("numpy", "foreign_host"):
        return cupy.asarray(to_numpy(x, name))
    if hasattr(x, "__dlpack__"):
        return cupy.from_dlpack(x)
    return cupy.asarray(x)


def check_dtype(arrays: dict) -> np.dtype:
    """The one dtype shared by all arrays in ``arrays`` ({name: array})."""
    first_name, first = next(iter(arrays.items()))
    try:
        name = dtype_name(first.dtype)
    except (TypeError, ValueError):
        raise TypeError(f"{first_name} has dtype {first.dtype}; expected one of "
                        f"{', '.join(SUPPORTED)}") from None
    for other_name, other in arrays.items():
        if np.dtype(other.dtype) != SUPPORTED[name]:
            raise TypeError(f"{other_name} has dtype {other.dtype} but {first_name} has {first.dtype}; "
                            "q, k, v (and do, o) must share one dtype")
    return SUPPORTED[name]


def check_qkv_shapes(q, k, v) -> tuple[int, int, int, int, int, int]:
    """(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim) after checking the layouts."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, nheads, headdim); "
                             f"got shape {tuple(x.shape)}")
    batch, seqlen_q, nheads, headdim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[0] != batch:
        raise ValueError(f"q and k must have the same batch size; got {batch} and {k.shape[0]}")
    if k.shape[3] != headdim:
        raise ValueError(f"q and k must have the same headdim; got {headdim} and {k.shape[3]} "
                         "(a v headdim different from q/k is not supported)")
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    if not 1 <= headdim <= MAX_HEADDIM:
        raise ValueError(f"headdim must be between 1 and {MAX_HEADDIM}; got {headdim}")
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        raise ValueError(f"nheads of q ({nheads}) must be a positive multiple of nheads of k/v "
                         f"({nheads_kv}) (GQA/MQA)")
    return batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim


def resolve_scale(softmax_scale, headdim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(headdim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None; got {type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale must be finite and > 0; got {softmax_scale}")
    return scale


def check_flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool; got {type(value).__name__}")
    return bool(value)


def check_backend(backend) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}; got {backend!r}")
    return backend


def check_backward_arrays(do, o, lse, q_shape, dtype):
    """Shapes and dtypes of the backward's extra inputs."""
    batch, seqlen_q, nheads, _ = q_shape
    for name, x in (("do", do), ("o", o)):
        if tuple(x.shape) != tuple(q_shape):
            raise ValueError(f"{name} must have the shape of q {tuple(q_shape)}; got {tuple(x.shape)}")
        if np.dtype(x.dtype) != dtype:
            raise TypeError(f"{name} must have the dtype of q ({dtype}); got {x.dtype}")
    expected = (batch, nheads, seqlen_q)
    if tuple(lse.shape) != expected:
        raise ValueError(f"lse must have shape (batch, nheads, seqlen_q) = {expected}; got {tuple(lse.shape)}")
    if np.dtype(lse.dtype) != lse_dtype(dtype):
        raise TypeError(f"lse must have dtype {lse_dtype(dtype)} for {dtype} inputs; got {lse.dtype}")


def same_device(arrays: dict) -> None:
    """All CuPy arrays on one device, and that device current."""
    devices = {name: x.device.id for name, x in arrays.items() if hasattr(x, "device") and hasattr(x.device, "id")}
    if len(set(devices.values())) > 1:
        raise ValueError("all arrays must be on the same GPU; got "
                         + ", ".join(f"{n} on device {d}" for n, d in devices.items()))


def last_dim_contiguous(x):
    """x itself when its last dimension is contiguous, else a C-contiguous copy."""
    if x.shape[-1] <= 1 or x.strides[-1] == x.itemsize:
        return x
    xp = np if isinstance(x, np.ndarray) else _cupy()
    return xp.ascontiguousarray(x)

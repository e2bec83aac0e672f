"""Argument checking and array conversion, before anything is launched.

Every error names the argument and what was expected. Arrays come in three kinds: CuPy (results
stay CuPy, on the current stream), NumPy (results come back as NumPy), and foreign arrays exposing
``__dlpack__`` / ``__cuda_array_interface__`` such as torch or JAX: device arrays are taken
zero-copy and give CuPy results, host arrays are taken as NumPy and give NumPy results.
"""
from __future__ import annotations

import math
import numbers

import ml_dtypes
import numpy as np

from . import capture
from ._dtypes import SUPPORTED, bfloat16, dtype_name, lse_dtype

MAX_HEADDIM = 256
BACKENDS = ("auto", "cuda", "simt", "mma", "numpy")
LOG2E = 1.4426950408889634
_DEVICE_DLPACK = (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged


def _cupy():
    try:
        import cupy
    except ImportError:  # pragma: no cover - depends on the install
        return None
    return cupy


def array_kind(x, name: str) -> str:
    """'cupy', 'numpy', 'foreign' (device) or 'foreign_host'; TypeError for things that are not
    arrays, and for masked arrays."""
    cupy = _cupy()
    if cupy is not None and isinstance(x, cupy.ndarray):
        return "cupy"
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(f"{name} is a NumPy masked array; attention has no use for a mask of elements: "
                        f"pass {name}.filled(value) or {name}.data")
    if isinstance(x, np.ndarray):
        return "numpy"
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        return "foreign" if int(x.__dlpack_device__()[0]) in _DEVICE_DLPACK else "foreign_host"
    if hasattr(x, "__cuda_array_interface__"):
        return "foreign"
    raise TypeError(f"{name} must be an array (NumPy, CuPy, or DLPack / CUDA-array-interface capable), "
                    f"got {type(x).__name__}")


def _torch_tensor(x):
    """torch itself when ``x`` is a torch tensor, else None (torch is never imported otherwise)."""
    if type(x).__module__.split(".")[0] != "torch":
        return None
    import torch

    return torch if isinstance(x, torch.Tensor) else None


def _from_dlpack(from_dlpack, x, name: str):
    """``from_dlpack(x)``, with the failures of an unsupported dtype named after the argument.
    torch's bfloat16 goes through an int16 view of the same bits (NumPy's DLPack has no bfloat16)."""
    torch = _torch_tensor(x)
    if torch is not None and x.requires_grad:
        raise TypeError(f"{name} is a torch tensor that requires grad; pass {name}.detach() "
                        "(cupyflash.torch has the differentiable functions)")
    try:
        if torch is not None and x.dtype == torch.bfloat16:
            return from_dlpack(x.view(torch.int16)).view(bfloat16)
        return from_dlpack(x)
    except (BufferError, RuntimeError, TypeError, ValueError) as error:
        dtype = getattr(x, "dtype", "unknown")
        raise TypeError(f"{name} (a {type(x).__name__} of dtype {dtype}) cannot be taken through "
                        f"DLPack ({error}); expected one of {', '.join(SUPPORTED)}") from None


def _native_byte_order(x: np.ndarray) -> np.ndarray:
    return x if x.dtype.isnative else x.astype(x.dtype.newbyteorder("="))


def take_array(x, name: str, kind: str):
    """``x`` as a NumPy array (host kinds, in native byte order) or a CuPy array (device kinds),
    without copying anything that need not be."""
    if kind == "numpy":
        return _native_byte_order(x)
    if kind == "foreign_host":
        return _native_byte_order(_from_dlpack(np.from_dlpack, x, name))
    if kind == "cupy":
        return x
    cupy = _cupy()
    if hasattr(x, "__dlpack__"):
        return _from_dlpack(cupy.from_dlpack, x, name)
    return cupy.asarray(x)


def to_numpy(x, name: str) -> np.ndarray:
    x = take_array(x, name, array_kind(x, name))
    return x if isinstance(x, np.ndarray) else x.get()


def to_cupy(x, name: str):
    x = take_array(x, name, array_kind(x, name))
    return _cupy().asarray(x) if isinstance(x, np.ndarray) else x


def check_dtype(arrays: dict) -> np.dtype:
    """The one dtype shared by all arrays in ``arrays`` ({name: array}), each of a supported dtype."""
    for name, x in arrays.items():
        try:
            dtype_name(x.dtype)
        except (TypeError, ValueError):
            raise TypeError(f"{name} has dtype {x.dtype}; expected one of {', '.join(SUPPORTED)}") from None
    first_name, first = next(iter(arrays.items()))
    for other_name, other in arrays.items():
        if np.dtype(other.dtype) != np.dtype(first.dtype):
            raise TypeError(f"{other_name} has dtype {other.dtype} but {first_name} has {first.dtype}; "
                            "q, k, v (and do, o) must share one dtype")
    return SUPPORTED[dtype_name(first.dtype)]


def check_qkv_shapes(q, k, v) -> tuple[int, int, int, int, int, int]:
    """(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim) after checking the layouts; headdim
    is q's and k's. v may have another head dim (``headdim_v``), which o (and do) then have."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, nheads, headdim); "
                             f"got shape {tuple(x.shape)}")
    batch, seqlen_q, nheads, headdim = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same (batch, seqlen, nheads); got k {tuple(k.shape)} and "
                         f"v {tuple(v.shape)}")
    if k.shape[0] != batch:
        raise ValueError(f"q and k must have the same batch size; got {batch} and {k.shape[0]}")
    if k.shape[3] != headdim:
        raise ValueError(f"q and k must have the same headdim; got {headdim} and {k.shape[3]} "
                         "(v's may differ)")
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    for name, d in (("headdim", headdim), ("headdim of v", v.shape[3])):
        if not 1 <= d <= MAX_HEADDIM:
            raise ValueError(f"{name} must be between 1 and {MAX_HEADDIM}; got {d}")
    if nheads_kv == 0 and nheads != 0 or nheads_kv != 0 and nheads % nheads_kv != 0:
        raise ValueError(f"nheads of q ({nheads}) must be a multiple of nheads of k/v ({nheads_kv}) "
                         "(GQA/MQA); k/v may have 0 heads only when q has 0")
    return batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim


def resolve_scale(softmax_scale, headdim: int) -> float:
    """The scale as a float: None means 1/sqrt(headdim); any finite real number (Python, NumPy
    scalar, or 0-d NumPy / CuPy array; a CuPy one is read back to the host) is taken as it is."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(headdim)
    value = softmax_scale
    cupy = _cupy()
    if isinstance(value, (np.generic, np.ndarray)) or cupy is not None and isinstance(value, cupy.ndarray):
        dtype = np.dtype(value.dtype)
        if value.ndim != 0 or not (dtype.kind in "iuf" or dtype == bfloat16):
            raise TypeError(f"softmax_scale must be a real number or None; got {type(value).__name__} of dtype "
                            f"{dtype} and shape {tuple(value.shape)}")
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number or None; got {type(value).__name__}")
    try:
        scale = float(value)
    except OverflowError:
        raise ValueError("softmax_scale must be finite; got an int too large for a float") from None
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite; got {softmax_scale}")
    return scale


def _max_abs(x) -> float:
    """max |x| of a NumPy or CuPy array, as a float (for CuPy, a device synchronisation)."""
    def to_host(scalar):
        return scalar.get() if hasattr(scalar, "get") else scalar  # CuPy 0-d array: the sync

    if x.dtype.itemsize == 2:
        # |x| of a 16-bit float orders like its bits with the sign cleared: one integer reduction,
        # no 16-bit float arithmetic needed of the array library.
        bits = to_host((x.view(np.uint16) & np.uint16(0x7FFF)).max())
        return float(np.asarray(bits, dtype=np.uint16).view(x.dtype))
    return float(to_host(abs(x).max()))


def check_scores_fit(q, k, scale: float) -> None:
    """ValueError when ``scale`` can push a score outside the range of the kernels' score
    arithmetic (float32; float64 for float64 inputs).

    The kernels form s = scale log2(e) q·k (the SIMT ones scale q first). With a = |scale| log2(e),
    |s| <= a max|q| max(headdim max|k|, 1). Nothing is read from the arrays unless a > 1 and the
    largest values of the dtype could overflow; only then one max-abs reduction of q and of k is
    made (for device arrays a synchronisation, which cupyflash.capture's modes skip). The ordinary
    call (scale 1/sqrt(headdim) with headdim >= 3, or float16 at any reasonable scale) reads nothing.
    """
    headdim = q.shape[-1]
    limit = float(np.finfo(lse_dtype(q.dtype)).max)
    amplification = abs(scale) * LOG2E
    if amplification <= 1.0:
        return
    if amplification > limit:
        raise ValueError(f"softmax_scale={scale:g}: softmax_scale * log2(e) exceeds the largest "
                         f"{lse_dtype(q.dtype)} ({limit:.3g}), the kernels' score arithmetic")
    dtype_max = float(ml_dtypes.finfo(q.dtype).max)
    if amplification * dtype_max * max(headdim * dtype_max, 1.0) <= limit or q.size == 0 or k.size == 0:
        return
    if not (isinstance(q, np.ndarray) and isinstance(k, np.ndarray)) and not capture.reads_allowed():
        return  # cupyflash.capture: device values are not read back, as flash-attn never reads them
    bound = amplification * _max_abs(q) * max(headdim * _max_abs(k), 1.0)
    if bound > limit:
        raise ValueError(f"softmax_scale={scale:g} can overflow the {lse_dtype(q.dtype)} scores of these "
                         f"inputs: |softmax_scale| * log2(e) * max|q| * headdim * max|k| = {bound:.3g} > "
                         f"{limit:.3g}; use a smaller softmax_scale or inputs of smaller magnitude")


def check_flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool; got {type(value).__name__}")
    return bool(value)


def check_backend(backend) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}; got {backend!r}")
    return backend


def check_backward_arrays(do, o, lse, out_shape, dtype):
    """Shapes and dtypes of the backward's extra inputs; ``out_shape`` is the forward output's,
    q's (batch, seqlen_q, nheads) and v's headdim."""
    batch, seqlen_q, nheads, _ = out_shape
    for name, x in (("do", do), ("o", o)):
        if tuple(x.shape) != tuple(out_shape):
            raise ValueError(f"{name} must have the output's shape (q's batch, seqlen, nheads and v's headdim) "
                             f"{tuple(out_shape)}; got {tuple(x.shape)}")
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

"""The four supported dtypes, by name. bfloat16 is ml_dtypes' type (NumPy and CuPy >= 14 share it)."""
from __future__ import annotations

import ml_dtypes
import numpy as np

bfloat16 = np.dtype(ml_dtypes.bfloat16)

SUPPORTED = {
    "float16": np.dtype(np.float16),
    "bfloat16": bfloat16,
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}


def dtype_name(dtype) -> str:
    """'float16' | 'bfloat16' | 'float32' | 'float64'; ValueError for anything else."""
    dt = np.dtype(dtype)
    for name, supported in SUPPORTED.items():
        if dt == supported:
            return name
    raise ValueError(f"unsupported dtype {dt}; expected one of {', '.join(SUPPORTED)}")


def is_float64(dtype) -> bool:
    return np.dtype(dtype) == SUPPORTED["float64"]


def is_16bit(dtype) -> bool:
    return np.dtype(dtype) in (SUPPORTED["float16"], SUPPORTED["bfloat16"])


def lse_dtype(dtype) -> np.dtype:
    """lse and the backward's D are float64 for float64 inputs, float32 otherwise."""
    return np.dtype(np.float64) if is_float64(dtype) else np.dtype(np.float32)

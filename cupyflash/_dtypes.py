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


SHORT_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}
_SPELLINGS = {**{name: name for name in SUPPORTED}, **{s: n for n, s in SHORT_NAMES.items()}}


def parse_dtype_name(text: str, allowed=tuple(SUPPORTED)) -> str:
    """The supported dtype a command line spells as ``text`` ('bf16' or 'bfloat16', any case),
    by its full name; ValueError, naming what ``allowed`` accepts, for anything else."""
    name = _SPELLINGS.get(text.strip().lower())
    if name is None or name not in allowed:
        choices = ", ".join(f"{SHORT_NAMES[n]} ({n})" for n in allowed)
        raise ValueError(f"unknown dtype {text!r} (choose from {choices})")
    return name


def dtype_argument(allowed=tuple(SUPPORTED)):
    """An argparse ``type=`` for a dtype option: the full name of the dtype given, or a usage
    error naming the option."""
    import argparse

    def parse(text: str) -> str:
        try:
            return parse_dtype_name(text, allowed)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = "dtype"  # argparse names the type in some of its messages
    return parse

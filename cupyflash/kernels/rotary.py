"""Launcher of ``kernels_cu/flash_rotary.cu``: rotary position embeddings of the rows of q or of the
new keys of flash_attn_with_kvcache, one launch a tensor (cupyflash/rotary.py has the definition,
the positions and the NumPy form this equals bit for bit)."""
from __future__ import annotations

import numpy as np

from .._dtypes import dtype_name
from ._module import Specialization, launch
from .constants import CTYPES, SHORT_NAMES
from .params import ROTARY_PARAMS, pointer, set_rows

__all__ = ["THREADS", "specialization", "specializations", "rotate"]

THREADS = 64  # flash_rotary.cu's ROTARY_THREADS


def specialization(dtype, interleaved: bool) -> Specialization:
    name = dtype_name(dtype)
    pairs = "interleaved" if interleaved else "halves"
    return Specialization(f"flash_rotary_{SHORT_NAMES[name]}_{pairs}", "flash_rotary.cu",
                          f"cf::flash_rotary<{CTYPES[name]}, {'true' if interleaved else 'false'}>", THREADS, 0)


def specializations() -> list[Specialization]:
    """Every rotary kernel (for the compile check)."""
    return [specialization(dtype, interleaved) for dtype in CTYPES for interleaved in (True, False)]


def rotate(x, cos, sin, starts, *, per_token: bool, interleaved: bool):
    """x (batch, tokens, heads, headdim), a CuPy array with a contiguous last dimension, turned into
    a new C-contiguous array: row (b, t) at position starts[b] + t (``per_token``) or starts[b].
    cos, sin: (rows, half) C-contiguous of x's dtype; starts: (batch,) int32; on the current stream.
    The positions are taken as given (the caller checked that they lie in the tables)."""
    import cupy

    batch, tokens, heads, headdim = x.shape
    out = cupy.empty(x.shape, x.dtype)
    if batch * tokens * heads == 0:
        return out
    if x.strides[3] != x.itemsize or not (cos.flags.c_contiguous and sin.flags.c_contiguous):
        raise ValueError("cupyflash: rotate takes x with a contiguous last dimension and C-contiguous tables")
    params = np.zeros(1, ROTARY_PARAMS)
    set_rows(params, "x", x)
    set_rows(params, "out", out)
    params["cos"], params["sin"], params["starts"] = pointer(cos), pointer(sin), pointer(starts)
    params["batch"], params["tokens"], params["heads"] = np.int32(batch), np.int32(tokens), np.int32(heads)
    params["headdim"], params["half"] = np.int32(headdim), np.int32(cos.shape[1])
    params["per_token"] = np.int32(bool(per_token))
    launch(specialization(x.dtype, interleaved), (batch * tokens, heads, 1), (params,))
    return out

"""How float32 products are formed: ``precision="ieee"`` (the default) or ``"tf32"``, PyTorch's names.

The float32 forward runs on tensor cores (``kernels_cu/flash_fwd_tf32.cu``; on sm_90 at head dims up
to 64, ``kernels_cu/flash_fwd_tf32_wgmma_ws.cu``), whose float32 input format is tf32: 10 explicit
mantissa bits instead of 23.

- ``"ieee"``: products as precise as float32's. Each operand is split, x = hi + lo with
  hi = tf32(x), and each product is formed as three tf32 products (hi·hi + hi·lo + lo·hi, float32
  accumulation), whose error is of the order of float32's own rounding (docs/algorithm.md,
  "float32 on tensor cores"). The tensor core's accumulation of them is not round to nearest:
  measured on the H200 the forward's error is 8-14x standard float32 attention's at 1k keys,
  within the library's float32 tolerance (docs/perf-log.md, "tf32-fwd-v1"); the shipped rows
  sum them apart: 0.74-1.08x at head dims 64 and 128 ("tf32-fwd-v3"), 0.62-0.67x on sm_90's
  wgmma row ("tf32-wgmma-route").
- ``"tf32"``: one product on operands rounded to tf32, about three times the speed, with the error
  of 11-bit operands (relative 2^-11 per operand, as float16's mantissa).

The precision is a permission, as in PyTorch: a path that computes in float32 on CUDA cores
(the SIMT family, the NumPy twin's "ieee") is at least as accurate as asked, and so is the float32
backward, whose products are three tf32 products of split operands whichever is asked.
Other dtypes ignore it: float16 and bfloat16 products are exact in their kernels' float32
accumulators, float64 runs in float64.
"""
from __future__ import annotations

import numpy as np

PRECISIONS = ("ieee", "tf32")
DEFAULT = "ieee"

# tf32 products per float32 product, the kernels' PRODUCTS template argument.
PRODUCTS = {"ieee": 3, "tf32": 1}


def check_precision(precision) -> str:
    """``precision`` checked ("ieee", "tf32"; None: "ieee")."""
    if precision is None:
        return DEFAULT
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"cupyflash: precision must be one of {PRECISIONS} (or None: {DEFAULT!r}), "
                         f"got {precision!r}")
    return precision


def rounds_operands(precision: str, dtype) -> bool:
    """Whether a call's products take operands rounded to tf32: precision "tf32" on float32 inputs
    (the NumPy twin's rule; the kernels' is their plan's PRODUCTS)."""
    return precision == "tf32" and np.dtype(dtype) == np.float32


def round_tf32(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to tf32 (to nearest, ties away from zero, as cvt.rna.tf32.f32 and the
    kernels' rounding), returned as float32 with their 13 low mantissa bits zero."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    finite = (bits & np.uint32(0x7F800000)) != np.uint32(0x7F800000)
    rounded = np.where(finite, (bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000), bits)
    return rounded.astype(np.uint32).view(np.float32).reshape(np.shape(x))

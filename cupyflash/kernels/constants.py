"""What the kernels' launchers and plans share: the C++ element type and the short name of each
dtype, the head-dim tiles of each family, and log2(e) (the kernels compute exp(x) as
exp2(x log2 e), so the softmax scale reaches them multiplied by it)."""
from __future__ import annotations

from .._dtypes import SHORT_NAMES

__all__ = ["CTYPES", "SHORT_NAMES", "SIXTEEN_BIT", "LOG2E", "TENSOR_CORE_D_TILES", "DMMA_D_TILES", "SIMT_D_TILES",
           "d_tile"]

CTYPES = {"float16": "cf::half_t", "bfloat16": "cf::bf16_t", "float32": "float", "float64": "double"}
SIXTEEN_BIT = ("float16", "bfloat16")  # the tensor-core families' dtypes, in specialization order

LOG2E = 1.4426950408889634

TENSOR_CORE_D_TILES = (64, 128, 256)
# float64 on tensor cores (flash_fwd_dmma): Q fragments and O accumulators take D / 2 registers
# each, so 256 does not fit
DMMA_D_TILES = (16, 32, 64, 128)
SIMT_D_TILES = (16, 32, 64, 128, 256)


def d_tile(headdim: int, d_tiles=TENSOR_CORE_D_TILES) -> int:
    """The smallest of ``d_tiles`` that holds ``headdim``."""
    for t in d_tiles:
        if headdim <= t:
            return t
    raise ValueError(f"cupyflash: headdim {headdim} > {d_tiles[-1]}")

"""The shared window as the models hold it: one float64 slot per 16-bit element, NaN where never
written; the aligned base the kernels start their tiles from; 32-bit fragment stores and loads."""
from __future__ import annotations

import numpy as np

from .wgmma import panel_offset

SMEM_WINDOW = 1 << 18  # bytes of shared window that smem_desc keeps (addr & 0x3FFFF)
RAW_SMEM = 400  # where dynamic shared memory starts: any value; the kernels align up to 1024


def aligned_base(raw: int) -> int:
    return (raw + 1023) & ~1023


def st_shared_b32(smem, addr: np.ndarray, pair: np.ndarray) -> None:
    smem[addr // 2] = pair[:, 0]
    smem[addr // 2 + 1] = pair[:, 1]


def ld_shared_b32(smem, addr: np.ndarray) -> np.ndarray:
    return np.stack([smem[addr // 2], smem[addr // 2 + 1]], axis=1)


def new_smem() -> np.ndarray:
    """The shared window, one float64 slot per 16-bit element; NaN marks a slot never written."""
    return np.full(SMEM_WINDOW // 2, np.nan)


def store_panels(smem, tile: int, values: np.ndarray) -> None:
    """A logical ROWS x COLS tile stored chunk by chunk at panel_offset (what cp_async_panels and
    the fragment stores build)."""
    rows, cols = values.shape
    for r in range(rows):
        for c in range(cols // 8):
            o = (tile + panel_offset(rows, r, c)) // 2
            smem[o: o + 8] = values[r, 8 * c: 8 * c + 8]


def load_panels(smem, tile: int, rows: int, cols: int) -> np.ndarray:
    return np.array([[smem[(tile + panel_offset(rows, r, c)) // 2 + i] for c in range(cols // 8) for i in range(8)]
                     for r in range(rows)])

"""The kernels' mask policy, kernels_cu/mask.cuh, in the form the kernels ask it."""
from __future__ import annotations

from typing import NamedTuple

from cupyflash import masks

from .mirrors import mirrors


@mirrors("mask.cuh",
         "return i < seqlen_q && j < seqlen_k && (!RIGHT || j <= i + hi_off) && (!LEFT || j >= i + lo_off);",
         "return m0 + rows > seqlen_q || n0 + cols > seqlen_k || (RIGHT && n0 + cols - 1 > m0 + hi_off) ||",
         "(LEFT && n0 < m0 + rows - 1 + lo_off);")
@mirrors("mask.cuh",
         "return i < seqlen_q && j < seqlen_k && (!RIGHT || j <= i + hi_off) && (!LEFT || j >= i + lo_off);")
class MaskPolicy(NamedTuple):
    """The kernels' mask policy (mask.cuh) for one problem, from its Python twin cupyflash.masks:
    element test and partial-block test in the kernel's form."""
    mask: masks.Mask
    seqlen_q: int
    seqlen_k: int

    def __call__(self, m, n):
        lo, hi = self.mask.offsets(self.seqlen_q, self.seqlen_k)
        ok = (m < self.seqlen_q) & (n < self.seqlen_k)
        if self.mask.HAS_RIGHT:
            ok = ok & (n <= m + hi)
        if self.mask.HAS_LEFT:
            ok = ok & (n >= m + lo)
        return ok

    def partial(self, m0: int, bm: int, n0: int, bn: int) -> bool:
        return self.mask.partial(m0, bm, n0, bn, self.seqlen_q, self.seqlen_k)

"""Register-fragment helpers shared by the kernels (mma_bwd.cuh, online_softmax.cuh)."""
from __future__ import annotations

import numpy as np

from .mirrors import mirrors


@mirrors("mma_bwd.cuh",
         "a[kk][0] = pack2<T>(c[2 * kk][0], c[2 * kk][1]);",
         "a[kk][1] = pack2<T>(c[2 * kk][2], c[2 * kk][3]);",
         "a[kk][2] = pack2<T>(c[2 * kk + 1][0], c[2 * kk + 1][1]);",
         "a[kk][3] = pack2<T>(c[2 * kk + 1][2], c[2 * kk + 1][3]);")
def pack_a_frags(c: np.ndarray) -> np.ndarray:
    """a[thread, kk, reg, half] from accumulators c[thread, j, e] (pack2: first value low). The
    16-bit rounding is left out: the model computes in float64. online_softmax.cuh's pack_p is
    the same packing (one strip)."""
    a = np.empty((c.shape[0], c.shape[1] // 2, 4, 2))
    for kk in range(c.shape[1] // 2):
        a[:, kk, 0] = c[:, 2 * kk, 0:2]
        a[:, kk, 1] = c[:, 2 * kk, 2:4]
        a[:, kk, 2] = c[:, 2 * kk + 1, 0:2]
        a[:, kk, 3] = c[:, 2 * kk + 1, 2:4]
    return a


mirrors("online_softmax.cuh",
        "p[i][kk][0] = pack2<T>(s[i][2 * kk][0], s[i][2 * kk][1]);",
        "p[i][kk][1] = pack2<T>(s[i][2 * kk][2], s[i][2 * kk][3]);",
        "p[i][kk][2] = pack2<T>(s[i][2 * kk + 1][0], s[i][2 * kk + 1][1]);",
        "p[i][kk][3] = pack2<T>(s[i][2 * kk + 1][2], s[i][2 * kk + 1][3]);")(pack_a_frags)


@mirrors("softmax_bwd.cuh", "return exp2_approx(min0_keep_nan(fmaf(s, scale_log2, -base_log2)));")
def recomputed_p(s, scale_log2, base_log2):
    """The backward's P from a raw score and the row's base (lse in log2 units): the exponent is
    clamped at 0 (P <= 1 whatever the rounding of lse's round trip); NaN stays NaN."""
    return np.exp2(np.minimum(s * scale_log2 - base_log2, 0.0))


@mirrors("softmax_bwd.cuh", "return exp2_(min0_keep_nan(log2_score(s, scale_log2) - top)) * weight;")
def recomputed_p_exact(s, scale_log2, top, weight):
    """The SIMT kernels' P: the score in log2 units rounded on its own (no FMA), its exponent
    against the row's top clamped at 0, times the row's weight (RowStats: 1 for a saved lse)."""
    return np.exp2(np.minimum((s * scale_log2) - top, 0.0)) * weight


@mirrors("mma_bwd.cuh", "return lse == neg_inf<float>() ? 0.f : lse * 1.4426950408889634f;")
def lse_base_log2(lse):
    return np.where(lse == -np.inf, 0.0, lse * 1.4426950408889634)

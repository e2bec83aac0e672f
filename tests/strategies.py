"""Hypothesis strategies for attention problems, shared by the CPU and GPU tests."""
from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

DTYPES = tuple(np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64))

# Favourite values, drawn about half the time: head dims the kernels specialise on (and odd ones
# that pad), sequence lengths just off tile multiples and tiny ones.
HEADDIMS = (1, 8, 40, 64, 72, 96, 128, 200, 256)
SEQLENS = (1, 2, 3, 5, 17, 31, 63, 65, 100, 127, 129, 191, 257, 300)
MAX_SEQLEN = 300

# Score standard deviation std(scale * q.k) = scale * magnitude^2 * sqrt(headdim) is capped by
# lowering the magnitude. At 8, rows still swing by tens of units between key blocks (the online
# softmax rescales hard) and many rows are nearly one-hot; beyond it the softmax is an argmax
# whose float32 result is exact only to eps * |S|, and tolerance.py's float32 bound assumes the cap.
MAX_LOGIT_STD = 8.0

# batch * nheads * seqlen_q * seqlen_k * headdim; keeps one CPU example (reference, baseline and
# NumPy twin, forward and backward) well under 0.3 s.
CPU_MAX_COST = 2.5e7


@dataclass(frozen=True)
class AttentionCase:
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads_kv: int
    group: int  # query heads per kv head
    headdim: int
    causal: bool
    softmax_scale: float | None  # None: the default 1 / sqrt(headdim)
    magnitude: float  # standard deviation of every input
    dtype: np.dtype
    seed: int

    @property
    def nheads(self) -> int:
        return self.nheads_kv * self.group

    @property
    def scale(self) -> float:
        """The softmax scale in effect."""
        return 1.0 / math.sqrt(self.headdim) if self.softmax_scale is None else self.softmax_scale

    @property
    def cost(self) -> int:
        return self.batch * self.nheads * self.seqlen_q * self.seqlen_k * self.headdim


def _favourite_or_any(favourites, upper: int):
    """An integer in [1, upper], half the time one of ``favourites``."""
    return st.one_of(
        st.sampled_from([f for f in favourites if f <= upper] or [1]),
        st.integers(1, upper),
    )


@st.composite
def attention_case(
    draw, *, dtypes=DTYPES, max_cost=CPU_MAX_COST, max_seqlen=MAX_SEQLEN, max_headdim=256
):
    """An AttentionCase with 1 <= seqlens <= max_seqlen and, when max_cost >= max_seqlen^2,
    batch * nheads * seqlen_q * seqlen_k * headdim <= max_cost. Seqlens are drawn first (the
    tiling is the interesting part), then headdim, batch and heads within what the cost bound
    leaves."""
    dtype = draw(st.sampled_from(dtypes))
    causal = draw(st.booleans())
    seqlen_q = draw(_favourite_or_any(SEQLENS, max_seqlen))
    seqlen_k = draw(_favourite_or_any(SEQLENS, max_seqlen))
    budget = max(int(max_cost) // (seqlen_q * seqlen_k), 1)
    headdim = draw(_favourite_or_any(HEADDIMS, min(max_headdim, budget)))
    budget = max(budget // headdim, 1)
    batch = draw(st.integers(1, min(3, budget)))
    budget = max(budget // batch, 1)
    nheads_kv = draw(st.integers(1, min(3, budget)))
    group = draw(st.integers(1, min(3, max(budget // nheads_kv, 1))))
    softmax_scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0)))
    magnitude = draw(st.floats(0.1, 4.0))
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else softmax_scale
    magnitude = min(magnitude, math.sqrt(MAX_LOGIT_STD / (scale * math.sqrt(headdim))))
    seed = draw(st.integers(0, 2**32 - 1))
    return AttentionCase(
        batch, seqlen_q, seqlen_k, nheads_kv, group, headdim, causal, softmax_scale, magnitude,
        np.dtype(dtype), seed,
    )


def make_inputs(case: AttentionCase):
    """(q, k, v, do): NumPy arrays of case.dtype, standard normal times case.magnitude."""
    rng = np.random.default_rng(case.seed)
    q_shape = (case.batch, case.seqlen_q, case.nheads, case.headdim)
    kv_shape = (case.batch, case.seqlen_k, case.nheads_kv, case.headdim)
    return tuple(
        (rng.standard_normal(shape) * case.magnitude).astype(case.dtype)
        for shape in (q_shape, kv_shape, kv_shape, q_shape)
    )

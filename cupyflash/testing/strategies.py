"""Hypothesis strategies for attention problems: the ones cupyflash's own tests draw from.

    from hypothesis import given
    from cupyflash.testing import assert_attention_close
    from cupyflash.testing.strategies import attention_problems

    @given(attention_problems(dtypes=["float16"], max_seqlen=128))
    def test_my_attention(problem):
        q, k, v, do = problem.arrays()
        o = my_attention(q, k, v, causal=problem.causal, softmax_scale=problem.scale)
        assert_attention_close(problem, o)

Needs Hypothesis (``pip install hypothesis``); ``import cupyflash.testing`` alone does not.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

try:
    from hypothesis import strategies as st
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("cupyflash.testing.strategies needs Hypothesis: pip install hypothesis") from exc

from .problem import DTYPES, AttentionProblem, as_dtype

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


def _favourite_or_any(favourites, lower: int, upper: int):
    """An integer in [lower, upper], half the time one of ``favourites``."""
    upper = max(upper, lower)
    return st.one_of(
        st.sampled_from([f for f in favourites if lower <= f <= upper] or [lower]),
        st.integers(lower, upper),
    )


def _check_range(name, bounds, lowest):
    low, high = bounds
    if not lowest <= low <= high:
        raise ValueError(f"{name} must satisfy {lowest} <= low <= high, got {bounds}")


def attention_problems(
    *,
    dtypes: Sequence = DTYPES,
    causal: bool | None = None,
    windows: bool = False,
    min_seqlen: int = 1,
    max_seqlen: int = MAX_SEQLEN,
    same_seqlens: bool = False,
    headdims: Sequence[int] | None = None,
    max_headdim: int = 256,
    max_batch: int = 3,
    max_heads_kv: int = 3,
    max_group: int = 3,
    scales: tuple[float, float] | None = (0.05, 2.0),
    magnitudes: tuple[float, float] = (0.1, 4.0),
    max_logit_std: float | None = MAX_LOGIT_STD,
    max_cost: float = CPU_MAX_COST,
):
    """AttentionProblems within the given bounds.

    - ``dtypes``: NumPy dtypes or the names 'float16', 'bfloat16', 'float32', 'float64'.
    - ``causal``: None draws both; True or False fixes it.
    - ``windows``: also draw a local-attention ``window_size`` (left, right), each side -1
      (unbounded) or 0..max(seqlen_q, seqlen_k); right is 0 where causal. Off: (-1, -1).
    - Sequence lengths in [min_seqlen, max_seqlen] (0 allowed), half the time one just off a
      tile multiple; ``same_seqlens``: seqlen_k = seqlen_q.
    - Head dim in [1, max_headdim], or one of ``headdims`` if given.
    - batch in [1, max_batch]; nheads_kv in [1, max_heads_kv] kv heads, each shared by a group
      of [1, max_group] query heads (GQA; max_group=1 for none).
    - ``softmax_scale``: None (the default 1 / sqrt(headdim)) or a float in ``scales``;
      scales=None: always the default. ``problem.scale`` is the one in effect either way.
    - Inputs' standard deviation in ``magnitudes``, lowered where the scores' standard deviation
      scale * magnitude^2 * sqrt(headdim) would exceed ``max_logit_std`` (None: no cap). The
      float32/float64 bounds of ``cupyflash.testing.tolerance`` assume the default cap.
    - batch * nheads * seqlen_q * seqlen_k * headdim <= max_cost where the lower bounds leave room:
      the sequence lengths are drawn first (the tiling is the interesting part), then headdim,
      batch and heads within what the cost bound leaves.

    Inputs come from ``problem.arrays()``, standard normal draws from a seed that Hypothesis
    chooses (so it shrinks towards small problems, never towards all-zero inputs).
    """
    dtypes = [as_dtype(d) for d in dtypes]
    if not dtypes:
        raise ValueError("dtypes is empty")
    _check_range("(min_seqlen, max_seqlen)", (min_seqlen, max_seqlen), 0)
    _check_range("magnitudes", magnitudes, 0)
    if magnitudes[0] <= 0:
        raise ValueError(f"magnitudes must be positive (zero inputs test nothing), got {magnitudes}")
    if scales is not None:
        _check_range("scales", scales, 0)
    if min(max_headdim, max_batch, max_heads_kv, max_group) < 1:
        raise ValueError("max_headdim, max_batch, max_heads_kv and max_group must be >= 1")
    if headdims is not None and (not headdims or min(headdims) < 1):
        raise ValueError(f"headdims must be positive integers, got {headdims}")

    return _attention_problems(
        dtypes, causal, windows, min_seqlen, max_seqlen, same_seqlens,
        None if headdims is None else tuple(headdims), max_headdim, max_batch, max_heads_kv,
        max_group, scales, magnitudes, max_logit_std, max_cost,
    )


@st.composite
def _attention_problems(draw, dtypes, causal, windows, min_seqlen, max_seqlen, same_seqlens,
                        headdims, max_headdim, max_batch, max_heads_kv, max_group, scales,
                        magnitudes, max_logit_std, max_cost):
    dtype = draw(st.sampled_from(dtypes))
    causal = draw(st.booleans() if causal is None else st.just(bool(causal)))
    seqlen_q = draw(_favourite_or_any(SEQLENS, min_seqlen, max_seqlen))
    seqlen_k = seqlen_q if same_seqlens else draw(_favourite_or_any(SEQLENS, min_seqlen, max_seqlen))
    budget = max(int(max_cost) // max(seqlen_q * seqlen_k, 1), 1)
    if headdims is None:
        headdim = draw(_favourite_or_any(HEADDIMS, 1, min(max_headdim, budget)))
    else:
        fitting = [d for d in headdims if d <= min(max_headdim, budget)]
        headdim = draw(st.sampled_from(fitting or [min(headdims)]))
    budget = max(budget // headdim, 1)
    batch = draw(st.integers(1, min(max_batch, budget)))
    budget = max(budget // batch, 1)
    nheads_kv = draw(st.integers(1, min(max_heads_kv, budget)))
    group = draw(st.integers(1, min(max_group, max(budget // nheads_kv, 1))))
    softmax_scale = draw(st.none() if scales is None else st.one_of(st.none(), st.floats(*scales)))
    magnitude = draw(st.floats(*magnitudes))
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else softmax_scale
    if max_logit_std is not None and scale > 0:
        magnitude = min(magnitude, math.sqrt(max_logit_std / (scale * math.sqrt(headdim))))
    seed = draw(st.integers(0, 2**32 - 1))
    window_size = (-1, -1)
    if windows:  # drawn last, so that windows=False draws exactly what it did before windows
        side = st.one_of(st.just(-1), st.integers(0, max(seqlen_q, seqlen_k)))
        window_size = (draw(side), 0 if causal else draw(side))
    return AttentionProblem(
        batch, seqlen_q, seqlen_k, nheads_kv, group, headdim, causal, softmax_scale, magnitude,
        dtype, seed, window_size,
    )

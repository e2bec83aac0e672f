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
    distinct_v: bool = False,
):
    """AttentionProblems within the given bounds.

    - ``dtypes``: NumPy dtypes or the names 'float16', 'bfloat16', 'float32', 'float64'.
    - ``causal``: None draws both; True or False fixes it.
    - ``windows``: also draw a local-attention ``window_size`` (left, right), each side -1
      (unbounded) or 0..max(seqlen_q, seqlen_k); right is 0 where causal. Off: (-1, -1).
    - Sequence lengths in [min_seqlen, max_seqlen] (0 allowed), half the time one just off a
      tile multiple; ``same_seqlens``: seqlen_k = seqlen_q.
    - Head dim in [1, max_headdim], or one of ``headdims`` if given; ``distinct_v``: v's head
      dim (``problem.headdim_v``) drawn on its own the same way (off: v has q's and k's).
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
        max_group, scales, magnitudes, max_logit_std, max_cost, bool(distinct_v),
    )


def _draw_headdim(draw, budget, headdims, max_headdim) -> int:
    """A head dimension of ``headdims`` (any up to max_headdim when None, favourites first) within
    ``budget``; the smallest of ``headdims`` when none fits."""
    if headdims is None:
        return draw(_favourite_or_any(HEADDIMS, 1, min(max_headdim, budget)))
    fitting = [d for d in headdims if d <= min(max_headdim, budget)]
    return draw(st.sampled_from(fitting or [min(headdims)]))


def _draw_heads(draw, budget, max_heads_kv, max_group) -> tuple[int, int]:
    """(nheads_kv, group) with nheads_kv * group within ``budget`` (at least 1 each)."""
    nheads_kv = draw(st.integers(1, min(max_heads_kv, budget)))
    group = draw(st.integers(1, min(max_group, max(budget // nheads_kv, 1))))
    return nheads_kv, group


def _draw_scale(draw, headdim, scales, magnitudes, max_logit_std) -> tuple[float | None, float]:
    """(softmax_scale, magnitude): the magnitude capped so that the logits' standard deviation
    stays within max_logit_std (when given)."""
    softmax_scale = draw(st.none() if scales is None else st.one_of(st.none(), st.floats(*scales)))
    magnitude = draw(st.floats(*magnitudes))
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else softmax_scale
    if max_logit_std is not None and scale > 0:
        magnitude = min(magnitude, math.sqrt(max_logit_std / (scale * math.sqrt(headdim))))
    return softmax_scale, magnitude


@st.composite
def _attention_problems(draw, dtypes, causal, windows, min_seqlen, max_seqlen, same_seqlens,
                        headdims, max_headdim, max_batch, max_heads_kv, max_group, scales,
                        magnitudes, max_logit_std, max_cost, distinct_v=False):
    dtype = draw(st.sampled_from(dtypes))
    causal = draw(st.booleans() if causal is None else st.just(bool(causal)))
    seqlen_q = draw(_favourite_or_any(SEQLENS, min_seqlen, max_seqlen))
    seqlen_k = seqlen_q if same_seqlens else draw(_favourite_or_any(SEQLENS, min_seqlen, max_seqlen))
    budget = max(int(max_cost) // max(seqlen_q * seqlen_k, 1), 1)
    headdim = _draw_headdim(draw, budget, headdims, max_headdim)
    budget = max(budget // headdim, 1)
    batch = draw(st.integers(1, min(max_batch, budget)))
    budget = max(budget // batch, 1)
    nheads_kv, group = _draw_heads(draw, budget, max_heads_kv, max_group)
    softmax_scale, magnitude = _draw_scale(draw, headdim, scales, magnitudes, max_logit_std)
    seed = draw(st.integers(0, 2**32 - 1))
    # drawn last, so that windows=False draws exactly what it did before windows
    window_size = _draw_window(draw, windows, causal, max(seqlen_q, seqlen_k))
    # drawn after everything else for the same reason, within the cost share headdim took
    headdim_v = _draw_headdim(draw, max(headdim, 1), headdims, max_headdim) if distinct_v else None
    return AttentionProblem(
        batch, seqlen_q, seqlen_k, nheads_kv, group, headdim, causal, softmax_scale, magnitude,
        dtype, seed, window_size, headdim_v,
    )


# --- packed variable-length batches and KV caches -------------------------------------------------

# Ragged lengths: empty sequences and single tokens as often as tile edges.
PACKED_SEQLENS = (0, 1, 2, 3, 17, 63, 64, 65, 127, 129)
# Page sizes of a paged KV cache (None: contiguous): 1, odd ones and powers of two up to 256.
PAGE_SIZES = (None, 1, 3, 5, 16, 17, 64, 256)


def _draw_heads_and_scale(draw, budget, headdims, max_headdim, max_heads_kv, max_group, scales, magnitudes,
                          max_logit_std):
    """(headdim, nheads_kv, group, softmax_scale, magnitude) within ``budget`` of
    nheads * headdim, the magnitude capped as attention_problems caps it."""
    headdim = _draw_headdim(draw, budget, headdims, max_headdim)
    nheads_kv, group = _draw_heads(draw, max(budget // headdim, 1), max_heads_kv, max_group)
    softmax_scale, magnitude = _draw_scale(draw, headdim, scales, magnitudes, max_logit_std)
    return headdim, nheads_kv, group, softmax_scale, magnitude


def _draw_window(draw, windows, causal, max_side):
    if not windows:
        return (-1, -1)
    side = st.one_of(st.just(-1), st.integers(0, max(max_side, 0)))
    return (draw(side), 0 if causal else draw(side))


def varlen_problems(
    *,
    dtypes: Sequence = DTYPES,
    causal: bool | None = None,
    windows: bool = False,
    min_batch: int = 1,
    max_batch: int = 5,
    max_seqlen: int = 130,
    same_seqlens: bool | None = None,
    headdims: Sequence[int] | None = None,
    max_headdim: int = 128,
    max_heads_kv: int = 3,
    max_group: int = 3,
    scales: tuple[float, float] | None = (0.05, 2.0),
    magnitudes: tuple[float, float] = (0.1, 4.0),
    max_logit_std: float | None = MAX_LOGIT_STD,
    max_cost: float = CPU_MAX_COST / 4,
    distinct_v: bool = False,
):
    """VarlenProblems: a batch of [min_batch, max_batch] sequences whose query and key lengths
    are each 0..max_seqlen, drawn one by one (half the time one of PACKED_SEQLENS: zeros, ones,
    tile edges), so batches are ragged. ``same_seqlens``: True gives every sequence as many keys as
    queries (self-attention, as in packed training), False draws them apart, None either way.
    The other bounds are attention_problems' (``distinct_v`` too); the cost is sum of seqlen_q *
    seqlen_k over the sequences, times nheads * headdim."""
    dtypes = [as_dtype(d) for d in dtypes]
    if not dtypes:
        raise ValueError("dtypes is empty")
    _check_range("(min_batch, max_batch)", (min_batch, max_batch), 0)
    _check_range("(0, max_seqlen)", (0, max_seqlen), 0)
    _check_range("magnitudes", magnitudes, 0)
    if magnitudes[0] <= 0:
        raise ValueError(f"magnitudes must be positive (zero inputs test nothing), got {magnitudes}")
    return _varlen_problems(dtypes, causal, windows, min_batch, max_batch, max_seqlen, same_seqlens,
                            None if headdims is None else tuple(headdims), max_headdim, max_heads_kv, max_group,
                            scales, magnitudes, max_logit_std, max_cost, bool(distinct_v))


@st.composite
def _varlen_problems(draw, dtypes, causal, windows, min_batch, max_batch, max_seqlen, same_seqlens, headdims,
                     max_headdim, max_heads_kv, max_group, scales, magnitudes, max_logit_std, max_cost,
                     distinct_v=False):
    from .packed import VarlenProblem

    dtype = draw(st.sampled_from(dtypes))
    causal = draw(st.booleans() if causal is None else st.just(bool(causal)))
    same = draw(st.booleans() if same_seqlens is None else st.just(bool(same_seqlens)))
    length = _favourite_or_any(PACKED_SEQLENS, 0, max_seqlen)
    batch = draw(st.integers(min_batch, max_batch))
    seqlens_q = draw(st.lists(length, min_size=batch, max_size=batch))
    seqlens_k = seqlens_q if same else draw(st.lists(length, min_size=batch, max_size=batch))
    pairs = sum(a * b for a, b in zip(seqlens_q, seqlens_k))
    budget = max(int(max_cost) // max(pairs, 1), 1)
    headdim, nheads_kv, group, softmax_scale, magnitude = _draw_heads_and_scale(
        draw, budget, headdims, max_headdim, max_heads_kv, max_group, scales, magnitudes, max_logit_std)
    seed = draw(st.integers(0, 2**32 - 1))
    window_size = _draw_window(draw, windows, causal, max(seqlens_q + seqlens_k, default=0))
    headdim_v = _draw_headdim(draw, max(headdim, 1), headdims, max_headdim) if distinct_v else None
    return VarlenProblem(tuple(seqlens_q), tuple(seqlens_k), nheads_kv, group, headdim, causal, softmax_scale,
                         magnitude, dtype, seed, window_size, headdim_v)


def kvcache_problems(
    *,
    dtypes: Sequence = DTYPES,
    causal: bool | None = None,
    windows: bool = False,
    page_sizes: Sequence = PAGE_SIZES,
    max_batch: int = 3,
    max_seqlen_q: int = 4,
    max_new: int = 4,
    max_capacity: int = 300,
    headdims: Sequence[int] | None = None,
    max_headdim: int = 128,
    max_heads_kv: int = 2,
    max_group: int = 4,
    scales: tuple[float, float] | None = (0.05, 2.0),
    magnitudes: tuple[float, float] = (0.1, 4.0),
    max_logit_std: float | None = MAX_LOGIT_STD,
    max_cost: float = CPU_MAX_COST / 4,
    distinct_v: bool = False,
    leftpad: bool = False,
):
    """KVCacheProblems of decoding steps: 1..max_batch sequences, each with 0..capacity - seqlen_new
    cached tokens (half the time an edge: none, one, a page edge, a full cache), seqlen_new in
    0..max_new appended tokens and seqlen_q in 1..max_seqlen_q queries (half the time as many as the
    new tokens, the usual decode step); a cache of ``page_sizes`` (None: contiguous) holding up to
    max_capacity tokens per sequence (at least one page), spare rows or pages, in order or
    shuffled. GQA groups up to max_group (decode's usual shape: many query heads per kv head).
    ``distinct_v``: v_cache's own head dim, drawn as attention_problems draws it. ``leftpad``: with a
    contiguous cache, half the time each sequence starts at a drawn position of its row
    (cache_leftpad), its tokens after it."""
    dtypes = [as_dtype(d) for d in dtypes]
    if not dtypes or not page_sizes:
        raise ValueError("dtypes and page_sizes must not be empty")
    if any(p is not None and p < 1 for p in page_sizes):
        raise ValueError(f"page sizes must be >= 1 (or None for a contiguous cache), got {page_sizes}")
    if min(max_batch, max_seqlen_q, max_capacity) < 1 or max_new < 0:
        raise ValueError("max_batch, max_seqlen_q and max_capacity must be >= 1, max_new >= 0")
    _check_range("magnitudes", magnitudes, 0)
    return _kvcache_problems(dtypes, causal, windows, tuple(page_sizes), max_batch, max_seqlen_q, max_new,
                             max_capacity, None if headdims is None else tuple(headdims), max_headdim,
                             max_heads_kv, max_group, scales, magnitudes, max_logit_std, max_cost, bool(distinct_v),
                             bool(leftpad))


@st.composite
def _kvcache_problems(draw, dtypes, causal, windows, page_sizes, max_batch, max_seqlen_q, max_new, max_capacity,
                      headdims, max_headdim, max_heads_kv, max_group, scales, magnitudes, max_logit_std, max_cost,
                      distinct_v=False, leftpad=False):
    from .packed import KVCacheProblem

    dtype = draw(st.sampled_from(dtypes))
    causal = draw(st.booleans() if causal is None else st.just(bool(causal)))
    page_size = draw(st.sampled_from(page_sizes))
    seqlen_new = draw(st.integers(0, max_new))
    if page_size is None:
        capacity = draw(_favourite_or_any(SEQLENS, max(seqlen_new, 1), max(max_capacity, seqlen_new, 1)))
    else:
        fewest = max(-(-max(seqlen_new, 1) // page_size), 1)
        pages = draw(st.integers(fewest, max(fewest, max_capacity // page_size)))
        capacity = pages * page_size
    batch = draw(st.integers(1, max_batch))
    room = capacity - seqlen_new
    edges = [0, 1, room] + ([] if page_size is None else [page_size - 1, page_size, page_size + 1])
    cached = _favourite_or_any(edges, 0, room)
    cache_seqlens = draw(st.lists(cached, min_size=batch, max_size=batch))
    seqlens_as_int = len(set(cache_seqlens)) == 1 and draw(st.booleans())
    seqlen_q = seqlen_new if seqlen_new and draw(st.booleans()) else draw(st.integers(1, max_seqlen_q))
    spare = draw(st.integers(0, 3))
    shuffle = draw(st.booleans())
    keys = sum(cache_seqlens) + batch * seqlen_new
    budget = max(int(max_cost) // max(seqlen_q * keys, 1), 1)
    headdim, nheads_kv, group, softmax_scale, magnitude = _draw_heads_and_scale(
        draw, budget, headdims, max_headdim, max_heads_kv, max_group, scales, magnitudes, max_logit_std)
    seed = draw(st.integers(0, 2**32 - 1))
    window_size = _draw_window(draw, windows, causal, capacity)
    headdim_v = _draw_headdim(draw, max(headdim, 1), headdims, max_headdim) if distinct_v else None
    starts = None
    if leftpad and page_size is None and draw(st.booleans()):
        starts = tuple(draw(st.integers(0, room - n)) for n in cache_seqlens)
        seqlens_as_int = False
    return KVCacheProblem(tuple(cache_seqlens), seqlen_q, seqlen_new, capacity, page_size, spare, shuffle,
                          nheads_kv, group, headdim, causal, softmax_scale, magnitude, dtype, seed, window_size,
                          seqlens_as_int, headdim_v, starts)

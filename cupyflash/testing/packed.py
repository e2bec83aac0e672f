"""Attention problems of packed variable-length batches and of KV caches: plain data, no Hypothesis
(``strategies.varlen_problems`` and ``strategies.kvcache_problems`` draw them), each rebuilt from
its repr.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .problem import ProblemData, as_dtype


def _cumulative(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)


@dataclass(frozen=True, repr=False)
class VarlenProblem(ProblemData):
    """A packed batch: sequence b has seqlens_q[b] queries and seqlens_k[b] keys (0 allowed), each
    sequence masked on its own (bottom-right causal alignment, window around its own diagonal).
    q (total_q, nheads, headdim), k, v (total_k, nheads_kv, headdim), v (and o, do) with
    ``headdim_v`` columns where that is set, nheads = nheads_kv * group; lse (nheads, total_q)."""

    seqlens_q: tuple[int, ...]
    seqlens_k: tuple[int, ...]
    nheads_kv: int
    group: int
    headdim: int
    causal: bool
    softmax_scale: float | None
    magnitude: float
    dtype: np.dtype
    seed: int
    window_size: tuple[int, int] = (-1, -1)
    headdim_v: int | None = None  # v's own head dim (None: headdim)

    def __post_init__(self):
        object.__setattr__(self, "dtype", as_dtype(self.dtype))
        object.__setattr__(self, "seqlens_q", tuple(int(n) for n in self.seqlens_q))
        object.__setattr__(self, "seqlens_k", tuple(int(n) for n in self.seqlens_k))
        object.__setattr__(self, "headdim_v", self.headdim if self.headdim_v is None else int(self.headdim_v))
        object.__setattr__(self, "window_size", tuple(int(side) for side in self.window_size))
        if len(self.seqlens_q) != len(self.seqlens_k):
            raise ValueError(f"seqlens_q and seqlens_k differ in length: {self.seqlens_q}, {self.seqlens_k}")

    @property
    def batch(self) -> int:
        return len(self.seqlens_q)

    @property
    def cu_seqlens_q(self) -> np.ndarray:
        return _cumulative(self.seqlens_q)

    @property
    def cu_seqlens_k(self) -> np.ndarray:
        return _cumulative(self.seqlens_k)

    @property
    def max_seqlen_q(self) -> int:
        return max(self.seqlens_q, default=0)

    @property
    def max_seqlen_k(self) -> int:
        return max(self.seqlens_k, default=0)

    @property
    def sequences(self) -> tuple:
        """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k): the positional arguments after
        q, k, v."""
        return self.cu_seqlens_q, self.cu_seqlens_k, self.max_seqlen_q, self.max_seqlen_k

    def ranges(self) -> list[tuple[slice, slice]]:
        """(queries, keys) row slices of each sequence."""
        cu_q, cu_k = self.cu_seqlens_q.tolist(), self.cu_seqlens_k.tolist()
        return [(slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])) for b in range(self.batch)]

    @property
    def q_shape(self) -> tuple[int, int, int]:
        return (sum(self.seqlens_q), self.nheads, self.headdim)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        return (sum(self.seqlens_k), self.nheads_kv, self.headdim)

    @property
    def v_shape(self) -> tuple[int, int, int]:
        return (sum(self.seqlens_k), self.nheads_kv, self.headdim_v)

    @property
    def o_shape(self) -> tuple[int, int, int]:
        """Of o and do: q's rows, v's head dim."""
        return (sum(self.seqlens_q), self.nheads, self.headdim_v)

    @property
    def lse_shape(self) -> tuple[int, int]:
        return (self.nheads, sum(self.seqlens_q))

    @property
    def cost(self) -> int:
        """sum over sequences of seqlen_q * seqlen_k, times nheads * max(headdim, headdim_v)."""
        return (sum(a * b for a, b in zip(self.seqlens_q, self.seqlens_k)) * self.nheads
                * max(self.headdim, self.headdim_v))

    def arrays(self):
        """(q, k, v, do) packed: NumPy arrays of ``dtype``, standard normal times ``magnitude``."""
        rng = np.random.default_rng(self.seed)
        return tuple((rng.standard_normal(shape) * self.magnitude).astype(self.dtype)
                     for shape in (self.q_shape, self.kv_shape, self.v_shape, self.o_shape))


@dataclass(frozen=True, repr=False)
class KVCacheProblem(ProblemData):
    """A decoding step: sequence b has cache_seqlens[b] tokens in the cache, seqlen_new new tokens
    to append (0: no k, v), and seqlen_q queries that attend over all cache_seqlens[b] + seqlen_new
    tokens (the mask aligned to their end).

    The cache holds ``capacity`` tokens per sequence: a contiguous cache (page_size None) of
    batch + spare rows of ``capacity`` tokens, its rows chosen by a random cache_batch_idx when
    ``shuffle``; or a paged one (capacity a multiple of page_size) of batch * capacity / page_size
    + spare pages, the block table a random permutation of them when ``shuffle`` (in order
    otherwise). Every slot that holds no cached token starts as NaN, so an implementation that
    reads one fails. ``seqlens_as_int`` passes cache_seqlens as one int (all of them equal).
    ``headdim_v``: v_cache's (and v's, o's) own head dim (None: headdim). ``leftpad`` (contiguous
    caches): sequence b's tokens start at position leftpad[b] of its row (cache_leftpad); the call's
    cache_seqlens is then leftpad[b] + cache_seqlens[b], and the slots before leftpad[b] are NaN
    too."""

    cache_seqlens: tuple[int, ...]
    seqlen_q: int
    seqlen_new: int
    capacity: int
    page_size: int | None
    spare: int
    shuffle: bool
    nheads_kv: int
    group: int
    headdim: int
    causal: bool
    softmax_scale: float | None
    magnitude: float
    dtype: np.dtype
    seed: int
    window_size: tuple[int, int] = (-1, -1)
    seqlens_as_int: bool = False
    headdim_v: int | None = None
    leftpad: tuple[int, ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", as_dtype(self.dtype))
        object.__setattr__(self, "headdim_v", self.headdim if self.headdim_v is None else int(self.headdim_v))
        object.__setattr__(self, "cache_seqlens", tuple(int(n) for n in self.cache_seqlens))
        object.__setattr__(self, "window_size", tuple(int(side) for side in self.window_size))
        if self.page_size is not None and self.capacity % self.page_size:
            raise ValueError(f"capacity {self.capacity} is not a multiple of page_size {self.page_size}")
        if self.leftpad is not None:
            object.__setattr__(self, "leftpad", tuple(int(n) for n in self.leftpad))
            if self.page_size is not None or self.seqlens_as_int or len(self.leftpad) != len(self.cache_seqlens) \
                    or min(self.leftpad, default=0) < 0:
                raise ValueError("leftpad: one first position >= 0 per sequence, contiguous caches, cache_seqlens an "
                                 "array")
        starts = self.leftpad or (0,) * len(self.cache_seqlens)
        if any(start + n + self.seqlen_new > self.capacity for start, n in zip(starts, self.cache_seqlens)):
            raise ValueError(f"leftpad {self.leftpad} + cache_seqlens {self.cache_seqlens} + seqlen_new "
                             f"{self.seqlen_new} exceed the capacity {self.capacity}")
        if self.seqlens_as_int and len(set(self.cache_seqlens)) > 1:
            raise ValueError("seqlens_as_int needs equal cache_seqlens")

    @property
    def batch(self) -> int:
        return len(self.cache_seqlens)

    @property
    def seqlens_k(self) -> tuple[int, ...]:
        """Keys each sequence attends over: its cached tokens and the new ones."""
        return tuple(n + self.seqlen_new for n in self.cache_seqlens)

    @property
    def q_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seqlen_q, self.nheads, self.headdim)

    @property
    def lse_shape(self) -> tuple[int, int, int]:
        return (self.batch, self.nheads, self.seqlen_q)

    @property
    def cache_shape(self) -> tuple[int, int, int, int]:
        if self.page_size is None:
            return (self.batch + self.spare, self.capacity, self.nheads_kv, self.headdim)
        pages = self.batch * (self.capacity // self.page_size) + self.spare
        return (pages, self.page_size, self.nheads_kv, self.headdim)

    @property
    def v_cache_shape(self) -> tuple[int, int, int, int]:
        return self.cache_shape[:3] + (self.headdim_v,)

    @property
    def o_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seqlen_q, self.nheads, self.headdim_v)

    @property
    def cost(self) -> int:
        return self.seqlen_q * sum(self.seqlens_k) * self.nheads * max(self.headdim, self.headdim_v)

    def inputs(self) -> dict:
        """The arrays of a call, by flash_attn_with_kvcache's argument names: q, k_cache, v_cache,
        k, v (None when seqlen_new = 0), cache_seqlens, cache_batch_idx, block_table, and
        cache_leftpad with ``leftpad``. Fresh arrays every call (the same values), so a copy before
        the call is one more call."""
        rng = np.random.default_rng(self.seed)

        def normal(shape):
            return (rng.standard_normal(shape) * self.magnitude).astype(self.dtype)

        q = normal(self.q_shape)
        k_cache, v_cache = normal(self.cache_shape), normal(self.v_cache_shape)
        new_shape = (self.batch, self.seqlen_new, self.nheads_kv, self.headdim)
        k, v = (normal(new_shape), normal(new_shape[:3] + (self.headdim_v,))) if self.seqlen_new else (None, None)
        order = rng.permutation(self.cache_shape[0]) if self.shuffle else np.arange(self.cache_shape[0])
        holds = np.zeros(self.cache_shape[:2], bool)  # slots holding a cached token
        cache_batch_idx = block_table = None
        starts = self.leftpad or (0,) * self.batch
        if self.page_size is None:
            rows = order[: self.batch]
            if self.shuffle:
                cache_batch_idx = rows.astype(np.int32)
            for row, start, n in zip(rows, starts, self.cache_seqlens):
                holds[row, start:start + n] = True
        else:
            pages_per_sequence = self.capacity // self.page_size
            table = order[: self.batch * pages_per_sequence].reshape(self.batch, pages_per_sequence)
            block_table = table.astype(np.int32)
            for pages, n in zip(table, self.cache_seqlens):
                for p in range(n):
                    holds[pages[p // self.page_size], p % self.page_size] = True
        for cache in (k_cache, v_cache):
            cache[~holds] = np.nan
        seqlens = (self.cache_seqlens[0] if self.seqlens_as_int and self.batch
                   else np.asarray(self.cache_seqlens, np.int32) + np.asarray(starts, np.int32))
        arrays = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=seqlens,
                      cache_batch_idx=cache_batch_idx, block_table=block_table)
        if self.leftpad is not None:
            arrays["cache_leftpad"] = np.asarray(self.leftpad, np.int32)
        return arrays

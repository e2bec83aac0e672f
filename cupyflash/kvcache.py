"""flash_attn_with_kvcache: attention of new queries over a KV cache, with the new keys and values
appended to the cache in place first (flash-attn 2.8's names, shapes and semantics).

Caches: contiguous, (batch_cache, seqlen_cache, nheads_kv, headdim), sequence b in row b or in
row cache_batch_idx[b]; or paged, (num_blocks, page_size, nheads_kv, headdim) with a block table
(batch, max_blocks_per_seq): position p of sequence b lives in page block_table[b, p // page_size],
slot p % page_size. Any page size is accepted (1, odd sizes, not only multiples of 256).

How a call runs:
- the append is one NumPy / CuPy advanced-index assignment per cache (in place for every layout
  and stride; no kernel of our own);
- float16 / bfloat16 with a head dim that is a multiple of 8, on the GPU: one launch of the KV-cache
  kernel (kernels/kvcache_mma.py, kernels_cu/flash_fwd_kvcache_mma.cu), which reads the caches in
  place through the block table (a contiguous cache: one page per sequence, its row), each sequence
  its own length, the query heads of a kv head packed into one tile, the keys split across CTAs
  (``num_splits``, 0: a heuristic from the shape and the device) and the splits combined by a
  second kernel (flash_fwd_combine.cu);
- float32 / float64 and other head dims, on the GPU: still one dense call per sequence over a view
  of its cache row, or over its pages gathered into a contiguous temporary (``take``), one call for
  the whole batch where every sequence has the same length (``num_splits`` unused there);
- the numpy backend: the NumPy twin of the KV-cache kernel's algorithm
  (numpy_backend.kvcache_forward: splits as ``num_splits`` asks, 0 meaning 1);
- cache_seqlens, cache_batch_idx and block_table are read to the host for the checks (one
  synchronisation each for device arrays), except inside cupyflash.no_host_sync() and CUDA-graph
  capture (cupyflash.capture): there device index arrays are used unread (their dtypes and
  shapes checked), the append is a scatter on the device at each sequence's cache_seqlens, and
  the kernel's grid is sized by the cache's capacity, so a captured decode step replays correctly
  while its sequences grow (``_attend_unread``; float16 / bfloat16 on the KV-cache kernel only).
"""
from __future__ import annotations

import numpy as np

from . import _arrays as A
from . import api, capture, dispatch
from ._dtypes import lse_dtype
from .masks import check_window
from .rotary import check_rotary
from .modifiers import check_element_modifiers
from .scores import check_variant
from .varlen import (check_count, check_sequences, check_softcap, dense_forward, device_arrays, device_int32,
                     host_int32, int32_index, sequence_variant, unread)

__all__ = ["flash_attn_with_kvcache"]


# --- the layout of a call, checked before anything is written or launched -------------------------

class CacheLayout:
    """Where each sequence's tokens live, in one form for both layouts: a contiguous cache is a
    paged one whose pages are whole rows (page_size = seqlen_cache) with a one-column table
    (the rows). ``pages`` (batch, pages_per_seq) int64; ``old_lengths`` and ``lengths`` (batch,)
    int64, the tokens before and after the append; ``starts`` (batch,) int64, the position of each
    sequence's first token (cache_leftpad; contiguous caches only, zeros otherwise): token p of
    sequence b is at cache position starts[b] + p."""

    def __init__(self, paged: bool, page_size: int, pages: np.ndarray, old_lengths: np.ndarray, new_tokens: int,
                 starts: np.ndarray | None = None):
        self.paged = paged
        self.page_size = page_size
        self.pages = pages
        self.old_lengths = old_lengths
        self.lengths = old_lengths + new_tokens
        self.new_tokens = new_tokens
        self.starts = np.zeros_like(old_lengths) if starts is None else starts

    @property
    def capacity(self) -> int:
        return self.pages.shape[1] * self.page_size

    @property
    def left_padded(self) -> bool:
        return bool(self.starts.any())

    def pages_used(self, b: int) -> np.ndarray:
        """The pages sequence b attends over, in order."""
        return self.pages[b, : -(-int(self.lengths[b]) // self.page_size)]

    def appended_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """(page, slot) of every appended token, sequence-major (the order of k.reshape(-1, ...))."""
        positions = (self.starts + self.old_lengths)[:, None] + np.arange(self.new_tokens, dtype=np.int64)[None, :]
        pages = np.take_along_axis(self.pages, positions // self.page_size, axis=1)
        return pages.reshape(-1), (positions % self.page_size).reshape(-1)

    def holds_cached(self, pages: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Whether each (page, slot) holds a cached token (before the append) of some sequence."""
        if self.left_padded:
            # contiguous rows: sequence b holds slots starts[b] .. starts[b] + old_lengths[b] - 1 of its row
            rows = self.pages[:, 0]
            first, end = self.starts, self.starts + self.old_lengths
            return ((pages[:, None] == rows[None, :]) & (first[None, :] <= slots[:, None])
                    & (slots[:, None] < end[None, :])).any(axis=1)
        # every sequence holds its pages from slot 0: one past the last held slot of each page decides
        page_ids = np.unique(pages)
        column = np.arange(self.pages.shape[1], dtype=np.int64)[None, :]
        extent = np.clip(self.old_lengths[:, None] - column * self.page_size, 0, self.page_size)
        found = np.zeros(page_ids.shape, np.int64)
        where = np.searchsorted(page_ids, self.pages)  # page_ids is sorted
        hit = (where < page_ids.size) & (page_ids[np.minimum(where, page_ids.size - 1)] == self.pages) & (extent > 0)
        np.maximum.at(found, where[hit], extent[hit])
        return slots < found[np.searchsorted(page_ids, pages)]


def _check_cache_seqlens(cache_seqlens, batch: int, capacity: int, appending: bool) -> np.ndarray:
    if cache_seqlens is None:
        if appending:
            raise ValueError("k and v are appended at cache_seqlens: pass cache_seqlens (the tokens each sequence "
                             "already has in the cache)")
        return np.full(batch, capacity, np.int64)
    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, (bool, np.bool_)):
        return np.full(batch, check_count(cache_seqlens, "cache_seqlens"), np.int64)
    lengths = host_int32(cache_seqlens, "cache_seqlens", 1)
    if lengths.shape != (batch,):
        raise ValueError(f"cache_seqlens must have shape (batch,) = ({batch},); got {tuple(lengths.shape)}")
    if (lengths < 0).any():
        b = int(np.argmax(lengths < 0))
        raise ValueError(f"cache_seqlens must be >= 0; got cache_seqlens[{b}] = {int(lengths[b])}")
    return lengths.astype(np.int64)


def _check_not_both(cache_batch_idx, block_table) -> None:
    if cache_batch_idx is not None and block_table is not None:
        raise ValueError("cache_batch_idx and block_table cannot be combined (a paged cache is addressed "
                         "through block_table alone, as in flash-attn)")


def _check_index_shapes(batch: int, cache_shape, rows, table) -> int:
    """The index arrays' shapes against the batch and the cache (cache_batch_idx ``rows``, a
    block_table ``table``: NumPy or CuPy arrays, or None), and a host cache_batch_idx's rows
    against the cache; a sequence's capacity in tokens."""
    _check_not_both(rows, table)
    if table is not None:
        if table.shape[0] != batch:
            raise ValueError(f"block_table must have shape (batch, max_blocks_per_seq) with batch = {batch}; "
                             f"got {tuple(table.shape)}")
        if cache_shape[1] == 0:
            raise ValueError("a paged k_cache (num_blocks, page_size, nheads_kv, headdim) needs page_size >= 1; "
                             f"got shape {tuple(cache_shape)}")
        return table.shape[1] * cache_shape[1]
    cache_rows = cache_shape[0]
    if rows is None and cache_rows < batch:
        raise ValueError(f"k_cache has {cache_rows} rows for a batch of {batch} sequences (sequence b reads row b "
                         "unless cache_batch_idx says otherwise)")
    if rows is not None:
        if rows.shape != (batch,):
            raise ValueError(f"cache_batch_idx must have shape (batch,) = ({batch},); got {tuple(rows.shape)}")
        if isinstance(rows, np.ndarray):
            bad = (rows < 0) | (rows >= cache_rows)
            if bad.any():
                b = int(np.argmax(bad))
                raise ValueError(f"cache_batch_idx[{b}] = {int(rows[b])} is not a row of k_cache "
                                 f"(0 .. {cache_rows - 1})")
    return cache_shape[1]


def _check_layout(q_shape, cache_shape, new_tokens: int, appending: bool, cache_seqlens, cache_batch_idx,
                  block_table, cache_leftpad=None) -> CacheLayout:
    batch = q_shape[0]
    _check_not_both(cache_batch_idx, block_table)  # before either is read back
    _check_leftpad_layout(cache_leftpad, block_table)
    table = None if block_table is None else host_int32(block_table, "block_table", 2)
    row_of = None if cache_batch_idx is None else host_int32(cache_batch_idx, "cache_batch_idx", 1)
    capacity = _check_index_shapes(batch, cache_shape, row_of, table)
    if table is not None:
        layout = CacheLayout(True, cache_shape[1], table.astype(np.int64),
                             _check_cache_seqlens(cache_seqlens, batch, capacity, appending), new_tokens)
    else:
        seqlen_cache = capacity
        row_of = np.arange(batch, dtype=np.int64) if row_of is None else row_of.astype(np.int64)
        # One page per sequence, its row; with seqlen_cache = 0 nothing fits and nothing is read.
        ends = _check_cache_seqlens(cache_seqlens, batch, seqlen_cache, appending)
        starts = _check_leftpad(cache_leftpad, ends, batch)
        layout = CacheLayout(False, seqlen_cache, row_of[:, None], ends - starts, new_tokens, starts)

    too_long = layout.starts + layout.lengths > layout.capacity
    if too_long.any():
        b = int(np.argmax(too_long))
        where = (f"its {layout.pages.shape[1]} pages of {layout.page_size} tokens" if layout.paged
                 else f"a cache of {layout.capacity} tokens per sequence")
        if appending:
            padded = f" from position {int(layout.starts[b])}" if layout.starts[b] else ""
            raise ValueError(f"the cache is too small for the append: sequence {b} has {int(layout.old_lengths[b])} "
                             f"cached tokens{padded} + {new_tokens} new ones = {int(layout.lengths[b])} > {where}")
        raise ValueError(f"cache_seqlens[{b}] = {int(layout.starts[b] + layout.old_lengths[b])} exceeds {where}")
    if layout.paged:
        num_blocks = cache_shape[0]
        for b in range(batch):
            used = layout.pages_used(b)
            bad = (used < 0) | (used >= num_blocks)
            if bad.any():
                j = int(np.argmax(bad))
                raise ValueError(f"block_table[{b}, {j}] = {int(used[j])} is not a page of k_cache "
                                 f"(0 .. {num_blocks - 1}); sequence {b} needs its first {used.size} entries")
    if appending and batch * new_tokens:
        _check_append_targets(layout)
    return layout


def _check_leftpad_layout(cache_leftpad, block_table) -> None:
    if cache_leftpad is not None and block_table is not None:
        raise ValueError("cache_leftpad and block_table cannot be combined (as in flash-attn: a paged sequence starts "
                         "at its first page)")


def _check_leftpad(cache_leftpad, ends: np.ndarray, batch: int) -> np.ndarray:
    """cache_leftpad read on the host: (batch,) int32, each sequence's first position, 0 <= leftpad[b]
    <= cache_seqlens[b] (``ends``, which without cache_seqlens is the capacity). Zeros without it."""
    if cache_leftpad is None:
        return np.zeros(batch, np.int64)
    starts = host_int32(cache_leftpad, "cache_leftpad", 1)
    if starts.shape != (batch,):
        raise ValueError(f"cache_leftpad must have shape (batch,) = ({batch},); got {tuple(starts.shape)}")
    bad = (starts < 0) | (starts > ends)
    if bad.any():
        b = int(np.argmax(bad))
        raise ValueError(f"cache_leftpad[{b}] = {int(starts[b])} must be in 0 .. cache_seqlens[{b}] = {int(ends[b])} "
                         "(the sequence's first position, at or before its end)")
    return starts.astype(np.int64)


def _check_append_targets(layout: CacheLayout) -> None:
    """Every appended token gets a slot of its own, and none overwrites a cached token of any
    sequence: both would make the result depend on the order of the writes."""
    pages, slots = layout.appended_slots()
    flat = pages * layout.page_size + slots
    unique, first, counts = np.unique(flat, return_index=True, return_counts=True)
    what = "row" if not layout.paged else "page"
    if (counts > 1).any():
        slot = unique[np.argmax(counts > 1)]
        writers = sorted({int(i) // layout.new_tokens for i in np.flatnonzero(flat == slot)})
        raise ValueError(f"sequences {writers} would append into the same cache slot ({what} "
                         f"{int(slot // layout.page_size)}, slot {int(slot % layout.page_size)}): each appended token "
                         "needs a slot of its own (distinct cache_batch_idx rows / block_table pages)")
    overwrites = layout.holds_cached(pages, slots)
    if overwrites.any():
        i = int(np.argmax(overwrites))
        raise ValueError(f"sequence {i // layout.new_tokens} would append over a cached token of the batch ({what} "
                         f"{int(pages[i])}, slot {int(slots[i])}, within cache_seqlens of a sequence that reads it)")


def _check_new_kv(k, v, q_shape, cache_shape, v_cache_shape):
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and values to append), or neither")
    if k is None:
        return 0
    for name, x in (("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, seqlen_new, nheads_kv, headdim); "
                             f"got shape {tuple(x.shape)}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same (batch, seqlen_new, nheads_kv); got k {tuple(k.shape)} and "
                         f"v {tuple(v.shape)}")
    if k.shape[0] != q_shape[0]:
        raise ValueError(f"k must have the batch size of q ({q_shape[0]}); got {k.shape[0]}")
    for name, x, cache_name, shape in (("k", k, "k_cache", cache_shape), ("v", v, "v_cache", v_cache_shape)):
        if x.shape[2:] != tuple(shape[2:]):
            raise ValueError(f"{name} must have the (nheads_kv, headdim) of {cache_name} {tuple(shape[2:])}; got "
                             f"{tuple(x.shape[2:])}")
    return k.shape[1]


def _check_shapes(q, k_cache, v_cache) -> None:
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.ndim != 4:
            layout = ("(batch, seqlen, nheads, headdim)" if name == "q" else "(batch_cache, seqlen_cache, nheads_kv, "
                      "headdim), or (num_blocks, page_size, nheads_kv, headdim) with a block_table")
            raise ValueError(f"{name} must have 4 dimensions {layout}; got shape {tuple(x.shape)}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache and v_cache must have the same shape but for the head dim (v_cache's may differ); "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    nheads, headdim = q.shape[2], q.shape[3]
    nheads_kv = k_cache.shape[2]
    if k_cache.shape[3] != headdim:
        raise ValueError(f"q and k_cache must have the same headdim; got {headdim} and {k_cache.shape[3]}")
    for name, d in (("headdim", headdim), ("headdim of v_cache", v_cache.shape[3])):
        if not 1 <= d <= A.MAX_HEADDIM:
            raise ValueError(f"{name} must be between 1 and {A.MAX_HEADDIM}; got {d}")
    if nheads_kv == 0 and nheads != 0 or nheads_kv != 0 and nheads % nheads_kv != 0:
        raise ValueError(f"nheads of q ({nheads}) must be a multiple of nheads of k_cache/v_cache ({nheads_kv}) "
                         "(GQA/MQA); the caches may have 0 heads only when q has 0")


def _scores_may_overflow(dtype, headdim: int, scale: float) -> bool:
    """Whether A.check_scores_fit has to read values for this dtype, head dim and scale (its
    bounds from the scale and the dtype alone do not settle it). The cached keys are checked
    per sequence only then: most of a cache is not this call's keys, and may hold anything."""
    import ml_dtypes

    amplification = abs(scale) * A.LOG2E
    limit = float(np.finfo(lse_dtype(dtype)).max)
    dtype_max = float(ml_dtypes.finfo(dtype).max)
    return amplification > 1.0 and amplification * dtype_max * max(headdim * dtype_max, 1.0) > limit


# --- reading a sequence's keys and values ----------------------------------------------------------

def _sequence_keys(cache, layout: CacheLayout, b: int, length: int):
    """Sequence b's first ``length`` keys (or values) of ``cache``, (1, length, nheads_kv, headdim):
    a view of its row, or its pages gathered into a contiguous temporary."""
    if not layout.paged:
        start = int(layout.starts[b])
        return cache[int(layout.pages[b, 0])][None, start:start + length]
    xp = np if isinstance(cache, np.ndarray) else A._cupy()
    pages = layout.pages[b, : -(-length // layout.page_size)]
    gathered = xp.take(cache, xp.asarray(pages), axis=0)
    return gathered.reshape((1, pages.size * layout.page_size) + cache.shape[2:])[:, :length]


def _batch_keys(cache, layout: CacheLayout, length: int):
    """Every sequence's first ``length`` keys at once, (batch, length, nheads_kv, headdim), where
    that is one view or one gather; None otherwise."""
    batch = layout.pages.shape[0]
    if not layout.paged:
        if not np.array_equal(layout.pages[:, 0], np.arange(batch)) or layout.left_padded:
            return None
        return cache[:batch, :length]
    xp = np if isinstance(cache, np.ndarray) else A._cupy()
    pages = layout.pages[:, : -(-length // layout.page_size)]
    gathered = xp.take(cache, xp.asarray(pages.reshape(-1)), axis=0)
    return gathered.reshape((batch, pages.shape[1] * layout.page_size) + cache.shape[2:])[:, :length]


# --- the public function ----------------------------------------------------------------------------

@capture.graph_safe
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, rotary_cos=None, rotary_sin=None,
                            rotary_interleaved=True, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            alibi_slopes=None, sink=None, score_mod=None, mask_mod=None, num_splits=0,
                            return_softmax_lse=False, return_lse=False, backend="auto", precision=None):
    """Append k, v to the caches in place at each sequence's cache_seqlens, then attend q over
    each sequence's cache_seqlens[b] + seqlen_new keys (flash-attn 2.8's flash_attn_with_kvcache).

    q: (batch, seqlen_q, nheads, headdim). k_cache, v_cache: (batch_cache, seqlen_cache,
    nheads_kv, headdim), or (num_blocks, page_size, nheads_kv, headdim) with ``block_table``
    (batch, max_blocks_per_seq) int32 (paged; any page size); v_cache's head dim (headdim_v) may
    differ from q's and k_cache's, and o then has it. k, v (optional, together): (batch,
    seqlen_new, nheads_kv, headdim) and (..., headdim_v), written into the caches at positions
    cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 of sequence b. ``cache_seqlens``: an int
    or (batch,) int32, the tokens already cached per sequence (required with k, v; without it the
    whole cache row / table is the sequence). ``cache_batch_idx`` (batch,) int32: the cache row of
    each sequence (contiguous caches only). ``cache_leftpad`` (batch,) int32 (contiguous caches
    only, flash-attn's): sequence b's first token is at cache position cache_leftpad[b], its
    tokens positions cache_leftpad[b] .. cache_seqlens[b] - 1 (cache_seqlens stays the end of the
    cached tokens, where k and v are appended); the mask, ALiBi and the modifiers' kv_idx count from
    that first token. ``rotary_cos``, ``rotary_sin`` (seqlen_ro, rotary_dim / 2),
    q's dtype, with k and v only: rotary embeddings (flash-attn's) of the first rotary_dim entries of
    the new keys at positions cache_seqlens[b] + t and of the queries (at cache_seqlens[b] + i when
    causal or windowed, else all at cache_seqlens[b]), GPT-J pairs when ``rotary_interleaved``, else
    GPT-NeoX halves; the cache receives the rotated keys; seqlen_ro must cover the cache's capacity
    (cupyflash.rotary). ``causal`` and ``window_size`` align the queries to the
    end of the updated cache: with seqlen_k = cache_seqlens[b] + seqlen_new, query i sees key j
    iff j <= i + seqlen_k - seqlen_q (and the window's bounds around that diagonal).
    Returns o (batch, seqlen_q, nheads, headdim_v), or (o, lse) with lse (batch, nheads, seqlen_q)
    when ``return_softmax_lse``
    (flash-attn's name) or ``return_lse`` (cupyflash's) is set.

    Every check runs before the caches are written: shapes, dtypes, index dtypes and ranges,
    block_table entries within the cache (those the call uses), room for the append, no two
    appended tokens on one slot, none over a cached token. ``num_splits``: CTAs along each
    sequence's keys (split-KV decoding), 0 to let a heuristic choose from the grid and the device;
    fewer are used where the longest sequence has fewer key tiles. ``softcap``, ``alibi_slopes`` ((nheads,) or (batch, nheads)
    float32) and ``sink`` ((nheads,) float32) are flash_attn_func's, the ALiBi distance taken
    from the end-aligned diagonal; so is ``precision`` (float32's products). ``score_mod`` and
    ``mask_mod`` are flash_attn_func's user modifiers with kv_idx the key's index in its sequence
    (0 .. seqlen_k - 1 of sequence b: the cache position, less cache_leftpad[b]) and q_idx the new
    query's index; the mask is applied element by element (no
    block map, no block skipping). On the GPU they run on the tensor-core KV-cache kernel (float16
    / bfloat16, head dims multiples of 8), elsewhere (float32, float64, caches the kernel cannot
    read) on one packed (varlen) launch over the sequences' gathered keys; the NumPy twin takes them
    in every dtype. Which kernels run: the module docstring.
    """
    backend = A.check_backend(backend)
    causal = A.check_flag(causal, "causal")
    window = check_window(window_size)
    want_lse = A.check_flag(return_softmax_lse, "return_softmax_lse")
    want_lse = A.check_flag(return_lse, "return_lse") or want_lse
    check_softcap(softcap)
    check_count(num_splits, "num_splits")
    on_gpu = api._on_gpu(backend)
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if k is not None:
        named["k"] = k
    if v is not None:
        named["v"] = v
    arrays, host_out = api._take(named)
    api._refuse_host_under_capture(arrays, backend)
    dtype = A.check_dtype(arrays)
    q, k_cache, v_cache = arrays["q"], arrays["k_cache"], arrays["v_cache"]
    k, v = arrays.get("k"), arrays.get("v")
    _check_shapes(q, k_cache, v_cache)
    batch, seqlen_q, nheads, headdim = q.shape
    variant = check_variant(softcap, alibi_slopes, sink, batch, nheads, check_element_modifiers(score_mod, mask_mod),
                            precision=precision)
    new_tokens = _check_new_kv(k, v, q.shape, k_cache.shape, v_cache.shape)
    appending = k is not None
    scale = A.resolve_scale(softmax_scale, headdim)
    indices = {"cache_batch_idx": cache_batch_idx, "block_table": block_table, "cache_leftpad": cache_leftpad}
    if not isinstance(cache_seqlens, (int, np.integer)):
        indices["cache_seqlens"] = cache_seqlens
    given = {name: None if x is None else int32_index(x, name, 2 if name == "block_table" else 1)
             for name, x in indices.items()}
    on_device = not isinstance(k_cache, np.ndarray)
    # Under capture every call takes this path (an int cache_seqlens included: its lengths become a
    # device array there), so nothing is uploaded from the host inside the graph.
    if unread(*given.values()) or (on_device and capture.under_capture()):
        A.same_device({**arrays, **device_arrays(**indices, rotary_cos=rotary_cos, rotary_sin=rotary_sin)})
        return _attend_unread(backend, q, k_cache, v_cache, k, v, new_tokens, cache_seqlens, given, scale, causal,
                              window, want_lse, variant, int(num_splits),
                              (rotary_cos, rotary_sin, rotary_interleaved))
    layout = _check_layout(q.shape, k_cache.shape, new_tokens, appending, cache_seqlens, cache_batch_idx,
                           block_table, cache_leftpad)
    ends = layout.starts + layout.old_lengths  # where each sequence's cached tokens end: rotary's positions
    rotary = _check_rotary((rotary_cos, rotary_sin, rotary_interleaved), q, new_tokens, appending, layout.capacity,
                           causal, window, ends)
    A.same_device({**arrays, **device_arrays(**indices, rotary_cos=rotary_cos, rotary_sin=rotary_sin)})
    which = dispatch.choose(backend, dtype, max(headdim, v_cache.shape[3]), "fwd")
    if appending:
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if isinstance(cache, np.ndarray) and not cache.flags.writeable:
                raise ValueError(f"{name} is read-only; k and v are appended to it in place")
    if rotary is not None:  # new arrays: the caller's q and k stay as they are; positions are the cache's
        k = rotary.turn(k, ends, per_token=True)
        q = rotary.turn(q, ends, _rotary_per_token(causal, window, layout.capacity))
    if batch * seqlen_q * nheads:
        if appending and new_tokens:
            A.check_scores_fit(q, k, scale)
        if _scores_may_overflow(dtype, headdim, scale):
            for b in range(batch):
                if layout.old_lengths[b]:
                    A.check_scores_fit(q[b:b + 1], _sequence_keys(k_cache, layout, b, int(layout.old_lengths[b])),
                                       scale)

    if appending and batch * new_tokens:
        _append(k_cache, v_cache, k, v, layout)
    return _attend(which, on_gpu, host_out, q, k_cache, v_cache, layout, scale, causal, window, want_lse, variant,
                   int(num_splits))


def _cache_kernel_reads(dtype, headdim: int, k_cache, v_cache) -> bool:
    """Whether the tensor-core KV-cache kernel reads these caches (``_attend_in_cache``'s test): a
    16-bit dtype, head dims multiples of 8, and device caches of 16-byte aligned rows whose strides
    are multiples of 8 elements (a NumPy cache, or one whose last dimension is strided, becomes a
    contiguous device copy first)."""
    from .kernels import kvcache_mma

    if not all(kvcache_mma.supports(dtype, d) for d in (headdim, v_cache.shape[3])):
        return False
    return all(isinstance(c, np.ndarray) or c.strides[3] != c.itemsize
               or not (any((s // c.itemsize) % 8 for s in c.strides[:3]) or c.data.ptr % 16)
               for c in (k_cache, v_cache))


def _attend_packed(which, q, k_cache, v_cache, layout: CacheLayout, scale, causal, window, variant) -> tuple:
    """(o, lse (batch, nheads, seqlen_q)) of a call with user modifiers off the KV-cache kernel
    (float32, float64, or caches it cannot read): every sequence's keys gathered into one packed
    batch and one varlen launch, whose kernels give the modifiers b = the sequence and kv_idx =
    the cache position, as the KV-cache kernel does (sequence by sequence, the dense kernels would
    see every sequence as batch entry 0). The mask is applied element by element: the modifiers
    carry no block map (scores.Variant.score)."""
    from .kernels.params import PackedBatch
    from .varlen import packed_forward

    cupy = A._cupy()
    batch, seqlen_q, nheads, headdim = q.shape
    lengths = [int(n) for n in layout.lengths]
    if not sum(lengths):
        return api.seeing_no_key(q, v_cache, variant, cupy)
    k, v = ([A.last_dim_contiguous(A.to_cupy(_sequence_keys(c, layout, b, n)[0], "k_cache"))
             for b, n in enumerate(lengths)] for c in (k_cache, v_cache))
    k, v = (cupy.concatenate(parts) for parts in (k, v))
    cu_q = cupy.asarray(np.arange(batch + 1, dtype=np.int32) * np.int32(seqlen_q))
    cu_k = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    packed = PackedBatch(cu_q, cu_k, seqlen_q, max(lengths))
    o, lse = packed_forward(which, q.reshape((batch * seqlen_q, nheads, headdim)), k, v, scale, causal, window,
                            variant, packed)
    return (o.reshape((batch, seqlen_q) + o.shape[1:]),
            cupy.ascontiguousarray(lse.reshape((nheads, batch, seqlen_q)).transpose(1, 0, 2)))


def _attend_in_cache(q, k_cache, v_cache, layout: CacheLayout, scale, causal, window, variant, num_splits):
    """(o, lse) from the tensor-core KV-cache kernel, which reads the caches in place through the
    layout's block table (kernels/kvcache_mma.py); None where it does not apply (a head dim that is
    not a multiple of 8, caches whose strides or alignment the kernel cannot take): the per-sequence
    path then runs."""
    from .kernels import kvcache_mma
    from .masks import mask_for

    cupy = A._cupy()
    if not _cache_kernel_reads(q.dtype, q.shape[3], k_cache, v_cache):
        return None
    k_cache, v_cache = (A.last_dim_contiguous(A.to_cupy(c, "k_cache")) for c in (k_cache, v_cache))
    if any((s // q.itemsize) % 8 for s in q.strides[:3]) or q.data.ptr % 16:
        q = cupy.ascontiguousarray(q)  # q is small: a copy, as _attend_unread makes
    batch, seqlen_q, nheads, _ = q.shape
    pages, row_pages = layout.pages, False
    if layout.left_padded:
        rows_per_row = row_page_ratio(k_cache, v_cache)
        if rows_per_row is None or (layout.pages[:, 0].max(initial=0) + 1) * rows_per_row > np.iinfo(np.int32).max:
            return None
        pages, row_pages = row_page_table(layout.pages, layout.starts, rows_per_row), True
    o = api._empty(q.shape[:3] + v_cache.shape[3:], q.dtype, xp=cupy)
    lse = api._empty((batch, nheads, seqlen_q), np.float32, xp=cupy)
    seqlens_k = cupy.asarray(layout.lengths.astype(np.int32))
    table = cupy.asarray(np.ascontiguousarray(pages, dtype=np.int32))
    kvcache_mma.forward(q, k_cache, v_cache, o, lse, seqlens_k=seqlens_k, block_table=table, row_pages=row_pages,
                        page_size=max(1, layout.page_size), paged=layout.paged,
                        max_seqlen_k=int(layout.lengths.max(initial=0)), softmax_scale=scale,
                        mask=mask_for(causal, window, variant.score.without_block_map), variant=variant,
                        num_splits=num_splits)
    return o, lse


def row_page_ratio(k_cache, v_cache) -> int | None:
    """Left-padded contiguous caches reach the kernels as pages that start at any row: a table entry
    counts rows (the caches' batch strides replaced by their row strides, ``row_pages``), so
    sequence b's entry is its row times the rows between two cache rows, plus its first position.
    That count (batch stride / row stride), where it is a whole number and the same in both caches;
    None otherwise (the per-sequence path then runs)."""
    ratios = set()
    for cache in (k_cache, v_cache):
        batch_stride, row_stride = cache.strides[0], cache.strides[1]
        if row_stride <= 0 or batch_stride % row_stride or (cache.shape[0] > 1 and batch_stride <= 0):
            return None
        ratios.add(batch_stride // row_stride if cache.shape[0] > 1 else cache.shape[1])
    return ratios.pop() if len(ratios) == 1 else None


def row_page_table(rows, starts, rows_per_row):
    """The table of a left-padded contiguous cache for ``row_pages``: sequence b's entry is the row
    (of the cache's rows laid end to end) of its first token, cache row rows[b, 0] at position
    starts[b]. NumPy or CuPy, on whichever the arguments are."""
    return rows * rows_per_row + starts.reshape(-1, 1)


def _rotary_per_token(causal: bool, window, capacity: int) -> bool:
    """Whether each query takes its own position (flash-attn: when causal or windowed), else all
    of a sequence's queries take its first new position. A window side of at least the cache's
    capacity is no bound, as flash-attn counts it (it sets such a side to -1 first)."""
    return causal or any(0 <= side < capacity for side in window)


def _check_rotary(arguments, q, new_tokens: int, appending: bool, capacity: int, causal: bool, window, ends=None):
    """check_rotary for a call: ``ends`` (host, (batch,)) where each sequence's cached tokens end,
    None where the lengths stay on the device; then the tables must hold every position a query
    could take (the capacity, plus the queries past the new keys when each query takes its own)."""
    seqlen_q = q.shape[1]
    per_token = _rotary_per_token(causal, window, capacity)
    # the farthest position turned, past a sequence's cached end: its last new key (new_tokens - 1),
    # its last query (seqlen_q - 1 each its own, else 0: every query at the end itself)
    past_end = max(new_tokens - 1, seqlen_q - 1 if per_token else 0)
    if ends is None:
        past = max(0, past_end + 1 - new_tokens)
        needed, why = capacity + past, (f"positions up to {past} past a full cache (the lengths stay on the "
                                        "device, unread)")
    elif not ends.size:
        needed, why = 0, ""
    else:
        last = ends + past_end
        b = int(np.argmax(last))
        needed = int(last[b]) + 1
        why = f"position {needed - 1} (sequence {b}: its cached tokens end at {int(ends[b])})"
    return check_rotary(*arguments, dtype=q.dtype, headdim=q.shape[3], appending=appending, capacity=capacity,
                        needed=needed, needed_why=why)


def _attend_unread(backend, q, k_cache, v_cache, k, v, new_tokens: int, cache_seqlens, given: dict, scale, causal,
                   window, want_lse, variant, num_splits: int, rotary_arguments=(None, None, True)):
    """flash_attn_with_kvcache with its device index arrays unread (cupyflash.capture): their dtypes
    and shapes checked, the values of those on the host checked as far as the others allow, the
    device values taken as given (flash-attn's contract: each sequence fits its cache, appends land
    on free slots). Every check runs before anything is queued. The append writes k and v on the
    device at cache_seqlens[b] .. + seqlen_new - 1 through the table (flash_kvcache_append.cu); the
    KV-cache kernel reads each sequence's length from the device and its grid is sized by the
    capacity of a sequence's cache, so a captured call stays valid while the lengths grow."""
    from .kernels import kvcache_mma
    from .masks import mask_for

    batch, seqlen_q, nheads, headdim = q.shape
    appending = k is not None
    rows, table, leftpad = given.get("cache_batch_idx"), given.get("block_table"), given.get("cache_leftpad")
    paged = table is not None
    _check_leftpad_layout(leftpad, table)
    capacity = _check_index_shapes(batch, k_cache.shape, rows, table)
    if leftpad is not None and leftpad.shape != (batch,):
        raise ValueError(f"cache_leftpad must have shape (batch,) = ({batch},); got {tuple(leftpad.shape)}")
    page_size = k_cache.shape[1]
    if cache_seqlens is None and appending:
        raise ValueError("k and v are appended at cache_seqlens: pass cache_seqlens (the tokens each sequence "
                         "already has in the cache)")
    host_lengths = None  # the lengths before the append, where they are known on the host
    if cache_seqlens is None:
        host_lengths = np.full(batch, capacity, np.int64)
    elif isinstance(cache_seqlens, (int, np.integer)):
        host_lengths = np.full(batch, check_count(cache_seqlens, "cache_seqlens"), np.int64)
    else:
        if given["cache_seqlens"].shape != (batch,):
            raise ValueError(f"cache_seqlens must have shape (batch,) = ({batch},); got "
                             f"{tuple(given['cache_seqlens'].shape)}")
        if isinstance(given["cache_seqlens"], np.ndarray):
            host_lengths = given["cache_seqlens"].astype(np.int64)
            if (host_lengths < 0).any():
                b = int(np.argmax(host_lengths < 0))
                raise ValueError(f"cache_seqlens must be >= 0; got cache_seqlens[{b}] = {int(host_lengths[b])}")
    if batch and (new_tokens > capacity or (host_lengths is not None and (host_lengths + new_tokens > capacity).any())):
        b = 0 if host_lengths is None else int(np.argmax(host_lengths + new_tokens > capacity))
        if not appending:
            raise ValueError(f"cache_seqlens[{b}] = {int(host_lengths[b])} exceeds the capacity of a sequence's "
                             f"cache ({capacity} tokens)")
        cached = "" if host_lengths is None else f"{int(host_lengths[b])} cached tokens + "
        raise ValueError(f"the cache is too small for the append: sequence {b} has {cached}{new_tokens} new ones "
                         f"> its capacity of {capacity} tokens")
    if isinstance(leftpad, np.ndarray):  # a host leftpad beside device arrays: checked as far as the lengths allow
        _check_leftpad(leftpad, np.full(batch, capacity, np.int64) if host_lengths is None else host_lengths, batch)
    rotary = _check_rotary(rotary_arguments, q, new_tokens, appending, capacity, causal, window, host_lengths)
    if rotary is not None:
        for name, tables in (("rotary_cos", rotary.cos), ("rotary_sin", rotary.sin)):
            if isinstance(tables, np.ndarray):
                capture.refuse_host_upload(name)
    rows_per_row = None
    if leftpad is not None:
        rows_per_row = None if isinstance(k_cache, np.ndarray) else row_page_ratio(k_cache, v_cache)
        if rows_per_row is None or k_cache.shape[0] * rows_per_row > np.iinfo(np.int32).max:
            raise ValueError("cupyflash.no_host_sync() / CUDA-graph capture with cache_leftpad: the caches must be "
                             "device arrays whose batch stride is a whole number of rows, the same in both, with "
                             "fewer than 2^31 rows in all (the kernels then address each sequence from its first "
                             "position)")
    headdim_v = v_cache.shape[3]
    if backend == "numpy" or not api._on_gpu(backend) \
            or dispatch.choose(backend, q.dtype, max(headdim, headdim_v), "fwd") != "mma" \
            or not all(kvcache_mma.supports(q.dtype, d) for d in (headdim, headdim_v)):
        raise ValueError("cupyflash.no_host_sync() / CUDA-graph capture: the KV cache is read unread only by the "
                         "tensor-core KV-cache kernel (float16 / bfloat16, a head dim that is a multiple of 8); "
                         f"this call ({np.dtype(q.dtype)}, headdims {headdim} / {headdim_v}, backend "
                         f"{backend!r}) runs sequence by sequence and needs cache_seqlens, block_table and "
                         "cache_batch_idx on the host")
    for cache, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if isinstance(cache, np.ndarray):
            raise ValueError(f"cupyflash.no_host_sync() / CUDA-graph capture: {name} is a host array, and the append "
                             "and the kernel work on device caches; pass CuPy caches")
        if cache.strides[3] != cache.itemsize or any((st // cache.itemsize) % 8 for st in cache.strides[:3]) \
                or cache.data.ptr % 16:
            raise ValueError(f"cupyflash.no_host_sync() / CUDA-graph capture: {name}'s strides or alignment are not "
                             "the KV-cache kernel's (a contiguous last dimension, rows of 16 bytes, strides "
                             "multiples of 8 elements)")
    if appending and batch * seqlen_q * nheads * new_tokens:
        A.check_scores_fit(q, k, scale)  # its scale bounds only: device values stay unread
    for name, x in given.items():
        if isinstance(x, np.ndarray):
            capture.refuse_host_upload(name)
    cupy = A._cupy()
    variant = variant.to(cupy)

    # Checked: from here on work is queued.
    if paged:
        table = device_int32(table, "block_table")
    elif rows is None:
        table = cupy.arange(batch, dtype=np.int32).reshape(batch, 1)
    else:
        table = device_int32(rows, "cache_batch_idx").reshape(batch, 1)
    if host_lengths is not None and not isinstance(given.get("cache_seqlens"), np.ndarray):
        old_lengths = cupy.full(batch, int(host_lengths[0]) if batch else 0, np.int32)  # an int, or the capacity
    else:
        old_lengths = device_int32(given["cache_seqlens"], "cache_seqlens")
    ends = old_lengths  # where each sequence's cached tokens end: the append's and rotary's positions
    if leftpad is not None:  # entries counting rows, each sequence from its first position (row_page_ratio)
        starts = device_int32(leftpad, "cache_leftpad")
        table = row_page_table(table, starts, np.int32(rows_per_row))
        old_lengths = old_lengths - starts
    q = A.last_dim_contiguous(A.to_cupy(q, "q"))
    if rotary is not None:  # positions from the device lengths, unread
        k = rotary.turn(A.to_cupy(k, "k"), ends, per_token=True)
        q = rotary.turn(q, ends, _rotary_per_token(causal, window, capacity))
    if any((st // q.itemsize) % 8 for st in q.strides[:3]) or q.data.ptr % 16:
        q = cupy.ascontiguousarray(q)
    seqlens_k = old_lengths
    if appending and batch * new_tokens:
        from .kernels import kvcache_append

        seqlens_k = cupy.empty(batch, np.int32)
        kvcache_append.append(A.last_dim_contiguous(A.to_cupy(k, "k")), A.last_dim_contiguous(A.to_cupy(v, "v")),
                              k_cache, v_cache, cache_seqlens=old_lengths, block_table=table, page_size=page_size,
                              seqlens_k=seqlens_k, row_pages=leftpad is not None)
    out_shape = q.shape[:3] + v_cache.shape[3:]
    if batch * seqlen_q * nheads == 0:
        o, lse = cupy.zeros(out_shape, q.dtype), cupy.full((batch, nheads, seqlen_q), -np.inf, np.float32)
        return (o, lse) if want_lse else o
    o = api._empty(out_shape, q.dtype, xp=cupy)
    lse = api._empty((batch, nheads, seqlen_q), np.float32, xp=cupy)
    kvcache_mma.forward(q, k_cache, v_cache, o, lse, seqlens_k=seqlens_k, block_table=table,
                        row_pages=leftpad is not None, page_size=max(1, page_size), paged=paged,
                        max_seqlen_k=capacity, softmax_scale=scale,
                        mask=mask_for(causal, window, variant.score.without_block_map), variant=variant,
                        num_splits=num_splits)
    return (o, lse) if want_lse else o


def _append(k_cache, v_cache, k, v, layout: CacheLayout) -> None:
    """k, v into their slots: one advanced-index assignment per cache, which NumPy and CuPy carry
    out in place whatever the cache's strides (CuPy scatters into the array's own memory)."""
    pages, slots = layout.appended_slots()
    for cache, new in ((k_cache, k), (v_cache, v)):
        on_host = isinstance(cache, np.ndarray)
        xp = np if on_host else A._cupy()
        values = (A.to_numpy if on_host else A.to_cupy)(new, "k").reshape((-1,) + cache.shape[2:])
        cache[xp.asarray(pages), xp.asarray(slots)] = values


def _attend(which, on_gpu, host_out, q, k_cache, v_cache, layout: CacheLayout, scale, causal, window, want_lse,
            variant, num_splits=0):
    batch, seqlen_q, nheads, _ = q.shape
    convert = A.to_cupy if on_gpu else A.to_numpy
    q = A.last_dim_contiguous(convert(q, "q"))
    variant = variant.to(np if which == "numpy" else A._cupy())
    if which == "numpy" and batch * seqlen_q * nheads:
        from . import numpy_backend

        sequences = [tuple(A.to_numpy(_sequence_keys(c, layout, b, int(layout.lengths[b]))[0], "k_cache")
                           for c in (k_cache, v_cache)) for b in range(batch)]
        o, lse = numpy_backend.kvcache_forward(q, sequences, softmax_scale=scale, causal=causal, window_size=window,
                                               variant=variant, num_splits=max(1, num_splits))
        o, lse = api._to_device((o, lse)) if not host_out else api._to_host((o, lse), host_out)
        return (o, lse) if want_lse else o
    if which == "mma" and batch * seqlen_q * nheads:
        done = _attend_in_cache(q, k_cache, v_cache, layout, scale, causal, window, variant, num_splits)
        if done is not None:
            o, lse = api._to_host(done, host_out)
            return (o, lse) if want_lse else o
    if variant.mods is not None and batch * seqlen_q * nheads:
        o, lse = api._to_host(_attend_packed(which, q, k_cache, v_cache, layout, scale, causal, window, variant),
                              host_out)
        return (o, lse) if want_lse else o

    def compute(q_part, keys, values, part_variant):
        keys, values = (A.last_dim_contiguous(convert(x, "k_cache")) for x in (keys, values))
        return dense_forward(which, q_part, keys, values, scale, causal, window, part_variant)

    lengths = layout.lengths
    same_length = batch > 0 and bool((lengths == lengths[0]).all())
    batch_keys = _batch_keys(k_cache, layout, int(lengths[0])) if same_length else None
    if batch_keys is not None:
        # One call for the whole batch: every sequence has the same keys' length and one view or
        # one gather holds them all.
        o, lse = compute(q, batch_keys, _batch_keys(v_cache, layout, int(lengths[0])), variant)
    else:
        xp = np if which == "numpy" else A._cupy()
        o = api._empty(q.shape[:3] + v_cache.shape[3:], q.dtype, xp=xp)
        lse = api._empty((batch, nheads, seqlen_q), lse_dtype(q.dtype), xp=xp)
        for b in range(batch):
            length = int(lengths[b])
            o_b, lse_b = compute(q[b:b + 1], _sequence_keys(k_cache, layout, b, length),
                                 _sequence_keys(v_cache, layout, b, length), sequence_variant(variant, b))
            o[b], lse[b] = o_b[0], lse_b[0]
    o, lse = api._to_device((o, lse)) if which == "numpy" and not host_out else api._to_host((o, lse), host_out)
    return (o, lse) if want_lse else o


# --- packed queries over a paged cache: flash_attn_varlen_func's block_table -------------------------

PAGED_VARLEN_MAX_PADDING = 2  # padded query rows per real one past which paged varlen gathers the keys


def _concatenate_rows(parts: list, like):
    """parts concatenated on axis 0 in ``like``'s array module (an empty one shaped like a row of it)."""
    xp = np if isinstance(like, np.ndarray) else A._cupy()
    return xp.concatenate(parts) if parts else xp.zeros((0,) + like.shape[2:], like.dtype)


def paged_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, *,
                         softmax_scale, causal, window_size, softcap, alibi_slopes, sink, return_lse, backend,
                         precision, unsupported: dict):
    """flash_attn_varlen_func with ``block_table`` (flash-attn 2.8's paged varlen forward): q (total_q,
    nheads, headdim) packed as in any varlen call; k, v pages (num_blocks, page_size, nheads_kv,
    headdim / headdim_v); sequence b's keys are its first cu_seqlens_k[b + 1] - cu_seqlens_k[b]
    positions through block_table[b]. Computed as a KV-cache call without an append: each
    sequence's queries at the end of a row of the longest query run (so each keeps its own
    bottom-right alignment), the rest of the row zeros whose results are dropped; one launch of the
    KV-cache kernel for 16-bit head dims it takes, the per-sequence path otherwise. Where that
    padding would exceed PAGED_VARLEN_MAX_PADDING rows per query, the keys are gathered from their
    pages into a packed batch and the unpaged varlen call runs instead. Forward only
    (flash-attn has no backward for it). ``unsupported``: the call's other options by name, each
    refused when set (user modifiers, dropout: their q_idx and masks would see the padded rows)."""
    named = [name for name, given in unsupported.items() if given]
    if named:
        raise ValueError(f"block_table (paged varlen) does not take {', '.join(named)}")
    backend = A.check_backend(backend)
    causal = A.check_flag(causal, "causal")
    window = check_window(window_size)
    return_lse = A.check_flag(return_lse, "return_lse")
    check_softcap(softcap)
    on_gpu = api._on_gpu(backend)
    arrays, host_out = api._take({"q": q, "k": k, "v": v})
    api._refuse_host_under_capture(arrays, backend)
    dtype = A.check_dtype(arrays)
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    if q.ndim != 3:
        raise ValueError(f"q must have 3 dimensions (total_q, nheads, headdim), the packed layout; got shape "
                         f"{tuple(q.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions (num_blocks, page_size, nheads_kv, headdim) with a "
                             f"block_table (pages of a paged cache); got shape {tuple(x.shape)}")
    _check_shapes(q[None], k, v)
    total_q, nheads, headdim = q.shape
    given = {name: int32_index(x, name, 2 if name == "block_table" else 1)
             for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                             ("block_table", block_table))}
    if unread(*given.values()):
        raise ValueError("cupyflash.no_host_sync() / CUDA-graph capture: paged varlen (block_table) reads "
                         "cu_seqlens_q, cu_seqlens_k and block_table on the host; call it outside them")
    cu_k = host_int32(given["cu_seqlens_k"], "cu_seqlens_k", 1)
    sequences = check_sequences(given["cu_seqlens_q"], cu_k, max_seqlen_q, max_seqlen_k, total_q,
                                int(cu_k[-1]) if cu_k.size else 0)
    batch = sequences.count
    lengths_q, lengths_k = np.diff(sequences.cu_q), np.diff(sequences.cu_k)
    table = host_int32(given["block_table"], "block_table", 2)
    capacity = table.shape[1] * k.shape[1]
    if table.shape[0] != batch:
        raise ValueError(f"block_table must have shape (batch, max_blocks_per_seq) with batch = {batch} (the "
                         f"sequences of cu_seqlens); got {tuple(table.shape)}")
    if batch and int(lengths_k.max()) > capacity:
        b = int(np.argmax(lengths_k))
        raise ValueError(f"sequence {b} has {int(lengths_k[b])} keys (cu_seqlens_k), more than its "
                         f"{table.shape[1]} pages of {k.shape[1]} hold ({capacity})")
    rows = int(lengths_q.max(initial=0))
    layout = _check_layout((batch, rows, nheads, headdim), k.shape, 0, False, lengths_k.astype(np.int32), None,
                           table)
    variant = check_variant(softcap, alibi_slopes, sink, batch, nheads, None, precision=precision)
    scale = A.resolve_scale(softmax_scale, headdim)
    A.same_device({**arrays, **device_arrays(**given)})
    which = dispatch.choose(backend, dtype, max(headdim, v.shape[3]), "fwd")
    if _scores_may_overflow(dtype, headdim, scale):
        for b in range(batch):
            if lengths_q[b] and lengths_k[b]:
                q_b = q[None, sequences.cu_q[b]:sequences.cu_q[b + 1]]
                A.check_scores_fit(q_b, _sequence_keys(k, layout, b, int(lengths_k[b])), scale)

    if batch * rows > PAGED_VARLEN_MAX_PADDING * max(total_q, 1):
        # Padding would more than double the queries (a long prefill beside short ones): gather the
        # keys into a packed batch instead and run the unpaged varlen call, whose kernels take each
        # sequence's own rows.
        from .varlen import flash_attn_varlen_func

        gathered = [_concatenate_rows([_sequence_keys(c, layout, b, int(lengths_k[b]))[0] for b in range(batch)], c)
                    for c in (k, v)]
        return flash_attn_varlen_func(q, *gathered, given["cu_seqlens_q"], cu_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale=scale, causal=causal, window_size=window, softcap=softcap,
                                      alibi_slopes=alibi_slopes, sink=sink, return_lse=return_lse, backend=backend,
                                      precision=precision)
    # each sequence's queries at the end of its row of the padded batch
    sequence_of = np.repeat(np.arange(batch), lengths_q)
    row_of = (rows - lengths_q)[sequence_of] + np.arange(total_q) - sequences.cu_q[sequence_of]
    xp = np if isinstance(q, np.ndarray) else A._cupy()
    padded = xp.zeros((batch, rows, nheads, headdim), dtype)
    padded[xp.asarray(sequence_of), xp.asarray(row_of)] = q
    o_rows, lse_rows = _attend(which, on_gpu, host_out, padded, k, v, layout, scale, causal, window, True,
                               variant)
    out_xp = np if isinstance(o_rows, np.ndarray) else A._cupy()
    picked = out_xp.asarray(sequence_of), out_xp.asarray(row_of)
    o = out_xp.ascontiguousarray(o_rows[picked])
    lse = out_xp.ascontiguousarray(lse_rows.transpose(0, 2, 1)[picked].T)
    return (o, lse) if return_lse else o

"""Ring attention: exact attention over a sequence sharded across P ranks.

Each rank keeps its query shard; the K/V shards travel around the ring, one hop per step, so that
after P steps every rank has attended to every key. Step t on rank r uses the K/V of rank
s = (r - t) mod P:

    forward, step t:  start sending the K/V held to r + 1 (receiving s - 1's from r - 1)
                      (o_t, lse_t) = flash_attn_func(q, K_s, V_s) on the rows / keys the mask sees
                      merge (o_t, lse_t) into the running (o, lse), float32, by the LSE rule
                      wait for the transfer

The transfer of the next K/V runs while this step computes (``overlap=False`` waits for it
before computing instead, to measure what the overlap hides).

The backward runs the same ring with the GLOBAL o and lse of the forward: with them, each step's
P = exp(S - lse) and D = rowsum(dO · O) are the whole sequence's, so cupyflash's own backward on
one (query shard, K/V shard) pair returns exact partial gradients, and dQ, dK, dV are their sums.
dQ accumulates on the rank; the dK/dV of the K/V held travel with it (float32): rank r adds its
part to the accumulator received from r - 1 and sends it on; after P steps each accumulator has
every rank's part and one last hop takes it home.

Causal masks use the zigzag layout (sharding.py): rank r holds chunks r and 2P - 1 - r of C rows.
Its query chunks against the key chunks of rank s:

    s == r:  chunks r, 2P-1-r against r, 2P-1-r  -> causal attention on the local 2C rows
    s <  r:  both query chunks see key chunk s only, entirely       -> q (2C) vs k[:C], no mask
    s >  r:  only chunk 2P-1-r sees anything: both key chunks      -> q[C:] vs k (2C), no mask

so every step after the first is a C x 2C block on every rank (balanced). ``layout="contiguous"``
(rank r holds rows r·S..(r+1)·S-1) is supported too: s < r full, s == r causal, s > r nothing —
correct, unbalanced (rank P-1 does P times rank 0's work). Without a mask the layout is irrelevant.

A sliding window (``window_size``, flash-attn's, on the whole sequence) shifts each chunk pair's
band by the chunks' distance, which a flash-attn window on the pair cannot express; ring_schedule
cuts every block to the rows that see a key and the keys seen, where the band's offset becomes
the block's own bottom-right diagonal, and keeps the fewest such blocks (RingBlock: rows, keys and
the block's own causal / window_size). ``softcap`` goes to every step as it is; a ``sink`` joins
each row's softmax once, after the last step, by the same LSE rule (the backward's steps need
nothing of it: the global lse includes it). ALiBi's bias needs the sequence's distance i - j, which
a block's own diagonal gives only where its mask put it: with ``alibi_slopes`` every block lies in
one chunk pair (``per_chunk``) and runs a score_mod that reads its RingBlock.distance.

Sums run in a fixed order (step order, deterministic kernels), so results are bitwise repeatable
for a given P. Every rank must hold shards of one shape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .._dtypes import lse_dtype
from ..api import flash_attn_backward, flash_attn_func
from ..masks import check_window
from ..merge import merge_attention_states
from ..modifiers import ScoreMod
from ..modifiers import tanh as _tanh
from ..scores import sink_grad

__all__ = ["RingStep", "RingBlock", "ring_schedule", "ring_flash_attn_func", "ring_flash_attn_backward",
           "ring_flash_attn_vjp"]

LAYOUTS = ("zigzag", "contiguous")
INF = math.inf


@dataclass(frozen=True)
class RingBlock:
    """One attention call of a ring step: the rank's query rows [rows[0], rows[1]) against keys
    [keys[0], keys[1]) of the K/V shard held, with flash-attn's ``causal`` and ``window_size`` on
    that block (bottom-right aligned on the block itself), which give exactly the whole
    sequence's mask on it."""

    rows: tuple[int, int]
    keys: tuple[int, int]
    causal: bool = False
    window_size: tuple[int, int] = (-1, -1)
    # For a block inside one query chunk and one key chunk: the whole sequence's i - j of a pair
    # minus the block's own q_idx - kv_idx (ALiBi's distance there, ring_flash_attn_func); None for
    # a block over more than one chunk pair, where no one number gives it.
    distance: int | None = field(default=None, compare=False)

    @property
    def row_slice(self) -> slice:
        return slice(*self.rows)

    @property
    def key_slice(self) -> slice:
        return slice(*self.keys)


@dataclass(frozen=True)
class RingStep:
    """Step t of one rank: the K/V of rank ``source`` = (rank - t) mod P and the blocks computed
    with them, in order (none where the rank's queries see none of those keys; the K/V move on
    every step either way)."""

    source: int
    blocks: tuple[RingBlock, ...] = ()


@dataclass(frozen=True)
class _Chunk:
    begin: int  # local rows [begin, end) of a shard
    end: int
    start: int  # global position of row `begin`


def _chunks(rank: int, size: int, length: int, layout: str) -> tuple[_Chunk, ...]:
    """The rank's chunks of the whole sequence: zigzag r and 2P - 1 - r of length / 2 rows each, or
    one contiguous shard (sharding.py)."""
    if layout == "zigzag":
        c = length // 2
        return _Chunk(0, c, rank * c), _Chunk(c, length, (2 * size - 1 - rank) * c)
    return (_Chunk(0, length, rank * length),)


def _clip(band, lo: int, hi: int):
    """band (a, b) (j - i in [a, b], infinite ends allowed) within [lo, hi]; None if empty."""
    a, b = max(band[0], lo), min(band[1], hi)
    return (a, b) if a <= b else None


def _offsets(rows: _Chunk | tuple, keys: _Chunk | tuple) -> tuple[int, int]:
    """The range of j - i (local key minus local query) over a rectangle of rows x keys."""
    return keys[0] - (rows[1] - 1), (keys[1] - 1) - rows[0]


def _rect_block(row_chunks, key_chunks, band) -> RingBlock | None | bool:
    """One block for the chunk pairs of row_chunks x key_chunks (adjacent chunks of the shards):
    None if no pair sees anything, False if no single band gives every pair its own mask.

    In local indices pair (A, B)'s mask is the whole sequence's band shifted by the chunks'
    offsets: j - i in band - delta, delta = (B.start - B.begin) - (A.start - A.begin). A band I
    serves the rectangle iff, on each pair's range of j - i, I and the pair's band agree."""
    pairs = []
    for a in row_chunks:
        for b in key_chunks:
            delta = (b.start - b.begin) - (a.start - a.begin)
            shifted = (band[0] - delta, band[1] - delta)
            pairs.append((shifted, _offsets((a.begin, a.end), (b.begin, b.end))))
    if all(_clip(shifted, *rng) is None for shifted, rng in pairs):
        return None
    for candidate, _ in pairs:
        if all(_clip(candidate, *rng) == _clip(shifted, *rng) for shifted, rng in pairs):
            break
    else:
        return False
    r0, r1 = row_chunks[0].begin, row_chunks[-1].end
    k0, k1 = key_chunks[0].begin, key_chunks[-1].end
    if band == (-INF, INF):  # no mask: the whole rectangle
        return RingBlock((r0, r1), (k0, k1), distance=_distance(row_chunks, key_chunks, r0, k0))
    lo, hi = _clip(candidate, *_offsets((r0, r1), (k0, k1)))
    lo = -INF if lo <= k0 - (r1 - 1) else lo  # a side the rectangle never reaches is no bound
    hi = INF if hi >= (k1 - 1) - r0 else hi
    # only the rows that see a key and the keys some row sees
    ra, rb = max(r0, k0 - hi), min(r1, k1 - lo)
    ka, kb = max(k0, ra + lo), min(k1, rb + hi)
    ra, rb, ka, kb = (int(x) for x in (ra, rb, ka, kb))
    # flash-attn's window on the block: j' - i' in [diag - left, diag + right], diag = keys - rows
    diag = (kb - ka) - (rb - ra)
    left = -1 if lo == -INF else diag - (lo - ka + ra)
    right = -1 if hi == INF else (hi - ka + ra) - diag
    if left < -1 or right < -1 or (left == -1 and lo != -INF) or (right == -1 and hi != INF):
        return False
    distance = _distance(row_chunks, key_chunks, ra, ka)
    if (left, right) == (-1, 0):
        return RingBlock((ra, rb), (ka, kb), causal=True, distance=distance)
    return RingBlock((ra, rb), (ka, kb), window_size=(int(left), int(right)), distance=distance)


def _distance(row_chunks, key_chunks, ra: int, ka: int) -> int | None:
    """RingBlock.distance of a block whose first row and key are local ra and ka."""
    if len(row_chunks) != 1 or len(key_chunks) != 1:
        return None
    a, b = row_chunks[0], key_chunks[0]
    return int((a.start + ra - a.begin) - (b.start + ka - b.begin))


def _step_blocks(row_chunks, key_chunks, band, per_chunk: bool = False) -> tuple[RingBlock, ...]:
    """The fewest blocks this tries for a step: the whole rectangle, then split by key chunks,
    by query chunks, then every chunk pair on its own (always possible: one pair's mask is one
    band); with ``per_chunk`` every chunk pair on its own at once."""
    whole, each = lambda chunks: [tuple(chunks)], lambda chunks: [(c,) for c in chunks]
    forms = ((each, each),) if per_chunk else ((whole, whole), (whole, each), (each, whole), (each, each))
    for rows_of, keys_of in forms:
        blocks = [_rect_block(rows, keys, band) for rows in rows_of(row_chunks) for keys in keys_of(key_chunks)]
        if all(b is not False for b in blocks):
            return tuple(b for b in blocks if b is not None)
    raise AssertionError(f"no block form for chunks {row_chunks} x {key_chunks} under {band}")  # pragma: no cover


def ring_schedule(rank: int, size: int, length: int, *, causal: bool = False, window_size=(-1, -1),
                  layout: str = "zigzag", key_length: int | None = None, per_chunk: bool = False) -> list:
    """The P steps of ``rank`` (a RingStep each) for shards of ``length`` query rows (and
    ``key_length`` keys, default the same).

    Without a mask every step is one block, every row against every key. With ``causal`` or a
    ``window_size`` (flash-attn's, on the whole sequence: query i sees key j iff i - left <= j <=
    i + right, causal: right = 0; self-attention, every shard of one length) each pair of a
    query chunk and a key chunk sees a band of the keys: the step computes it in as few blocks as
    one flash-attn mask per block allows, each cut to the rows that see a key and the keys seen.
    Zigzag causal gives the balanced C x 2C blocks of the module's docstring; a window gives the
    few blocks near the diagonal, and no block at all on steps whose keys lie outside it.
    ``per_chunk``: every block inside one query chunk and one key chunk, so that each has its
    RingBlock.distance (ALiBi's), at the cost of more, smaller blocks (zigzag: up to four a step)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    left, right = check_window(window_size)
    key_length = length if key_length is None else key_length
    masked = causal or (left, right) != (-1, -1)
    if not masked and not per_chunk:
        return [RingStep((rank - t) % size, (RingBlock((0, length), (0, key_length)),)) for t in range(size)]
    band = (-INF if left < 0 else -left, 0 if causal else INF if right < 0 else right)
    rows = _chunks(rank, size, length, layout)
    steps = []
    for t in range(size):
        source = (rank - t) % size
        key_chunks = _chunks(source, size, key_length, layout)
        steps.append(RingStep(source, _step_blocks(rows, key_chunks, band, per_chunk)))
    return steps


def _array_module_of(x) -> str:
    if isinstance(x, np.ndarray):
        return "numpy"
    return type(x).__module__.split(".")[0]


def _check(comm, arrays: dict, causal: bool, window_size, layout: str, alibi: bool = False):
    """A TypeError or ValueError naming what the ring cannot take; nothing when it can (softcap
    is checked by each step's call). A mask, and ALiBi's distances, are positions of one sequence:
    self-attention, and (zigzag) shards of two whole chunks."""
    for attr in ("rank", "size", "xp", "start_exchange"):
        if not hasattr(comm, attr):
            raise TypeError(f"comm must be a ring communicator (rank, size, xp, start_exchange), got {type(comm).__name__}")
    want = comm.xp.__name__.split(".")[0]
    for name, x in arrays.items():
        if _array_module_of(x) != want:
            raise TypeError(f"{name} is a {type(x).__module__}.{type(x).__name__}; this communicator moves {want} arrays")
    window = check_window(window_size)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}: expected (batch, seqlen, heads, headdim) shards, "
                         "k and v of one shape")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {q.shape} and k {k.shape} differ in batch or headdim")
    if causal or window != (-1, -1) or alibi:
        what = "causal" if causal else f"window_size={window}" if window != (-1, -1) else "alibi_slopes"
        if q.shape[1] != k.shape[1]:
            raise ValueError(f"ring attention with {what} is self-attention: q and k shards of one length, got "
                             f"{q.shape[1]} and {k.shape[1]}")
        if layout == "zigzag" and q.shape[1] % 2:
            raise ValueError(f"ring attention with {what} and the zigzag layout needs an even shard length (two "
                             f"chunks of seqlen / 2P rows), got {q.shape[1]} on rank {comm.rank}: shard with "
                             f"zigzag_shard, which needs the sequence length to be a multiple of 2P")


def _scale(softmax_scale, headdim: int) -> float:
    return 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)


def _kv_ring(xp, k, v):
    """The K/V held at step 0 (the caller's, only ever read) and two spare buffer pairs that the
    following steps receive into in turn."""
    held = (xp.ascontiguousarray(k), xp.ascontiguousarray(v))
    return held, [None, None]


def _next_kv(comm, xp, held, spare, t: int, overlap: bool):
    """Start the transfer of the K/V of step t + 1; (pending, where they arrive)."""
    if spare[t % 2] is None:
        spare[t % 2] = (xp.empty_like(held[0]), xp.empty_like(held[1]))
    pending = comm.start_exchange(held, spare[t % 2])
    if not overlap:
        pending.wait()
    return pending, spare[t % 2]


def _check_slopes(xp, alibi_slopes, batch: int, nheads: int):
    """ALiBi's slopes as (1 or batch, nheads) float32, or None."""
    if alibi_slopes is None:
        return None
    slopes = xp.asarray(alibi_slopes)
    if slopes.dtype != np.float32 or slopes.shape not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must be ({nheads},) or ({batch}, {nheads}) float32 (flash-attn's), got "
                         f"{slopes.dtype} {slopes.shape}")
    return xp.ascontiguousarray(slopes.reshape(-1, nheads))


def _block_variant(xp, block: RingBlock, slopes, softcap, made: dict) -> dict:
    """flash_attn_func's variant keywords for one block: ``softcap`` as it is; with ALiBi slopes a
    score_mod that applies the cap (if any) and then the bias at the whole sequence's distance,
    i - j = q_idx - kv_idx + block.distance (the built-in ALiBi measures from the block's own
    diagonal). One kernel serves every block: the distance is a tensor the score_mod reads.
    ``made``: the call's score_mods by distance, each made (traced, its tensor uploaded) once."""
    if slopes is None:
        return dict(softcap=softcap)
    assert block.distance is not None, block  # ring_schedule(per_chunk=True) gives every block one
    if block.distance in made:
        return made[block.distance]
    by_batch = 1 if slopes.shape[0] > 1 else 0
    offset = xp.asarray([block.distance], dtype=np.int32)
    cap = float(softcap)
    if cap:
        def ring_alibi(score, b, h, q_idx, kv_idx, slopes, offset):
            return cap * _tanh(score / cap) - slopes[b * by_batch, h] * abs(q_idx - kv_idx + offset[0])
    else:
        def ring_alibi(score, b, h, q_idx, kv_idx, slopes, offset):
            return score - slopes[b * by_batch, h] * abs(q_idx - kv_idx + offset[0])
    made[block.distance] = dict(score_mod=ScoreMod(ring_alibi, slopes=slopes, offset=offset))
    return made[block.distance]


def ring_flash_attn_func(q, k, v, *, comm, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, sink=None, layout="zigzag", return_lse=False, backend="auto",
                         overlap=True):
    """Attention of this rank's query shard over the whole sharded sequence.

    q: (batch, seqlen_local, nheads, headdim), k, v: (batch, seqlen_local_k, nheads_kv, headdim)
    (GQA as flash_attn_func): this rank's shards, every rank's of one shape. ``comm``: a ring
    communicator (comm.py; its array module decides NumPy or CuPy arrays). ``causal`` and
    ``window_size`` (flash-attn's sliding window, -1: that side unbounded): the mask of the whole
    sequence, which must then be self-attention sharded by ``layout`` ("zigzag", default, or
    "contiguous"); ring_schedule cuts each step into blocks with flash-attn masks of their own.
    ``softcap``: flash_attn_func's, on every score. ``alibi_slopes`` ((nheads,) or (batch, nheads)
    float32, flash-attn's): the bias -slope |i - j| of the whole sequence's positions (self-attention
    or equal shards); each step then runs a block per chunk pair (ring_schedule's per_chunk) through
    a score_mod that knows the block's distance (and applies the cap first, as flash-attn orders
    them). ``sink`` ((nheads,) float32, gpt-oss's
    attention sinks, every rank the same): joins each row's denominator once, after the last step
    (lse includes it, as flash_attn_func's). Returns o (like q, this rank's rows), or (o, lse) with
    lse (batch, nheads, seqlen_local) float32 (float64 for float64). ``backend``:
    flash_attn_func's, for each step. ``overlap=False``: wait for each K/V transfer before
    computing (to measure the overlap).
    """
    _check(comm, {"q": q, "k": k, "v": v}, causal, window_size, layout, alibi_slopes is not None)
    xp = comm.xp
    sink = _check_sink(xp, sink, q.shape[2])
    slopes = _check_slopes(xp, alibi_slopes, q.shape[0], q.shape[2])
    scale = _scale(softmax_scale, q.shape[3])
    acc = lse_dtype(q.dtype)
    steps = ring_schedule(comm.rank, comm.size, q.shape[1], causal=causal, window_size=window_size, layout=layout,
                          key_length=k.shape[1], per_chunk=slopes is not None)
    variants: dict = {}
    held, spare = _kv_ring(xp, k, v)
    o_acc = lse_acc = None
    for t, step in enumerate(steps):
        pending = arriving = None
        if t + 1 < len(steps):
            pending, arriving = _next_kv(comm, xp, held, spare, t, overlap)
        for block in step.blocks:
            rows, keys = block.row_slice, block.key_slice
            o_t, lse_t = flash_attn_func(q[:, rows], held[0][:, keys], held[1][:, keys], softmax_scale=scale,
                                         causal=block.causal, window_size=block.window_size,
                                         **_block_variant(xp, block, slopes, softcap, variants), return_lse=True,
                                         backend=backend)
            if o_acc is None and block.rows == (0, q.shape[1]):  # the first block, every row: taken as it is
                o_acc, lse_acc = o_t.astype(acc), lse_t.astype(acc, copy=True)
                continue
            if o_acc is None:
                o_acc, lse_acc = _seeing_no_key(xp, q.shape, acc)
            o_rows, lse_rows = o_acc[:, rows], lse_acc[:, :, rows]
            merge_attention_states(o_rows, lse_rows, o_t, lse_t, out=o_rows, lse_out=lse_rows)
        if pending is not None:
            pending.wait()
            held = arriving
    if o_acc is None:  # no block at all (empty shards)
        o_acc, lse_acc = _seeing_no_key(xp, q.shape, acc)
    if sink is not None:
        o_acc, lse_acc = _add_sink(xp, o_acc, lse_acc, sink)
    o = o_acc.astype(q.dtype, copy=False)
    return (o, lse_acc) if return_lse else o


def _seeing_no_key(xp, q_shape, acc):
    """The running (o, lse) of rows that no block has reached yet: o = 0, lse = -inf (the merge
    gives such a side weight 0 and does not read its o)."""
    batch, seqlen, nheads, _ = q_shape
    return xp.zeros(q_shape, acc), xp.full((batch, nheads, seqlen), -np.inf, acc)


def _check_sink(xp, sink, nheads: int):
    if sink is None:
        return None
    sink = xp.asarray(sink)
    if sink.shape != (nheads,) or sink.dtype != np.float32:
        raise ValueError(f"sink must be a ({nheads},) float32 array (one logit per query head), got "
                         f"{sink.dtype} {sink.shape}")
    return sink


def _add_sink(xp, o_acc, lse_acc, sink):
    """The sink as one more key set with no value row, by the LSE rule: lse' = log(e^lse + e^sink),
    o' = e^(lse - lse') o (a row that saw no key: o = 0, lse' = sink)."""
    sink = sink.astype(lse_acc.dtype)[None, :, None]
    lse_new = xp.logaddexp(lse_acc, sink)
    weight = xp.exp(lse_acc - lse_new)  # (batch, nheads, rows)
    o_acc *= weight.transpose(0, 2, 1)[..., None]
    return o_acc, lse_new


def ring_flash_attn_backward(dout, q, k, v, out, softmax_lse, *, comm, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sink=None, layout="zigzag",
                             backend="auto", deterministic=True, overlap=True):
    """(dq, dk, dv) of this rank's shards, from ring_flash_attn_func's o and lse (this rank's);
    with a ``sink``, (dq, dk, dv, dsink), dsink (nheads,) float32 this rank's share: the sum over
    its rows of flash_attn_backward's dsink, to be summed over the ranks (as a data-parallel
    gradient reduction does for any parameter every rank holds).

    Arguments as ring_flash_attn_func's, with flash_attn_backward's order (dout, q, k, v, out,
    softmax_lse). Partial gradients accumulate in float32 (float64 for float64) and are rounded to
    the input dtype once; dk, dv of GQA sum over the query heads sharing a kv head, as always. The
    steps run without the sink: with the global lse (which includes it) each step's P is already
    the whole softmax's.
    """
    arrays = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "softmax_lse": softmax_lse}
    _check(comm, arrays, causal, window_size, layout, alibi_slopes is not None)
    batch, seqlen, nheads, _ = q.shape
    if dout.shape != q.shape or out.shape != q.shape or softmax_lse.shape != (batch, nheads, seqlen):
        raise ValueError(f"dout {dout.shape} and out {out.shape} must have q's shape {q.shape}, softmax_lse "
                         f"{softmax_lse.shape} must be {(batch, nheads, seqlen)}")
    xp = comm.xp
    sink = _check_sink(xp, sink, nheads)
    slopes = _check_slopes(xp, alibi_slopes, batch, nheads)
    scale = _scale(softmax_scale, q.shape[3])
    acc = lse_dtype(q.dtype)
    steps = ring_schedule(comm.rank, comm.size, seqlen, causal=causal, window_size=window_size, layout=layout,
                          key_length=k.shape[1], per_chunk=slopes is not None)
    variants: dict = {}
    held, spare = _kv_ring(xp, k, v)
    dq_acc = xp.zeros(q.shape, acc)
    # Two (dk, dv) accumulators: the one of the K/V held, and the one arriving from rank r - 1.
    dkv = [(xp.zeros(k.shape, acc), xp.zeros(v.shape, acc)), None]
    dkv_pending = None
    for t, step in enumerate(steps):
        pending = arriving = None
        if t + 1 < len(steps):
            pending, arriving = _next_kv(comm, xp, held, spare, t, overlap)
        grads = []
        for block in step.blocks:
            rows, keys = block.row_slice, block.key_slice
            grads.append((rows, keys, flash_attn_backward(
                dout[:, rows], q[:, rows], held[0][:, keys], held[1][:, keys], out[:, rows], softmax_lse[:, :, rows],
                softmax_scale=scale, causal=block.causal, window_size=block.window_size,
                **_block_variant(xp, block, slopes, softcap, variants), backend=backend, deterministic=deterministic)))
        if dkv_pending is not None:
            dkv_pending.wait()  # the accumulator of the K/V held, with ranks r - t .. r - 1's parts
        dk_acc, dv_acc = dkv[t % 2]
        for rows, keys, (dq_t, dk_t, dv_t) in grads:
            dq_acc[:, rows] += dq_t.astype(acc)
            dk_acc[:, keys] += dk_t.astype(acc)
            dv_acc[:, keys] += dv_t.astype(acc)
        if comm.size > 1:
            if dkv[(t + 1) % 2] is None:
                dkv[(t + 1) % 2] = (xp.empty_like(dk_acc), xp.empty_like(dv_acc))
            # After the last step this is the hop that takes each accumulator home.
            dkv_pending = comm.start_exchange((dk_acc, dv_acc), dkv[(t + 1) % 2])
            if not overlap:
                dkv_pending.wait()
        if pending is not None:
            pending.wait()
            held = arriving
    if dkv_pending is not None:
        dkv_pending.wait()
    dk_home, dv_home = dkv[len(steps) % 2] if comm.size > 1 else dkv[0]
    grads = (dq_acc.astype(q.dtype, copy=False), dk_home.astype(k.dtype, copy=False),
             dv_home.astype(v.dtype, copy=False))
    return grads + (sink_grad(sink, dout, out, softmax_lse, xp=xp),) if sink is not None else grads


def ring_flash_attn_vjp(q, k, v, *, comm, **options):
    """(o, vjp) with vjp(do) -> (dq, dk, dv), all this rank's shards: ring_flash_attn_func's
    options (softmax_scale, causal, window_size, softcap, alibi_slopes, sink, layout, backend, overlap);
    ``deterministic`` goes to the backward (with a sink, vjp returns this rank's dsink share too)."""
    deterministic = options.pop("deterministic", True)
    if "return_lse" in options:
        raise TypeError("ring_flash_attn_vjp does not take return_lse (the lse is kept for the backward)")
    o, lse = ring_flash_attn_func(q, k, v, comm=comm, return_lse=True, **options)

    def vjp(do):
        return ring_flash_attn_backward(do, q, k, v, o, lse, comm=comm, deterministic=deterministic, **options)

    return o, vjp

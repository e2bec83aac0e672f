"""Attention written straight from its definition, for testing.

``attention`` and ``attention_backward`` materialise the score matrix S and the probabilities P
in float64; they share no code with the kernels or with the NumPy twin, so an error common to
those two cannot hide here. ``standard_attention`` and ``standard_attention_backward`` compute
the same thing the way an unfused implementation does in a 16-bit dtype (rounding S, P, O and the
gradients to that dtype); their error against float64 is the yardstick of flash-attn's tolerance
rule: a fused kernel may be at most a small multiple of it.

Layouts: q (batch, seqlen_q, nheads, headdim); k (batch, seqlen_k, nheads_kv, headdim); v
(batch, seqlen_k, nheads_kv, headdim_v), headdim_v any width (o and do have it); query head h
reads kv head h // (nheads // nheads_kv). lse is (batch, nheads, seqlen_q).
Masks are aligned bottom-right, as in flash-attn 2.8: with ``window_size=(left, right)`` query i
sees key j iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right, each bound
only where that side is not -1; ``causal=True`` sets right = 0. A query that sees no key has
output 0, lse -inf and zero gradients.

Variants (flash-attn 2.8's), with z_ij = softmax_scale * q_i . k_j for query head h of batch b:
``softcap`` c > 0 replaces z by c * tanh(z / c); then ``alibi_slopes`` ((nheads,) or (batch,
nheads)) subtracts slope[b, h] * |i + seqlen_k - seqlen_q - j|; the mask then hides keys as
above. ``sink`` ((nheads,)) is a logit per query head that joins every row's softmax without a
value row: the row's weights are exp(z_ij - lse_i) with lse_i = log(sum_j exp(z_ij) + exp(sink[h]))
over its visible keys. A query that sees no key then has output 0 and lse = sink[h].

User modifiers (cupyflash.modifiers): ``score_mod(score, b, h, q_idx, kv_idx, **tensors)`` replaces
z (after softcap and ALiBi here; cupyflash's API takes it without them); ``mask_mod(b, h, q_idx, kv_idx, **tensors)`` hides the pairs it
returns False for, on top of the mask above. Both are called here on NumPy float64 and int64
arrays, the user's own functions, not their traced graphs; only the backward's dz'/dz of a score
modifier comes from the graph (cupyflash.modifiers.ScoreMod's symbolic derivative).
"""
from __future__ import annotations

import math

import numpy as np

__all__ = [
    "attention",
    "attention_backward",
    "standard_attention",
    "standard_attention_backward",
    "visible_keys",
    "varlen_attention",
    "varlen_attention_backward",
    "kvcache_sequences",
    "kvcache_appended",
    "kvcache_attention",
    "rotary",
]


def visible_keys(seqlen_q: int, seqlen_k: int, causal: bool, window_size=(-1, -1)) -> np.ndarray:
    """Boolean (seqlen_q, seqlen_k) matrix: entry (i, j) is True iff query i attends key j."""
    left, right = window_size
    if causal:
        right = 0
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    diagonal = i + (seqlen_k - seqlen_q)
    visible = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if right >= 0:
        visible &= j <= diagonal + right
    if left >= 0:
        visible &= j >= diagonal - left
    return visible


def _check_shapes(q, k, v) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be 4-d: (batch, seqlen, heads, headdim)")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k {k.shape} and v {v.shape} differ in batch, seqlen or heads")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {q.shape} and k {k.shape} differ in batch or headdim")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"nheads {q.shape[2]} is not a multiple of nheads_kv {k.shape[2]}")


def _scale(softmax_scale, headdim: int) -> float:
    return 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)


def _heads_first(x: np.ndarray, nheads: int) -> np.ndarray:
    """(batch, seqlen, heads, dim) -> (batch, nheads, seqlen, dim), kv heads repeated for GQA."""
    x = np.moveaxis(x, 2, 1)
    return np.repeat(x, nheads // x.shape[1], axis=1)


def _seqlen_first(x: np.ndarray, nheads_out: int) -> np.ndarray:
    """(batch, nheads, seqlen, dim) -> (batch, seqlen, nheads_out, dim), summing the query heads
    that share one kv head when nheads_out < nheads."""
    b, h, s, d = x.shape
    x = x.reshape(b, nheads_out, h // nheads_out, s, d).sum(axis=2)
    return np.ascontiguousarray(np.moveaxis(x, 1, 2))


def _sum_over_visible(weights: np.ndarray, rows: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """out[..., i, :] = sum over keys j visible to query i of weights[..., i, j] * rows[..., j, :].

    A plain ``weights @ rows`` would turn 0 * NaN into NaN, letting a non-finite row of a key
    that query i does not see leak into query i. Every mask here keeps one contiguous run of
    keys per query, so queries are grouped by their run and only the run is summed.
    """
    count = mask.sum(axis=1)
    first = mask.argmax(axis=1) if mask.shape[1] else count
    out = np.zeros(weights.shape[:-1] + rows.shape[-1:], dtype=np.float64)
    for start, n in set(zip(first.tolist(), count.tolist())):
        if n == 0:
            continue
        queries = np.flatnonzero((first == start) & (count == n))
        out[..., queries, :] = weights[..., queries, start:start + n] @ rows[..., start:start + n, :]
    return out


def _check_variant(softcap, alibi_slopes, sink, batch: int, nheads: int) -> float:
    """softcap as a float, after checking it and the shapes of the slopes and sinks."""
    softcap = float(softcap)
    if not softcap >= 0:
        raise ValueError(f"softcap must be >= 0 (0: no cap), got {softcap}")
    if alibi_slopes is not None and np.shape(alibi_slopes) not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes {np.shape(alibi_slopes)} must be (nheads,) = ({nheads},) "
                         f"or (batch, nheads) = ({batch}, {nheads})")
    if sink is not None and np.shape(sink) != (nheads,):
        raise ValueError(f"sink {np.shape(sink)} must be (nheads,) = ({nheads},)")
    return softcap


def _per_head(values, batch: int, nheads: int, dtype):
    """Per-head values ((nheads,) or (batch, nheads)) as a (batch, nheads, 1, 1) array of
    ``dtype``, which broadcasts over (batch, nheads, seqlen_q, seqlen_k); None stays None."""
    if values is None:
        return None
    values = np.asarray(values).astype(dtype)
    return np.broadcast_to(values, (batch, nheads))[:, :, None, None]


def _alibi_distances(seqlen_q: int, seqlen_k: int, dtype) -> np.ndarray:
    """|i + seqlen_k - seqlen_q - j|, (seqlen_q, seqlen_k): ALiBi's distance of key j from query
    i's bottom-right diagonal."""
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    return np.abs(i + (seqlen_k - seqlen_q) - j).astype(dtype)


def _user_mods(score_mod, mask_mod):
    """(score_mod, mask_mod) as cupyflash.modifiers objects (a bare function: one reading no
    tensors), or Nones."""
    if score_mod is None and mask_mod is None:
        return None
    from .modifiers import MaskMod, ScoreMod

    score_mod = score_mod if score_mod is None or isinstance(score_mod, ScoreMod) else ScoreMod(score_mod)
    mask_mod = mask_mod if mask_mod is None or isinstance(mask_mod, MaskMod) else MaskMod(mask_mod)
    return score_mod, mask_mod


def _index_grids(shape):
    """b, h, q_idx, kv_idx as int64 arrays that broadcast to (batch, nheads, seqlen_q, seqlen_k)."""
    b, h, sq, sk = shape
    return (np.arange(b)[:, None, None, None], np.arange(h)[None, :, None, None],
            np.arange(sq)[None, None, :, None], np.arange(sk)[None, None, None, :])


def _host_tensors(mod) -> dict:
    from ._arrays import to_numpy

    return {t.name: to_numpy(t.array, t.name) for t in mod.tensors}


def _user_visible(user, shape):
    """The mask modifier's pairs, (batch, nheads, seqlen_q, seqlen_k) bool, or None."""
    if user is None or user[1] is None:
        return None
    mod = user[1]
    keep = np.asarray(mod.fn(*_index_grids(shape), **_host_tensors(mod)))
    if keep.dtype != np.bool_:
        raise TypeError(f"mask_mod {mod.fn.__name__} returned {keep.dtype} on NumPy arrays, not bool")
    return np.broadcast_to(keep, shape)


def _user_scores(z, user, acc: np.dtype, rnd):
    """(z', dz'/dz) of the score modifier: z' from the user's function on z (in ``acc``, rounded by
    ``rnd``), dz'/dz from its traced graph (None where it is 1); (z, None) without one."""
    if user is None or user[0] is None:
        return z, None
    from .modifiers import Modifiers

    mod = user[0]
    grids = _index_grids(z.shape)
    with np.errstate(all="ignore"):
        out = np.asarray(mod.fn(z, *grids, **_host_tensors(mod)))
    z_new = rnd(np.broadcast_to(out, z.shape).astype(acc))
    host = Modifiers(mod, None).to(np)
    _, dz_dz = host.scores(z, *(g.astype(np.int32) for g in grids), acc)
    return z_new, None if dz_dz is None else np.broadcast_to(dz_dz, z.shape).astype(acc)


def _transformed_scores(z, softcap: float, slopes, acc: np.dtype, rnd, user=None):
    """(z', dz'/dz): the variant's transform of the scaled scores z (batch, nheads, seqlen_q,
    seqlen_k), the cap first, then ALiBi's bias (``slopes`` (batch, nheads, 1, 1) or None), each
    step computed in ``acc`` and passed through ``rnd``. dz'/dz is None without a cap (ALiBi's bias
    is additive)."""
    dz_dz = None
    if softcap > 0:
        cap = acc.type(softcap)
        t = np.tanh(z / cap)
        z = rnd(cap * t)
        dz_dz = 1 - t * t
    if slopes is not None:
        z = rnd(z - slopes * _alibi_distances(z.shape[-2], z.shape[-1], acc))
    if user is not None and user[0] is not None:
        z, dz_dz = _user_scores(z, user, acc, rnd)
    return z, dz_dz


def _softmax_with_sink(s, sink):
    """Row softmax of s (-inf where a key is hidden) whose denominator also holds exp(sink) when
    ``sink`` ((batch, nheads, 1, 1)) is given: (p, p_sink, lse), p_sink the sink's weight
    (batch, nheads, seqlen_q, 1) or None. A row with nothing to weigh (no visible key and no
    sink) gets p = 0 and lse = -inf."""
    top = s.max(axis=-1, keepdims=True, initial=-np.inf)
    if sink is not None:
        top = np.maximum(top, sink)
    weighs_something = np.isfinite(top)
    e = np.exp(s - np.where(weighs_something, top, 0))  # exactly 0 where hidden
    denom = e.sum(axis=-1, keepdims=True)
    p_sink = None
    if sink is not None:
        e_sink = np.exp(sink - np.where(weighs_something, top, 0))
        denom = denom + e_sink
        p_sink = e_sink / np.where(weighs_something, denom, 1)
    p = e / np.where(weighs_something, denom, 1)
    with np.errstate(divide="ignore"):
        lse = np.where(weighs_something, top + np.log(denom), -np.inf)[..., 0]
    return p, p_sink, lse


def _exact(x):
    return x


def _dropped(x, dropout_p, dropout_mask, acc=np.float64):
    """x o Z / (1 - dropout_p) for a (batch, nheads, seqlen_q, seqlen_k) x (x itself without a mask)."""
    if dropout_mask is None:
        return x
    keep = np.asarray(dropout_mask, dtype=bool)
    if keep.shape != x.shape:
        raise ValueError(f"dropout_mask must have shape {x.shape}, got {keep.shape}")
    return np.where(keep, x * np.dtype(acc).type(1.0 / (1.0 - float(dropout_p))), np.dtype(acc).type(0))


def _probabilities(q, k, scale, causal, window_size=(-1, -1), softcap=0.0, slopes=None, sink=None, user=None):
    """P = softmax(z') over the visible keys (and the sink), in float64, z' the variant's transform
    of z = scale * Q K^T: (P, the sink's weight, lse, the band's mask, dz'/dz, the mask with the
    user's mask modifier: the band's where there is none)."""
    mask = visible_keys(q.shape[2], k.shape[2], causal, window_size)
    z, dz_dz = _transformed_scores(scale * (q @ np.swapaxes(k, -1, -2)), softcap, slopes,
                                   np.dtype(np.float64), _exact, user)
    keep = _user_visible(user, z.shape)
    visible = mask if keep is None else mask & keep
    p, p_sink, lse = _softmax_with_sink(np.where(visible, z, -np.inf), sink)
    return p, p_sink, lse, mask, dz_dz, visible


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, sink=None, score_mod=None, mask_mod=None, dropout_p=0.0, dropout_mask=None):
    """Exact attention in float64: (o, lse), o (batch, seqlen_q, nheads, headdim_v), lse (batch,
    nheads, seqlen_q).
    ``softcap``, ``alibi_slopes`` and ``sink``: the variants of the module docstring. Dropout:
    ``dropout_mask`` (batch, nheads, seqlen_q, seqlen_k) bool, True where a weight is kept, and
    ``dropout_p``: o = (P o Z / (1 - dropout_p)) V; lse is the softmax's."""
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    _check_shapes(q, k, v)
    batch, nheads = q.shape[0], q.shape[2]
    softcap = _check_variant(softcap, alibi_slopes, sink, batch, nheads)
    q_, k_, v_ = _heads_first(q, nheads), _heads_first(k, nheads), _heads_first(v, nheads)
    p, _, lse, mask, _, _ = _probabilities(q_, k_, _scale(softmax_scale, q.shape[3]), causal, window_size, softcap,
                                           _per_head(alibi_slopes, batch, nheads, np.float64),
                                           _per_head(sink, batch, nheads, np.float64), _user_mods(score_mod, mask_mod))
    o = _sum_over_visible(_dropped(p, dropout_p, dropout_mask), v_, mask)
    return _seqlen_first(o, nheads), lse


def attention_backward(do, q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                       alibi_slopes=None, sink=None, score_mod=None, mask_mod=None, dropout_p=0.0,
                       dropout_mask=None):
    """Gradients (dq, dk, dv) in float64 of sum(do * o) with o = attention(q, k, v, ...); with a
    ``sink``, (dq, dk, dv, dsink), dsink (nheads,).

    dS is formed from the softmax Jacobian, dS_i = (diag(P_i) - P_i P_i^T) dP_i, rather than
    from rowsum(dO * O), so that this stays independent of the fused formulation. With a sink the
    Jacobian's row spans the visible keys and the sink, whose dP is 0 (it has no value row); its
    column of dS, summed over batch and queries, is dsink. A cap multiplies dS by dz'/dz. With
    dropout (``attention``'s arguments) o = W V, W = P o Z / (1 - p): dV = W^T dO, and the
    Jacobian takes dP = (dO V^T) o Z / (1 - p).
    """
    do, q, k, v = (np.asarray(x).astype(np.float64) for x in (do, q, k, v))
    _check_shapes(q, k, v)
    if do.shape != q.shape[:3] + v.shape[3:]:
        raise ValueError(f"do {do.shape} must have the shape of the output {q.shape[:3] + v.shape[3:]}")
    batch, nheads, nheads_kv = q.shape[0], q.shape[2], k.shape[2]
    softcap = _check_variant(softcap, alibi_slopes, sink, batch, nheads)
    scale = _scale(softmax_scale, q.shape[3])
    q_, k_, v_, do_ = (_heads_first(x, nheads) for x in (q, k, v, do))
    p, p_sink, _, mask, dz_dz, visible = _probabilities(q_, k_, scale, causal, window_size, softcap,
                                                        _per_head(alibi_slopes, batch, nheads, np.float64),
                                                        _per_head(sink, batch, nheads, np.float64),
                                                        _user_mods(score_mod, mask_mod))
    dp = np.where(visible, _dropped(do_ @ np.swapaxes(v_, -1, -2), dropout_p, dropout_mask), 0.0)
    weighted_dp = (p * dp).sum(axis=-1, keepdims=True)  # the sink's term p_sink * 0 adds nothing
    ds = p * dp - p * weighted_dp
    if dz_dz is not None:
        ds = np.where(visible, ds * dz_dz, 0.0)  # a hidden key's score may be NaN
    dq = scale * _sum_over_visible(ds, k_, mask)
    dk = scale * (np.swapaxes(ds, -1, -2) @ q_)
    dv = np.swapaxes(_dropped(p, dropout_p, dropout_mask), -1, -2) @ do_
    grads = (
        _seqlen_first(dq, nheads),
        _seqlen_first(dk, nheads_kv),
        _seqlen_first(dv, nheads_kv),
    )
    if sink is None:
        return grads
    ds_sink = p_sink * (0.0 - weighted_dp)
    return (*grads, ds_sink.sum(axis=(0, 2, 3)))


# Standard (unfused) attention in a given dtype: the baseline of the tolerance rule.


def _accumulator(dtype) -> np.dtype:
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _rounder(dtype):
    """Rounds an accumulator array to ``dtype`` (round to nearest even) and back, so that the
    value is representable in ``dtype`` while arithmetic stays in the accumulator type."""
    dtype, acc = np.dtype(dtype), _accumulator(dtype)
    return lambda x: np.asarray(x).astype(acc).astype(dtype).astype(acc)


def _standard_softmax(q, k, scale, causal, dtype, window_size=(-1, -1), softcap=0.0, slopes=None, sink=None,
                      user=None):
    """(P, the sink's weight, lse, dz'/dz) of standard attention in ``dtype``: S = Q K^T rounded,
    then scaled and rounded, each transform of the variant in the accumulator type and rounded,
    then a softmax in the accumulator type (the sink logit rounded to ``dtype`` as one more column
    of S) whose results are rounded. ``slopes`` and ``sink``: (batch, nheads, 1, 1) or None, in
    the accumulator type."""
    rnd, acc = _rounder(dtype), _accumulator(dtype)
    mask = visible_keys(q.shape[2], k.shape[2], causal, window_size)
    s = rnd(rnd(q @ np.swapaxes(k, -1, -2)) * acc.type(scale))
    s, dz_dz = _transformed_scores(s, softcap, slopes, acc, rnd, user)
    keep = _user_visible(user, s.shape)
    p, p_sink, lse = _softmax_with_sink(np.where(mask if keep is None else mask & keep, s, -np.inf),
                                        None if sink is None else rnd(sink))
    return rnd(p), None if p_sink is None else rnd(p_sink), lse.astype(acc), dz_dz


def _standard_probabilities(q, k, scale, causal, dtype, window_size=(-1, -1)):
    """P of standard attention in ``dtype``: S = Q K^T rounded, then scaled and rounded, then a
    softmax in the accumulator type whose result is rounded; and lse."""
    p, _, lse, _ = _standard_softmax(q, k, scale, causal, dtype, window_size)
    return p, lse


def _standard_inputs(dtype, nheads, *xs):
    rnd = _rounder(dtype)
    return [_heads_first(rnd(np.asarray(x)), nheads) for x in xs]


def standard_attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                       alibi_slopes=None, sink=None, score_mod=None, mask_mod=None, dropout_p=0.0,
                       dropout_mask=None, dtype):
    """Attention as an unfused implementation computes it in ``dtype``: returns (o, lse).

    Inputs are rounded to ``dtype``; products accumulate in float32 (float64 for float64) and are
    rounded to ``dtype`` where an unfused implementation stores them (S, each transform of S, P,
    O). o has ``dtype``; lse comes from the accumulator-precision softmax and has the accumulator
    type. A query that sees no key gets o = 0 and lse = -inf, or the sink (an unfused softmax
    would give NaN without one).
    """
    dtype = np.dtype(dtype)
    q, k, v = (np.asarray(x) for x in (q, k, v))
    _check_shapes(q, k, v)
    batch, nheads = q.shape[0], q.shape[2]
    softcap = _check_variant(softcap, alibi_slopes, sink, batch, nheads)
    acc = _accumulator(dtype)
    q_, k_, v_ = _standard_inputs(dtype, nheads, q, k, v)
    p, _, lse, _ = _standard_softmax(q_, k_, _scale(softmax_scale, q.shape[3]), causal, dtype, window_size, softcap,
                                     _per_head(alibi_slopes, batch, nheads, acc), _per_head(sink, batch, nheads, acc),
                                     _user_mods(score_mod, mask_mod))
    rnd = _rounder(dtype)
    o = rnd(rnd(_dropped(p, dropout_p, dropout_mask, acc)) @ v_)  # dropout's W stored, as unfused code does
    return _seqlen_first(o, nheads).astype(dtype), lse


def standard_attention_backward(do, q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                                softcap=0.0, alibi_slopes=None, sink=None, score_mod=None, mask_mod=None,
                                dropout_p=0.0, dropout_mask=None, dtype):
    """Gradients (dq, dk, dv) as an unfused implementation computes them in ``dtype``; with a
    ``sink``, (dq, dk, dv, dsink), dsink (nheads,) in the accumulator type.

    Rounded to ``dtype``: P, dP = dO V^T, dS = P * (dP - rowsum(P * dP)) (formed in the
    accumulator type, as a softmax backward does), dS times the cap's dz'/dz, scale * dS, and each
    gradient. For GQA the per-query-head dk, dv are rounded, then summed in the accumulator type
    and rounded again. The sink's column of dS (its dP is 0) is rounded, summed over batch and
    queries in the accumulator type and rounded.
    """
    dtype = np.dtype(dtype)
    do, q, k, v = (np.asarray(x) for x in (do, q, k, v))
    _check_shapes(q, k, v)
    batch, nheads, nheads_kv = q.shape[0], q.shape[2], k.shape[2]
    softcap = _check_variant(softcap, alibi_slopes, sink, batch, nheads)
    scale = _scale(softmax_scale, q.shape[3])
    rnd, acc = _rounder(dtype), _accumulator(dtype)
    q_, k_, v_, do_ = _standard_inputs(dtype, nheads, q, k, v, do)
    p, p_sink, _, dz_dz = _standard_softmax(q_, k_, scale, causal, dtype, window_size, softcap,
                                            _per_head(alibi_slopes, batch, nheads, acc),
                                            _per_head(sink, batch, nheads, acc), _user_mods(score_mod, mask_mod))
    dv = rnd(np.swapaxes(rnd(_dropped(p, dropout_p, dropout_mask, acc)), -1, -2) @ do_)
    dp = rnd(do_ @ np.swapaxes(v_, -1, -2))
    if dropout_mask is not None:
        dp = rnd(_dropped(dp, dropout_p, dropout_mask, acc))
    weighted_dp = (p * dp).sum(axis=-1, keepdims=True)
    ds = rnd(p * (dp - weighted_dp))
    if dz_dz is not None:
        ds = rnd(np.where(p > 0, ds * dz_dz, 0.0))  # a hidden key's dz'/dz may be NaN
    ds = rnd(ds * acc.type(scale))
    dq = rnd(ds @ k_)
    dk = rnd(np.swapaxes(ds, -1, -2) @ q_)
    grads = tuple(
        _seqlen_first(g, n).astype(dtype)
        for g, n in ((dq, nheads), (dk, nheads_kv), (dv, nheads_kv))
    )
    if sink is None:
        return grads
    ds_sink = rnd(p_sink * (0 - weighted_dp))
    return (*grads, rnd(ds_sink.sum(axis=(0, 2, 3))))


# Packed variable-length batches and KV caches, from the same definitions: each sequence is one
# attention problem of its own, computed by ``attention`` above. Nothing here reads cupyflash's
# checks or layouts; index arguments are taken as given.


def _sequence_ranges(cu_seqlens) -> list[tuple[int, int]]:
    cu = [int(x) for x in np.asarray(cu_seqlens).reshape(-1)]
    return list(zip(cu[:-1], cu[1:]))


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale=None, causal=False,
                     window_size=(-1, -1)):
    """Exact attention in float64 over a packed batch: q (total_q, nheads, headdim), k, v (total_k,
    nheads_kv, headdim); sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q and
    cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1 of k and v, masked with its own lengths. Returns
    (o, lse): o (total_q, nheads, headdim_v), lse (nheads, total_q)."""
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    o = np.zeros(q.shape[:2] + v.shape[2:])
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for (q0, q1), (k0, k1) in zip(_sequence_ranges(cu_seqlens_q), _sequence_ranges(cu_seqlens_k)):
        o_b, lse_b = attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], softmax_scale=softmax_scale,
                               causal=causal, window_size=window_size)
        o[q0:q1], lse[:, q0:q1] = o_b[0], lse_b[0]
    return o, lse


def varlen_attention_backward(do, q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale=None, causal=False,
                              window_size=(-1, -1)):
    """Gradients (dq, dk, dv) in float64 of sum(do * o) with o = varlen_attention(q, k, v, ...);
    packed like q, k and v."""
    do, q, k, v = (np.asarray(x).astype(np.float64) for x in (do, q, k, v))
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for (q0, q1), (k0, k1) in zip(_sequence_ranges(cu_seqlens_q), _sequence_ranges(cu_seqlens_k)):
        dq_b, dk_b, dv_b = attention_backward(do[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                                              softmax_scale=softmax_scale, causal=causal, window_size=window_size)
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = dq_b[0], dk_b[0], dv_b[0]
    return dq, dk, dv


def _cache_position(b: int, p: int, cache, cache_batch_idx, block_table):
    """(first, second) index of position p of sequence b in a cache: (row, p) of a contiguous
    cache, (page, slot) of a paged one (num_blocks, page_size, ...)."""
    if block_table is not None:
        page_size = cache.shape[1]
        return int(np.asarray(block_table)[b, p // page_size]), p % page_size
    row = b if cache_batch_idx is None else int(np.asarray(cache_batch_idx)[b])
    return row, p


def _cached_lengths(batch: int, k_cache, cache_seqlens, block_table) -> list[int]:
    if cache_seqlens is None:  # the whole row, or every page of the table
        capacity = k_cache.shape[1] * (1 if block_table is None else np.asarray(block_table).shape[1])
        return [capacity] * batch
    if np.ndim(cache_seqlens) == 0:
        return [int(cache_seqlens)] * batch
    return [int(n) for n in np.asarray(cache_seqlens)]


def kvcache_sequences(batch, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, cache_batch_idx=None,
                      block_table=None, cache_leftpad=None):
    """[(K_b, V_b)] for b < batch: the keys and values sequence b attends to after the append, in
    the caches' dtype, (cache_seqlens[b] - cache_leftpad[b] + seqlen_new, nheads_kv, headdim). Its
    cached tokens are read one position at a time, positions cache_leftpad[b] (0 without it) ..
    cache_seqlens[b] - 1: position p from row cache_batch_idx[b] (b without it) at p, or from page
    block_table[b, p // page_size] at slot p % page_size; then its new k[b], v[b]."""
    k_cache, v_cache = np.asarray(k_cache), np.asarray(v_cache)
    lengths = _cached_lengths(batch, k_cache, cache_seqlens, block_table)
    firsts = [0] * batch if cache_leftpad is None else [int(p) for p in np.asarray(cache_leftpad)]
    sequences = []
    for b in range(batch):
        keys = [k_cache[_cache_position(b, p, k_cache, cache_batch_idx, block_table)]
                for p in range(firsts[b], lengths[b])]
        values = [v_cache[_cache_position(b, p, v_cache, cache_batch_idx, block_table)]
                  for p in range(firsts[b], lengths[b])]
        if k is not None:
            keys += list(np.asarray(k)[b])
            values += list(np.asarray(v)[b])
        sequences.append((np.stack(keys) if keys else np.zeros((0,) + k_cache.shape[2:], k_cache.dtype),
                          np.stack(values) if values else np.zeros((0,) + v_cache.shape[2:], v_cache.dtype)))
    return sequences


def kvcache_appended(cache, new, *, cache_seqlens, cache_batch_idx=None, block_table=None):
    """A copy of ``cache`` with ``new`` (batch, seqlen_new, nheads_kv, headdim) written where the
    append puts it: token t of sequence b at position cache_seqlens[b] + t, one position at a
    time (row and page addressing as in kvcache_sequences). Everything else is the cache's own."""
    out = np.array(cache, copy=True)
    new = np.asarray(new)
    lengths = _cached_lengths(new.shape[0], out, cache_seqlens, block_table)
    for b in range(new.shape[0]):
        for t in range(new.shape[1]):
            out[_cache_position(b, lengths[b] + t, out, cache_batch_idx, block_table)] = new[b, t]
    return out


def rotary(x, cos, sin, positions, *, interleaved):
    """Rotary position embedding in float64, from its definition as complex rotation: the first
    rotary_dim = 2 * cos.shape[1] entries of each row of x (..., tokens, heads, headdim) form
    complex numbers z_i = x1_i + 1j x2_i, with (x1_i, x2_i) = (x[2i], x[2i + 1]) when
    ``interleaved`` (GPT-J) and (x[i], x[i + rotary_dim / 2]) otherwise (GPT-NeoX); each is
    multiplied by cos[p, i] + 1j sin[p, i] for the row's position p (``positions`` (..., tokens)).
    The remaining entries are x's. Returns float64."""
    x = np.asarray(x).astype(np.float64)
    cos, sin = np.asarray(cos).astype(np.float64), np.asarray(sin).astype(np.float64)
    half = cos.shape[1]
    positions = np.asarray(positions)
    turn = (cos[positions] + 1j * sin[positions])[..., None, :]  # (..., tokens, 1, half)
    first, second = (slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if interleaved else \
        (slice(0, half), slice(half, 2 * half))
    z = (x[..., first] + 1j * x[..., second]) * turn
    out = x.copy()
    out[..., first], out[..., second] = z.real, z.imag
    return out


def kvcache_attention(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, cache_batch_idx=None,
                      block_table=None, cache_leftpad=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                      softcap=0.0, alibi_slopes=None, sink=None):
    """Exact attention in float64 of q (batch, seqlen_q, nheads, headdim) over each sequence's
    cached and new tokens (kvcache_sequences), the mask aligned to the end of them (seqlen_k =
    cache_seqlens[b] - cache_leftpad[b] + seqlen_new). Returns (o, lse): o (batch, seqlen_q, nheads, v_cache's
    headdim), lse (batch, nheads, seqlen_q).
    ``softcap``, ``alibi_slopes`` ((nheads,), or (batch, nheads): row b for sequence b) and ``sink``
    are attention's, per sequence."""
    q = np.asarray(q).astype(np.float64)
    batch, seqlen_q, nheads, _ = q.shape
    o = np.zeros(q.shape[:3] + np.shape(v_cache)[-1:])
    lse = np.full((batch, nheads, seqlen_q), -np.inf)
    sequences = kvcache_sequences(batch, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                  cache_batch_idx=cache_batch_idx, block_table=block_table,
                                  cache_leftpad=cache_leftpad)
    for b, (keys, values) in enumerate(sequences):
        slopes = None if alibi_slopes is None else np.asarray(alibi_slopes)
        if slopes is not None and slopes.ndim == 2:
            slopes = slopes[b:b + 1]
        o_b, lse_b = attention(q[b:b + 1], keys[None], values[None], softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size, softcap=softcap, alibi_slopes=slopes, sink=sink)
        o[b], lse[b] = o_b[0], lse_b[0]
    return o, lse

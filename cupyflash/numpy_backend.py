"""The tiled FlashAttention algorithm in NumPy: a readable twin of the CUDA kernels.

Same blocks, same loop order and the same numerics as ``kernels_cu/``, vectorised over batch and
heads instead of threads, and written in the paper's notation: query blocks Q_i of Br rows
(Tr of them), key/value blocks K_j, V_j of Bc rows (Tc of them), running row maximum m_i and
row sum l_i, and the rescale factor exp(m_old - m_new) applied when m_i grows.

Numerics shared with the kernels:
- 16-bit and float32 inputs are computed in float32, float64 in float64; P is not rounded to
  the input dtype before P V.
- Scores are kept in log2 units: log2(e) is folded into the softmax scale, so every exponential
  is an exp2 and the saved lse (natural log) is converted once per row.
- A row that has seen no visible key yet has m_i = -inf; its exponentials are taken against 0
  instead, so they come out 0 rather than exp2(-inf - -inf) = NaN. Such a row ends with o = 0,
  lse = -inf, and gets zero gradients.
- Variants (cupyflash.scores) transform the log2-unit scores where the kernels do (score.cuh's
  ScoreFn with unit ln 2): the cap c as (c log2(e)) tanh(s / (c log2(e))), ALiBi's bias as
  slope log2(e) |i + seqlen_k - seqlen_q - j|, both before the mask; the backward multiplies dS by
  the cap's 1 - tanh^2. A sink joins each row's sum in the forward's epilogue only (lse carries
  it to the backward; dsink comes from D and lse: cupyflash.scores.sink_grad).
- Dropout (cupyflash.dropout) zeroes the dropped weights after the row sum and multiplies O by
  1 / (1 - p) at the end; the backward's dV takes the kept weights, dS = P (Z dP / (1 - p) - D).

Arrays arrive validated: NumPy arrays of one float dtype in the (batch, seqlen, heads, headdim)
layout, with nheads a multiple of nheads_kv.
"""
from __future__ import annotations

import math

import numpy as np

from .masks import mask_for
from .precision import round_tf32, rounds_operands
from .scores import NO_VARIANT

__all__ = ["forward", "backward", "kvcache_forward"]

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)
LN2 = 0.6931471805599453  # ln(2): ln(x) == log2(x) * LN2


def _accumulator(dtype) -> np.dtype:
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _heads_first(x: np.ndarray, acc: np.dtype, nheads: int) -> np.ndarray:
    """(batch, seqlen, heads, dim) -> (batch, nheads, seqlen, dim) in the accumulator type; query
    head h reads kv head h // (nheads // nheads_kv)."""
    x = np.moveaxis(x, 2, 1).astype(acc)
    kv_head = np.arange(nheads) // max(nheads // max(x.shape[1], 1), 1)  # zero heads: no group
    return x[:, kv_head]


def _block_mask(mask, rows: slice, cols: slice, seqlen_q: int, seqlen_k: int):
    """Visibility inside one (Br, Bc) block, or None where the block needs no element mask."""
    if not mask.partial(rows.start, rows.stop - rows.start, cols.start, cols.stop - cols.start, seqlen_q, seqlen_k):
        return None
    return mask.visible(np.arange(rows.start, rows.stop), np.arange(cols.start, cols.stop), seqlen_q, seqlen_k)


class _ScoreTransform:
    """The variant's transform of log2-unit scores in the accumulator type ``acc``."""

    def __init__(self, variant, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, acc: np.dtype):
        self.acc = acc
        self.mods = variant.mods  # cupyflash.modifiers.Modifiers with NumPy tensors, or None
        first = 0 if self.mods is None else self.mods.first_sequence  # a packed batch's sequence run alone
        self.b = np.arange(first, first + batch, dtype=np.int32)[:, None, None, None]
        self.h = np.arange(nheads, dtype=np.int32)[None, :, None, None]
        self.cap_log2 = acc.type(variant.softcap * LOG2E) if variant.softcap > 0 else None
        slopes = variant.slopes(batch, nheads)
        self.slopes_log2 = None if slopes is None else (slopes.astype(acc) * acc.type(LOG2E))[:, :, None, None]
        self.diag = seqlen_k - seqlen_q

    def __call__(self, S, rows: slice, cols: slice):
        """(S', dS'/dS) of the block (rows, cols) of S (S itself without a transform); dS'/dS is
        None without a cap."""
        dS_dS = None
        if self.cap_log2 is not None:
            t = np.tanh(S / self.cap_log2)
            S = self.cap_log2 * t
            dS_dS = 1 - t * t
        if self.slopes_log2 is not None:
            i = np.arange(rows.start, rows.stop)[:, None]
            j = np.arange(cols.start, cols.stop)[None, :]
            S = S - self.slopes_log2 * np.abs(i + self.diag - j).astype(self.acc)
        if self.mods is not None:
            S, dS_dS = self._user(S, rows, cols)
        return S, dS_dS

    def _user(self, S, rows: slice, cols: slice):
        """The user modifiers on log2-unit scores, as score.cuh's UserScoreFn: z = ln 2 S through
        score_mod, back to log2 units; pairs the mask_mod hides -inf with dS'/dS = 0."""
        acc = self.acc
        q = np.arange(rows.start, rows.stop, dtype=np.int32)[None, None, :, None]
        kv = np.arange(cols.start, cols.stop, dtype=np.int32)[None, None, None, :]
        dS_dS = None
        if self.mods.has_score:
            z, dS_dS = self.mods.scores(S * acc.type(LN2), self.b, self.h, q, kv, acc)
            S = z * acc.type(LOG2E)
        if self.mods.has_mask:
            keep = self.mods.visible(self.b, self.h, q, kv)
            S = np.where(keep, S, -np.inf).astype(acc)
            if dS_dS is not None:
                dS_dS = np.where(keep, dS_dS, 0).astype(acc)
        return S, dS_dS


def _map_range(variant, table: str, start: int, count: int, other_block: int) -> tuple[int, int] | None:
    """The block map's range (in indices of the other axis, whole granules) for indices [start,
    start + count) of one axis, as mask.cuh's WithScore reads it, as a union over every (batch,
    head) (the twin handles all of them at once); None without a map. ``table``: "key" (the keys
    of query rows) or "query" (the queries of key rows)."""
    mods = variant.mods
    if mods is None or not mods.has_map or count <= 0:
        return None
    bm = mods.block_mask
    G = bm.GRANULE
    key, query = bm.tables(1, np)
    t = key if table == "key" else query
    first = int(t[..., start // G, 0].min()) * G
    end = int(t[..., (start + count - 1) // G, 1].max()) * G
    return first, max(first, end)


def _narrowed(blocks: range, block: int, limits) -> range:
    """``blocks`` (of ``block`` indices each) less those wholly outside ``limits`` = [first, end)."""
    if limits is None:
        return blocks
    first, end = limits
    return range(max(blocks.start, first // block), min(blocks.stop, -(-end // block))) if end > first else range(0)


def _keep(dropout, batch: int, nheads: int, rows: slice, cols: slice) -> np.ndarray:
    """The dropout keep bits (batch, nheads, rows, cols) of one block (cupyflash.dropout)."""
    return dropout.keep(np.arange(batch)[:, None, None, None], np.arange(nheads)[None, :, None, None], nheads,
                        np.arange(rows.start, rows.stop)[:, None], np.arange(cols.start, cols.stop)[None, :])


def _finish_rows_log2(m, l, sink2, acc):
    """(factor of each row's O, top, log2 of the sum over top) from its maximum m and sum l (log2
    units) when the sink logit ``sink2`` (broadcast against m; -inf: none) joins the sum
    (score.cuh's finish_row_log2): lse = top + log2_sum in log2 units; O = 0 and lse = sink for a
    row that saw no key, and top = -inf, log2_sum = 0 for a row that weighs nothing."""
    seen_a_key = l > 0
    top = np.where(seen_a_key, np.maximum(m, sink2), sink2).astype(acc)
    weighs_something = top != -np.inf
    top_safe = np.where(weighs_something, top, acc.type(0))
    own = np.where(seen_a_key, np.exp2(m - top_safe), acc.type(0))
    denom = l * own + np.exp2(sink2 - top_safe)
    denom_safe = np.where(weighs_something, denom, acc.type(1))
    factor = np.where(weighs_something, own / denom_safe, acc.type(0))
    return factor, top, np.log2(denom_safe).astype(acc)


def _finish_rows_with_sink(m, l, sink_log2, acc):
    """_finish_rows_log2 for the sink logits ``sink_log2`` (nheads,): (factor, lse in natural log)."""
    factor, top, log2_sum = _finish_rows_log2(m, l, sink_log2[None, :, None], acc)
    return factor, (top + log2_sum) * acc.type(LN2)


def _recomputed_statistics(blocks, scores_and_dp, shape, acc, sink_log2):
    """(top, weight, dp_ref, D - dp_ref) of every row from one walk over ``blocks`` ((cols,
    [rows, ...]) pairs) with an online maximum, as flash_bwd_stats_simt: P_ij = 2^(S_ij - top)
    weight (top the row's largest score, log2 units), dp_ref the dP of the row's top key and
    D = sum_j P_ij dP_ij kept as D - dp_ref, summed as sum_j P_ij (dP_ij - dp_ref) so that it does
    not cancel. A one-hot row gets top = its key's score, weight = 1, dp_ref = its key's dP and
    D - dp_ref = the other keys' small sum, exactly. ``sink_log2``: (nheads,) sink logits in log2
    units, or None. The recipe is the kernel's, not its every rounding: a tie for the maximum takes
    the first key here (the kernel: the larger dP), and nothing is flushed to zero."""
    m = np.full(shape, -np.inf, acc)
    l = np.zeros(shape, acc)
    w = np.zeros(shape, acc)  # sum_j 2^(S_j - m) (dP_j - ref)
    ref = np.zeros(shape, acc)
    with np.errstate(invalid="ignore"):  # -inf - -inf where a row has seen no key yet
        for cols, row_blocks in blocks:
            for rows in row_blocks:
                S, _, dP, _ = scores_and_dp(rows, cols)
                best = S.argmax(axis=-1)[..., None]
                block_max = np.take_along_axis(S, best, axis=-1)[..., 0]
                block_ref = np.take_along_axis(dP, best, axis=-1)[..., 0]
                m_old, ref_old = m[:, :, rows], ref[:, :, rows]
                m_new = np.maximum(m_old, block_max)
                ref_new = np.where(block_max > m_old, block_ref, ref_old).astype(acc)
                base = np.where(m_new == -np.inf, acc.type(0), m_new)
                rescale = np.exp2(m_old - base)
                e = np.exp2(S - base[..., None])
                shifted = np.where(ref_new == ref_old, w[:, :, rows], w[:, :, rows] + l[:, :, rows] * (ref_old - ref_new))
                w[:, :, rows] = shifted * rescale + np.where(S == -np.inf, acc.type(0),
                                                             e * (dP - ref_new[..., None])).sum(axis=-1)
                l[:, :, rows] = l[:, :, rows] * rescale + e.sum(axis=-1)
                m[:, :, rows], ref[:, :, rows] = m_new, ref_new
    sink2 = acc.type(-np.inf) if sink_log2 is None else sink_log2[None, :, None]
    factor, top, log2_sum = _finish_rows_log2(m, l, sink2, acc)
    # P_sink against the row's top (<= 0): 2^(sink - m) factor would overflow for a dominant sink
    with np.errstate(invalid="ignore", over="ignore"):
        sink_share = np.where(top == -np.inf, acc.type(0), np.exp2((sink2 - top) - log2_sum))
    return m, factor, ref, (w * factor - ref * sink_share).astype(acc)


def forward(q, k, v, *, softmax_scale, causal, window_size=(-1, -1), block_m=64, block_n=64, variant=None):
    """Tiled forward pass: returns (o, lse), o in q's dtype, lse (batch, nheads, seqlen_q).
    ``variant``: a cupyflash.scores.Variant with NumPy arrays, or None (plain attention)."""
    acc = _accumulator(q.dtype)
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k = k.shape[1]
    Q = _heads_first(q, acc, nheads)
    K = _heads_first(k, acc, nheads)
    V = _heads_first(v, acc, nheads)
    O = np.zeros((batch, nheads, seqlen_q, v.shape[3]), acc)  # v's head dim (headdim_v)
    lse = np.full((batch, nheads, seqlen_q), -np.inf, acc)
    scale_log2 = acc.type(softmax_scale * LOG2E)
    mask = mask_for(causal, window_size)
    variant = NO_VARIANT if variant is None else variant
    transform = _ScoreTransform(variant, batch, nheads, seqlen_q, seqlen_k, acc)
    sink_log2 = None if variant.sink is None else np.asarray(variant.sink).astype(acc) * acc.type(LOG2E)
    dropout = variant.dropout
    # precision "tf32": the float32 kernel's one product on operands rounded to tf32 (P too; its
    # row sums stay float32's). "ieee" products are float32's, which NumPy forms.
    one_tf32_product = rounds_operands(variant.precision, q.dtype)
    if one_tf32_product:
        Q, K, V = (round_tf32(x) for x in (Q, K, V))

    Br, Bc = block_m, block_n
    Tr = math.ceil(seqlen_q / Br)
    for i in range(Tr):
        rows = slice(i * Br, min((i + 1) * Br, seqlen_q))
        Q_i = Q[:, :, rows] * scale_log2  # scores come out in log2 units
        m_i = np.full(Q_i.shape[:-1], -np.inf, acc)
        l_i = np.zeros(Q_i.shape[:-1], acc)
        O_i = np.zeros(Q_i.shape[:-1] + V.shape[-1:], acc)
        # Key blocks outside the mask are skipped; the rest are masked element by element only
        # where some pair of the block is hidden.
        key_blocks = _narrowed(mask.key_blocks(rows.start, Br, Bc, seqlen_q, seqlen_k), Bc,
                               _map_range(variant, "key", rows.start, rows.stop - rows.start, Bc))
        for j in key_blocks:
            cols = slice(j * Bc, min((j + 1) * Bc, seqlen_k))
            K_j = K[:, :, cols]
            V_j = V[:, :, cols]
            S_ij = Q_i @ np.swapaxes(K_j, -1, -2)
            S_ij, _ = transform(S_ij, rows, cols)
            visible = _block_mask(mask, rows, cols, seqlen_q, seqlen_k)
            if visible is not None:
                S_ij = np.where(visible, S_ij, -np.inf)
            m_new = np.maximum(m_i, S_ij.max(axis=-1))
            m_ref = np.where(m_new == -np.inf, acc.type(0), m_new)
            P_ij = np.exp2(S_ij - m_ref[..., None])
            rescale = np.exp2(m_i - m_ref)  # exp(m_old - m_new), in log2 units
            l_i = rescale * l_i + P_ij.sum(axis=-1)
            if dropout.on:  # after the row sum: l and lse are the softmax's (cupyflash.dropout)
                P_ij = np.where(_keep(dropout, batch, nheads, rows, cols), P_ij, acc.type(0))
            O_i = rescale[..., None] * O_i + (round_tf32(P_ij) if one_tf32_product else P_ij) @ V_j
            m_i = m_new
        if dropout.on:  # kept weights count 1 / (1 - p)
            O_i = O_i * acc.type(dropout.scale)
        if sink_log2 is None:
            seen_a_key = l_i > 0
            l_safe = np.where(seen_a_key, l_i, acc.type(1))
            O[:, :, rows] = O_i / l_safe[..., None]
            lse[:, :, rows] = np.where(
                seen_a_key, (m_i + np.log2(l_safe)) * acc.type(LN2), -np.inf
            )
        else:
            factor, lse[:, :, rows] = _finish_rows_with_sink(m_i, l_i, sink_log2, acc)
            O[:, :, rows] = O_i * factor[..., None]
    o = np.moveaxis(O, 1, 2).astype(q.dtype, order="C")
    return o, lse


def backward(do, q, k, v, o, lse, *, softmax_scale, causal, window_size=(-1, -1), block_m=64, block_n=64,
             variant=None):
    """Tiled backward pass from the saved lse: returns (dq, dk, dv) in q's dtype.

    Key/value blocks form the outer loop (each owns its dK_j, dV_j); dQ is accumulated block by
    block in a fixed order, so the result is deterministic. ``variant`` must be the forward's; its
    sink acts only through lse (dsink: cupyflash.scores.sink_grad). Its ``statistics``
    "recomputed" (float32 / float64): lse and D from a first walk over the keys, as
    flash_bwd_stats_simt forms them, instead of the saved lse and o.
    """
    acc = _accumulator(q.dtype)
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    Q = _heads_first(q, acc, nheads)
    K = _heads_first(k, acc, nheads)
    V = _heads_first(v, acc, nheads)
    dO = _heads_first(do, acc, nheads)
    O = _heads_first(o, acc, nheads)
    scale = acc.type(softmax_scale)
    scale_log2 = acc.type(softmax_scale * LOG2E)
    mask = mask_for(causal, window_size)
    variant = NO_VARIANT if variant is None else variant
    transform = _ScoreTransform(variant, batch, nheads, seqlen_q, seqlen_k, acc)
    dropout = variant.dropout

    Br, Bc = block_m, block_n
    Tc = math.ceil(seqlen_k / Bc)

    def walk():
        """The (rows, cols) blocks the backward visits, key blocks outermost."""
        for j in range(Tc):
            cols = slice(j * Bc, min((j + 1) * Bc, seqlen_k))
            query_blocks = _narrowed(mask.query_blocks(cols.start, Bc, Br, seqlen_q, seqlen_k), Br,
                                     _map_range(variant, "query", cols.start, cols.stop - cols.start, Br))
            yield cols, [slice(i * Br, min((i + 1) * Br, seqlen_q)) for i in query_blocks]

    def scores_and_dp(rows, cols):
        """(S, dS'/dS, dP, keep) of a block: scores in log2 units (-inf where hidden), dP with
        dropout's keep and scale. One function for the statistics' walk and the gradients', so
        that recomputed statistics are those of the very values the gradients use."""
        S_ij = (Q[:, :, rows] @ np.swapaxes(K[:, :, cols], -1, -2)) * scale_log2
        S_ij, dS_dS = transform(S_ij, rows, cols)
        visible = _block_mask(mask, rows, cols, seqlen_q, seqlen_k)
        if visible is not None:
            S_ij = np.where(visible, S_ij, -np.inf)
        dP_ij = dO[:, :, rows] @ np.swapaxes(V[:, :, cols], -1, -2)
        keep = None
        if dropout.on:  # O = (P o Z / (1 - p)) V: dV takes P Z, dS = P (Z dP / (1 - p) - D)
            keep = _keep(dropout, batch, nheads, rows, cols)
            dP_ij = np.where(keep, dP_ij * acc.type(dropout.scale), acc.type(0))
        return S_ij, dS_dS, dP_ij, keep

    # P_ij = 2^(S_ij - top_i) weight_i and dS_ij = P_ij ((dP_ij - dp_ref_i) - D_i). Saved: top is
    # lse in log2 units, weight 1, dp_ref 0. Recomputed: top the row's largest score, weight
    # 1 / its sum, and D kept as D - dp_ref, so that S - top and dP - dp_ref are exact at the
    # maximum (as standard attention's S - max) and nothing small is lost in the rounding of a
    # large lse or D.
    if variant.statistics == "recomputed":
        sink_log2 = None if variant.sink is None else np.asarray(variant.sink).astype(acc) * acc.type(LOG2E)
        top, weight, dp_ref, D = _recomputed_statistics(walk(), scores_and_dp, (batch, nheads, seqlen_q), acc,
                                                        sink_log2)
    else:
        # D_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij, the softmax-backward term of each row.
        D = (dO * O).sum(axis=-1)
        top, weight = lse.astype(acc) * acc.type(LOG2E), np.ones(lse.shape, acc)
        dp_ref = np.zeros(lse.shape, acc)
    # A row that saw no key has lse = -inf; +inf makes its recomputed P exactly 0.
    top = np.where(top == -np.inf, np.inf, top)

    dQ = np.zeros(Q.shape, acc)
    dK = np.zeros(K.shape, acc)
    dV = np.zeros(V.shape, acc)
    for cols, row_blocks in walk():
        K_j = K[:, :, cols]
        dK_j = np.zeros(K_j.shape, acc)
        dV_j = np.zeros(V[:, :, cols].shape, acc)
        for rows in row_blocks:
            Q_i = Q[:, :, rows]
            dO_i = dO[:, :, rows]
            S_ij, dS_dS, dP_ij, keep = scores_and_dp(rows, cols)
            # The exponent clamped at 0 as the kernels clamp it (kernels_cu/softmax_bwd.cuh): P <= 1.
            P_ij = np.exp2(np.minimum(S_ij - top[:, :, rows, None], 0.0)) * weight[:, :, rows, None]
            dV_j += np.swapaxes(P_ij if keep is None else np.where(keep, P_ij, acc.type(0)), -1, -2) @ dO_i
            dS_ij = P_ij * ((dP_ij - dp_ref[:, :, rows, None]) - D[:, :, rows, None])
            if dS_dS is not None:
                dS_ij = dS_ij * dS_dS
            dK_j += np.swapaxes(dS_ij, -1, -2) @ Q_i
            dQ[:, :, rows] += dS_ij @ K_j
        dK[:, :, cols] = dK_j * scale
        dV[:, :, cols] = dV_j * acc.type(dropout.scale) if dropout.on else dV_j
    dQ *= scale

    def to_input_layout(x, heads):
        # Query heads sharing one kv head (GQA) are adjacent: sum them.
        x = x.reshape(batch, heads, nheads // heads if heads else 0, *x.shape[2:]).sum(axis=2)
        return np.moveaxis(x, 1, 2).astype(q.dtype, order="C")

    dq = to_input_layout(dQ, nheads)
    return dq, to_input_layout(dK, nheads_kv), to_input_layout(dV, nheads_kv)


def kvcache_forward(q, sequences, *, softmax_scale, causal, window_size=(-1, -1), variant=None, num_splits=1,
                    block_n=None, key_warps=None):
    """The KV-cache kernel's algorithm (kernels_cu/flash_fwd_kvcache_mma.cu with
    flash_fwd_combine.cu) for q (batch, seqlen_q, nheads, headdim) and each sequence's keys and
    values ``sequences[b] = (K_b, V_b)``, (seqlen_k_b, nheads_kv, headdim) and (seqlen_k_b,
    nheads_kv, headdim_v): returns (o, lse), o (batch, seqlen_q, nheads, headdim_v).

    Per sequence the keys are cut into ``num_splits`` ranges of split_keys keys (whole tiles of
    ``block_n``, kvcache_mma.split_layout over the longest sequence, as the plan cuts them; a split
    past a sequence's end sees nothing). ``block_n`` and ``key_warps`` default to the tiles the
    kernel's plan takes for this head dim and number of packed rows (kvcache_mma.cache_tiles). Within a split each tile's keys are dealt to ``key_warps`` shares, one per
    warp, and each share keeps its own running max m, sum l and O; at the split's end they are
    merged in share order (merge_key_warps: M = max m_w, L = sum l_w 2^(m_w - M), O = sum
    2^(m_w - M) O_w / L). The splits' (O / l, lse) are then combined by the LSE rule with the sink's
    term added once. (The kernel also packs a kv head's query heads into the rows of one tile; here
    the heads are one vectorised axis, which is the same arithmetic row by row.) ``variant``: a
    cupyflash.scores.Variant with NumPy arrays (ALiBi slopes (batch, nheads): row b for sequence b).
    """
    from .varlen import sequence_variant

    acc = _accumulator(q.dtype)
    batch, seqlen_q, nheads, headdim = q.shape
    headdim_v = int(sequences[0][1].shape[-1]) if sequences else headdim
    variant = NO_VARIANT if variant is None else variant
    mask = mask_for(causal, window_size)
    scale_log2 = acc.type(softmax_scale * LOG2E)
    o = np.zeros(q.shape[:3] + (headdim_v,), q.dtype)
    lse = np.full((batch, nheads, seqlen_q), -np.inf, acc)
    from .kernels import kvcache_mma
    from .kernels.constants import TENSOR_CORE_D_TILES, d_tile

    if block_n is None or key_warps is None:
        tiles = kvcache_mma.cache_tiles(d_tile(max(headdim, headdim_v, 8), TENSOR_CORE_D_TILES),
                                        seqlen_q * (nheads // max(int(sequences[0][0].shape[1]), 1) if sequences else 1),
                                        mask.with_score(variant.score))  # modifiers take their own tiles
        block_n = tiles.block_n if block_n is None else block_n
        key_warps = tiles.key_warps if key_warps is None else key_warps
    longest = max((int(keys.shape[0]) for keys, _ in sequences), default=0)
    num_splits, per_split = kvcache_mma.split_layout(math.ceil(longest / block_n), num_splits)
    split_keys = per_split * block_n
    share = block_n // key_warps
    sink_log2 = None if variant.sink is None else np.asarray(variant.sink).astype(acc) * acc.type(LOG2E)
    one_tf32_product = rounds_operands(variant.precision, q.dtype)
    for b, (keys, values) in enumerate(sequences):
        seqlen_k = int(keys.shape[0])
        own = sequence_variant(variant, b)
        transform = _ScoreTransform(own, 1, nheads, seqlen_q, seqlen_k, acc)
        Q, K, V = (_heads_first(x, acc, nheads) for x in (q[b:b + 1], keys[None], values[None]))
        if one_tf32_product:  # as forward's: one product on tf32 operands
            Q, K, V = (round_tf32(x) for x in (Q, K, V))
        Q = Q * scale_log2
        rows = slice(0, seqlen_q)
        first, end = mask.key_begin(0, seqlen_q, seqlen_k), mask.key_end(0, seqlen_q, seqlen_q, seqlen_k)
        partials = []  # (O / l, lse) of each split
        for s in range(max(1, num_splits)):
            begin, stop = max(first, s * split_keys), min(end, (s + 1) * split_keys)
            m = np.full((key_warps, 1, nheads, seqlen_q), -np.inf, acc)
            l = np.zeros(m.shape, acc)
            O = np.zeros((key_warps, 1, nheads, seqlen_q, headdim_v), acc)
            for j in range(begin // block_n, -(-stop // block_n) if stop > begin else 0):
                for w in range(key_warps):
                    cols = slice(j * block_n + w * share, min(j * block_n + (w + 1) * share, seqlen_k))
                    if cols.start >= cols.stop:
                        continue
                    S, _ = transform(Q @ np.swapaxes(K[:, :, cols], -1, -2), rows, cols)
                    visible = mask.visible(np.arange(seqlen_q), np.arange(cols.start, cols.stop), seqlen_q, seqlen_k)
                    S = np.where(visible, S, -np.inf)
                    m_new = np.maximum(m[w], S.max(axis=-1))
                    m_ref = np.where(m_new == -np.inf, acc.type(0), m_new)
                    P = np.exp2(S - m_ref[..., None])
                    rescale = np.exp2(m[w] - m_ref)
                    l[w] = rescale * l[w] + P.sum(axis=-1)
                    O[w] = rescale[..., None] * O[w] + (round_tf32(P) if one_tf32_product else P) @ V[:, :, cols]
                    m[w] = m_new
            top = m.max(axis=0)
            top_ref = np.where(top == -np.inf, acc.type(0), top)
            weight = np.where(m == -np.inf, acc.type(0), np.exp2(m - top_ref))
            total = (weight * l).sum(axis=0)
            merged = (weight[..., None] * O).sum(axis=0)
            seen = total > 0
            total_safe = np.where(seen, total, acc.type(1))
            partials.append((merged / total_safe[..., None],
                             np.where(seen, (top + np.log2(total_safe)) * acc.type(LN2), -np.inf)))
        o_b, lse_b = _combine_splits(partials, None if sink_log2 is None else sink_log2 * acc.type(LN2), acc)
        o[b] = np.moveaxis(o_b[0], 0, 1).astype(q.dtype)
        lse[b] = lse_b[0]
    return o, lse


def _combine_splits(partials, sink, acc):
    """flash_fwd_combine.cu: (o, lse) from the splits' (O_s, lse_s) (natural log) and the sink
    logits ``sink`` (nheads,) or None: M = max(lse_s, sink), lse = M + log(sum exp(lse_s - M) +
    exp(sink - M)), o = sum exp(lse_s - lse) O_s over the splits with lse_s > -inf."""
    lses = np.stack([lse_s for _, lse_s in partials])
    top = lses.max(axis=0)
    if sink is not None:
        top = np.maximum(top, sink[None, :, None])
    nothing = top == -np.inf
    top_ref = np.where(nothing, acc.type(0), top)
    total = np.exp2((lses - top_ref) * acc.type(LOG2E)).sum(axis=0)
    if sink is not None:
        total = total + np.exp2((sink[None, :, None] - top_ref) * acc.type(LOG2E))
    lse = np.where(nothing, -np.inf, top_ref + np.log2(np.where(nothing, acc.type(1), total)) * acc.type(LN2))
    o = np.zeros(partials[0][0].shape, acc)
    for O_s, lse_s in partials:
        seen = lse_s != -np.inf
        w = np.where(seen, np.exp2((lse_s - np.where(nothing, acc.type(0), lse)) * acc.type(LOG2E)), acc.type(0))
        o = o + np.where(seen[..., None], w[..., None] * O_s, acc.type(0))
    return o, lse

"""Model of flash_fwd_mma (kernels_cu/flash_fwd_mma.cu): one thread block, warp by warp, in
float64; one warp's registers are arrays with a leading lane axis. The online softmax keeps each
row's running max and sum in either RowStats layout (all lanes of a quad, or one lane per row);
P is repacked from accumulators into A fragments (pack_p); O is staged through the Q tile."""
from __future__ import annotations

import math

import numpy as np

from cupyflash import masks, reference

from .mma import (GROUP, LANES, THREAD_IN_GROUP, a_operand_address, cp_async_tile, k_operand_address, ldmatrix_x4,
                  mma_16816, quad_reduce, swizzled_offset)
from .mma_bwd_walks import key_range

def pack_p(s):
    """pack_p: s[lane, strip, fragment, 4] -> A fragments [lane, strip, kstep, reg, half]."""
    lanes, strips, n_frags, _ = s.shape
    p = np.empty((lanes, strips, n_frags // 2, 4, 2))
    for kk in range(n_frags // 2):
        p[:, :, kk, 0] = s[:, :, 2 * kk, 0:2]
        p[:, :, kk, 1] = s[:, :, 2 * kk, 2:4]
        p[:, :, kk, 2] = s[:, :, 2 * kk + 1, 0:2]
        p[:, :, kk, 3] = s[:, :, 2 * kk + 1, 2:4]
    return p


def quad_sum_scatter(x):
    """quad_sum_scatter: x[lane, rows] partial row sums -> per lane the quad's sum of row t % rows."""
    rows = x.shape[1]
    odd = (LANES & 1).astype(bool)
    a0 = np.where(odd, x[:, 1], x[:, 0])
    a0 = a0 + np.where(odd, x[:, 0], x[:, 1])[LANES ^ 1]
    if rows == 2:
        return a0 + a0[LANES ^ 2]
    a1 = np.where(odd, x[:, 3], x[:, 2])
    a1 = a1 + np.where(odd, x[:, 2], x[:, 3])[LANES ^ 1]
    high = (LANES & 2).astype(bool)
    return np.where(high, a1, a0) + np.where(high, a0, a1)[LANES ^ 2]


def row_holder(r):
    """Lane of each lane's quad that holds the running max and sum of row r = 2 strip + half."""
    return (LANES & ~3) | r


def exp2_base(m_new):
    return np.where(m_new == -np.inf, 0.0, m_new)


class RowStatsAllLanes:
    """RowStats<RowState::ALL_LANES>: every lane holds m and its partial l of each row (i, h)."""

    def __init__(self, strips):
        self.m = np.full((32, strips, 2), -np.inf)
        self.l = np.zeros((32, strips, 2))

    def old_max(self, i, h):
        return self.m[:, i, h]

    def take_max(self, m_new):
        rescale = np.exp2(self.m - exp2_base(m_new))
        self.m = m_new.copy()
        return rescale

    @staticmethod
    def rescale_row(rescale, i, h):
        return rescale[:, i, h]

    def add_sums(self, rescale, row_sum):
        self.l = self.l * rescale + row_sum

    def get(self, i, h):
        return self.m[:, i, h], quad_reduce(self.l[:, i, h], np.add)


class RowStatsOneLane:
    """RowStats<RowState::ONE_LANE>: lane t of a quad holds m and the full l of row t % (2 strips)."""

    def __init__(self, strips):
        self.own = THREAD_IN_GROUP % (2 * strips)
        self.m = np.full(32, -np.inf)
        self.l = np.zeros(32)

    def old_max(self, i, h):
        return np.where(self.own == 2 * i + h, self.m, -np.inf)

    def take_max(self, m_new):
        own_m_new = m_new[LANES, self.own // 2, self.own % 2]
        rescale = np.exp2(self.m - exp2_base(own_m_new))
        self.m = own_m_new
        return rescale

    @staticmethod
    def rescale_row(rescale, i, h):
        return rescale[row_holder(2 * i + h)]

    def add_sums(self, rescale, row_sum):
        self.l = self.l * rescale + quad_sum_scatter(row_sum.reshape(32, -1))  # row r = 2 i + h

    def get(self, i, h):
        holder = row_holder(2 * i + h)
        return self.m[holder], self.l[holder]


ROW_STATS = {"all_lanes": RowStatsAllLanes, "one_lane": RowStatsOneLane}


def fwd_block(q, k, v, o, lse, *, batch, head, m_block, group, scale_log2, mask,
              d_tile, block_m, block_n, warps, stages, q_in_regs, row_state):
    """One thread block of flash_fwd_mma, in float64 (no 16-bit rounding); ``mask`` is the
    kernel's policy (cupyflash.masks, the twin of mask.cuh)."""
    seqlen_q, seqlen_k, headdim = q.shape[1], k.shape[1], q.shape[3]
    nthreads, strips = 32 * warps, block_m // (16 * warps)
    n_frags, d_frags = block_n // 8, d_tile // 8
    q_bytes, kv_tile_bytes = block_m * d_tile * 2, block_n * d_tile * 2
    smem = np.full((q_bytes + stages * 2 * kv_tile_bytes) // 2, np.nan)  # 16-bit slots
    k_tile = lambda stage: q_bytes + stage * 2 * kv_tile_bytes
    v_tile = lambda stage: k_tile(stage) + kv_tile_bytes

    head_kv = head // group
    m0 = m_block * block_m
    j_begin, _, _, n_end = key_range(mask, m0, block_m, block_n, seqlen_q, seqlen_k)  # KeyBlockRange
    lo_off, hi_off = mask.offsets(seqlen_q, seqlen_k)
    qs, ks, vs = q[batch, :, head], k[batch, :, head_kv], v[batch, :, head_kv]

    def load_kv_tile(block, stage):
        n0 = block * block_n
        cp_async_tile(smem, k_tile(stage), block_n, d_tile, nthreads, ks, n0, seqlen_k - n0, headdim)
        cp_async_tile(smem, v_tile(stage), block_n, d_tile, nthreads, vs, n0, seqlen_k - n0, headdim)

    cp_async_tile(smem, 0, block_m, d_tile, nthreads, qs, m0, seqlen_q - m0, headdim)
    for ahead in range(stages - 1):
        j = j_begin + ahead
        if j * block_n < n_end:
            load_kv_tile(j, j % stages)

    a_addr, k_addr = a_operand_address(d_tile), k_operand_address(d_tile)
    state = []
    for warp in range(warps):
        strip_row0 = warp * 16 * strips
        q_strips = strip_row0 * d_tile * 2
        q_frag = None
        if q_in_regs:
            q_frag = [[ldmatrix_x4(smem, a_addr(q_strips, i, kk)) for kk in range(d_tile // 16)]
                      for i in range(strips)]
        state.append(dict(strip_row0=strip_row0, q_strips=q_strips, q_frag=q_frag,
                          o=np.zeros((32, strips, d_frags, 4)), stats=ROW_STATS[row_state](strips)))

    for j in range(j_begin, (n_end + block_n - 1) // block_n):  # j * block_n < n_end
        stage = j % stages
        ahead = j + stages - 1
        if ahead * block_n < n_end:
            load_kv_tile(ahead, ahead % stages)
        n0 = j * block_n
        masked = mask.keys_partial(m0, block_m, n0, block_n, seqlen_q, seqlen_k)
        for w in state:
            # mma_qk
            s = np.zeros((32, strips, n_frags, 4))
            for kk in range(d_tile // 16):
                a = [w["q_frag"][i][kk] if q_in_regs else ldmatrix_x4(smem, a_addr(w["q_strips"], i, kk))
                     for i in range(strips)]
                for f in range(0, n_frags, 2):
                    b = ldmatrix_x4(smem, k_addr(k_tile(stage), f // 2, kk))
                    for i in range(strips):
                        mma_16816(s[:, i, f], a[i], b[:, 0], b[:, 1])
                        mma_16816(s[:, i, f + 1], a[i], b[:, 2], b[:, 3])
            # scale_and_mask
            s *= scale_log2
            if masked:
                for i in range(strips):
                    for h in range(2):
                        row = m0 + w["strip_row0"] + 16 * i + 8 * h + GROUP
                        key_end = np.minimum(seqlen_k, row + 1 + hi_off) if mask.HAS_RIGHT else seqlen_k
                        key_begin = row + lo_off if mask.HAS_LEFT else 0
                        for f in range(n_frags):
                            for e in range(2):
                                key = n0 + 8 * f + 2 * THREAD_IN_GROUP + e
                                hidden = (key >= key_end) | (key < key_begin)
                                s[:, i, f, 2 * h + e] = np.where(hidden, -np.inf, s[:, i, f, 2 * h + e])
            # row_max
            stats = w["stats"]
            m_new = np.empty((32, strips, 2))
            for i in range(strips):
                for h in range(2):
                    x = np.maximum(stats.old_max(i, h), s[:, i, :, 2 * h: 2 * h + 2].max(axis=(1, 2)))
                    m_new[:, i, h] = quad_reduce(x, np.maximum)
            # softmax_rescale
            rescale = stats.take_max(m_new)
            row_sum = np.empty((32, strips, 2))
            for i in range(strips):
                for h in range(2):
                    p = np.exp2(s[:, i, :, 2 * h: 2 * h + 2] - exp2_base(m_new[:, i, h])[:, None, None])
                    s[:, i, :, 2 * h: 2 * h + 2] = p
                    row_sum[:, i, h] = p.sum(axis=(1, 2))
                    w["o"][:, i, :, 2 * h: 2 * h + 2] *= stats.rescale_row(rescale, i, h)[:, None, None]
            stats.add_sums(rescale, row_sum)
            # pack_p, mma_pv
            p = pack_p(s)
            for kk in range(n_frags // 2):
                for f in range(0, d_frags, 2):
                    b = ldmatrix_x4(smem, a_addr(v_tile(stage), kk, f // 2), trans=True)
                    for i in range(strips):
                        mma_16816(w["o"][:, i, f], p[:, i, kk], b[:, 0], b[:, 1])
                        mma_16816(w["o"][:, i, f + 1], p[:, i, kk], b[:, 2], b[:, 3])

    # store_o, staging through the Q tile
    for w in state:
        strip_row0 = w["strip_row0"]
        for i in range(strips):
            for h in range(2):
                m_row, l_row = w["stats"].get(i, h)
                # row_epilogue: l == 0 (no key seen) gives O = 0, a NaN l a NaN O; lse -inf for both
                inv_l = np.where(l_row == 0, 0.0, 1.0 / np.where(l_row == 0, 1.0, l_row))
                row = strip_row0 + 16 * i + 8 * h + GROUP
                writes = (THREAD_IN_GROUP == 0) & (m0 + row < seqlen_q)
                with np.errstate(divide="ignore"):
                    value = np.where(l_row > 0, (m_row + np.log2(l_row)) * math.log(2), -np.inf)
                lse[batch, head, (m0 + row)[writes]] = value[writes]
                for f in range(d_frags):
                    addr = swizzled_offset(d_tile, row, f) + 4 * THREAD_IN_GROUP
                    smem[addr // 2] = w["o"][:, i, f, 2 * h] * inv_l
                    smem[addr // 2 + 1] = w["o"][:, i, f, 2 * h + 1] * inv_l
        chunks = d_tile // 8
        for it in range(16 * strips * chunks // 32):
            idx = LANES + 32 * it
            for lane in range(32):
                row, chunk = strip_row0 + idx[lane] // chunks, idx[lane] % chunks
                if m0 + row < seqlen_q and chunk * 8 < headdim:
                    src = swizzled_offset(d_tile, row, chunk) // 2
                    o[batch, m0 + row, head, chunk * 8: chunk * 8 + 8] = smem[src: src + 8]


def fwd_emulated(q, k, v, *, causal, scale, d_tile, block_m, block_n, warps, stages=2, q_in_regs=False,
                 row_state="one_lane", window_size=(-1, -1)):
    batch, seqlen_q, nheads, headdim = q.shape
    o = np.full(q.shape, np.nan)
    lse = np.full((batch, nheads, seqlen_q), np.nan)
    for b in range(batch):
        for h in range(nheads):
            for m_block in range(math.ceil(seqlen_q / block_m)):
                fwd_block(q, k, v, o, lse, batch=b, head=h, m_block=m_block, group=nheads // k.shape[2],
                          scale_log2=scale * math.log2(math.e), mask=masks.mask_for(causal, window_size),
                          d_tile=d_tile,
                          block_m=block_m, block_n=block_n, warps=warps, stages=stages, q_in_regs=q_in_regs,
                          row_state=row_state)
    return o, lse


def attention_reference(q, k, v, *, causal, scale, window_size=(-1, -1)):
    """float64 attention with the project's conventions (bottom-right causal and windows, empty
    rows -> 0, -inf)."""
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, group = k.shape[1], nheads // k.shape[2]
    kk = np.repeat(k, group, axis=2)
    vv = np.repeat(v, group, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    s = np.where(reference.visible_keys(seqlen_q, seqlen_k, causal, window_size), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    l = p.sum(axis=-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", p / np.where(l > 0, l, 1.0), vv)
    with np.errstate(divide="ignore"):
        lse = np.where(l[..., 0] > 0, np.log(np.where(l[..., 0] > 0, l[..., 0], 1.0)) + m[..., 0], -np.inf)
    return o, lse

"""Models of the mma.sync dK/dV kernels: flash_bwd_dkdv_mma (v1: a warp owns 16 key rows and
D_TILE / WARPS_D columns, partial S^T and dP^T swapped between warp pairs when WARPS_D = 2),
flash_bwd_dkdv_mma_v2 (ROW_GROUPS 16-row key groups per warp, WARPS_D = 1) and
flash_bwd_dkdv_mma_split (warp pairs: a dV warp and a dK warp per 16 G key rows, P^T through
shared memory). Each CTA is emulated phase by phase (all warps do one step, then the next), in the
order the kernel's barriers impose, in float64; with atomic dQ a CTA also adds dS K into dq_accum
(step 7)."""
from __future__ import annotations

import math

import numpy as np

from .mirrors import mirrors
from .mma import GROUP, LANES, THREAD_IN_GROUP, cp_async_tile
from .mma_bwd import (mma_AB_regs, mma_AB_regs_groups, mma_ABt, mma_ABt_groups, mma_AtB, pack_a_frags, stage_acc,
                      store_fragment_pairs, store_tile)
from .fragments import lse_base_log2, recomputed_p
from .mma_bwd_walks import DKDV_KERNELS, block_partial, query_block_range, visible

V1, V2, SPLIT = DKDV_KERNELS

@mirrors(V1, "static constexpr u32 XCHG = DS + (DQ_ADD == DqAdd::atomic ? BLOCK_N * BLOCK_M * 2 : 0);")
def bwd_dkdv_layout(d_tile, block_m, m_sub, block_n, nwarps, warps_d, dq_add):
    """DkdvSmem<...> of the dK/dV kernels, field by field (``dq_add`` "atomic": the dS^T tile of
    the atomic dQ adds; "none")."""
    assert dq_add in ("atomic", "none")
    kv_tile, q_tile = block_n * d_tile * 2, block_m * d_tile * 2
    lay = dict(KV_TILE=kv_tile, Q_TILE=q_tile, K=0)
    lay["V"] = lay["K"] + kv_tile
    lay["Q"] = lay["V"] + kv_tile
    lay["DO"] = lay["Q"] + 2 * q_tile
    lay["DS"] = lay["DO"] + 2 * q_tile
    lay["XCHG"] = lay["DS"] + (block_n * block_m * 2 if dq_add == "atomic" else 0)
    lay["XCHG_WARP"] = 2 * (m_sub // 8) * 32 * 16 if warps_d > 1 else 0
    lay["LSE"] = lay["XCHG"] + nwarps * lay["XCHG_WARP"]
    lay["DELTA"] = lay["LSE"] + 2 * block_m * 4
    lay["BYTES"] = lay["DELTA"] + 2 * block_m * 4
    return lay


class KeyBlockCta:
    """What the dK/dV CTAs share (MmaKeyCta in mma_bwd_key_cta.cuh for v2 and _split; v1 writes the
    same steps out): key block n_block of kv head head_kv in shared memory (``lay``, ``smem_bytes``),
    the walk of the query blocks that see it, their copies into two stages, step 7 (the atomic dQ
    adds) and the stores of dK_j and dV_j."""

    def __init__(self, q, k, v, do, lse, delta, *, batch, head_kv, n_block, group, mask, d_tile, block_m, block_n,
                 nwarps, lay, smem_bytes):
        self.q, self.do, self.lse, self.delta = q, do, lse, delta
        self.batch, self.head_kv, self.group, self.lay = batch, head_kv, group, lay
        self.d_tile, self.block_m, self.block_n, self.nwarps = d_tile, block_m, block_n, nwarps
        self.seqlen_q, self.headdim = q.shape[1], q.shape[3]
        self.seqlen_k = k.shape[1]
        self.nthreads = 32 * nwarps
        self.smem = np.full(smem_bytes // 2, np.nan)  # 16-bit tiles, by byte address // 2
        self.smem32 = np.full(smem_bytes // 4, np.nan)  # float slots (lse, D, partial sums), byte // 4
        self.n0 = n_block * block_n
        self.m_block_first, self.m_blocks = query_block_range(mask, self.n0, block_n, block_m, self.seqlen_q,
                                                              self.seqlen_k)
        self.n_iters = group * self.m_blocks
        for tile, x in ((lay["K"], k), (lay["V"], v)):
            cp_async_tile(self.smem, tile, block_n, d_tile, self.nthreads, x[batch, :, head_kv], self.n0,
                          self.seqlen_k - self.n0, self.headdim)
        if self.n_iters > 0:
            self.load_query_block(0, 0)

    def head_and_m0(self, it):
        return (self.head_kv * self.group + it // self.m_blocks,
                (self.m_block_first + it % self.m_blocks) * self.block_m)

    def load_query_block(self, it, stage):
        lay, block_m, seqlen_q = self.lay, self.block_m, self.seqlen_q
        head, m0 = self.head_and_m0(it)
        for tile, x in ((lay["Q"], self.q), (lay["DO"], self.do)):
            cp_async_tile(self.smem, tile + stage * lay["Q_TILE"], block_m, self.d_tile, self.nthreads,
                          x[self.batch, :, head], m0, seqlen_q - m0, self.headdim)
        for i in range(2 * block_m):
            r, is_lse = i % block_m, i < block_m
            dst = (lay["LSE"] if is_lse else lay["DELTA"]) + (stage * block_m + r) * 4
            stats = (self.lse if is_lse else self.delta)[self.batch, head]
            self.smem32[dst // 4] = stats[m0 + r] if m0 + r < seqlen_q else 0.0

    def query_stage(self, it):
        """Iteration it (the next block's copies started): head, m0 and its stage's Q, dO tiles (smem)
        and lse, D rows (smem32)."""
        lay, stage = self.lay, it & 1
        if it + 1 < self.n_iters:
            self.load_query_block(it + 1, stage ^ 1)
        head, m0 = self.head_and_m0(it)
        s_q, s_do = lay["Q"] + stage * lay["Q_TILE"], lay["DO"] + stage * lay["Q_TILE"]
        s_lse, s_delta = (lay["LSE"] + stage * self.block_m * 4) // 4, (lay["DELTA"] + stage * self.block_m * 4) // 4
        return head, m0, s_q, s_do, s_lse, s_delta

    def add_dq(self, dq_accum, head, m0):
        """Step 7: dq_accum += dS K_j, dS from the dS^T tile (add_dq_atomic)."""
        block_m, d_tile, lay = self.block_m, self.d_tile, self.lay
        dq_warps_m = block_m // 16
        dq_cols = d_tile // (self.nwarps // dq_warps_m)
        dq_pass = min(dq_cols, 32)
        for w in range(self.nwarps):
            q_row0 = 16 * (w % dq_warps_m)
            m_lo = m0 + q_row0 + GROUP
            for col0 in range(dq_cols * (w // dq_warps_m), dq_cols * (w // dq_warps_m + 1), dq_pass):
                dq_acc = np.zeros((32, dq_pass // 8, 4))
                mma_AtB(dq_acc, self.smem, dq_pass, self.block_n, block_m, d_tile, lay["DS"], q_row0, lay["K"], col0)
                for j in range(dq_pass // 8):
                    col = col0 + 8 * j + 2 * THREAD_IN_GROUP
                    for half, m in ((0, m_lo), (1, m_lo + 8)):
                        for lane in np.flatnonzero((col < self.headdim) & (m < self.seqlen_q)):
                            dq_accum[self.batch, m[lane], head, col[lane]] += dq_acc[lane, j, 2 * half]
                            dq_accum[self.batch, m[lane], head, col[lane] + 1] += dq_acc[lane, j, 2 * half + 1]

    def store_grads(self, dk, dv):
        n0, head_kv = self.n0, self.head_kv
        for out, tile in ((dk, self.lay["K"]), (dv, self.lay["V"])):
            store_tile(out[self.batch, n0:, head_kv], self.smem, tile, self.block_n, self.d_tile, self.nthreads,
                       self.seqlen_k - n0, self.headdim)


@mirrors(V1,
         "const bool hidden = masked.value && !mask.visible(m0_sub + c + (e & 1), n0 + row0 + lane / 4 + 8 * (e >> 1));",
         "s_acc[j][e] = hidden ? 0.f : p;",
         "dp_acc[j][e] = hidden ? 0.f : ds;")
def dkdv_block(q, k, v, do, lse, delta, dk, dv, dq_accum, *, batch, head_kv, n_block, group, scale,
               mask, d_tile, block_m, m_sub, block_n, nwarps, warps_d):
    """One CTA of flash_bwd_dkdv_mma (dq_accum is None unless ATOMIC_DQ)."""
    atomic_dq = dq_accum is not None
    dw = d_tile // warps_d
    assert block_n == 16 * nwarps // warps_d and block_m % m_sub == 0
    lay = bwd_dkdv_layout(d_tile, block_m, m_sub, block_n, nwarps, warps_d, "atomic" if atomic_dq else "none")
    cta = KeyBlockCta(q, k, v, do, lse, delta, batch=batch, head_kv=head_kv, n_block=n_block, group=group, mask=mask,
                      d_tile=d_tile, block_m=block_m, block_n=block_n, nwarps=nwarps, lay=lay, smem_bytes=lay["BYTES"])
    smem, smem32, n0, seqlen_q, seqlen_k = cta.smem, cta.smem32, cta.n0, cta.seqlen_q, cta.seqlen_k
    scale_log2 = scale * math.log2(math.e)

    warps = range(nwarps)
    key_group = [w // warps_d for w in warps]
    d_part = [w % warps_d for w in warps]
    row0 = [16 * g for g in key_group]
    dk_acc = np.zeros((nwarps, 32, dw // 8, 4))
    dv_acc = np.zeros((nwarps, 32, dw // 8, 4))

    def swap_partial_sums(acc, xchg):
        for w in warps:  # all warps store, then the pair barrier, then all read
            for j in range(acc.shape[2]):
                slot = (xchg + w * lay["XCHG_WARP"] + LANES * 16 + j * 512) // 4
                for e in range(4):
                    smem32[slot + e] = acc[w, :, j, e]
        theirs = np.empty_like(acc)
        for w in warps:
            for j in range(acc.shape[2]):
                slot = (xchg + (w ^ 1) * lay["XCHG_WARP"] + LANES * 16 + j * 512) // 4
                for e in range(4):
                    theirs[w, :, j, e] = smem32[slot + e]
        acc += theirs

    for it in range(cta.n_iters):
        head, m0, s_q, s_do, s_lse, s_delta = cta.query_stage(it)
        for mc0 in range(0, block_m, m_sub):
            s_q_sub, s_do_sub = s_q + mc0 * d_tile * 2, s_do + mc0 * d_tile * 2
            m0_sub = m0 + mc0
            partial = block_partial(m0_sub, m_sub, n0, block_n, seqlen_q, seqlen_k, mask)
            # Step 1
            s_acc = np.zeros((nwarps, 32, m_sub // 8, 4))
            for w in warps:
                mma_ABt(s_acc[w], smem, m_sub, dw, d_tile, d_tile, lay["K"], row0[w], s_q_sub, d_part[w] * dw)
            if warps_d == 2:
                swap_partial_sums(s_acc, lay["XCHG"])
            # Step 2
            hidden = np.zeros((nwarps, 32, m_sub // 8, 4), dtype=bool)
            for w in warps:
                for j in range(m_sub // 8):
                    c = 8 * j + 2 * THREAD_IN_GROUP
                    for e in range(4):
                        base = lse_base_log2(smem32[s_lse + mc0 + c + (e & 1)])
                        p = recomputed_p(s_acc[w, :, j, e], scale_log2, base)
                        m = m0_sub + c + (e & 1)
                        n = n0 + row0[w] + GROUP + 8 * (e >> 1)
                        hidden[w, :, j, e] = partial & ~visible(m, n, seqlen_q, seqlen_k, mask)
                        s_acc[w, :, j, e] = np.where(hidden[w, :, j, e], 0.0, p)
            # Step 3
            for w in warps:
                mma_AB_regs(dv_acc[w], pack_a_frags(s_acc[w]), smem, dw, m_sub, d_tile, s_do_sub,
                                d_part[w] * dw)
            # Step 4
            dp_acc = np.zeros((nwarps, 32, m_sub // 8, 4))
            for w in warps:
                mma_ABt(dp_acc[w], smem, m_sub, dw, d_tile, d_tile, lay["V"], row0[w], s_do_sub, d_part[w] * dw)
            if warps_d == 2:
                swap_partial_sums(dp_acc, lay["XCHG"] + m_sub // 8 * 512)
            # Step 5, 6 and the dS^T store
            for w in warps:
                for j in range(m_sub // 8):
                    c = 8 * j + 2 * THREAD_IN_GROUP
                    for e in range(4):
                        d = smem32[s_delta + mc0 + c + (e & 1)]
                        ds = s_acc[w, :, j, e] * (dp_acc[w, :, j, e] - d)
                        dp_acc[w, :, j, e] = np.where(hidden[w, :, j, e], 0.0, ds)
                ds_frag = pack_a_frags(dp_acc[w])
                mma_AB_regs(dk_acc[w], ds_frag, smem, dw, m_sub, d_tile, s_q_sub, d_part[w] * dw)
                if atomic_dq and d_part[w] == 0:
                    for kk in range(m_sub // 16):
                        col = mc0 + 16 * kk
                        store_fragment_pairs(smem, lay["DS"], block_m, row0[w], col, ds_frag[:, kk, 0])
                        store_fragment_pairs(smem, lay["DS"], block_m, row0[w] + 8, col, ds_frag[:, kk, 1])
                        store_fragment_pairs(smem, lay["DS"], block_m, row0[w], col + 8, ds_frag[:, kk, 2])
                        store_fragment_pairs(smem, lay["DS"], block_m, row0[w] + 8, col + 8, ds_frag[:, kk, 3])
        # Step 7
        if atomic_dq:
            cta.add_dq(dq_accum, head, m0)

    # Epilogue
    for w in warps:
        stage_acc(smem, lay["K"], d_tile, row0[w], d_part[w] * dw, dk_acc[w], scale)
        stage_acc(smem, lay["V"], d_tile, row0[w], d_part[w] * dw, dv_acc[w], 1.0)
    cta.store_grads(dk, dv)


@mirrors(V2, "m_min[g][half] = n < seqlen_k ? mask.row_query_begin(n) : seqlen_q;")
@mirrors(SPLIT,
         "m_min[g][half] = n < seqlen_k ? mask.row_query_begin(n) : seqlen_q;")
def first_query_of_key_rows(groups, key_row0, seqlen_q, seqlen_k, mask):
    """m_min[g, half, lane]: the first query the right bound lets see key key_row0 + 16 g + 8 half
    + lane / 4 (seqlen_q for keys past seqlen_k): the per-row mask of the 2 x 16-row dK/dV
    emulations (the left bound comes from hidden_left)."""
    m_min = np.zeros((groups, 2, 32), dtype=np.int64)
    for g in range(groups):
        for half in range(2):
            n = key_row0 + 16 * g + GROUP + 8 * half
            m_min[g, half] = np.where(n < seqlen_k, mask.row_query_begin(n, seqlen_q, seqlen_k), seqlen_q)
    return m_min


_HIDES_P_CALL = ("const bool hidden = masked.value && hides_p(mask, origin, m_min, m0_sub + c, seqlen_q, g, e,"
                 " 8 * j + (e & 1), 16 * g + 8 * (e >> 1));")


@mirrors(V2, "return m < m_min[g][e >> 1] || m >= seqlen_q || mask.hidden_left(origin, di, dj);")
@mirrors(SPLIT, "return m < m_min[g][e >> 1] || m >= seqlen_q || mask.hidden_left(origin, di, dj);")
def hides_p(m, n, m_min_row, seqlen_q, seqlen_k, mask):
    """hides_p (mma_bwd_key_cta.cuh) for query m and key n, m_min_row the key row's first query:
    P^T's test of the 2 x 16-row dK/dV kernels (the left bound from hidden_left)."""
    return (m < m_min_row) | (m >= seqlen_q) | mask.hidden_left(m, n, seqlen_q, seqlen_k)


@mirrors(V2, "return m < m_min[g][e >> 1] || m >= seqlen_q || (Mask::HAS_LEFT && p == 0.f);")
@mirrors(SPLIT, "return m < m_min[g][e >> 1] || m >= seqlen_q || (Mask::HAS_LEFT && p == 0.f);")
def hides_ds(m, m_min_row, seqlen_q, p, mask):
    """hides_ds (mma_bwd_key_cta.cuh): dS^T's test, the left bound read from P^T (0 where hidden)."""
    return (m < m_min_row) | (m >= seqlen_q) | (mask.HAS_LEFT & (p == 0.0))


@mirrors(V2, _HIDES_P_CALL, "s_acc[g][j][e] = hidden ? 0.f : p;")
@mirrors(SPLIT, _HIDES_P_CALL, "s_acc[g][j][e] = hidden ? 0.f : p;")
def p_transposed_groups(smem, smem32, tile_k, row0, s_q_sub, s_lse_sub, m0_sub, m_min, partial, groups, m_sub,
                        d_tile, scale_log2, seqlen_q, mask, n0, seqlen_k):
    """S^T = K Q^T of a warp's row groups (mma_ABt_groups), then P^T = exp2(S^T scale - lse), 0
    where hidden: steps 1-2 of flash_bwd_dkdv_mma_v2 and of the dV warp of flash_bwd_dkdv_mma_split."""
    s_acc = np.zeros((groups, 32, m_sub // 8, 4))
    mma_ABt_groups(s_acc, smem, m_sub, d_tile, d_tile, d_tile, tile_k, row0, s_q_sub, 0)
    for j in range(m_sub // 8):
        c = 8 * j + 2 * THREAD_IN_GROUP
        for g in range(groups):
            for e in range(4):
                base = lse_base_log2(smem32[s_lse_sub + c + (e & 1)])
                p = recomputed_p(s_acc[g, :, j, e], scale_log2, base)
                m, n = m0_sub + c + (e & 1), n0 + row0 + 16 * g + GROUP + 8 * (e >> 1)
                hidden = partial & hides_p(m, n, m_min[g, e >> 1], seqlen_q, seqlen_k, mask)
                s_acc[g, :, j, e] = np.where(hidden, 0.0, p)
    return s_acc


def store_ds_transposed(smem, tile_ds, block_m, row0, mc0, ds_frags):
    """dS^T A fragments (ds_frags[g][lane, kk, reg]) of a warp's row groups into the dS^T tile, as
    the atomic-dQ dK/dV kernels store them for step 7."""
    for g, frag in enumerate(ds_frags):
        r = row0 + 16 * g
        for kk in range(frag.shape[1]):
            col = mc0 + 16 * kk
            store_fragment_pairs(smem, tile_ds, block_m, r, col, frag[:, kk, 0])
            store_fragment_pairs(smem, tile_ds, block_m, r + 8, col, frag[:, kk, 1])
            store_fragment_pairs(smem, tile_ds, block_m, r, col + 8, frag[:, kk, 2])
            store_fragment_pairs(smem, tile_ds, block_m, r + 8, col + 8, frag[:, kk, 3])


@mirrors(V2, "masked.value && hides_ds<Mask>(m_min, m0_sub + c, seqlen_q, g, e, s_acc[g][j][e]);")
def dkdv_block_v2(q, k, v, do, lse, delta, dk, dv, dq_accum, *, batch, head_kv, n_block, group, scale,
                  mask, d_tile, block_m, m_sub, block_n, nwarps, row_groups):
    """One CTA of flash_bwd_dkdv_mma_v2 (dq_accum is None unless ATOMIC_DQ)."""
    atomic_dq = dq_accum is not None
    G = row_groups
    warp_rows = 16 * G
    assert block_n == warp_rows * nwarps and block_m % m_sub == 0 and m_sub % 16 == 0
    lay = bwd_dkdv_layout(d_tile, block_m, m_sub, block_n, nwarps, 1, "atomic" if atomic_dq else "none")
    cta = KeyBlockCta(q, k, v, do, lse, delta, batch=batch, head_kv=head_kv, n_block=n_block, group=group, mask=mask,
                      d_tile=d_tile, block_m=block_m, block_n=block_n, nwarps=nwarps, lay=lay, smem_bytes=lay["BYTES"])
    smem, smem32, n0, seqlen_q, seqlen_k = cta.smem, cta.smem32, cta.n0, cta.seqlen_q, cta.seqlen_k
    scale_log2 = scale * math.log2(math.e)

    dk_acc = np.zeros((nwarps, G, 32, d_tile // 8, 4))
    dv_acc = np.zeros((nwarps, G, 32, d_tile // 8, 4))
    for it in range(cta.n_iters):
        head, m0, s_q, s_do, s_lse, s_delta = cta.query_stage(it)
        for mc0 in range(0, block_m, m_sub):
            s_q_sub, s_do_sub = s_q + mc0 * d_tile * 2, s_do + mc0 * d_tile * 2
            m0_sub = m0 + mc0
            partial = block_partial(m0_sub, m_sub, n0, block_n, seqlen_q, seqlen_k, mask)
            for w in range(nwarps):
                row0 = warp_rows * w
                m_min = first_query_of_key_rows(G, n0 + row0, seqlen_q, seqlen_k, mask)
                # Step 1, 2
                s_acc = p_transposed_groups(smem, smem32, lay["K"], row0, s_q_sub, s_lse + mc0, m0_sub, m_min,
                                            partial, G, m_sub, d_tile, scale_log2, seqlen_q, mask, n0, seqlen_k)
                # Step 3
                mma_AB_regs_groups(dv_acc[w], [pack_a_frags(s_acc[g]) for g in range(G)], smem, d_tile,
                                       m_sub, d_tile, s_do_sub, 0)
                # Steps 4, 5 in 16-column slices
                ds_frag = np.full((G, 32, m_sub // 16, 4, 2), np.nan)
                for kk in range(m_sub // 16):
                    dp_acc = np.zeros((G, 32, 2, 4))
                    mma_ABt_groups(dp_acc, smem, 16, d_tile, d_tile, d_tile, lay["V"], row0,
                                       s_do_sub + 16 * kk * d_tile * 2, 0)
                    for jj in range(2):
                        j = 2 * kk + jj
                        c = 8 * j + 2 * THREAD_IN_GROUP
                        for g in range(G):
                            for e in range(4):
                                d = smem32[s_delta + mc0 + c + (e & 1)]
                                ds = s_acc[g, :, j, e] * (dp_acc[g, :, jj, e] - d)
                                m = m0_sub + c + (e & 1)
                                hidden = partial & hides_ds(m, m_min[g, e >> 1], seqlen_q, s_acc[g, :, j, e], mask)
                                dp_acc[g, :, jj, e] = np.where(hidden, 0.0, ds)
                    for g in range(G):
                        ds_frag[g, :, kk] = pack_a_frags(dp_acc[g])[:, 0]
                # Step 6 and the dS^T store
                mma_AB_regs_groups(dk_acc[w], ds_frag, smem, d_tile, m_sub, d_tile, s_q_sub, 0)
                if atomic_dq:
                    store_ds_transposed(smem, lay["DS"], block_m, row0, mc0, [ds_frag[g] for g in range(G)])
        # Step 7
        if atomic_dq:
            cta.add_dq(dq_accum, head, m0)

    for w in range(nwarps):
        for g in range(G):
            r = warp_rows * w + 16 * g
            stage_acc(smem, lay["K"], d_tile, r, 0, dk_acc[w, g], scale)
            stage_acc(smem, lay["V"], d_tile, r, 0, dv_acc[w, g], 1.0)
    cta.store_grads(dk, dv)


def bwd_dkdv_split_xchg(d_tile, block_m, m_sub, block_n, nwarps, row_groups, dq_add):
    """DkdvSplitSmem<...>: (XCHG, XCHG_SLOT, BYTES)."""
    slot = row_groups * (m_sub // 8) * 32 * 16
    xchg = bwd_dkdv_layout(d_tile, block_m, m_sub, block_n, nwarps, 1, dq_add)["BYTES"]
    return xchg, slot, xchg + (nwarps // 2) * 2 * slot


def bwd_split_p_address(xchg, slot_bytes, m_sub, pair, slot, g, j):
    """Byte address of lane l's float4 of P^T fragment (g, j) in the pair's slot, for all lanes."""
    return xchg + pair * 2 * slot_bytes + LANES * 16 + slot * slot_bytes + (g * (m_sub // 8) + j) * 512


@mirrors(SPLIT, "masked.value && hides_ds<Mask>(m_min, m0_sub + c, seqlen_q, g, e, __uint_as_float(p[e]));")
def dkdv_block_split(q, k, v, do, lse, delta, dk, dv, dq_accum, *, batch, head_kv, n_block, group, scale,
                     mask, d_tile, block_m, m_sub, block_n, nwarps, row_groups):
    """One CTA of flash_bwd_dkdv_mma_split; within a sub-block each pair's dV warp runs up to the
    pair barrier (P^T stored), then its dK warp (which reads P^T after the barrier)."""
    atomic_dq = dq_accum is not None
    G, pairs = row_groups, nwarps // 2
    warp_rows = 16 * G
    assert block_n == warp_rows * pairs and block_m % m_sub == 0 and m_sub % 16 == 0
    dq_add = "atomic" if atomic_dq else "none"
    lay = bwd_dkdv_layout(d_tile, block_m, m_sub, block_n, nwarps, 1, dq_add)
    xchg, slot_bytes, total = bwd_dkdv_split_xchg(d_tile, block_m, m_sub, block_n, nwarps, G, dq_add)
    cta = KeyBlockCta(q, k, v, do, lse, delta, batch=batch, head_kv=head_kv, n_block=n_block, group=group, mask=mask,
                      d_tile=d_tile, block_m=block_m, block_n=block_n, nwarps=nwarps, lay=lay, smem_bytes=total)
    smem, smem32, n0, seqlen_q, seqlen_k = cta.smem, cta.smem32, cta.n0, cta.seqlen_q, cta.seqlen_k
    scale_log2 = scale * math.log2(math.e)

    acc = np.zeros((nwarps, G, 32, d_tile // 8, 4))  # dV for warps < pairs, dK for the others
    slot = 0
    for it in range(cta.n_iters):
        head, m0, s_q, s_do, s_lse, s_delta = cta.query_stage(it)
        for mc0 in range(0, block_m, m_sub):
            s_q_sub, s_do_sub = s_q + mc0 * d_tile * 2, s_do + mc0 * d_tile * 2
            m0_sub = m0 + mc0
            partial = block_partial(m0_sub, m_sub, n0, block_n, seqlen_q, seqlen_k, mask)
            for pair in range(pairs):
                row0 = warp_rows * pair
                m_min = first_query_of_key_rows(G, n0 + row0, seqlen_q, seqlen_k, mask)
                # dV warp
                s_acc = p_transposed_groups(smem, smem32, lay["K"], row0, s_q_sub, s_lse + mc0, m0_sub, m_min,
                                            partial, G, m_sub, d_tile, scale_log2, seqlen_q, mask, n0, seqlen_k)
                for j in range(m_sub // 8):
                    for g in range(G):
                        addr = bwd_split_p_address(xchg, slot_bytes, m_sub, pair, slot, g, j)
                        for e in range(4):
                            smem32[addr // 4 + e] = s_acc[g, :, j, e]
                mma_AB_regs_groups(acc[pair], [pack_a_frags(s_acc[g]) for g in range(G)], smem, d_tile,
                                       m_sub, d_tile, s_do_sub, 0)
                # dK warp
                dp_acc = np.zeros((G, 32, m_sub // 8, 4))
                mma_ABt_groups(dp_acc, smem, m_sub, d_tile, d_tile, d_tile, lay["V"], row0, s_do_sub, 0)
                for j in range(m_sub // 8):
                    c = 8 * j + 2 * THREAD_IN_GROUP
                    for g in range(G):
                        addr = bwd_split_p_address(xchg, slot_bytes, m_sub, pair, slot, g, j)
                        for e in range(4):
                            p = smem32[addr // 4 + e]
                            ds = p * (dp_acc[g, :, j, e] - smem32[s_delta + mc0 + c + (e & 1)])
                            m = m0_sub + c + (e & 1)
                            hidden = partial & hides_ds(m, m_min[g, e >> 1], seqlen_q, p, mask)
                            dp_acc[g, :, j, e] = np.where(hidden, 0.0, ds)
                ds_frag = [pack_a_frags(dp_acc[g]) for g in range(G)]
                mma_AB_regs_groups(acc[pairs + pair], ds_frag, smem, d_tile, m_sub, d_tile, s_q_sub, 0)
                if atomic_dq:
                    store_ds_transposed(smem, lay["DS"], block_m, row0, mc0, [ds_frag[g] for g in range(G)])
            slot ^= 1
        if atomic_dq:
            cta.add_dq(dq_accum, head, m0)

    for w in range(nwarps):
        for g in range(G):
            r = warp_rows * (w % pairs) + 16 * g
            if w >= pairs:
                stage_acc(smem, lay["K"], d_tile, r, 0, acc[w, g], scale)
            else:
                stage_acc(smem, lay["V"], d_tile, r, 0, acc[w, g], 1.0)
    cta.store_grads(dk, dv)

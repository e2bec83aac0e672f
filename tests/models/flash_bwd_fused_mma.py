"""Model of flash_bwd_fused_mma (kernels_cu/flash_bwd_fused_mma.cu): one CTA per key block
computes S^T, P^T, dP^T and dS^T once per query block, keeps dK and dV in registers, stages P^T and
dS^T in shared memory and adds dQ into dq_accum, in a fixed key-block order with DQ_ORDERED (a
semaphore per query block); and the ordered protocol on a model of the GPU's scheduling
(simulate_dq_order)."""
from __future__ import annotations

import math

import numpy as np

from cupyflash import masks

from .fragments import lse_base_log2, recomputed_p
from .mirrors import mirrors
from .mma import GROUP, THREAD_IN_GROUP, cp_async_tile
from .mma_bwd import mma_AB_groups, mma_ABt_groups, mma_AtB_groups, stage_acc, store_tile
from .mma_bwd_walks import QUERY_BLOCK_WALK, block_partial, query_block_range

FUSED = "flash_bwd_fused_mma"  # the kernel (models.mirrors finds its file)

def bwd_fused_layout(d_tile, block_m, block_n):
    """FusedSmem<D_TILE, BLOCK_M, BLOCK_N> of flash_bwd_fused_mma.cu, field by field."""
    kv_tile, q_tile, p_tile = block_n * d_tile * 2, block_m * d_tile * 2, block_n * block_m * 2
    lay = dict(KV_TILE=kv_tile, Q_TILE=q_tile, P_TILE=p_tile, K=0)
    lay["V"] = lay["K"] + kv_tile
    lay["Q"] = lay["V"] + kv_tile
    lay["DO"] = lay["Q"] + 2 * q_tile
    lay["PT"] = lay["DO"] + 2 * q_tile
    lay["DST"] = lay["PT"] + p_tile
    lay["LSE"] = lay["DST"] + p_tile
    lay["DELTA"] = lay["LSE"] + 2 * block_m * 4
    lay["BYTES"] = lay["DELTA"] + 2 * block_m * 4
    return lay


def bwd_fused_tiles(d_tile, config):
    """The constexpr warp-tile sizes of flash_bwd_fused_mma for one configuration (C++ integer
    division, as in the kernel)."""
    block_m, block_n, warps_n, warps_d, dq_warps_m, s_unroll = config[:6]  # [6]: release timing only
    t = dict(BLOCK_M=block_m, BLOCK_N=block_n, WARPS_N=warps_n, WARPS_D=warps_d, DQ_WARPS_M=dq_warps_m,
             S_UNROLL=s_unroll, NWARPS=warps_n * warps_d, KN=block_n // warps_n, SQ=block_m // warps_d,
             DW=d_tile // warps_d, QM=block_m // dq_warps_m)
    t["NTHREADS"] = 32 * t["NWARPS"]
    t["KG"], t["QG"] = t["KN"] // 16, t["QM"] // 16
    t["DQ_WARPS_D"] = t["NWARPS"] // dq_warps_m
    t["DQW"] = d_tile // t["DQ_WARPS_D"]
    t["DQ_PASS"] = min(t["DQW"], 32)
    return t


def bwd_fused_warp_origins(t, warp):
    """Per warp, as the kernel derives them: key_row0, q_col0, d_col0, dq_row0, dq_col0."""
    return dict(key_row0=t["KN"] * (warp // t["WARPS_D"]), q_col0=t["SQ"] * (warp % t["WARPS_D"]),
                d_col0=t["DW"] * (warp % t["WARPS_D"]), dq_row0=t["QM"] * (warp % t["DQ_WARPS_M"]),
                dq_col0=t["DQW"] * (warp // t["DQ_WARPS_M"]))


@mirrors(FUSED, *QUERY_BLOCK_WALK,
         "auto m_block_of = [&](int it) { return DQ_ORDERED ? walk.block_down_from(walk.end - 1, it) : walk.block(it); };")
def fused_loop_bounds(seqlen_q, seqlen_k, block_m, block_n, mask, n_block):
    """The kernel's (m_block_first, q_blocks, m_blocks) for key block n_block (mask: a policy, or
    the causal flag of the ordered-dQ simulations, which take no window)."""
    mask = masks.as_mask(mask)
    m_block_first, m_blocks = query_block_range(mask, n_block * block_n, block_n, block_m, seqlen_q, seqlen_k)
    return m_block_first, (seqlen_q + block_m - 1) // block_m, m_blocks


def fused_iterations(seqlen_q, seqlen_k, block_m, block_n, mask, n_block, head_kv, group, ordered):
    """(head, m_block) of each iteration of key block n_block's CTA: m_block_of(it); with
    DQ_ORDERED each head's query blocks from the last to the first."""
    first, q_blocks, m_blocks = fused_loop_bounds(seqlen_q, seqlen_k, block_m, block_n, mask, n_block)
    return [(head_kv * group + it // m_blocks, q_blocks - 1 - it % m_blocks if ordered else first + it % m_blocks)
            for it in range(group * m_blocks)]


@mirrors(FUSED,
         "const typename Mask::Origin origin = mask.origin(query0, key0);",
         "const bool hidden = mask.hidden(origin, query_off, key_off);",
         "masked_or_not(partial, [&](auto masked) {",
         "s_acc[g][j][e] = masked.value && hidden ? 0.f : p;")
def fused_cta(q, k, v, do, lse, delta, dk, dv, dq_accum, semaphore, *, n_block, head_kv, batch, scale, mask,
              d_tile, config, ordered):
    """One CTA (blockIdx = (n_block, head_kv, batch)) of flash_bwd_fused_mma, phase by phase: step 1
    of all warps, (ordered) the releases and the prefetch, steps 2-5 of all warps, the barrier,
    steps 6-9 of all warps. ``semaphore`` is the dq_semaphore array (ordered only); CTAs run one
    after another in blockIdx order, so every wait must find its turn already reached (the
    kernel would spin forever otherwise)."""
    seqlen_q, headdim = q.shape[1], q.shape[3]
    seqlen_k, group = k.shape[1], q.shape[2] // k.shape[2]
    t = bwd_fused_tiles(d_tile, config)
    block_m, block_n, nwarps, nthreads = t["BLOCK_M"], t["BLOCK_N"], t["NWARPS"], t["NTHREADS"]
    KG, SQ, DW, QG, DQW, DQ_PASS = t["KG"], t["SQ"], t["DW"], t["QG"], t["DQW"], t["DQ_PASS"]
    lay = bwd_fused_layout(d_tile, block_m, block_n)
    smem = np.full(lay["BYTES"] // 2, np.nan)  # 16-bit tiles, by byte address // 2
    smem32 = np.full(lay["BYTES"] // 4, np.nan)  # lse and D, by byte address // 4
    scale_log2 = scale * math.log2(math.e)
    n0 = n_block * block_n
    lo_off, hi_off = mask.offsets(seqlen_q, seqlen_k)
    iterations = fused_iterations(seqlen_q, seqlen_k, block_m, block_n, mask, n_block, head_kv, group, ordered)
    n_iters = len(iterations)

    def load_query_block(it, stage):
        head, m_block = iterations[it]
        m0 = m_block * block_m
        for tile, src in ((lay["Q"], q), (lay["DO"], do)):
            cp_async_tile(smem, tile + stage * lay["Q_TILE"], block_m, d_tile, nthreads, src[batch, :, head],
                          m0, seqlen_q - m0, headdim)
        for i in range(2 * block_m):  # cp_async_4, zero-filled past seqlen_q
            r, is_lse = i % block_m, i < block_m
            dst = (lay["LSE"] if is_lse else lay["DELTA"]) + (stage * block_m + r) * 4
            smem32[dst // 4] = (lse if is_lse else delta)[batch, head, m0 + r] if m0 + r < seqlen_q else 0.0

    cp_async_tile(smem, lay["K"], block_n, d_tile, nthreads, k[batch, :, head_kv], n0, seqlen_k - n0, headdim)
    cp_async_tile(smem, lay["V"], block_n, d_tile, nthreads, v[batch, :, head_kv], n0, seqlen_k - n0, headdim)
    if n_iters > 0:
        load_query_block(0, 0)

    warps = [bwd_fused_warp_origins(t, w) for w in range(nwarps)]
    dk_acc = np.zeros((nwarps, KG, 32, DW // 8, 4))
    dv_acc = np.zeros((nwarps, KG, 32, DW // 8, 4))
    pending_release = None  # ordered: (batch, head, m_block) added last, not yet released

    for it in range(n_iters):
        stage = it & 1
        if not ordered and it + 1 < n_iters:
            load_query_block(it + 1, stage ^ 1)
        head, m_block = iterations[it]
        m0 = m_block * block_m
        s_q, s_do = lay["Q"] + stage * lay["Q_TILE"], lay["DO"] + stage * lay["Q_TILE"]
        s_lse, s_delta = (lay["LSE"] + stage * block_m * 4) // 4, (lay["DELTA"] + stage * block_m * 4) // 4
        partial = block_partial(m0, block_m, n0, block_n, seqlen_q, seqlen_k, mask)

        # Step 1
        s_acc = np.zeros((nwarps, KG, 32, SQ // 8, 4))
        for w, o in enumerate(warps):
            mma_ABt_groups(s_acc[w], smem, SQ, d_tile, d_tile, d_tile, lay["K"], o["key_row0"],
                               s_q + o["q_col0"] * d_tile * 2, 0)
        if ordered:  # release_dq_block by every warp, then the prefetch
            if pending_release is not None:
                semaphore[pending_release] += nwarps
            pending_release = None
            if it + 1 < n_iters:
                load_query_block(it + 1, stage ^ 1)
        for w, o in enumerate(warps):  # steps 2-5, up to the barrier
            key_row0, q_col0 = o["key_row0"], o["q_col0"]
            key0, query0 = n0 + key_row0 + GROUP, m0 + q_col0 + 2 * THREAD_IN_GROUP
            keys_left, queries_left = seqlen_k - key0, seqlen_q - query0
            hi_slack, lo_slack = query0 + hi_off - key0, query0 + lo_off - key0  # the policy's origin
            for j in range(SQ // 8):
                c = q_col0 + 8 * j + 2 * THREAD_IN_GROUP
                base_log2 = [lse_base_log2(smem32[s_lse + c]), lse_base_log2(smem32[s_lse + c + 1])]
                for g in range(KG):
                    for e in range(4):
                        p = recomputed_p(s_acc[w, g, :, j, e], scale_log2, base_log2[e & 1])
                        key_off, query_off = 16 * g + 8 * (e >> 1), 8 * j + (e & 1)
                        hidden = (key_off >= keys_left) | (query_off >= queries_left)
                        if mask.HAS_RIGHT:
                            hidden |= key_off - query_off > hi_slack
                        if mask.HAS_LEFT:
                            hidden |= key_off - query_off < lo_slack
                        s_acc[w, g, :, j, e] = np.where(partial & hidden, 0.0, p)
            for g in range(KG):
                stage_acc(smem, lay["PT"], block_m, key_row0 + 16 * g, q_col0, s_acc[w, g], 1.0)
            dp_acc = np.zeros((KG, 32, SQ // 8, 4))
            mma_ABt_groups(dp_acc, smem, SQ, d_tile, d_tile, d_tile, lay["V"], key_row0,
                               s_do + q_col0 * d_tile * 2, 0)
            for j in range(SQ // 8):
                c = q_col0 + 8 * j + 2 * THREAD_IN_GROUP
                d2 = [smem32[s_delta + c], smem32[s_delta + c + 1]]
                for g in range(KG):
                    for e in range(4):
                        p = s_acc[w, g, :, j, e]
                        with np.errstate(invalid="ignore"):  # NaN data (test of the selection)
                            ds = p * (dp_acc[g, :, j, e] - d2[e & 1])
                        dp_acc[g, :, j, e] = np.where(p == 0.0, 0.0, ds)
            for g in range(KG):
                stage_acc(smem, lay["DST"], block_m, key_row0 + 16 * g, q_col0, dp_acc[g], 1.0)

        sem = (batch, head, m_block)
        for w, o in enumerate(warps):  # steps 6-9, after the barrier
            key_row0, d_col0 = o["key_row0"], o["d_col0"]
            mma_AB_groups(dv_acc[w], smem, DW, block_m, block_m, d_tile, lay["PT"], key_row0, s_do, d_col0)
            mma_AB_groups(dk_acc[w], smem, DW, block_m, block_m, d_tile, lay["DST"], key_row0, s_q, d_col0)
            if ordered:
                # Sequential CTAs: key blocks 0..n_block-1 have finished (the count is exact), and
                # this CTA's warps release the block only at the next step 1.
                assert semaphore[sem] == n_block * nwarps, ("would wait forever", sem, n_block, semaphore[sem])
            dq_row0, dq_col0 = o["dq_row0"], o["dq_col0"]
            for pass_col0 in range(dq_col0, dq_col0 + DQW, DQ_PASS):
                dq_acc = np.zeros((QG, 32, DQ_PASS // 8, 4))
                mma_AtB_groups(dq_acc, smem, DQ_PASS, block_n, block_m, d_tile, lay["DST"], dq_row0, lay["K"],
                                   pass_col0)
                for g in range(QG):
                    m_lo = m0 + dq_row0 + 16 * g + GROUP
                    for j in range(DQ_PASS // 8):
                        col = pass_col0 + 8 * j + 2 * THREAD_IN_GROUP
                        for half, m in ((0, m_lo), (1, m_lo + 8)):
                            adds = (col < headdim) & (m < seqlen_q)  # red_add_f32x2: two columns per lane
                            for e in range(2):
                                dq_accum[batch, m[adds], head, col[adds] + e] += dq_acc[g, adds, j, 2 * half + e]
        if ordered:
            pending_release = sem
    if pending_release is not None:
        semaphore[pending_release] += nwarps

    # Epilogue: dK (times scale) and dV staged through the K and V tiles, then 16-byte stores.
    for w, o in enumerate(warps):
        for g in range(KG):
            stage_acc(smem, lay["K"], d_tile, o["key_row0"] + 16 * g, o["d_col0"], dk_acc[w, g], scale)
            stage_acc(smem, lay["V"], d_tile, o["key_row0"] + 16 * g, o["d_col0"], dv_acc[w, g], 1.0)
    store_tile(dk[batch, n0:, head_kv], smem, lay["K"], block_n, d_tile, nthreads, seqlen_k - n0, headdim)
    store_tile(dv[batch, n0:, head_kv], smem, lay["V"], block_n, d_tile, nthreads, seqlen_k - n0, headdim)


def fused_emulated(q, k, v, do, causal, scale, config, ordered=True, window_size=(-1, -1)):
    """dq, dk, dv from the emulated flash_bwd_fused_mma (CTAs in blockIdx order, x fastest) and
    flash_bwd_dq_convert; config is a FUSED_CONFIG entry, the head-dim tile follows from headdim."""
    from cupyflash.kernels.mma_bwd import d_tile as d_tile_of
    from cupyflash.reference import attention  # sums over visible keys only: NaN-safe

    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    d_tile, block_m, block_n = d_tile_of(headdim), config[0], config[1]
    o, lse = attention(q, k, v, softmax_scale=scale, causal=causal, window_size=window_size)
    mask = masks.mask_for(causal, window_size)
    assert not (ordered and mask.HAS_LEFT)  # the kernel's static_assert: ordered dQ adds take no window
    with np.errstate(invalid="ignore"):
        delta = np.einsum("bqhd,bqhd->bhq", do, o)
    dq, dk, dv = np.full(q.shape, np.nan), np.full(k.shape, np.nan), np.full(v.shape, np.nan)
    dq_accum = np.zeros((batch, seqlen_q, nheads, d_tile))
    q_blocks = math.ceil(seqlen_q / block_m)
    semaphore = np.zeros((batch, nheads, q_blocks), dtype=np.int64)
    n_blocks = math.ceil(seqlen_k / block_n)
    for b in range(batch):
        for hk in range(nheads_kv):
            for n_block in range(n_blocks):
                fused_cta(q, k, v, do, lse, delta, dk, dv, dq_accum, semaphore, n_block=n_block, head_kv=hk,
                          batch=b, scale=scale, mask=mask, d_tile=d_tile, config=config, ordered=ordered)
    if ordered:  # every warp of every key block that visits a query block released it once
        nwarps = config[2] * config[3]
        for m_block in range(q_blocks):
            visitors = sum(m_block >= fused_loop_bounds(seqlen_q, seqlen_k, block_m, block_n, mask, j)[0]
                           for j in range(n_blocks))
            assert np.all(semaphore[:, :, m_block] == visitors * nwarps)
    assert np.all(dq_accum[..., headdim:] == 0)
    for idx in range(batch * seqlen_q * nheads * (headdim // 8)):  # flash_bwd_dq_convert
        chunk, row_id = idx % (headdim // 8), idx // (headdim // 8)
        h, m, b = row_id % nheads, (row_id // nheads) % seqlen_q, row_id // (nheads * seqlen_q)
        dq[b, m, h, chunk * 8: chunk * 8 + 8] = dq_accum[b, m, h, chunk * 8: chunk * 8 + 8] * scale
    return dq, dk, dv


def simulate_dq_order(seqlen_q, seqlen_k, block_m, block_n, causal, *, resident, rng, descending=False,
                      group=2, nheads_kv=2, nwarps=8):
    """The DQ_ORDERED protocol of flash_bwd_fused_mma on a model of the GPU: CTAs dispatched in
    blockIdx order (x fastest), at most `resident` at a time, each walking its (query head, query
    block) iterations in the kernel's order. An iteration releases the previous query block (NWARPS
    increments: one per warp, at step 1), waits until the block's counter reaches turn * NWARPS
    (step 8; turn = n_block, or last visitor - n_block with `descending`, the counter-example),
    then adds; the last block is released after the loop. Resident CTAs advance in random
    interleavings. Returns {(head, query block): key blocks in the order they added}, or None when
    no resident CTA can advance (deadlock)."""
    n_blocks = (seqlen_k + block_n - 1) // block_n
    visitors = {}
    for j in range(n_blocks):
        for m_block in fused_iterations(seqlen_q, seqlen_k, block_m, block_n, causal, j, 0, 1, True):
            visitors[m_block[1]] = visitors.get(m_block[1], 0) + 1
    counters, order = {}, {}

    def advance(cta):
        if cta["pending"] is not None:
            counters[cta["pending"]] = counters.get(cta["pending"], 0) + nwarps
            cta["pending"] = None
            return True
        if cta["it"] == len(cta["iters"]):
            cta["done"] = True
            return True
        head, m_block = cta["iters"][cta["it"]]
        turn = visitors[m_block] - 1 - cta["n_block"] if descending else cta["n_block"]
        if counters.get((head, m_block), 0) < turn * nwarps:
            return False
        order.setdefault((head, m_block), []).append(cta["n_block"])
        cta["pending"], cta["it"] = (head, m_block), cta["it"] + 1
        return True

    waiting = [(x, hk) for hk in range(nheads_kv) for x in range(n_blocks)]  # linear blockIdx order
    running = []
    while waiting or running:
        while waiting and len(running) < resident:
            x, hk = waiting.pop(0)
            running.append(dict(n_block=x, it=0, pending=None, done=False, iters=fused_iterations(
                seqlen_q, seqlen_k, block_m, block_n, causal, x, hk, group, True)))
        progressed = False
        for i in rng.permutation(len(running)):
            while rng.random() < 0.7 and not running[i]["done"] and advance(running[i]):
                progressed = True
        if not progressed and not any(advance(cta) for cta in running if not cta["done"]):
            return None
        running = [cta for cta in running if not cta["done"]]
    return order

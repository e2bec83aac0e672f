"""The mma.sync backward as its kernels run it: a dK/dV kernel (flash_bwd_dkdv_mma, _v2 or
_split), then a dQ kernel (flash_bwd_dq_mma or _v2), or atomic dQ adds and flash_bwd_dq_convert;
and the check of an emulation against the float64 reference."""
from __future__ import annotations

import math

import numpy as np

from cupyflash import masks

from .flash_bwd_dkdv_mma import dkdv_block, dkdv_block_split, dkdv_block_v2
from .flash_bwd_dq_mma import dq_block, dq_block_v2

def bwd_emulated(q, k, v, do, *, causal, scale, dkdv_config, dq_config=None, window_size=(-1, -1)):
    """dq, dk, dv from the emulated kernels; dq by flash_bwd_dq_mma when dq_config is given, else
    by ATOMIC_DQ and flash_bwd_dq_convert."""
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    from cupyflash.reference import attention  # sums over visible keys only: NaN-safe

    o, lse = attention(q, k, v, softmax_scale=scale, causal=causal, window_size=window_size)
    mask = masks.mask_for(causal, window_size)
    delta = np.einsum("bqhd,bqhd->bhq", do, o)
    # (d_tile, BLOCK_M, M_SUB, BLOCK_N, NWARPS, WARPS_D), or ("v2", ..., ROW_GROUPS) for v2
    kernel = dkdv_config[0] if isinstance(dkdv_config[0], str) else "v1"  # "v2", "split": + ROW_GROUPS
    d_tile, block_m, m_sub, block_n, nwarps, warps_d = dkdv_config[1:] if kernel != "v1" else dkdv_config
    dq, dk, dv = np.full(q.shape, np.nan), np.full(k.shape, np.nan), np.full(v.shape, np.nan)
    dq_accum = None if dq_config else np.zeros((batch, seqlen_q, nheads, d_tile))
    for b in range(batch):
        for hk in range(nheads_kv):
            for n_block in range(math.ceil(seqlen_k / block_n)):
                kwargs = dict(batch=b, head_kv=hk, n_block=n_block, group=group, scale=scale, mask=mask,
                              d_tile=d_tile, block_m=block_m, m_sub=m_sub, block_n=block_n, nwarps=nwarps)
                if kernel == "split":
                    dkdv_block_split(q, k, v, do, lse, delta, dk, dv, dq_accum, row_groups=warps_d, **kwargs)
                elif kernel == "v2":
                    dkdv_block_v2(q, k, v, do, lse, delta, dk, dv, dq_accum, row_groups=warps_d, **kwargs)
                else:
                    dkdv_block(q, k, v, do, lse, delta, dk, dv, dq_accum, warps_d=warps_d, **kwargs)
    if dq_config:
        # (d_tile, BLOCK_M, BLOCK_N, NWARPS): flash_bwd_dq_mma; one more entry (ROW_GROUPS): v2
        dq_d_tile, dq_bm, dq_bn, dq_warps = dq_config[:4]
        for b in range(batch):
            for h in range(nheads):
                for m_block in range(math.ceil(seqlen_q / dq_bm)):
                    kwargs = dict(batch=b, head=h, m_block=m_block, group=group, scale=scale, mask=mask,
                                  d_tile=dq_d_tile, block_m=dq_bm, block_n=dq_bn, nwarps=dq_warps)
                    if len(dq_config) == 5:
                        dq_block_v2(q, k, v, do, lse, delta, dq, row_groups=dq_config[4], **kwargs)
                    else:
                        dq_block(q, k, v, do, lse, delta, dq, **kwargs)
    else:  # flash_bwd_dq_convert: one thread per 8 columns
        assert np.all(dq_accum[..., headdim:] == 0)
        for idx in range(batch * seqlen_q * nheads * (headdim // 8)):
            chunk, row_id = idx % (headdim // 8), idx // (headdim // 8)
            h, m, b = row_id % nheads, (row_id // nheads) % seqlen_q, row_id // (nheads * seqlen_q)
            dq[b, m, h, chunk * 8: chunk * 8 + 8] = dq_accum[b, m, h, chunk * 8: chunk * 8 + 8] * scale
    return dq, dk, dv


def bwd_case_id(c):
    dkdv, dq = c[0], c[1]
    if isinstance(dkdv[0], str):
        name = "{}_d{}_bm{}_ms{}_bn{}_w{}_rg{}".format(*dkdv)
    else:
        name = "d{}_bm{}_ms{}_bn{}_w{}_wd{}".format(*dkdv)
    name += "_dq_bm{1}_bn{2}_w{3}".format(*dq) if dq else "_atomic"
    if dq and len(dq) == 5:
        name += f"_rg{dq[4]}"
    return name + "_hd{}_sq{}_sk{}_h{}_{}{}".format(c[2], c[4], c[5], c[6], c[7], "_causal" if c[8] else "")


def check_bwd_emulation(emulate, headdim, batch, sq, sk, nheads, nheads_kv, causal, window_size=(-1, -1)):
    """emulate(q, k, v, do, scale) -> (dq, dk, dv) on float64 inputs drawn from the shape, against
    the float64 reference at 1e-9; no element may stay NaN (the emulations poison their outputs)."""
    from cupyflash.reference import attention_backward

    rng = np.random.default_rng(headdim + batch + sq + sk + nheads + nheads_kv)
    q = rng.standard_normal((batch, sq, nheads, headdim))
    k = rng.standard_normal((batch, sk, nheads_kv, headdim))
    v = rng.standard_normal((batch, sk, nheads_kv, headdim))
    do = rng.standard_normal((batch, sq, nheads, headdim))
    scale = 1 / math.sqrt(headdim)
    dq, dk, dv = emulate(q, k, v, do, scale)
    dq_ref, dk_ref, dv_ref = attention_backward(do, q, k, v, softmax_scale=scale, causal=causal,
                                                window_size=window_size)
    for name, got, want in (("dq", dq, dq_ref), ("dk", dk, dk_ref), ("dv", dv, dv_ref)):
        assert not np.isnan(got).any(), f"{name}: some element was never written"
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9, err_msg=name)
    if causal and sq > sk:
        assert np.all(dq[:, : sq - sk] == 0)  # queries that see no key


def check_bwd_case(case) -> None:
    """A case (dkdv config, dq config or None (atomic), headdim, batch, seqlen_q, seqlen_k, nheads,
    nheads_kv, causal) of the whole backward against the reference."""
    dkdv_config, dq_config, headdim, batch, sq, sk, nheads, nheads_kv, causal = case
    check_bwd_emulation(lambda q, k, v, do, scale: bwd_emulated(q, k, v, do, causal=causal, scale=scale,
                                                                dkdv_config=dkdv_config, dq_config=dq_config),
                        headdim, batch, sq, sk, nheads, nheads_kv, causal)

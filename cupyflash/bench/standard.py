"""Standard (materialised) attention, written for NumPy and CuPy alike.

Two uses in the benchmark: the O(N^2)-memory baseline of ``--memory`` (the scores and
probabilities exist as (batch, heads, seqlen_q, seqlen_k) arrays), and, in float64, the
reference that every timed cupyflash result is checked against before it is timed.

The updates are in place where the algebra allows, so the baseline is a fair straightforward
implementation, not a straw man: about three score-sized arrays are live at its peak.
"""
from __future__ import annotations

import math

import numpy as np

# Relative Frobenius error above which a timed result is flagged as wrong. These catch broken
# results (wrong mask, wrong head, a race), not precision regressions: typical errors are
# ~4e-3 (bf16), ~5e-4 (fp16), ~1e-6 (fp32); the precision rule lives in tests/.
VALIDATION_TOLERANCE = {"bf16": 3e-2, "fp16": 4e-3, "fp32": 1e-4}


def array_module(x):
    """numpy or cupy, whichever owns ``x`` (cupy is not imported for NumPy arrays)."""
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy.get_array_module(x)


def standard_attention(q, k, v, do=None, *, softmax_scale=None, causal=False, acc_dtype=None):
    """Attention with materialised S and P, and its gradients when ``do`` is given.

    Layouts as in cupyflash: q, do (B, Sq, H, D); k, v (B, Sk, Hkv, D); causal aligned
    bottom-right. Returns a dict of o (B, Sq, H, D), lse (B, H, Sq) and, with ``do``, dq, dk,
    dv, all in the accumulation dtype (float32 for 16-bit and float32 inputs unless
    ``acc_dtype`` says otherwise; float64 stays float64).
    """
    xp = array_module(q)
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    if acc_dtype is None:
        acc_dtype = np.float64 if q.dtype == np.float64 else np.float32
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)

    def heads_first(x, repeat=1):
        x = x.transpose(0, 2, 1, 3).astype(acc_dtype)
        return xp.repeat(x, repeat, axis=1) if repeat > 1 else x

    qh, kh, vh = heads_first(q), heads_first(k, group), heads_first(v, group)
    s = xp.matmul(qh, kh.swapaxes(-1, -2))
    s *= scale
    if causal:
        rows = xp.arange(seqlen_q)[:, None]
        cols = xp.arange(seqlen_k)[None, :]
        s += xp.where(cols > rows + (seqlen_k - seqlen_q), -xp.inf, 0.0).astype(acc_dtype)
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0.0).astype(acc_dtype)  # rows with no key: exp(-inf) = 0
    s -= m
    xp.exp(s, out=s)
    l = s.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = (xp.log(l) + m)[..., 0]
    s /= xp.where(l > 0, l, 1.0).astype(acc_dtype)
    p = s
    oh = xp.matmul(p, vh)
    out = {"o": oh.transpose(0, 2, 1, 3), "lse": lse}
    if do is None:
        return out

    doh = heads_first(do)
    dvh = xp.matmul(p.swapaxes(-1, -2), doh)
    ds = xp.matmul(doh, vh.swapaxes(-1, -2))  # dP, turned into dS in place below
    ds -= (doh * oh).sum(axis=-1, keepdims=True)
    ds *= p
    del p, s
    dqh = xp.matmul(ds, kh)
    dqh *= scale
    dkh = xp.matmul(ds.swapaxes(-1, -2), qh)
    dkh *= scale
    del ds
    if group > 1:
        dkh = dkh.reshape(batch, nheads_kv, group, seqlen_k, headdim).sum(axis=2)
        dvh = dvh.reshape(batch, nheads_kv, group, seqlen_k, headdim).sum(axis=2)
    out.update(dq=dqh.transpose(0, 2, 1, 3), dk=dkh.transpose(0, 2, 1, 3),
               dv=dvh.transpose(0, 2, 1, 3))
    return out


def rel_error(actual, ref) -> float:
    """||actual - ref||_F / ||ref||_F in float64; infinite entries must match exactly
    (e.g. lse = -inf of rows that see no key), otherwise the error is infinite."""
    xp = array_module(ref)
    a = xp.asarray(actual).astype(np.float64)
    r = ref.astype(np.float64)
    finite = xp.isfinite(r)
    if not bool((xp.isfinite(a) == finite).all()):
        return math.inf
    if not bool(finite.all()):
        if not bool((a[~finite] == r[~finite]).all()):
            return math.inf
        a, r = xp.where(finite, a, 0.0), xp.where(finite, r, 0.0)
    num = float(xp.linalg.norm((a - r).ravel()))
    den = float(xp.linalg.norm(r.ravel()))
    return num / den if den > 0 else num


def validation_heads(nheads: int, nheads_kv: int) -> tuple[slice, slice]:
    """The query heads and the kv head that validation recomputes: the last kv head and the
    query heads that share it (the last ones exercise the largest offsets; the whole group is
    needed because dk, dv sum over it)."""
    group = nheads // nheads_kv
    hk = nheads_kv - 1
    return slice(hk * group, (hk + 1) * group), slice(hk, hk + 1)


def validate(outputs: dict, q, k, v, do=None, *, dtype: str, softmax_scale=None,
             causal=False) -> dict:
    """Compare ``outputs`` (o, lse and optionally dq, dk, dv of a whole batch) with a float64
    recomputation of batch 0, last kv head group."""
    hq, hk = validation_heads(q.shape[2], k.shape[2])
    ref = standard_attention(q[:1, :, hq], k[:1, :, hk], v[:1, :, hk],
                             None if do is None else do[:1, :, hq],
                             softmax_scale=softmax_scale, causal=causal, acc_dtype=np.float64)
    pick = {"o": (slice(0, 1), slice(None), hq), "lse": (slice(0, 1), hq),
            "dq": (slice(0, 1), slice(None), hq), "dk": (slice(0, 1), slice(None), hk),
            "dv": (slice(0, 1), slice(None), hk)}
    errors = {name: rel_error(outputs[name][pick[name]], ref[name])
              for name in ("o", "lse", "dq", "dk", "dv") if name in outputs and name in ref}
    tolerance = VALIDATION_TOLERANCE[dtype]
    return {"errors": errors, "tolerance": tolerance,
            "ok": all(e <= tolerance for e in errors.values())}

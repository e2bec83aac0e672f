"""The oracles of the float64 reference itself: attention one row and one key at a time from the
definition (with math.fsum), and central differences for its backward."""
from __future__ import annotations

import math

import numpy as np

from cupyflash.scores import NO_VARIANT


def numerical_gradient(loss, x, step=1e-6):
    """Central differences of loss() with respect to every entry of x (perturbed in place)."""
    grad = np.zeros_like(x)
    for idx in np.ndindex(*x.shape):
        saved = x[idx]
        x[idx] = saved + step
        up = loss()
        x[idx] = saved - step
        down = loss()
        x[idx] = saved
        grad[idx] = (up - down) / (2 * step)
    return grad


def brute_force_attention(q, k, v, case, variant=NO_VARIANT):
    """(o, lse) one query row at a time, one key at a time, from the definition, sums with math.fsum:
    case's scale, causal and window_size, the variant's softcap, ALiBi slopes and sink."""
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    left, right = case.window_size
    if case.causal:
        right = 0
    slopes = None if variant.alibi_slopes is None else np.broadcast_to(variant.alibi_slopes, (batch, nheads))
    o = np.zeros(q.shape)
    lse = np.full((batch, nheads, seqlen_q), -np.inf)
    for b in range(batch):
        for h in range(nheads):
            kv_head = h // (nheads // nheads_kv)
            for i in range(seqlen_q):
                diagonal = i + seqlen_k - seqlen_q
                keys = [j for j in range(seqlen_k)
                        if (left < 0 or j >= diagonal - left) and (right < 0 or j <= diagonal + right)]
                scores = []
                for j in keys:
                    z = case.scale * math.fsum(q[b, i, h] * k[b, j, kv_head])
                    if variant.softcap > 0:
                        z = variant.softcap * math.tanh(z / variant.softcap)
                    if slopes is not None:
                        z -= float(slopes[b, h]) * abs(diagonal - j)
                    scores.append(z)
                logits = scores + ([] if variant.sink is None else [float(variant.sink[h])])
                if not logits:
                    continue
                top = max(logits)
                lse[b, h, i] = top + math.log(math.fsum(math.exp(s - top) for s in logits))
                for d in range(headdim):
                    o[b, i, h, d] = math.fsum(math.exp(s - lse[b, h, i]) * v[b, j, kv_head, d]
                                              for s, j in zip(scores, keys))
    return o, lse

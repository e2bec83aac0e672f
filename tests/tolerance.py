"""How close an attention result must be to the float64 reference.

16-bit dtypes follow flash-attn's rule: the error may be at most ``factor`` times the error of
standard (unfused) attention computed in the same dtype, both measured against float64.

float32 and float64 get a relative bound derived from their machine epsilon instead: there the
unfused baseline is no yardstick, since on a nearly one-hot softmax row it is exact (P = 1) while
a fused backward, recomputing P = exp2(S - lse) from a separately rounded lse, is off by
eps * |S|, many times the baseline's error yet exactly as accurate as the dtype allows.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

# Relative bounds on max|actual - ref| / (1 + max|ref|). They assume inputs drawn as in
# strategies.py, where the standard deviation of the scores S = scale * q.k is capped at
# MAX_LOGIT_STD = 8, so |S| stays below ~5 * 8 = 40 (58 in log2 units):
# - float32 represents such a score only to eps * scale * sum_d |q_d k_d|, and for d <= 256
#   that sum is up to ~10 standard deviations, i.e. ~80 * 2^-24 ~ 5e-6 absolute. exp2 turns it
#   into the same relative error of P; the backward recomputes P from the saved lse, whose own
#   rounding doubles it; dot products over d <= 256 and sums over <= ~300 keys of random sign add
#   ~sqrt(n) * eps more. Measured on 800 random cases at the cap, the worst output error was
#   6e-6 and the worst gradient error 2e-5 (relative as above); 1e-4 leaves a 5x margin for
#   other summation orders (GPU kernels, FMA contraction).
# - float64 has the same error sources scaled by eps64 / eps32 = 2^-29: 1e-4 * 2^-29 ~ 2e-13,
#   measured worst 1e-13; 1e-12 leaves the same margin.
RTOL = {np.dtype(np.float32): 1e-4, np.dtype(np.float64): 1e-12}
SIXTEEN_BIT = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def _as_f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def max_abs_error(actual, ref) -> float:
    """max|actual - ref| over the entries where ref is finite (0 when there are none); NaN
    when actual is not finite at one of them."""
    actual, ref = _as_f64(actual), _as_f64(ref)
    finite = np.isfinite(ref)
    diff = np.abs(actual[finite] - ref[finite])
    return float(diff.max()) if diff.size else 0.0


def rel_fro_error(a, ref) -> float:
    """||a - ref||_F / ||ref||_F (the absolute norm when ref is all zeros)."""
    a, ref = _as_f64(a), _as_f64(ref)
    norm = np.linalg.norm(ref)
    diff = np.linalg.norm(a - ref)
    return float(diff / norm) if norm > 0 else float(diff)


def max_abs(x) -> float:
    """max|x| over the finite entries of x (0 when there are none)."""
    x = _as_f64(x)
    finite = x[np.isfinite(x)]
    return float(np.abs(finite).max()) if finite.size else 0.0


def bound(ref, *, dtype, scale=None) -> float:
    """The float32/float64 bound: RTOL * (1 + scale), scale defaulting to max|ref|.

    For 16-bit dtypes this is the float32 bound: they compute in float32, so differences below
    it are arithmetic noise, not a kernel's fault (it matters when ref and baseline are exact).
    Pass ``scale`` when the result may cancel to far below the terms it sums: dq and dk are
    exactly 0 when every query sees a single key, while their float32 terms, and the noise those
    leave, are as large as dv."""
    dtype = np.dtype(dtype)
    scale = max_abs(ref) if scale is None else scale
    return RTOL[np.dtype(np.float32) if dtype in SIXTEEN_BIT else dtype] * (1.0 + scale)


def output_rounding_allowance(do, q, k, v, o, o_ref, *, softmax_scale, causal):
    """max|change| of (dq, dk, dv) caused by a backward being handed o (rounded to its dtype)
    instead of the exact output o_ref. Standard attention never forms D, so it does not show in
    the baseline error; on small problems with nearly one-hot rows (where dP - D cancels) it can
    be many times that error.

    The backward forms D = rowsum(dO * o); an error e_i of D_i moves dS_ij by exactly -P_ij e_i,
    so dq_i by -scale * e_i * sum_j P_ij k_j and dk_j by -scale * sum_i P_ij e_i q_i: attention
    outputs that the float64 reference computes. dv does not depend on D.
    """
    from cupyflash import reference

    q, k, v, do, o, o_ref = (_as_f64(x) for x in (q, k, v, do, o, o_ref))
    scale = 1.0 / np.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    e = np.sum(do * (o - o_ref), axis=-1, keepdims=True)  # (batch, seqlen_q, heads, 1)
    kwargs = dict(softmax_scale=softmax_scale, causal=causal)
    p_k = reference.attention(q, k, k, **kwargs)[0]
    p_t_e_q = reference.attention_backward(e * q, q, k, v, **kwargs)[2]
    return scale * max_abs(e * p_k), scale * max_abs(p_t_e_q), 0.0


def flash_rounding_baseline(do, q, k, v, *, softmax_scale, causal, dtype):
    """(dq, dk, dv) computed exactly except where a FlashAttention-2-style backward rounds: P and
    dS to ``dtype`` as 16-bit tensor-core operands (dV = P^T dO, dS = P (dP - D) from that P,
    dK = dS^T Q, dQ = dS K), and each gradient to ``dtype``.

    A second baseline beside standard attention's: both round the same operands, but which
    rounding errors add up is luck, and on sums of a few terms 3x the standard baseline's error can
    fall below what rounding P once does (headdim 1, 6 terms: 1.6e-3 against 5.0e-3).
    """
    from cupyflash import reference

    q, k, v, do = (_as_f64(x) for x in (q, k, v, do))
    nheads, nheads_kv = q.shape[2], k.shape[2]
    scale = 1.0 / np.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    rnd = lambda x: np.asarray(x).astype(dtype).astype(np.float64)  # noqa: E731
    q_, k_, v_, do_ = reference._standard_inputs(np.float64, nheads, q, k, v, do)
    p, _ = reference._standard_probabilities(q_, k_, scale, causal, np.float64)
    dp = do_ @ np.swapaxes(v_, -1, -2)
    delta = (p * dp).sum(axis=-1, keepdims=True)
    p16 = rnd(p)
    ds16 = rnd(np.where(p16 > 0, p16 * (dp - delta), 0.0))
    dv = reference._seqlen_first(np.swapaxes(p16, -1, -2) @ do_, nheads_kv)
    dk = reference._seqlen_first(np.swapaxes(ds16, -1, -2) @ q_, nheads_kv) * scale
    dq = reference._seqlen_first(ds16 @ k_, nheads) * scale
    return tuple(rnd(g) for g in (dq, dk, dv))


def worse_baseline(ref64, first, *others):
    """The baseline farthest from ``ref64`` (max abs error) among ``first`` and those ``others``
    whose error is finite: a baseline that overflows its dtype must not make the allowed error
    infinite."""
    finite = [b for b in others if np.isfinite(max_abs_error(b, ref64))]
    return max([first, *finite], key=lambda b: max_abs_error(b, ref64))


def assert_close(name, actual, ref64, baseline=None, *, dtype, factor=2.0, scale=None, atol=0.0):
    """Assert that ``actual`` matches the float64 reference ``ref64`` closely enough for ``dtype``.

    float16/bfloat16: max|actual - ref| <= factor * max|baseline - ref| + bound(float32) + atol,
    where ``baseline`` is standard attention computed in ``dtype`` and ``atol`` allows for an
    error the baseline does not make (output_rounding_allowance). float32/float64:
    max|actual - ref| <= bound = RTOL * (1 + max|ref|), or RTOL * (1 + scale) when ``scale`` is
    given (see bound), + atol; ``baseline`` is not used. Where ref is +-inf (lse of a query that
    sees no key) actual must equal it; where ref is finite, actual must be finite.
    """
    dtype = np.dtype(dtype)
    actual, ref64 = _as_f64(actual), _as_f64(ref64)
    assert actual.shape == ref64.shape, f"{name}: shape {actual.shape} != reference {ref64.shape}"
    finite = np.isfinite(ref64)
    n_mismatch = int(np.count_nonzero(actual[~finite] != ref64[~finite]))
    n_nonfinite = int(np.count_nonzero(~np.isfinite(actual[finite])))
    err = max_abs_error(actual, ref64) if n_nonfinite == 0 else np.inf
    floor = bound(ref64, dtype=dtype, scale=scale)
    if dtype in SIXTEEN_BIT:
        if baseline is None:
            raise ValueError(f"{name}: {dtype.name} needs the standard-attention baseline")
        base_err = max_abs_error(baseline, ref64)
        allowed = factor * base_err + floor + atol
        rule = f"{factor:g} x baseline error {base_err:.3e} + float32 floor {floor:.3e}"
    else:
        allowed = floor + atol
        rule = f"{RTOL[dtype]:g} x (1 + {'max|ref|' if scale is None else f'scale {scale:.3g}'})"
    if atol:
        rule += f" + atol {atol:.3e}"
    if n_mismatch or n_nonfinite or not err <= allowed:
        fro = rel_fro_error(np.where(finite, actual, 0), np.where(finite, ref64, 0))
        raise AssertionError(
            f"{name} ({dtype.name}): max abs error {err:.3e}, allowed {allowed:.3e} [{rule}]; "
            f"rel. Frobenius error {fro:.3e}; "
            f"{n_nonfinite} non-finite where the reference is finite, "
            f"{n_mismatch} entries differ where the reference is +-inf"
        )

"""How close an attention result must be to the float64 reference.

16-bit dtypes follow flash-attn's rule: the error may be at most ``factor`` times the error of
standard (unfused) attention computed in the same dtype, both measured against float64 (2x for
o and lse, 3x for gradients). For gradients the baseline is the larger of standard attention's
error and that of a FlashAttention-style backward that rounds only its tensor-core operands
(``flash_rounding_baseline``).

float32 and float64 get a relative bound derived from their machine epsilon instead: there the
unfused baseline is no yardstick, since on a nearly one-hot softmax row it is exact (P = 1) while
a fused backward, recomputing P = exp2(S - lse) from a separately rounded lse, is off by
eps * |S|, many times the baseline's error yet exactly as accurate as the dtype allows.

Everything here is computed from ``cupyflash.reference`` (float64, written from the definition),
never from a kernel or the NumPy twin.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .. import reference
from .problem import AttentionProblem, as_numpy, mask_options

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
# half a unit in the last place, relative: the most a rounding to the dtype moves a value by
UNIT_ROUNDOFF = {np.dtype(np.float16): 2.0 ** -11, np.dtype(ml_dtypes.bfloat16): 2.0 ** -8}

# flash-attn's factors on the baseline's error.
OUTPUT_FACTOR = 2.0
GRADIENT_FACTOR = 3.0


def _as_f64(x) -> np.ndarray:
    return as_numpy(x).astype(np.float64)


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


def output_rounding_allowance(do, q, k, v, o, o_ref, *, softmax_scale, causal, window_size=(-1, -1),
                              **variant):
    """max|change| of (dq, dk, dv) caused by a backward being handed o (rounded to its dtype)
    instead of the exact output o_ref. Standard attention never forms D, so it does not show in
    the baseline error; on small problems with nearly one-hot rows (where dP - D cancels) it can
    be many times that error.

    The backward forms D = rowsum(dO * o); an error e_i of D_i moves dS_ij by exactly -P_ij e_i,
    so dq_i by -scale * e_i * sum_j P_ij k_j and dk_j by -scale * sum_i P_ij e_i q_i: attention
    outputs that the float64 reference computes. dv does not depend on D.

    ``variant``: the variant keyword arguments (softcap, alibi_slopes, sink; dropout's are
    ignored), P being theirs. With
    softcap dS_ij moves by -P_ij g_ij e_i, g_ij = 1 - tanh^2 in [0, 1]: the sums are bounded
    through |k| and |e q| instead.

    With o in a 16-bit dtype, the error also passes two roundings to it on its way out, which
    the factor (1 + u)^2 allows for (u: UNIT_ROUNDOFF): dS rounded as a tensor-core operand
    (dQ = dS K, dK = dS^T Q), then the gradient. Where the reference is 0 and standard attention's
    result exactly 0 (a row of one key: no D there), nothing else in the rule covers them.
    """
    o = as_numpy(o)
    roundings = (1 + UNIT_ROUNDOFF.get(np.dtype(o.dtype), 0.0)) ** 2
    q, k, v, do, o, o_ref = (_as_f64(x) for x in (q, k, v, do, o, o_ref))
    # Dropout leaves D's place in dS = P (Z dP / (1 - p) - D) as it is: P is the softmax's.
    variant = {name: value for name, value in variant.items() if not name.startswith("dropout")}
    scale = 1.0 / np.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    e = np.sum(do * (o - o_ref), axis=-1, keepdims=True)  # (batch, seqlen_q, heads, 1)
    kwargs = {**mask_options(softmax_scale, causal, window_size), **variant}
    score_mod = variant.get("score_mod")
    capped = bool(variant.get("softcap")) or (score_mod is not None and getattr(score_mod, "has_grad", True))
    p_k = reference.attention(q, k, np.abs(k) if capped else k, **kwargs)[0]
    # P^T (e q) is the dv of a backward whose output gradient is e q: k stands in for v, whose
    # values (and head dim, should it be v's own) dv does not depend on.
    p_t_e_q = reference.attention_backward(np.abs(e * q) if capped else e * q, q, k, k, **kwargs)[2]
    return (roundings * scale * max_abs(np.abs(e) * p_k if capped else e * p_k),
            roundings * scale * max_abs(p_t_e_q), 0.0)


def flash_rounding_baseline(do, q, k, v, *, softmax_scale, causal, dtype, window_size=(-1, -1), o=None):
    """(dq, dk, dv) computed exactly except where a FlashAttention-2-style backward rounds: P and
    dS to ``dtype`` as 16-bit tensor-core operands (dV = P^T dO, dK = dS^T Q, dQ = dS K), and each
    gradient to ``dtype``. dS = P (dP - D) is formed in the ways the kernels form it: from the
    unrounded P (the mma.sync kernels keep P in float32) and from P rounded as dV's operand (the
    wgmma kernel), D from ``o``, the output the backward is handed (rounded to ``dtype``); and, as
    this baseline was before it modelled the handed o, from the rounded P with the exact D. Each
    gradient takes the one farther from exact (so the rule only widened). Without ``o`` D is exact.

    A second baseline beside standard attention's: both round the same operands, but which
    rounding errors add up is luck, and on sums of a few terms 3x the standard baseline's error can
    fall below what rounding P once does (headdim 1, 6 terms: 1.6e-3 against 5.0e-3). The handed o
    matters for the same reason: on a sum dominated by two terms of dS, the rounded o moved D just
    enough to turn both terms' rounding the same way (headdim 1, 298 keys: dq off by 6.8e-2, where
    the same rounding with the exact D is off by 7e-3; output_rounding_allowance, which moves dS
    by exactly -P e, cannot see a change of rounding direction).
    """
    q, k, v, do = (_as_f64(x) for x in (q, k, v, do))
    nheads, nheads_kv = q.shape[2], k.shape[2]
    scale = 1.0 / np.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    rnd = lambda x: np.asarray(x).astype(dtype).astype(np.float64)  # noqa: E731
    q_, k_, v_, do_ = reference._standard_inputs(np.float64, nheads, q, k, v, do)
    window = () if tuple(window_size) == (-1, -1) else (tuple(window_size),)
    p, _ = reference._standard_probabilities(q_, k_, scale, causal, np.float64, *window)
    dp = do_ @ np.swapaxes(v_, -1, -2)
    exact_delta = (p * dp).sum(axis=-1, keepdims=True)
    p16 = rnd(p)
    # (P in dS, D): the rounded P with the exact D first (this baseline before the handed o was
    # modelled, kept so that the rule only widens), then both kernel styles with the handed o's D
    styles = [(p16, exact_delta)]
    if o is not None:
        o_ = reference._standard_inputs(np.float64, nheads, _as_f64(o), k, v, do)[0]
        handed_delta = (do_ * o_).sum(axis=-1, keepdims=True)
        styles += [(p, handed_delta), (p16, handed_delta)]
    else:
        styles += [(p, exact_delta)]
    dv = reference._seqlen_first(np.swapaxes(p16, -1, -2) @ do_, nheads_kv)

    def dq_dk(ds):
        return (reference._seqlen_first(ds @ k_, nheads) * scale,
                reference._seqlen_first(np.swapaxes(ds, -1, -2) @ q_, nheads_kv) * scale)

    exact_dq, exact_dk = dq_dk(p * (dp - exact_delta))  # the yardstick for "farther from exact"
    dq = dk = None
    for p_in_ds, delta in styles:
        dq_, dk_ = (rnd(g) for g in dq_dk(rnd(np.where(p16 > 0, p_in_ds * (dp - delta), 0.0))))
        dq = dq_ if dq is None else worse_baseline(exact_dq, dq, dq_)
        dk = dk_ if dk is None else worse_baseline(exact_dk, dk, dk_)
    return dq, dk, rnd(dv)


def references_and_baselines(do, q, k, v, *, dtype, **options):
    """(o, lse, grads) of the float64 reference and, for 16-bit dtypes, of standard attention in
    that dtype (Nones otherwise): what the rule compares a result and its baseline against.
    ``options``: softmax_scale, causal, window_size, as for ``reference.attention``."""
    o_ref, lse_ref = reference.attention(q, k, v, **options)
    grads_ref = reference.attention_backward(do, q, k, v, **options)
    o_std = lse_std = None
    grads_std = (None, None, None)
    if np.dtype(dtype) in SIXTEEN_BIT:
        o_std, lse_std = reference.standard_attention(q, k, v, dtype=dtype, **options)
        grads_std = reference.standard_attention_backward(do, q, k, v, dtype=dtype, **options)
    return (o_ref, lse_ref, grads_ref), (o_std, lse_std, grads_std)


def worse_baseline(ref64, first, *others):
    """The baseline farthest from ``ref64`` (max abs error) among ``first`` and those ``others``
    whose error is finite: a baseline that overflows its dtype must not make the allowed error
    infinite."""
    finite = [b for b in others if np.isfinite(max_abs_error(b, ref64))]
    return max([first, *finite], key=lambda b: max_abs_error(b, ref64))


def _first(mask: np.ndarray) -> tuple[int, ...]:
    """The index of the first True entry of ``mask``."""
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(mask)), mask.shape))


def assert_close(name, actual, ref64, baseline=None, *, dtype, factor=2.0, scale=None, atol=0.0):
    """Assert that ``actual`` matches the float64 reference ``ref64`` closely enough for ``dtype``.

    float16/bfloat16: max|actual - ref| <= factor * max|baseline - ref| + bound(float32) + atol,
    where ``baseline`` is standard attention computed in ``dtype`` and ``atol`` allows for an
    error the baseline does not make (output_rounding_allowance). float32/float64:
    max|actual - ref| <= bound = RTOL * (1 + max|ref|), or RTOL * (1 + scale) when ``scale`` is
    given (see bound), + atol; ``baseline`` is not used. Where ref is +-inf (lse of a query that
    sees no key) actual must equal it; where ref is finite, actual must be finite.

    The AssertionError names the output, the largest error and where it is, what was allowed and
    by which rule, and counts the non-finite and mismatched entries.
    """
    dtype = np.dtype(dtype)
    actual, ref64 = _as_f64(actual), _as_f64(ref64)
    assert actual.shape == ref64.shape, f"{name}: shape {actual.shape} != reference {ref64.shape}"
    finite = np.isfinite(ref64)
    mismatch = ~finite & (actual != ref64)
    nonfinite = finite & ~np.isfinite(actual)
    n_mismatch, n_nonfinite = int(np.count_nonzero(mismatch)), int(np.count_nonzero(nonfinite))
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
        at = ""
        if actual.size:
            if n_nonfinite:
                worst = _first(nonfinite)
            elif not err <= allowed:
                worst = _first(np.where(finite, np.abs(actual - ref64), -1.0) == err)
            else:
                worst = _first(mismatch)
            at = f" at {list(worst)} (got {actual[worst]:.6g}, reference {ref64[worst]:.6g})"
        fro = rel_fro_error(np.where(finite, actual, 0), np.where(finite, ref64, 0))
        raise AssertionError(
            f"{name} ({dtype.name}): max abs error {err:.3e}{at}, allowed {allowed:.3e} [{rule}]; "
            f"rel. Frobenius error {fro:.3e}; "
            f"{n_nonfinite} non-finite where the reference is finite, "
            f"{n_mismatch} entries differ where the reference is +-inf"
            + (f" (first at {list(_first(mismatch))})" if n_mismatch else "")
        )


def _check_output(failures, name, value, shape, dtype):
    """value as NumPy, or None after recording why it cannot be compared."""
    try:
        value = as_numpy(value, name)
    except TypeError as exc:
        failures.append(str(exc))
        return None
    if value.shape != tuple(shape):
        failures.append(f"{name}: shape {value.shape}, expected {tuple(shape)}")
        return None
    if dtype is not None and value.dtype != dtype:
        failures.append(f"{name}: dtype {value.dtype}, expected {np.dtype(dtype).name}")
        return None
    return value


def _passes(failures, name, actual, ref64, baseline, *, dtype, **options) -> bool:
    """assert_close, its failure recorded in ``failures`` instead of raised."""
    try:
        assert_close(name, actual, ref64, baseline, dtype=dtype, **options)
    except AssertionError as failure:
        failures.append(str(failure))
        return False
    return True


def assert_attention_close(problem: AttentionProblem, o, lse=None, grads=None, *, inputs=None,
                           check_dtype=True, variant=None):
    """Assert that an attention implementation's results for ``problem`` are as accurate as the
    rule in this module requires, against ``cupyflash.reference`` in float64.

    ``o`` is the output for the inputs ``problem.arrays()`` (or ``inputs`` = (q, k, v, do), if
    given); ``lse`` (batch, nheads, seqlen_q), natural log, and ``grads`` = (dq, dk, dv) of
    sum(do * o) are checked when given. The gradients are assumed to come from a backward that
    was handed this ``o`` (as a FlashAttention backward is); its rounding is allowed for
    (``output_rounding_allowance``). Arrays may be NumPy, CuPy or torch (any device) or anything
    ``np.asarray`` takes. With ``check_dtype``, o and the gradients must have ``problem.dtype``.
    ``variant``: the call's variant keywords beyond the problem's (softcap, alibi_slopes,
    score_mod, mask_mod: those of ``cupyflash.reference.attention``), which the references and
    the baseline then take too. A score_mod's derivative must lie in [0, 1] (a cap, a bias) for
    the output-rounding allowance (``output_rounding_allowance``) to bound the gradients.

    Every output is checked, then one AssertionError lists each failing one: its largest error,
    where, the reference value there, and the allowed error with the rule that set it.
    """
    q, k, v, do = problem.arrays() if inputs is None else (as_numpy(x) for x in inputs)
    variant = dict(variant or {})
    if variant.get("sink") is not None:
        raise ValueError("assert_attention_close checks (dq, dk, dv); check a sink's dsink on its own")
    kwargs = {**problem.kwargs, **variant}
    dtype = problem.dtype
    out_dtype = dtype if check_dtype else None
    sixteen_bit = dtype in SIXTEEN_BIT
    given = 1 + (lse is not None) + (3 if grads is not None else 0)
    failures = []

    def passes(name, actual, ref64, baseline, **options) -> bool:
        return _passes(failures, name, actual, ref64, baseline, dtype=dtype, **options)

    o_ref, lse_ref = reference.attention(q, k, v, **kwargs)
    o_std = lse_std = None
    if sixteen_bit:
        o_std, lse_std = reference.standard_attention(q, k, v, dtype=dtype, **kwargs)
    o = _check_output(failures, "o", o, problem.o_shape, out_dtype)
    o_passes = o is not None and passes("o", o, o_ref, o_std, factor=OUTPUT_FACTOR)
    if lse is not None:
        lse = _check_output(failures, "lse", lse, problem.lse_shape, None)
        if lse is not None:
            passes("lse", lse, lse_ref, lse_std, factor=OUTPUT_FACTOR)

    if grads is not None:
        grads = tuple(grads)
        if len(grads) != 3:
            raise ValueError(f"grads must be (dq, dk, dv), got {len(grads)} arrays")
        refs = reference.attention_backward(do, q, k, v, **kwargs)
        # The o the backward saw, if that o is within the rule; else a correctly rounded one: a
        # wrong o must not widen what the gradients may get wrong.
        o_seen = o if o_passes else o_ref.astype(dtype)
        baselines = (None, None, None)
        if sixteen_bit:
            standard = reference.standard_attention_backward(do, q, k, v, dtype=dtype, **kwargs)
            if variant:  # the FlashAttention-2 rounding baseline is of the plain softmax
                baselines = list(standard)
            else:
                flash = flash_rounding_baseline(do, q, k, v, dtype=dtype, o=o_seen, **kwargs)
                baselines = [worse_baseline(r, s, f) for r, s, f in zip(refs, standard, flash)]
        allowances = output_rounding_allowance(do, q, k, v, o_seen, o_ref, **kwargs)
        grad_scale = max(max_abs(r) for r in refs)  # dq, dk may cancel to 0 while their terms do not
        shapes = (problem.q_shape, problem.kv_shape, problem.v_shape)
        for name, grad, shape, ref, baseline, atol in zip(
            ("dq", "dk", "dv"), grads, shapes, refs, baselines, allowances
        ):
            grad = _check_output(failures, name, grad, shape, out_dtype)
            if grad is not None:
                passes(name, grad, ref, baseline, factor=GRADIENT_FACTOR, scale=grad_scale,
                       atol=atol)

    if failures:
        raise AssertionError(
            f"{len(failures)} of {given} outputs fail against the float64 reference for "
            f"{problem}:\n" + "\n".join(f"  {f}" for f in failures)
        )


# --- packed batches and KV caches: the same rule over every sequence at once ----------------------

def assert_varlen_close(problem, o, lse=None, grads=None, *, inputs=None, check_dtype=True):
    """assert_attention_close for a packed batch (``cupyflash.testing.packed.VarlenProblem``):
    o (total_q, nheads, headdim), lse (nheads, total_q), grads (dq, dk, dv) packed like q, k, v,
    against ``reference.varlen_attention`` in float64.

    The rule is the dense one applied to the whole packed batch: the baselines (standard attention
    in the dtype, and for gradients the FlashAttention rounding baseline) are computed sequence by
    sequence and packed, the allowance for the rounded o the backward saw is the largest of any
    sequence, and each output's largest error over all sequences is compared with them."""
    q, k, v, do = problem.arrays() if inputs is None else (as_numpy(x) for x in inputs)
    options = problem.kwargs
    dtype = problem.dtype
    out_dtype = dtype if check_dtype else None
    sixteen_bit = dtype in SIXTEEN_BIT
    given = 1 + (lse is not None) + (3 if grads is not None else 0)
    failures = []
    cu_q, cu_k = problem.cu_seqlens_q, problem.cu_seqlens_k
    ranges = [(queries, keys) for queries, keys in problem.ranges()
              if queries.stop > queries.start and keys.stop > keys.start]  # the others are exact zeros

    o_ref, lse_ref = reference.varlen_attention(q, k, v, cu_q, cu_k, **options)
    o_std, lse_std = o_ref.copy(), lse_ref.copy()
    if sixteen_bit:
        for queries, keys in ranges:
            o_b, lse_b = reference.standard_attention(q[None, queries], k[None, keys], v[None, keys], dtype=dtype,
                                                      **options)
            o_std[queries], lse_std[:, queries] = o_b[0], lse_b[0]
    o = _check_output(failures, "o", o, problem.o_shape, out_dtype)
    o_passes = o is not None and _passes(failures, "o", o, o_ref, o_std, dtype=dtype, factor=OUTPUT_FACTOR)
    if lse is not None:
        lse = _check_output(failures, "lse", lse, problem.lse_shape, None)
        if lse is not None:
            _passes(failures, "lse", lse, lse_ref, lse_std, dtype=dtype, factor=OUTPUT_FACTOR)

    if grads is not None:
        grads = tuple(grads)
        if len(grads) != 3:
            raise ValueError(f"grads must be (dq, dk, dv), got {len(grads)} arrays")
        refs = reference.varlen_attention_backward(do, q, k, v, cu_q, cu_k, **options)
        standard = [r.copy() for r in refs]
        flash = [r.copy() for r in refs]
        allowances = [0.0, 0.0, 0.0]
        # The allowance for the o the backward saw, if that o is within the rule; else for a
        # correctly rounded one (as assert_attention_close).
        o_seen = o if o_passes else o_ref.astype(dtype)
        for queries, keys in ranges:
            parts = (do[None, queries], q[None, queries], k[None, keys], v[None, keys])
            if sixteen_bit:
                for packed, part in ((standard, reference.standard_attention_backward(*parts, dtype=dtype, **options)),
                                     (flash, flash_rounding_baseline(*parts, dtype=dtype, o=o_seen[None, queries],
                                                                     **options))):
                    packed[0][queries], packed[1][keys], packed[2][keys] = (g[0] for g in part)
            part_allowances = output_rounding_allowance(*parts, o_seen[None, queries], o_ref[None, queries], **options)
            allowances = [max(a, b) for a, b in zip(allowances, part_allowances)]
        baselines = ([worse_baseline(r, s, f) for r, s, f in zip(refs, standard, flash)] if sixteen_bit
                     else [None, None, None])
        grad_scale = max(max_abs(r) for r in refs)  # dq, dk may cancel to 0 while their terms do not
        shapes = (problem.q_shape, problem.kv_shape, problem.v_shape)
        for name, grad, shape, ref, baseline, atol in zip(("dq", "dk", "dv"), grads, shapes, refs, baselines,
                                                            allowances):
            grad = _check_output(failures, name, grad, shape, out_dtype)
            if grad is not None:
                _passes(failures, name, grad, ref, baseline, dtype=dtype, factor=GRADIENT_FACTOR, scale=grad_scale,
                        atol=atol)

    if failures:
        raise AssertionError(f"{len(failures)} of {given} outputs fail against the float64 reference for "
                             f"{problem}:\n" + "\n".join(f"  {f}" for f in failures))


def assert_kvcache_close(problem, o, lse=None, *, inputs=None, check_dtype=True, variant=None):
    """The rule for a KV-cache call (``cupyflash.testing.packed.KVCacheProblem``): o (batch,
    seqlen_q, nheads, headdim) and lse (batch, nheads, seqlen_q) against
    ``reference.kvcache_attention`` over the cache as it was before the call (``inputs``: the
    arrays the call was given, copied before it; problem.inputs() by default), the standard
    attention baseline computed sequence by sequence over its keys. ``variant``: the call's
    softcap, alibi_slopes and sink keywords, which the references then take too."""
    inputs = problem.inputs() if inputs is None else inputs
    arrays = {name: None if x is None or np.ndim(x) == 0 else as_numpy(x) for name, x in inputs.items()}
    if np.ndim(inputs["cache_seqlens"]) == 0:
        arrays["cache_seqlens"] = inputs["cache_seqlens"]
    options = problem.kwargs
    variant = dict(variant or {})  # softcap, alibi_slopes, sink: reference.kvcache_attention's
    dtype = problem.dtype
    failures = []
    o_ref, lse_ref = reference.kvcache_attention(**arrays, **options, **variant)
    o_std, lse_std = o_ref.copy(), lse_ref.copy()
    if dtype in SIXTEEN_BIT:
        sequences = reference.kvcache_sequences(
            problem.batch, arrays["k_cache"], arrays["v_cache"], arrays["k"], arrays["v"],
            cache_seqlens=arrays["cache_seqlens"], cache_batch_idx=arrays["cache_batch_idx"],
            block_table=arrays["block_table"], cache_leftpad=arrays.get("cache_leftpad"))
        for b, (keys, values) in enumerate(sequences):
            if keys.shape[0] and problem.seqlen_q:
                own = dict(variant)
                if own.get("alibi_slopes") is not None and np.ndim(own["alibi_slopes"]) == 2:
                    own["alibi_slopes"] = np.asarray(own["alibi_slopes"])[b:b + 1]
                o_b, lse_b = reference.standard_attention(arrays["q"][b:b + 1], keys[None], values[None], dtype=dtype,
                                                          **options, **own)
                o_std[b], lse_std[b] = o_b[0], lse_b[0]
    o = _check_output(failures, "o", o, problem.o_shape, dtype if check_dtype else None)
    if o is not None:
        _passes(failures, "o", o, o_ref, o_std, dtype=dtype, factor=OUTPUT_FACTOR)
    if lse is not None:
        lse = _check_output(failures, "lse", lse, problem.lse_shape, None)
        if lse is not None:
            _passes(failures, "lse", lse, lse_ref, lse_std, dtype=dtype, factor=OUTPUT_FACTOR)
    if failures:
        raise AssertionError(f"{len(failures)} of {1 + (lse is not None)} outputs fail against the float64 "
                             f"reference for {problem}:\n" + "\n".join(f"  {f}" for f in failures))

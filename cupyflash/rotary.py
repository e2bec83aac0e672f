"""Rotary position embeddings (RoPE) for flash_attn_with_kvcache: flash-attn 2.8's ``rotary_cos``,
``rotary_sin`` and ``rotary_interleaved``.

Definition (per head, per token at position p): the first rotary_dim = 2 * rotary_cos.shape[1]
entries of a q or k row form rotary_dim / 2 pairs (x1, x2), each turned by the angle of row p:

    x1' = x1 cos[p, i] - x2 sin[p, i]        x2' = x1 sin[p, i] + x2 cos[p, i]

with pair i = (x[2i], x[2i + 1]) when ``interleaved`` (GPT-J) and (x[i], x[i + rotary_dim / 2])
otherwise (GPT-NeoX); entries past rotary_dim pass unchanged. Computed in float32 (float64 for
float64) and rounded once to the input's dtype; on the GPU by kernels_cu/flash_rotary.cu, whose
operations are ``apply_rotary``'s one for one (no FMA, subnormals kept), so both give the same
bits (NaN payloads aside).

Positions, as flash-attn takes them: the new keys of sequence b sit at cache_seqlens[b],
cache_seqlens[b] + 1, ...; the queries too when the call is causal or has a window, and otherwise
every query of sequence b at cache_seqlens[b] (the new tokens are taken as one position). The rows
are rotated before the keys are appended, so the cache holds rotated keys, as it does in flash-attn.
"""
from __future__ import annotations

import numpy as np

from . import _arrays as A

__all__ = ["Rotary", "check_rotary", "apply_rotary"]


class Rotary:
    """The checked cos / sin tables of a call and the mode; ``apply`` turns q or k."""

    def __init__(self, cos, sin, interleaved: bool):
        self.cos, self.sin, self.interleaved = cos, sin, interleaved
        # on the GPU, what the kernel takes, converted once a call (turn runs for k, then for q)
        self._device_tables = None
        self._starts_given = self._device_starts = None

    def positions(self, start, tokens: int, per_token: bool):
        """(batch, tokens) int64 positions: start[b] + t per token, or start[b] for all of them."""
        xp = np if isinstance(start, np.ndarray) else A._cupy()
        start = start.astype(np.int64)[:, None]
        offsets = xp.arange(tokens, dtype=np.int64)[None, :] if per_token else xp.zeros((1, tokens), np.int64)
        return start + offsets

    def turn(self, x, starts, per_token: bool):
        """x (batch, tokens, heads, headdim) turned with token t of sequence b at position
        starts[b] + t (``per_token``) or starts[b], a new array of x's dtype and array module: on
        the GPU one launch of kernels_cu/flash_rotary.cu (the array code's arithmetic, bit for bit),
        on the host the array code."""
        if isinstance(x, np.ndarray):
            return self.apply(x, self.positions(np.asarray(starts), x.shape[1], per_token))
        from .kernels import rotary

        cupy = A._cupy()
        if self._device_tables is None:
            self._device_tables = tuple(cupy.ascontiguousarray(A.to_cupy(t, name))
                                        for t, name in ((self.cos, "rotary_cos"), (self.sin, "rotary_sin")))
        if starts is not self._starts_given:  # a host array is uploaded, once for k and q alike
            self._starts_given = starts
            self._device_starts = cupy.ascontiguousarray(cupy.asarray(starts), dtype=np.int32)
        return rotary.rotate(A.last_dim_contiguous(x), *self._device_tables, self._device_starts,
                             per_token=per_token, interleaved=self.interleaved)

    def apply(self, x, positions):
        """x (batch, tokens, heads, headdim) turned at ``positions`` (batch, tokens), a new array of
        x's dtype and array module, by the array code (the definition's operations in order)."""
        on_host = isinstance(x, np.ndarray)
        convert = A.to_numpy if on_host else A.to_cupy
        xp = np if on_host else A._cupy()
        cos, sin = convert(self.cos, "rotary_cos"), convert(self.sin, "rotary_sin")
        positions = xp.asarray(positions)
        return apply_rotary(x, cos, sin, positions, self.interleaved, xp)


def apply_rotary(x, cos, sin, positions, interleaved: bool, xp=np):
    """The module docstring's rotation of x (..., tokens, heads, headdim) with cos / sin rows taken at
    ``positions`` (..., tokens); cos, sin, positions and x of one array module ``xp``."""
    work = np.float64 if x.dtype == np.float64 else np.float32
    half = cos.shape[1]
    angle_cos = xp.take(cos, positions, axis=0).astype(work)[..., None, :]  # (..., tokens, 1, half)
    angle_sin = xp.take(sin, positions, axis=0).astype(work)[..., None, :]
    turned = x[..., : 2 * half].astype(work)
    if interleaved:
        x1, x2 = turned[..., 0::2], turned[..., 1::2]
    else:
        x1, x2 = turned[..., :half], turned[..., half:]
    y1 = x1 * angle_cos - x2 * angle_sin
    y2 = x1 * angle_sin + x2 * angle_cos
    out = x.copy()
    if interleaved:
        out[..., 0: 2 * half: 2] = y1.astype(x.dtype)
        out[..., 1: 2 * half: 2] = y2.astype(x.dtype)
    else:
        out[..., :half] = y1.astype(x.dtype)
        out[..., half: 2 * half] = y2.astype(x.dtype)
    return out


def check_rotary(rotary_cos, rotary_sin, rotary_interleaved, *, dtype, headdim: int, appending: bool,
                 capacity: int, needed: int = 0, needed_why: str = "") -> Rotary | None:
    """The rotary arguments checked before anything runs: both or neither; only with new k, v (as
    flash-attn: the rotation is part of the append); 2-d (seqlen_ro, rotary_dim / 2) of one shape,
    q's dtype, rotary_dim <= headdim; seqlen_ro >= ``capacity``, the cache's capacity (flash-attn's
    rule), and >= ``needed``, the positions the call turns (``needed_why`` says which)."""
    interleaved = A.check_flag(rotary_interleaved, "rotary_interleaved")
    if rotary_cos is None and rotary_sin is None:
        return None
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if not appending:
        raise ValueError("rotary_cos / rotary_sin turn the new keys as they are appended (flash-attn's rule): pass "
                         "k and v with them")
    tables = {}
    for name, table in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        table = A.take_array(table, name, A.array_kind(table, name))
        if table.ndim != 2:
            raise ValueError(f"{name} must be 2-d (seqlen_ro, rotary_dim / 2); got shape {tuple(table.shape)}")
        if np.dtype(table.dtype) != np.dtype(dtype):
            raise TypeError(f"{name} has dtype {np.dtype(table.dtype)}; it must be q's ({np.dtype(dtype)}), as in "
                            "flash-attn")
        tables[name] = table
    cos, sin = tables["rotary_cos"], tables["rotary_sin"]
    if cos.shape != sin.shape:
        raise ValueError(f"rotary_cos and rotary_sin must have one shape; got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    if cos.shape[1] == 0 or 2 * cos.shape[1] > headdim:
        raise ValueError(f"rotary_dim = 2 * rotary_cos.shape[1] = {2 * cos.shape[1]} must be in 2 .. headdim "
                         f"({headdim})")
    if cos.shape[0] < capacity:
        raise ValueError(f"rotary_cos / rotary_sin have {cos.shape[0]} rows (positions); they must cover the "
                         f"cache's capacity, {capacity} positions, as in flash-attn")
    if cos.shape[0] < needed:
        raise ValueError(f"rotary_cos / rotary_sin have {cos.shape[0]} rows (positions); this call turns "
                         f"{needed_why}, so it needs {needed}")
    return Rotary(cos, sin, interleaved)

"""The score policy in Python: the twin of ``kernels_cu/score.cuh``.

A variant changes what the softmax of a row is taken over, in two places:

* the **score transform**, applied to each scaled score z = softmax_scale * q_i . k_j before
  the mask and the softmax, in this order (flash-attn 2.8's):
    softcap = c > 0:  z <- c * tanh(z / c)                               (Gemma 2, Grok)
    ALiBi slopes:     z <- z - slope[b, h] * |i + seqlen_k - seqlen_q - j|
  The backward applies the chain rule: dz = dz' * (1 - tanh(z / c)^2) (ALiBi adds a constant).
* **attention sinks** (gpt-oss): a logit sink[h] per query head joins each row's denominator
  without a value row, sum_j exp(z'_ij) + exp(sink[h]), so lse includes it and the row's weights
  sum to less than 1. A row that sees no key has o = 0 and lse = sink[h]. Its gradient is
  dsink[h] = -sum_{b, i} exp(sink[h] - lse[b, h, i]) * D[b, h, i], D = rowsum(dO * O).

``Score`` is the compile-time part (which of these a kernel specialization applies: part of the
mask policy's name and template argument, cupyflash.masks); ``Variant`` carries a call's values
(the cap, the slopes, the sink logits) to the kernels' Params structs, the NumPy twin and the
launchers. ``cupyflash.reference`` implements the same definitions independently.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from .dropout import NO_DROPOUT, Dropout
from .precision import check_precision

__all__ = ["Score", "PLAIN", "Variant", "NO_VARIANT", "check_variant", "sink_grad"]


@dataclass(frozen=True)
class Score:
    """Which transforms a kernel specialization applies (kernels_cu/score.cuh's ScoreMod, or its
    UserScore for a call with user modifiers: ``user``, a cupyflash.modifiers.Modifiers, whose
    hash names the specialization)."""

    softcap: bool = False
    alibi: bool = False
    sink: bool = False  # the forward's epilogue adds exp(sink) to each row's sum
    user: object = None  # cupyflash.modifiers.Modifiers (score_mod / mask_mod), or None
    dropout: bool = False  # the weights go through the call's dropout mask (cupyflash.dropout)
    # a user mask narrows the block ranges by its block map; False: element by element only (the
    # KV-cache kernel's, "nomap" in names)
    block_map: bool = True
    # softcap without ALiBi: the forward's online softmax takes the cap's bound as every row's
    # maximum (kernels_cu/online_softmax.cuh block_softmax; chosen by cupyflash.plans.takes_fixed_max,
    # "fixedmax" in names); the backward's kernels do not see it (backward())
    fixed_max: bool = False

    def __post_init__(self):
        if self.fixed_max and (not self.softcap or self.alibi or self.user is not None):
            raise ValueError("cupyflash: a fixed row maximum is softcap's bound: fixed_max needs softcap, "
                             "without ALiBi or user modifiers")

    @property
    def without_block_map(self) -> "Score":
        """The same score with a user mask applied element by element only (no block map)."""
        return replace(self, block_map=False) if self.user is not None and self.user.has_mask else self

    @property
    def plain(self) -> bool:
        return not (self.softcap or self.alibi or self.sink or self.dropout or self.user is not None)

    @property
    def has_grad(self) -> bool:
        """Whether the backward multiplies dS by ds'/ds (softcap's, or a user score's)."""
        return self.softcap or (self.user is not None and self.user.has_grad)

    @property
    def name(self) -> str:
        """The suffix of specialization names ("" for the plain softmax)."""
        parts = (("softcap", self.softcap), ("fixedmax", self.fixed_max), ("alibi", self.alibi),
                 (self.user.name if self.user is not None else "", self.user is not None),
                 ("nomap", self.user is not None and not self.block_map), ("sink", self.sink),
                 ("dropout", self.dropout))
        return "_".join(part for part, on in parts if on)

    @property
    def cpp(self) -> str:
        flag = {True: "true", False: "false"}
        if self.user is not None:
            self.user.register()
            options = f", {flag[self.dropout]}, false" if not self.block_map else (", true" if self.dropout else "")
            return f"cf::UserScore<{self.user.cpp}, {flag[self.sink]}{options}>"
        # the template's defaults otherwise: names unchanged
        tail = f", {flag[self.dropout]}, true" if self.fixed_max else (", true" if self.dropout else "")
        return f"cf::ScoreMod<{flag[self.softcap]}, {flag[self.alibi]}, {flag[self.sink]}{tail}>"

    def backward(self) -> "Score":
        """The score of the backward's kernels: a sink changes only lse, which they read, so
        they are the kernels without it (dsink is reduced from D and lse by the launcher); the
        forward's fixed maximum changes nothing they compute."""
        return Score(self.softcap, self.alibi, False, self.user, self.dropout)


PLAIN = Score()


@dataclass(frozen=True, eq=False)
class Variant:
    """The variant values of one call: ``softcap`` (0: none), ``alibi_slopes`` ((nheads,) or
    (batch, nheads) float32) and ``sink`` ((nheads,) float32), arrays as NumPy or CuPy."""

    softcap: float = 0.0
    alibi_slopes: object = None
    sink: object = None
    mods: object = None  # cupyflash.modifiers.Modifiers: the user's score_mod / mask_mod, or None
    dropout: Dropout = NO_DROPOUT  # cupyflash.dropout: p, seed, offset
    # cupyflash.precision: how float32 products are formed ("ieee", "tf32"); not part of the score
    precision: str = "ieee"
    # where a backward takes its row statistics (backward_plans.STATISTICS): the forward's o and
    # lse ("saved") or its own walk over the keys ("recomputed", float32 / float64); not part of
    # the score either
    statistics: str = "saved"

    @property
    def score(self) -> Score:
        """The kernels' score policy; a user mask without a block map (flash_attn_with_kvcache's,
        applied element by element) names the specializations that read none."""
        element_mask = self.mods is not None and self.mods.has_mask and not self.mods.has_map
        return Score(self.softcap > 0, self.alibi_slopes is not None, self.sink is not None, self.mods,
                     self.dropout.on, block_map=not element_mask)

    @property
    def plain(self) -> bool:
        return self.score.plain

    def slopes(self, batch: int, nheads: int, xp=np):
        """The slopes as a (batch, nheads) float array of module ``xp`` (None without ALiBi)."""
        if self.alibi_slopes is None:
            return None
        s = xp.asarray(self.alibi_slopes)
        return xp.broadcast_to(s if s.ndim == 2 else s[None, :], (batch, nheads))

    def sliced(self, batch: slice, heads: slice) -> "Variant":
        """The values of a chunk of batch entries and query heads (cupyflash.api's chunking)."""
        slopes = self.alibi_slopes
        if slopes is not None:
            slopes = slopes[batch, heads] if slopes.ndim == 2 else slopes[heads]
        sink = None if self.sink is None else self.sink[heads]
        if self.mods is not None:
            raise NotImplementedError("cupyflash: user modifiers take at most 65535 batch entries and 65535 "
                                      "query heads per call (one launch); split the call")
        if self.dropout.on:
            raise NotImplementedError("cupyflash: dropout takes at most 65535 batch entries and 65535 query heads "
                                      "per call (one launch: the mask is a function of the call's indices)")
        return Variant(self.softcap, slopes, sink, precision=self.precision, statistics=self.statistics)

    def to(self, xp) -> "Variant":
        """The same values with arrays of module ``xp`` (contiguous float32)."""
        def move(a, name):
            if a is None:
                return None
            if xp is np and not isinstance(a, np.ndarray):
                a = a.get()
            elif xp is not np and isinstance(a, np.ndarray):
                from . import capture

                capture.refuse_host_upload(name)
            return xp.ascontiguousarray(xp.asarray(a, dtype=np.float32))
        mods = None if self.mods is None else self.mods.to(xp)
        return Variant(self.softcap, move(self.alibi_slopes, "alibi_slopes"), move(self.sink, "sink"), mods,
                       self.dropout, self.precision, self.statistics)


NO_VARIANT = Variant()


def _float_array(x, name: str, shapes: tuple, shape_text: str):
    """x as a NumPy or CuPy float32 array of one of ``shapes`` (DLPack / torch objects via CuPy)."""
    from . import _arrays as A

    kind = A.array_kind(x, name)
    arr = A.take_array(x, name, kind)
    if arr.dtype != np.float32:
        raise TypeError(f"cupyflash: {name} must be float32 (flash-attn's type), got {arr.dtype}")
    if tuple(arr.shape) not in shapes:
        raise ValueError(f"cupyflash: {name} must have shape {shape_text}, got {tuple(arr.shape)}")
    return arr


def check_variant(softcap, alibi_slopes, sink, batch: int, nheads: int, mods=None, dropout=NO_DROPOUT,
                  precision=None, statistics="saved") -> Variant:
    """A call's variant arguments checked against its batch and query heads, or a clear error;
    ``mods`` the call's user modifiers (cupyflash.modifiers.check_modifiers), which take a sink
    but not softcap or ALiBi (a score_mod writes them itself); ``dropout`` a checked
    cupyflash.dropout.Dropout; ``precision`` cupyflash.precision's (None: "ieee"); ``statistics``
    a backward's, already checked against its dtype (backward_plans.check_statistics)."""
    precision = check_precision(precision)
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, (int, float, np.integer, np.floating)):
        raise TypeError(f"cupyflash: softcap must be a float >= 0 (0: no cap), got {softcap!r}")
    softcap = float(softcap)
    if not np.isfinite(softcap) or softcap < 0:
        raise ValueError(f"cupyflash: softcap must be a finite float >= 0 (0: no cap), got {softcap!r}")
    if alibi_slopes is not None:
        alibi_slopes = _float_array(alibi_slopes, "alibi_slopes", ((nheads,), (batch, nheads)),
                                    f"(nheads,) = ({nheads},) or (batch, nheads) = ({batch}, {nheads})")
    if sink is not None:
        sink = _float_array(sink, "sink", ((nheads,),), f"(nheads,) = ({nheads},)")
    if mods is not None and mods.has_score and (softcap > 0 or alibi_slopes is not None):
        raise ValueError("cupyflash: score_mod does not combine with softcap or alibi_slopes; write the cap or "
                         "the bias into the score_mod (cupyflash.modifiers.tanh, a slopes tensor)")
    return Variant(softcap, alibi_slopes, sink, mods, dropout, precision, statistics)


def sink_grad(sink, do, o, lse, xp=np):
    """dsink (nheads,) float32: -sum over batch and queries of exp(sink[h] - lse[b, h, i]) *
    D[b, h, i], D = rowsum(do * o) in float32 (float64 for float64 inputs); do, o (batch, seqlen,
    nheads, headdim), lse (batch, nheads, seqlen), arrays of module ``xp`` (NumPy or CuPy). A row
    with lse = -inf (it saw no key and there is no sink) adds 0."""
    acc = np.float64 if do.dtype == np.float64 else np.float32
    D = _row_dots(do, o, acc, xp).transpose(0, 2, 1)
    sink = xp.asarray(sink).astype(acc)[None, :, None]
    lse = lse.astype(acc)
    live = lse != -np.inf
    # A dead row's exp(sink - lse) would be inf, and inf * 0 NaN: it gets exp(0), then the factor 0.
    weight = xp.exp(sink - xp.where(live, lse, sink)) * live
    return (-(weight * D).sum(axis=(0, 2))).astype(np.float32)


def _row_dots(do, o, acc, xp):
    """rowsum(do * o) over the last axis in ``acc``. On CuPy one reduction kernel reads the 16-bit
    inputs as they are (bfloat16 through its bits: the upper half of a float32): converting both
    arrays first would write and read three accumulator-sized temporaries, 10% of a d128
    backward's time at 8k."""
    if xp is np or np.dtype(acc) == np.float64 or do.dtype == np.float32:
        return (do.astype(acc) * o.astype(acc)).sum(axis=-1)
    if do.dtype == np.float16:
        return _row_dot_kernel("half")(do, o, axis=-1)
    return _row_dot_kernel("bf16")(do.view(np.uint16), o.view(np.uint16), axis=-1)


@functools.lru_cache(maxsize=None)
def _row_dot_kernel(kind: str):
    """The CuPy reduction of rowsum(a * b) in float32 for float16 ("half") or bfloat16 bits ("bf16")."""
    import cupy

    to_float = ("float(a) * float(b)" if kind == "half" else
                "__uint_as_float((unsigned)a << 16) * __uint_as_float((unsigned)b << 16)")
    return cupy.ReductionKernel("T a, T b", "float32 y", to_float, "a + b", "y = a", "0",
                                f"cupyflash_row_dot_{kind}", reduce_type="float")

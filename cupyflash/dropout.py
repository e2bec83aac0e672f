"""Dropout on the attention weights: the twin of ``kernels_cu/dropout.cuh``, word for word.

A call with ``dropout_p = p > 0`` multiplies each weight P_ij = softmax(z)_ij by Z_ij / (1 - p)
before P V, where Z_ij = 1 with probability 1 - p. The mask Z is a function of the call's
``seed`` and ``offset`` and of the element's coordinates alone (a counter-based generator,
Philox4x32 at 7 rounds), so the forward and every backward kernel find the same Z whatever their
tiles, and so does this module: ``dropout_mask`` returns the mask that a call with the same
arguments used, on the CPU (NumPy) or the GPU (CuPy).

The words: element (query i, key j) of sequence b, query head h (of nheads) is byte 2 a + c
(a = (i >> 3) & 1, c = (j >> 3) & 1) of word 2 (i & 1) + (j & 1) of Philox4x32 (7 rounds) with
counter (j & ~9, i & ~9, b * nheads + h, offset) and key
(seed mod 2^32, seed >> 32); it is kept iff that byte is below threshold = round((1 - p) 256).
So one call serves the sixteen elements {i0, i0 + 1, i0 + 8, i0 + 9} x {j0, j0 + 1, j0 + 8,
j0 + 9}, and each element is kept with probability threshold / 256, which is 1 - p to within
2^-9 (flash-attn's resolution; the kept weights are still scaled by 1 / (1 - p)). Indices are
those of the sequence (a packed batch's sequence b counts its own rows from 0, and its b is its
index in the batch).

The softmax statistics (lse) are those of the undropped weights; the backward uses
D = rowsum(dO o O) of the dropped-out O, which equals rowsum(P o Z dP / (1 - p)).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np

__all__ = ["Dropout", "NO_DROPOUT", "check_dropout", "philox4x32", "PHILOX_ROUNDS", "dropout_mask", "keep_threshold"]

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = np.uint64(0xFFFFFFFF)
PHILOX_ROUNDS = 7  # the mask's (flash-attn's too); tests check 7 and 10 against Random123's answers


def philox4x32(counter, key, rounds: int = PHILOX_ROUNDS):
    """Philox4x32 at ``rounds`` rounds of arrays of counters: ``counter`` a tuple of four
    uint32-valued arrays (broadcast together), ``key`` a pair of ints; returns four uint32 arrays."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in np.broadcast_arrays(*counter))
    k0, k1 = int(key[0]) & 0xFFFFFFFF, int(key[1]) & 0xFFFFFFFF
    for _ in range(rounds):
        p0 = _M0 * c0
        p1 = _M1 * c2
        hi0, lo0 = p0 >> np.uint64(32), p0 & _MASK32
        hi1, lo1 = p1 >> np.uint64(32), p1 & _MASK32
        c0, c1, c2, c3 = hi1 ^ c1 ^ np.uint64(k0), lo1, hi0 ^ c3 ^ np.uint64(k1), lo0
        k0 = (k0 + _W0) & 0xFFFFFFFF
        k1 = (k1 + _W1) & 0xFFFFFFFF
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def keep_threshold(dropout_p: float) -> int:
    """round((1 - p) 256): a byte below it keeps its element (256: every one)."""
    return int(round((1.0 - float(dropout_p)) * 256.0))


@dataclass(frozen=True)
class Dropout:
    """A call's dropout: probability ``p`` of dropping a weight (0: none), ``seed`` (uint64) and
    ``offset`` (uint32)."""

    p: float = 0.0
    seed: int = 0
    offset: int = 0
    # the batch index of this call's sequence 0: a packed batch's sequence b taken alone (the NumPy
    # twin's per-sequence views of a varlen batch) is sequence 0 of a call with first_sequence b.
    # The kernels take every sequence of a call in one launch: they run with 0 (kernels.params).
    first_sequence: int = 0

    @property
    def on(self) -> bool:
        return self.p > 0

    @property
    def threshold(self) -> int:
        return keep_threshold(self.p)

    @property
    def scale(self) -> float:
        return 1.0 / (1.0 - self.p)

    def keep(self, sequence, head, nheads: int, i, j):
        """The keep bits (bool) of elements (i, j) of (sequence, head), arrays broadcast together."""
        sequence, head, i, j = (np.asarray(x, dtype=np.int64) for x in (sequence, head, i, j))
        stream = ((sequence + self.first_sequence) * nheads + head) & 0xFFFFFFFF
        words = philox4x32((j & ~9, i & ~9, stream, np.int64(self.offset)),
                           (self.seed & 0xFFFFFFFF, self.seed >> 32))
        qb, kb = i & 1, j & 1
        pick = np.select([(qb == 0) & (kb == 0), (qb == 0) & (kb == 1), (qb == 1) & (kb == 0)], words[:3], words[3])
        byte = (pick >> (8 * (2 * ((i >> 3) & 1) + ((j >> 3) & 1))).astype(np.uint32)) & np.uint32(0xFF)
        return byte < np.uint32(self.threshold)


NO_DROPOUT = Dropout()


def check_dropout(dropout_p, seed, offset, *, need_seed: bool = False) -> Dropout:
    """The dropout arguments of a call as a Dropout, or a clear error. ``seed`` None with
    ``dropout_p > 0`` draws a fresh seed (``need_seed``: the backward, which must be given the
    forward's)."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, (int, float, np.integer, np.floating)):
        raise TypeError(f"cupyflash: dropout_p must be a float in [0, 1), got {dropout_p!r}")
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"cupyflash: dropout_p must be in [0, 1), got {dropout_p!r}")
    if dropout_p == 0.0:
        return NO_DROPOUT
    if keep_threshold(dropout_p) == 0:
        raise ValueError(f"cupyflash: dropout_p = {dropout_p!r} keeps no weight at the mask's 8-bit resolution "
                         f"(the keep rate is round((1 - p) 256) / 256): take p < 1 - 2^-9")
    if seed is None:
        if need_seed:
            raise ValueError("cupyflash: a backward with dropout_p > 0 needs the forward's seed (and offset): "
                             "pass seed=")
        seed = int.from_bytes(os.urandom(8), "little")
    for name, value, bits in (("seed", seed, 64), ("offset", offset, 32)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or \
                not 0 <= int(value) < 2**bits:
            raise ValueError(f"cupyflash: {name} must be an int in [0, 2^{bits}), got {value!r}")
    return Dropout(dropout_p, int(seed), int(offset))


def draw_seed_once(options: dict) -> None:
    """A vjp's call options (flash_attn_vjp, flash_attn_varlen_vjp): with dropout and no seed, a
    seed drawn here, in place, so that the forward and the backward use the same mask."""
    if options.get("dropout_p", 0.0) and options.get("seed") is None:
        options["seed"] = check_dropout(options["dropout_p"], None, options.get("offset", 0)).seed


def dropout_mask(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, dropout_p: float, seed: int,
                 offset: int = 0, *, first_sequence: int = 0, xp=np):
    """The keep mask (batch, nheads, seqlen_q, seqlen_k) bool of a call with these arguments:
    True where the call kept the weight (scaled by 1 / (1 - dropout_p)), False where it dropped it.
    ``first_sequence``: the mask of sequences first_sequence .. first_sequence + batch - 1 (a
    flash_attn_varlen_func call's sequence b: first_sequence=b, batch=1, its own lengths).
    ``xp``: numpy (the default) or cupy (computed on the GPU by the kernels' own header)."""
    d = check_dropout(dropout_p, seed, offset)
    if not d.on:
        return xp.ones((batch, nheads, seqlen_q, seqlen_k), dtype=bool)
    if xp is not np:
        return _mask_on_gpu(d, batch, nheads, seqlen_q, seqlen_k, first_sequence)
    d = replace(d, first_sequence=int(first_sequence))
    b = np.arange(batch)[:, None, None, None]
    h = np.arange(nheads)[None, :, None, None]
    i = np.arange(seqlen_q)[None, None, :, None]
    j = np.arange(seqlen_k)[None, None, None, :]
    return np.broadcast_to(d.keep(b, h, nheads, i, j), (batch, nheads, seqlen_q, seqlen_k)).copy()


def _mask_on_gpu(d: Dropout, batch, nheads, seqlen_q, seqlen_k, first_sequence=0):
    import cupy

    from .kernels._module import kernel_source

    kernel = cupy.ElementwiseKernel(
        "uint64 seed, uint32 offset, uint32 threshold, int32 nheads, int32 seqlen_q, int32 seqlen_k, "
        "int64 first_bh",
        "bool keep",
        """
        const long long n = i;
        const int j = (int)(n % seqlen_k), r = (int)(n / seqlen_k % seqlen_q);
        const long long bh = n / ((long long)seqlen_k * seqlen_q);
        cf::DropoutFn<true> d;
        d.k0 = (unsigned)seed; d.k1 = (unsigned)(seed >> 32);
        d.stream = (unsigned)(first_bh + bh); d.offset = offset; d.addend = cf::DropoutFn<true>::addend_of(threshold);
        keep = d.keep(r, j);
        """, "cupyflash_dropout_mask", preamble=kernel_source("dropout.cuh"))
    out = cupy.empty((batch, nheads, seqlen_q, seqlen_k), dtype=bool)
    kernel(np.uint64(d.seed), np.uint32(d.offset), np.uint32(d.threshold), np.int32(nheads), np.int32(seqlen_q),
           np.int32(seqlen_k), np.int64(int(first_sequence) * nheads), out)
    return out

"""The mask policy in Python: the twin of ``kernels_cu/mask.cuh``, with the same answers.

A policy is a band of S around the bottom-right diagonal (diag = seqlen_k - seqlen_q): query i
sees key j iff j < seqlen_k, i + lo_off <= j (a left bound) and j <= i + hi_off (a right bound),
with lo_off = diag - window_left and hi_off = diag + window_right. ``NoMask`` has neither bound,
``Causal`` the right one with window_right = 0, ``Local`` the window (left, right) of flash-attn
2.8 (-1: that side unbounded). ``mask_for(causal, window_size)`` picks the policy of a call, the
same way the launchers pick the kernel's template argument (``Mask.cpp``).

Ranges are half-open index ranges; the block helpers turn them into the blocks a kernel visits.
The NumPy twin, the bench's IO model and the layout tests take their masks from here;
``cupyflash.reference`` does not (it is written from the definition, independently).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .modifiers import example_modifiers
from .scores import PLAIN, Score

__all__ = ["Mask", "NoMask", "Causal", "Local", "KINDS", "VARIANT_KINDS", "PACKED_KINDS", "mask_for", "as_mask", "check_window"]

MASK_UNBOUNDED = 1 << 30  # offset of an unbounded side (mask.cuh's MASK_UNBOUNDED)


def check_window(window_size) -> tuple[int, int]:
    """``window_size`` as (left, right) ints >= -1, or a ValueError naming the argument."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right) of ints >= -1, got {window_size!r}") from None
    for side in (left, right):
        if isinstance(side, (bool, np.bool_)) or not isinstance(side, (int, np.integer)) or side < -1:
            raise ValueError(f"window_size must be a pair (left, right) of ints >= -1, got {window_size!r}")
    return int(left), int(right)


@dataclass(frozen=True)
class Mask:
    """A band policy; subclasses fix which bounds exist. ``left``/``right`` are the window sides
    (-1: unbounded). ``score`` is the variant's compile-time part (cupyflash.scores): the
    transform of the scores and the sink that the kernels apply inside the band."""

    left: int = -1
    right: int = -1
    score: Score = PLAIN
    # A packed (varlen) batch: each sequence its own problem, the kernels' Packed<...> policy
    # (mask.cuh), which finds the sequence's rows and lengths from the call's cu_seqlens.
    packed: bool = False
    HAS_LEFT = False
    HAS_RIGHT = False
    band = ""  # in specialization names: "full", "causal", "local"
    band_cpp = ""  # the band's type in kernels_cu/mask.cuh

    @property
    def name(self) -> str:
        """The policy in specialization names: the band, then the score's parts, then "packed"."""
        name = f"{self.band}_{self.score.name}" if not self.score.plain else self.band
        return f"{name}_packed" if self.packed else name

    @property
    def cpp(self) -> str:
        """The kernels' template argument: the band, with its score where there is one, packed
        where the batch is."""
        cpp = self.band_cpp if self.score.plain else f"cf::WithScore<{self.band_cpp}, {self.score.cpp}>"
        return f"cf::Packed<{cpp}>" if self.packed else cpp

    def as_packed(self, packed: bool = True) -> "Mask":
        """The same policy over a packed batch (or a dense one). User modifiers see each sequence
        as batch entry b of a dense call, with indices from its first row (mask.cuh's Packed)."""
        return replace(self, packed=packed)

    def with_score(self, score: Score) -> "Mask":
        """The same band with ``score``."""
        return replace(self, score=score)

    def backward(self) -> "Mask":
        """The policy of the backward's kernels (a sink does not reach them: Score.backward)."""
        return self.with_score(self.score.backward())

    def offsets(self, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
        """(lo_off, hi_off) for this problem, as the kernel's constructor computes them."""
        diag = seqlen_k - seqlen_q
        lo = -MASK_UNBOUNDED if self.left < 0 else diag - self.left
        hi = MASK_UNBOUNDED if self.right < 0 else diag + self.right
        return lo, hi

    def band_keys(self) -> int | None:
        """Keys one row's band spans (left + right + 1), None where a side has no bound: the run-time
        width the forward's plan reads (plans.LOCAL_PRODUCER_MIN_KEYS)."""
        if not (self.HAS_LEFT and self.HAS_RIGHT) or self.left < 0 or self.right < 0:
            return None
        return self.left + self.right + 1

    def window_args(self) -> tuple:
        """The kernels' last two arguments (window_left, window_right)."""
        return np.int32(self.left), np.int32(self.right)

    # --- elements ---------------------------------------------------------------------------
    def visible(self, rows, cols, seqlen_q: int, seqlen_k: int) -> np.ndarray:
        """Boolean (len(rows), len(cols)) visibility of queries ``rows`` and keys ``cols``."""
        i = np.asarray(rows)[:, None]
        j = np.asarray(cols)[None, :]
        lo, hi = self.offsets(seqlen_q, seqlen_k)
        ok = (i < seqlen_q) & (j < seqlen_k)
        if self.HAS_RIGHT:
            ok &= j <= i + hi
        if self.HAS_LEFT:
            ok &= j >= i + lo
        return ok

    # --- per-row bounds (elementwise over arrays of rows or keys) ---------------------------
    def row_key_begin(self, i, seqlen_q: int, seqlen_k: int):
        """First key the left bound lets query ``i`` see (not clamped to 0: mask.cuh's form)."""
        lo, _ = self.offsets(seqlen_q, seqlen_k)
        return np.asarray(i) + lo if self.HAS_LEFT else np.zeros_like(np.asarray(i))

    def row_key_end(self, i, seqlen_q: int, seqlen_k: int):
        """One past the last key query ``i`` sees by its right bound and seqlen_k."""
        _, hi = self.offsets(seqlen_q, seqlen_k)
        return np.minimum(seqlen_k, np.asarray(i) + 1 + hi) if self.HAS_RIGHT else np.full_like(np.asarray(i), seqlen_k)

    def row_query_begin(self, j, seqlen_q: int, seqlen_k: int):
        """First query the right bound lets see key ``j`` (S^T; the left bound ends the range)."""
        _, hi = self.offsets(seqlen_q, seqlen_k)
        return np.asarray(j) - hi if self.HAS_RIGHT else np.zeros_like(np.asarray(j))

    def hidden_left(self, i, j, seqlen_q: int, seqlen_k: int):
        """Whether the left bound alone hides (i, j): the part of the element test that kernels
        holding per-row bounds for the other sides add (mask.cuh's hidden_left at an origin)."""
        lo, _ = self.offsets(seqlen_q, seqlen_k)
        if not self.HAS_LEFT:
            return np.zeros(np.broadcast(np.asarray(i), np.asarray(j)).shape, dtype=bool)
        return np.asarray(j) < np.asarray(i) + lo

    # --- S: the keys of query rows [m0, m0 + rows) ------------------------------------------
    def key_begin(self, m0: int, seqlen_q: int, seqlen_k: int) -> int:
        lo, _ = self.offsets(seqlen_q, seqlen_k)
        return max(0, m0 + lo) if self.HAS_LEFT else 0

    def key_end(self, m0: int, rows: int, seqlen_q: int, seqlen_k: int) -> int:
        _, hi = self.offsets(seqlen_q, seqlen_k)
        return min(seqlen_k, max(0, m0 + rows + hi)) if self.HAS_RIGHT else seqlen_k

    def key_full_begin(self, m0: int, rows: int, seqlen_q: int, seqlen_k: int) -> int:
        lo, _ = self.offsets(seqlen_q, seqlen_k)
        return m0 + rows - 1 + lo if self.HAS_LEFT else 0

    def key_full_end(self, m0: int, seqlen_q: int, seqlen_k: int) -> int:
        _, hi = self.offsets(seqlen_q, seqlen_k)
        return min(seqlen_k, max(0, m0 + 1 + hi)) if self.HAS_RIGHT else seqlen_k

    def keys_partial(self, m0: int, rows: int, n0: int, cols: int, seqlen_q: int, seqlen_k: int) -> bool:
        """Whether keys [n0, n0 + cols) need the element mask for rows [m0, m0 + rows) (rows past
        seqlen_q are not asked about)."""
        return (n0 + cols > self.key_full_end(m0, seqlen_q, seqlen_k) or
                (self.HAS_LEFT and n0 < self.key_full_begin(m0, rows, seqlen_q, seqlen_k)))

    def key_blocks(self, m0: int, rows: int, block_n: int, seqlen_q: int, seqlen_k: int) -> range:
        """Key blocks (indices of block_n keys) that query rows [m0, m0 + rows) visit."""
        begin, end = self.key_begin(m0, seqlen_q, seqlen_k), self.key_end(m0, rows, seqlen_q, seqlen_k)
        if begin >= end:
            return range(0)
        return range(begin // block_n, -(-end // block_n))

    # --- S^T: the queries of key rows [n0, n0 + cols) ---------------------------------------
    def query_begin(self, n0: int, seqlen_q: int, seqlen_k: int) -> int:
        _, hi = self.offsets(seqlen_q, seqlen_k)
        return max(0, n0 - hi) if self.HAS_RIGHT else 0

    def query_end(self, n0: int, cols: int, seqlen_q: int, seqlen_k: int) -> int:
        lo, _ = self.offsets(seqlen_q, seqlen_k)
        return min(seqlen_q, max(0, min(n0 + cols, seqlen_k) - lo)) if self.HAS_LEFT else seqlen_q

    def query_blocks(self, n0: int, cols: int, block_m: int, seqlen_q: int, seqlen_k: int) -> range:
        """Query blocks (indices of block_m rows) that key rows [n0, n0 + cols) visit."""
        begin, end = self.query_begin(n0, seqlen_q, seqlen_k), self.query_end(n0, cols, seqlen_q, seqlen_k)
        if begin >= end:
            return range(0)
        return range(begin // block_m, -(-end // block_m))

    def partial(self, m0: int, rows: int, n0: int, cols: int, seqlen_q: int, seqlen_k: int) -> bool:
        """Whether some (i, j) of the block [m0, m0 + rows) x [n0, n0 + cols) is hidden."""
        lo, hi = self.offsets(seqlen_q, seqlen_k)
        return (m0 + rows > seqlen_q or n0 + cols > seqlen_k or
                (self.HAS_RIGHT and n0 + cols - 1 > m0 + hi) or (self.HAS_LEFT and n0 < m0 + rows - 1 + lo))

    # --- load balance -----------------------------------------------------------------------
    def query_block(self, block: int, blocks: int) -> int:
        """Query block handed to grid index ``block`` (heaviest first with a right bound)."""
        return blocks - 1 - block if self.HAS_RIGHT else block


@dataclass(frozen=True)
class NoMask(Mask):
    band = "full"
    band_cpp = "cf::NoMask"


@dataclass(frozen=True)
class Causal(Mask):
    left: int = -1
    right: int = 0
    HAS_RIGHT = True
    band = "causal"
    band_cpp = "cf::Causal"


@dataclass(frozen=True)
class Local(Mask):
    HAS_LEFT = True
    HAS_RIGHT = True
    band = "local"
    band_cpp = "cf::Local"


# One instance per kernel specialization (a Local's run-time window does not change its kernel).
KINDS = (NoMask(), Causal(), Local())
# The score policies that the compile check builds beside KINDS for every kernel the plans launch:
# softcap with the sink on the causal band, ALiBi on the window (the backward's kernels take them
# without the sink). Two, not one with all: the plans route some kernels by score (the fused
# kernel runs softcap, not ALiBi).
# Dropout (cupyflash.dropout) on the causal band, alone: its kernels' own code path.
# A third, the user modifiers (cupyflash.modifiers.example_modifiers: a score with a derivative and a
# table read, a mask with a block map) on the band without bounds, as a mask_mod call runs.
VARIANT_KINDS = (Causal(score=Score(softcap=True, sink=True)), Local(score=Score(alibi=True)),
                 NoMask(score=Score(user=example_modifiers())), Causal(score=Score(dropout=True)))

# Packed (varlen) batches, which the compile check builds into every kernel the plans launch for
# them: the causal band, ALiBi (whose diagonal is each sequence's) on the window, and the user
# modifiers (a block map per sequence) on the band without bounds.
PACKED_KINDS = (Causal(packed=True), Local(score=Score(alibi=True), packed=True),
                NoMask(score=Score(user=example_modifiers()), packed=True))


def as_mask(mask_or_causal) -> Mask:
    """A Mask, or the policy of a bare ``causal`` flag (launchers and tools that predate windows)."""
    return mask_or_causal if isinstance(mask_or_causal, Mask) else mask_for(bool(mask_or_causal))


def mask_for(causal: bool, window_size=(-1, -1), score: Score = PLAIN, packed: bool = False) -> Mask:
    """The policy of a call: ``causal`` sets the right side to 0 (flash-attn 2.8); a window equal
    to no mask or to the causal one gets that policy (and its kernels); ``score`` the variant's
    transforms (cupyflash.scores); ``packed`` a varlen batch's."""
    left, right = check_window(window_size)
    if causal:
        right = 0
    if right < 0 and left < 0:
        mask = NoMask(score=score)
    elif right == 0 and left < 0:
        mask = Causal(score=score)
    else:
        mask = Local(left, right, score)
    return mask.as_packed() if packed else mask

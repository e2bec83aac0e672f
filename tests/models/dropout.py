"""kernels_cu/dropout.cuh's walks: which (query, key) element of a lane's accumulator fragments
each Philox half goes to, for S (walk_s_units: forward, dQ) and S^T (walk_st_units: dK/dV), in the
order of the packed registers that pack_p / pack_a_frags (models/fragments.py) form, and the word
arithmetic of the keep test (dropped_flags, spread_flags), as NumPy code that
tests/kernels/test_dropout_layout.py compares with cupyflash.dropout's definition of the mask.

A 32-bit word is modelled as a tuple of four byte labels (its bytes 0..3), so that a byte
permutation is followed label by label: a half is (label of byte 2 e, label of byte 2 e + 1)."""
from __future__ import annotations

import numpy as np

from .mirrors import mirrors

DROPOUT = "dropout.cuh"


def word_labels(word) -> tuple:
    """A word whose bytes are labelled (word, 0) .. (word, 3)."""
    return tuple((word, b) for b in range(4))


def byte_perm(x: tuple, y: tuple, selector: int) -> tuple:
    """__byte_perm (PTX prmt, default mode without sign replication) on labelled words: byte n of
    the result is byte (selector >> 4 n) & 7 of (x bytes 0-3, y bytes 4-7)."""
    pool = x + y
    return tuple(pool[(selector >> (4 * n)) & 7] for n in range(4))


def halves(word: tuple) -> list:
    """The two 16-bit halves of a labelled word as (source word, half index), checking that each
    is a whole half of one source word in order."""
    out = []
    for e in range(2):
        lo, hi = word[2 * e], word[2 * e + 1]
        assert lo[0] == hi[0] and lo[1] % 2 == 0 and hi[1] == lo[1] + 1, f"not a whole half: {word}"
        out.append((lo[0], lo[1] // 2))
    return out


@mirrors(DROPOUT, "return a ? (c ? w.w : w.z) : (c ? w.y : w.x);")
def word_of(words, a: int, c: int):
    """Word 2 a + c of a group's four: x, y, z, w."""
    return words[2 * a + c]


@mirrors(DROPOUT,
         "const uint4 w = d.words(row_lane + 16 * i, key_lane + 16 * fp);",
         "const unsigned flags[4] = {d.dropped_flags(w.x), d.dropped_flags(w.z), d.dropped_flags(w.y),",
         "d.dropped_flags(w.w)};")
def s_unit_words(m_strips: int, n_frags: int, row_lane: int, key_lane: int):
    """{(i, fp, r): (group origin (i0, j0), a, c)}: the word of one lane's S unit (strip i,
    fragment pair fp) whose flags are flags[r]."""
    out = {}
    order = [(0, 0), (1, 0), (0, 1), (1, 1)]  # x, z, y, w as (a, c)
    for i in range(m_strips):
        for fp in range(n_frags // 2):
            origin = (row_lane + 16 * i, key_lane + 16 * fp)
            for r, (a, c) in enumerate(order):
                out[(i, fp, r)] = (origin, a, c)
    return out


@mirrors(DROPOUT,
         "const unsigned flags = d.dropped_flags(word_of(w, a, c));",
         "for (int e = 0; e < 2; ++e) visit(i, 2 * fp + c, 2 * a + e, Drop::kept_of(flags, e));")
def s_frag_words(m_strips: int, n_frags: int, row_lane: int, key_lane: int):
    """{(i, f, k): (group origin, a, c, half e)} of one lane's S fragments s[i][f][k] (walk_s_frags:
    the call of s_unit_words, its words taken in place, which keeps the float32 kernels' registers
    below their limits)."""
    out = {}
    for i in range(m_strips):
        for fp in range(n_frags // 2):
            origin = (row_lane + 16 * i, key_lane + 16 * fp)
            for a in range(2):
                for c in range(2):
                    for e in range(2):
                        out[(i, 2 * fp + c, 2 * a + e)] = (origin, a, c, e)
    return out


@mirrors(DROPOUT,
         "const int key_parity = key_lane & 1;",
         "const unsigned theirs = key_parity ? 0x5410u : 0x7632u;",
         "const unsigned pair[2] = {key_parity ? 0x3254u : 0x5410u, key_parity ? 0x3276u : 0x7610u};",
         "const uint4 w = d.words(query_lane + 16 * fp + key_parity, key_lane & ~1);",
         "const unsigned got[2] = {__shfl_xor_sync(0xffffffffu, __byte_perm(w.x, w.y, theirs), 4),",
         "__shfl_xor_sync(0xffffffffu, __byte_perm(w.z, w.w, theirs), 4)};",
         "const unsigned own[4] = {w.x, w.y, w.z, w.w};",
         "for (int r = 0; r < 4; ++r) flags[r] = d.dropped_flags(__byte_perm(own[r], got[r >> 1], pair[r & 1]));")
def st_unit_words(n_frags: int, key_lanes, query_lanes):
    """The warp's S^T walk, lanes given by their (key_lane, query_lane): per lane, the group
    origins of the calls it makes, and {(fp, r): [(origin, a, c, half) of half 0, of half 1]} of
    the word whose flags are its flags[r], with the shuffle followed (lane ^ 4's call, the halves
    its byte_perm hands over)."""
    calls, sent, own = {}, {}, {}
    for lane, (key_lane, query_lane) in enumerate(zip(key_lanes, query_lanes)):
        key_parity = key_lane & 1
        theirs = 0x5410 if key_parity else 0x7632
        calls[lane] = []
        for fp in range(n_frags // 2):
            origin = (query_lane + 16 * fp + key_parity, key_lane & ~1)
            calls[lane].append(origin)
            w = [word_labels((origin, a, c)) for a in range(2) for c in range(2)]  # x y z w
            own[lane, fp] = w
            sent[lane, fp] = [byte_perm(w[0], w[1], theirs), byte_perm(w[2], w[3], theirs)]
    units = {}
    for lane, (key_lane, _) in enumerate(zip(key_lanes, query_lanes)):
        key_parity = key_lane & 1
        pair = [0x3254 if key_parity else 0x5410, 0x3276 if key_parity else 0x7610]
        out = units[lane] = {}
        for fp in range(n_frags // 2):
            got = sent[lane ^ 4, fp]
            for r in range(4):
                word = byte_perm(own[lane, fp][r], got[r >> 1], pair[r & 1])
                out[(fp, r)] = [(origin, a, c, half) for (origin, a, c), half in halves(word)]
    return calls, units


@mirrors(DROPOUT,
         "for (int e = 0; e < 2; ++e) visit(2 * fp + (r >> 1), 2 * (r & 1) + e, Drop::kept_of(flags[r], e));")
def st_frag_words(n_frags: int, key_lanes, query_lanes):
    """Per lane {(f, k): (group origin, a, c, half)} of its S^T fragments s[f][k] (walk_st_frags),
    and the calls of st_unit_words."""
    calls, units = st_unit_words(n_frags, key_lanes, query_lanes)
    elements = {lane: {(2 * fp + (r >> 1), 2 * (r & 1) + e): words[e]
                       for (fp, r), words in unit.items() for e in range(2)} for lane, unit in units.items()}
    return calls, elements


@mirrors(DROPOUT,
         "static __device__ __forceinline__ unsigned addend_of(unsigned threshold) { return (0x8000u - threshold) * 0x10001u; }",
         "__device__ __forceinline__ unsigned dropped_flags(unsigned word) const { return (word & 0x7FFF7FFFu) + addend; }")
def dropped_flags(word, threshold: int):
    """DropoutFn::dropped_flags on uint32 words (NumPy arrays), in 32-bit arithmetic."""
    addend = ((0x8000 - int(threshold)) * 0x10001) & 0xFFFFFFFF
    return ((np.asarray(word, np.uint64) & np.uint64(0x7FFF7FFF)) + np.uint64(addend)) & np.uint64(0xFFFFFFFF)


@mirrors(DROPOUT,
         "static __device__ __forceinline__ bool kept_of(unsigned flags, int e) { return !(flags & (e ? 0x80000000u : 0x8000u)); }")
def kept_of(flags, e: int):
    return (np.asarray(flags, np.uint64) & np.uint64(0x80000000 if e else 0x8000)) == 0


def prmt_sign(x, selector: int):
    """PTX prmt in its default mode with sign replication, b = 0: result byte n is byte
    s = (selector >> 4 n) & 7 of (x, 0), or, where bit 3 of that nibble is set, that byte's top
    bit replicated over the byte."""
    x = np.asarray(x, np.uint64)
    out = np.zeros_like(x)
    for n in range(4):
        nibble = (selector >> (4 * n)) & 0xF
        src = nibble & 7
        byte = (x >> np.uint64(8 * src)) & np.uint64(0xFF) if src < 4 else np.zeros_like(x)
        if nibble & 8:
            byte = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        out |= byte << np.uint64(8 * n)
    return out


@mirrors(DROPOUT, 'asm("prmt.b32 %0, %1, 0, 0xBB99;" : "=r"(m) : "r"(flags));')
def spread_flags(flags):
    return prmt_sign(flags, 0xBB99)


@mirrors(DROPOUT, "for (int r = 0; r < 4; ++r) p[i][fp][r] &= ~spread_flags(flags[r]);")
def drop_packed(packed, flags):
    """drop_packed_p on one register: the packed pair with its dropped halves cleared."""
    return np.asarray(packed, np.uint64) & ~spread_flags(flags) & np.uint64(0xFFFFFFFF)


@mirrors(DROPOUT, "constexpr unsigned DROPPED_BITS = 0x80008000u;",
         "for (int r = 0; r < 4; ++r) p[fp][r] ^= flags[r] & DROPPED_BITS;")
def mark_packed(packed, flags):
    """mark_packed_pt on one register: the packed pair with its dropped halves' signs flipped."""
    return np.asarray(packed, np.uint64) ^ (np.asarray(flags, np.uint64) & np.uint64(0x80008000))


def s_frag_element(i: int, f: int, k: int, row_lane: int, key_lane: int) -> tuple[int, int]:
    """(query, key) of s[i][f][k] in an m16n8 C fragment (mma.cuh): rows + 8 for k >= 2."""
    return row_lane + 16 * i + 8 * (k >> 1), key_lane + 8 * f + (k & 1)


def st_frag_element(f: int, k: int, key_lane: int, query_lane: int) -> tuple[int, int]:
    """(query, key) of s[f][k] in a fragment of S^T: key rows + 8 for k >= 2, query columns."""
    return query_lane + 8 * f + (k & 1), key_lane + 8 * (k >> 1)


def documented_word(query: int, key: int) -> tuple[tuple[int, int], int, int, int]:
    """cupyflash.dropout's definition: group origin (i & ~8, j & ~9), word 2 a + c, half j & 1."""
    return (query & ~8, key & ~9), (query >> 3) & 1, (key >> 3) & 1, key & 1


def lanes(row0: int, col0: int):
    """(row_lane, col_lane) of the 32 lanes of a warp whose fragments start at (row0, col0)."""
    lane = np.arange(32)
    return row0 + lane // 4, col0 + 2 * (lane % 4)

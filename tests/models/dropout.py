"""kernels_cu/dropout.cuh's fragment walks: which (query, key) element of a lane's accumulator
fragments each Philox word goes to, for S (for_s_frags: forward, dQ) and S^T (for_st_frags: dK/dV),
as index arrays that tests/kernels/test_dropout_layout.py compares with cupyflash.dropout's
definition of the mask."""
from __future__ import annotations

import numpy as np

from .mirrors import mirrors

DROPOUT = "dropout.cuh"


@mirrors(DROPOUT, "return a ? (c ? w.w : w.z) : (c ? w.y : w.x);", "return e ? word >> 16 : word & 0xFFFFu;")
def word_of(words, a: int, c: int):
    """Word 2 a + c of a group's four: x, y, z, w."""
    return words[2 * a + c]


@mirrors(DROPOUT,
         "const uint4 w = d.words(row_lane + 16 * i, key_lane + 16 * fp);",
         "for (int e = 0; e < 2; ++e) visit(i, 2 * fp + c, 2 * a + e, d.kept_half(half_of(word_of(w, a, c), e)));")
def s_frag_words(m_strips: int, n_frags: int, row_lane: int, key_lane: int):
    """{(i, f, k): (group origin (i0, j0), a, c, half e)} of one lane's S fragments s[i][f][k]."""
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
         "const unsigned mine = key_parity ? 0x7632u : 0x5410u, theirs = key_parity ? 0x5410u : 0x7632u;",
         "const uint4 w = d.words(query_lane + 16 * fp + key_parity, key_lane & ~1);",
         "const unsigned own[2] = {__byte_perm(w.x, w.y, mine), __byte_perm(w.z, w.w, mine)};",
         "const unsigned got[2] = {__shfl_xor_sync(0xffffffffu, __byte_perm(w.x, w.y, theirs), 4),",
         "const unsigned halves = (e == key_parity) ? own[a] : got[a];",
         "for (int c = 0; c < 2; ++c) visit(2 * fp + a, 2 * c + e, d.kept_half(half_of(halves, c)));")
def st_frag_words(n_frags: int, key_lanes, query_lanes):
    """The warp's S^T walk, lanes given by their (key_lane, query_lane): per lane, the group
    origins of the calls it makes, and {(f, k): (group origin, a, c, half)} of its fragments
    s[f][k], with the shuffle followed (lane ^ 4's call, the halves its byte_perm hands over)."""
    def byte_perm(x, y, selector):  # 16-bit halves as (word, half) pairs: the two selectors used
        return {0x5410: ((x, 0), (y, 0)), 0x7632: ((x, 1), (y, 1))}[selector]

    calls, sent, own = {}, {}, {}
    for lane, (key_lane, query_lane) in enumerate(zip(key_lanes, query_lanes)):
        key_parity = key_lane & 1
        mine, theirs = (0x7632, 0x5410) if key_parity else (0x5410, 0x7632)
        calls[lane] = []
        for fp in range(n_frags // 2):
            origin = (query_lane + 16 * fp + key_parity, key_lane & ~1)
            calls[lane].append(origin)
            words = [(origin, 0, 0), (origin, 0, 1), (origin, 1, 0), (origin, 1, 1)]  # x y z w: (a, c)
            own[lane, fp] = [byte_perm(words[0], words[1], mine), byte_perm(words[2], words[3], mine)]
            sent[lane, fp] = [byte_perm(words[0], words[1], theirs), byte_perm(words[2], words[3], theirs)]
    elements = {}
    for lane, (key_lane, _) in enumerate(zip(key_lanes, query_lanes)):
        key_parity = key_lane & 1
        out = elements[lane] = {}
        for fp in range(n_frags // 2):
            got = sent[lane ^ 4, fp]
            for e in range(2):
                for a in range(2):
                    halves = own[lane, fp][a] if e == key_parity else got[a]
                    for c in range(2):
                        (origin, word_a, word_c), half = halves[c]
                        out[(2 * fp + a, 2 * c + e)] = (origin, word_a, word_c, half)
    return calls, elements


@mirrors(DROPOUT, "static __device__ __forceinline__ unsigned limit_of(unsigned threshold) { return (threshold << 16) - 1u; }",
         "__device__ __forceinline__ bool kept_in(unsigned word, int e) const { return (e ? word : word << 16) <= limit; }",
         "__device__ __forceinline__ bool kept_half(unsigned half) const { return half <= (limit >> 16); }")
def kept_in(word, e, threshold):
    """DropoutFn::kept_in on uint32 words (NumPy arrays): the element in half e kept."""
    word = np.asarray(word, np.uint32)
    limit = np.uint32(((int(threshold) << 16) - 1) & 0xFFFFFFFF)
    moved = word if e else (word << np.uint32(16))
    return moved <= limit


def kept_half(half, threshold):
    """DropoutFn::kept_half on extracted 16-bit halves."""
    limit = ((int(threshold) << 16) - 1) & 0xFFFFFFFF
    return np.asarray(half, np.uint32) <= np.uint32(limit >> 16)


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

"""kernels_cu/dropout.cuh's fragment walks: which (query, key) element of a lane's accumulator
fragments each Philox word goes to, for S (for_s_frags: forward, dQ) and S^T (for_st_frags: dK/dV),
as index arrays that tests/kernels/test_dropout_layout.py compares with cupyflash.dropout's
definition of the mask."""
from __future__ import annotations

import numpy as np

from .mirrors import mirrors

DROPOUT = "dropout.cuh"


@mirrors(DROPOUT, "return a ? (c ? w.w : w.z) : (c ? w.y : w.x);")
def word_of(words, a: int, c: int):
    """Word 2 a + c of a group's four: x, y, z, w."""
    return words[2 * a + c]


@mirrors(DROPOUT,
         "const uint4 w = d.words(row_lane + 16 * i, key_lane + 16 * fp + e);",
         "for (int c = 0; c < 2; ++c) visit(i, 2 * fp + c, 2 * a + e, d.kept(word_of(w, a, c)));")
def s_frag_words(m_strips: int, n_frags: int, row_lane: int, key_lane: int):
    """{(i, f, k): (group origin (i0, j0), a, c)} of one lane's S fragments s[i][f][k]."""
    out = {}
    for i in range(m_strips):
        for fp in range(n_frags // 2):
            for e in range(2):
                origin = (row_lane + 16 * i, key_lane + 16 * fp + e)
                for a in range(2):
                    for c in range(2):
                        out[(i, 2 * fp + c, 2 * a + e)] = (origin, a, c)
    return out


@mirrors(DROPOUT,
         "const uint4 w = d.words(query_lane + 16 * fp + e, key_lane);",
         "for (int c = 0; c < 2; ++c) visit(2 * fp + a, 2 * c + e, d.kept(word_of(w, a, c)));")
def st_frag_words(n_frags: int, key_lane: int, query_lane: int):
    """{(f, k): (group origin (i0, j0), a, c)} of one lane's S^T fragments s[f][k]."""
    out = {}
    for fp in range(n_frags // 2):
        for e in range(2):
            origin = (query_lane + 16 * fp + e, key_lane)
            for a in range(2):
                for c in range(2):
                    out[(2 * fp + a, 2 * c + e)] = (origin, a, c)
    return out


def s_frag_element(i: int, f: int, k: int, row_lane: int, key_lane: int) -> tuple[int, int]:
    """(query, key) of s[i][f][k] in an m16n8 C fragment (mma.cuh): rows + 8 for k >= 2."""
    return row_lane + 16 * i + 8 * (k >> 1), key_lane + 8 * f + (k & 1)


def st_frag_element(f: int, k: int, key_lane: int, query_lane: int) -> tuple[int, int]:
    """(query, key) of s[f][k] in a fragment of S^T: key rows + 8 for k >= 2, query columns."""
    return query_lane + 8 * f + (k & 1), key_lane + 8 * (k >> 1)


def documented_word(query: int, key: int) -> tuple[tuple[int, int], int, int]:
    """cupyflash.dropout's definition: group origin (i & ~8, j & ~8), word 2 a + c."""
    return (query & ~8, key & ~8), (query >> 3) & 1, (key >> 3) & 1


def lanes(row0: int, col0: int):
    """(row_lane, col_lane) of the 32 lanes of a warp whose fragments start at (row0, col0)."""
    lane = np.arange(32)
    return row0 + lane // 4, col0 + 2 * (lane % 4)

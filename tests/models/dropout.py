"""kernels_cu/dropout.cuh's walks: which (query, key) element of a lane's accumulator fragments
each Philox byte goes to, for S (walk_s_units, walk_s_frags: forward, dQ) and S^T (walk_st_units:
dK/dV), in the order of the packed registers that pack_p / pack_a_frags (models/fragments.py)
form, with the lane pairs' shuffles followed; and the word arithmetic of the keep test
(byte_flags, spread_pair, the packed drop and mark), as NumPy code that
tests/kernels/test_dropout_layout.py compares with cupyflash.dropout's definition of the mask.

A word is labelled (group origin (i0, j0), word index 0..3): the byte of an element is then the
label and a byte index."""
from __future__ import annotations

import numpy as np

from .mirrors import mirrors

DROPOUT = "dropout.cuh"


@mirrors(DROPOUT, "return qb ? (kb ? w.w : w.z) : (kb ? w.y : w.x);")
def word_of(words, qb: int, kb: int):
    """Word 2 qb + kb of a group's four: x, y, z, w."""
    return words[2 * qb + kb]


@mirrors(DROPOUT,
         "out[0] = parity ? w.y : w.x;",
         "out[1] = parity ? w.w : w.z;",
         "out[0] = parity ? w.z : w.x;",
         "out[1] = parity ? w.w : w.y;")
def lane_words(words, parity: int, st: bool):
    """lane_words<ST>: a lane's two words of a group, S^T (st) lanes by key parity, S by query parity."""
    x, y, z, w = words
    if st:
        return [y if parity else x, w if parity else z]
    return [z if parity else x, w if parity else y]


def group_words(origin):
    """A call's four words, labelled."""
    return [(origin, n) for n in range(4)]


@mirrors(DROPOUT,
         "for (int u = 0; u + 1 < UNITS; u += 2) {",
         "const int2 o0 = origin(u), o1 = origin(u + 1);",
         "const uint4 w = d.words(parity ? o1.x : o0.x, parity ? o1.y : o0.y);",
         "lane_words<ST>(mine, w, parity);",
         "lane_words<ST>(theirs, w, parity ^ 1);",
         "for (int k = 0; k < 2; ++k) got[k] = __shfl_xor_sync(0xffffffffu, theirs[k], 4);",
         "const unsigned first[2] = {parity ? got[0] : mine[0], parity ? got[1] : mine[1]};",
         "const unsigned second[2] = {parity ? mine[0] : got[0], parity ? mine[1] : got[1]};",
         "visit(u, first);",
         "visit(u + 1, second);",
         "if constexpr (UNITS % 2) {",
         "const int2 o = origin(UNITS - 1);",
         "lane_words<ST>(mine, d.words(o.x, o.y), parity);",
         "visit(UNITS - 1, mine);")
def walk_units(st: bool, units: int, parities, origins):
    """walk_units for a whole warp: parities[lane], origins[lane](u) -> (i0, j0). Returns the
    calls each lane makes (group origins) and per lane {u: its two words' labels}."""
    calls = {lane: [] for lane in range(32)}
    words, sent = {}, {}
    for lane in range(32):
        parity = parities[lane]
        for u in range(0, units - 1, 2):
            origin = origins[lane](u + 1) if parity else origins[lane](u)
            calls[lane].append(origin)
            w = group_words(origin)
            words[lane, u] = (lane_words(w, parity, st), lane_words(w, parity ^ 1, st))
    out = {lane: {} for lane in range(32)}
    for lane in range(32):
        parity = parities[lane]
        for u in range(0, units - 1, 2):
            mine = words[lane, u][0]
            got = words[lane ^ 4, u][1]  # the partner's `theirs`, through the shuffle
            out[lane][u] = got if parity else mine
            out[lane][u + 1] = mine if parity else got
        if units % 2:
            origin = origins[lane](units - 1)
            calls[lane].append(origin)
            out[lane][units - 1] = lane_words(group_words(origin), parity, st)
    return calls, out


@mirrors(DROPOUT,
         "constexpr int PAIRS = N_FRAGS / 2;",
         "const int row0 = row_lane & ~1;",
         "d, row_lane & 1, [&](int u) { return make_int2(row0 + 16 * (u / PAIRS), key_lane + 16 * (u % PAIRS)); },",
         "const unsigned masks[4] = {spread_pair<0>(f0, f1), spread_pair<2>(f0, f1), spread_pair<1>(f0, f1),",
         "spread_pair<3>(f0, f1)};",
         "visit_unit(u / PAIRS, u % PAIRS, masks);")
def s_unit_words(m_strips: int, n_frags: int, row_lanes, key_lanes):
    """The warp's S walk (walk_s_units): the calls per lane, and per lane {(i, fp, r): [(word
    label, byte) of half 0, of half 1]} of its masks[r]."""
    pairs = n_frags // 2
    parities = [int(r) & 1 for r in row_lanes]
    origins = [lambda u, r0=int(r) & ~1, k=int(k): (r0 + 16 * (u // pairs), k + 16 * (u % pairs))
               for r, k in zip(row_lanes, key_lanes)]
    calls, words = walk_units(False, m_strips * pairs, parities, origins)
    byte_of_register = [0, 2, 1, 3]
    units = {lane: {(u // pairs, u % pairs, r): [(w[e], byte_of_register[r]) for e in range(2)]
                    for u, w in words[lane].items() for r in range(4)} for lane in range(32)}
    return calls, units


@mirrors(DROPOUT,
         "for (int e = 0; e < 2; ++e) visit(i, 2 * fp + (r >> 1), 2 * (r & 1) + e, Drop::kept_of(masks[r], e));")
def s_frag_words_paired(m_strips: int, n_frags: int, row_lanes, key_lanes):
    """walk_s_frags<..., PAIRED = true>: per lane {(i, f, k): (word label, byte)} of s[i][f][k]."""
    calls, units = s_unit_words(m_strips, n_frags, row_lanes, key_lanes)
    return calls, {lane: {(i, 2 * fp + (r >> 1), 2 * (r & 1) + e): halves[e]
                          for (i, fp, r), halves in unit.items() for e in range(2)} for lane, unit in units.items()}


@mirrors(DROPOUT,
         "const int parity = row_lane & 1, row0 = row_lane & ~1;",
         "lane_words<false>(words, d.words(row0 + 16 * i, key_lane + 16 * fp), parity);",
         "const unsigned flags = d.byte_flags(words[e]);",
         "for (int c = 0; c < 2; ++c) visit(i, 2 * fp + c, 2 * a + e, Drop::kept_in(flags, 2 * a + c));")
def s_frag_words(m_strips: int, n_frags: int, row_lane: int, key_lane: int):
    """walk_s_frags<..., PAIRED = false> for one lane: its calls, and {(i, f, k): (word label,
    byte)} of s[i][f][k] (each lane calls each of its units; no shuffle)."""
    parity, row0 = row_lane & 1, row_lane & ~1
    calls, out = [], {}
    for i in range(m_strips):
        for fp in range(n_frags // 2):
            origin = (row0 + 16 * i, key_lane + 16 * fp)
            calls.append(origin)
            words = lane_words(group_words(origin), parity, False)
            for e in range(2):
                for a in range(2):
                    for c in range(2):
                        out[(i, 2 * fp + c, 2 * a + e)] = (words[e], 2 * a + c)
    return calls, out


@mirrors(DROPOUT,
         "const int key0 = key_lane & ~1;",
         "d, key_lane & 1, [&](int u) { return make_int2(query_lane + 16 * u, key0); },",
         "const unsigned masks[4] = {spread_pair<0>(f0, f1), spread_pair<1>(f0, f1), spread_pair<2>(f0, f1),",
         "spread_pair<3>(f0, f1)};",
         "visit_unit(u, masks);")
def st_unit_words(n_frags: int, key_lanes, query_lanes):
    """The warp's S^T walk (walk_st_units): the calls per lane, and per lane {(fp, r): [(word
    label, byte) of half 0, of half 1]} of its masks[r]."""
    parities = [int(k) & 1 for k in key_lanes]
    origins = [lambda u, q=int(q), k0=int(k) & ~1: (q + 16 * u, k0) for k, q in zip(key_lanes, query_lanes)]
    calls, words = walk_units(True, n_frags // 2, parities, origins)
    units = {lane: {(u, r): [(w[e], r) for e in range(2)] for u, w in words[lane].items() for r in range(4)}
             for lane in range(32)}
    return calls, units


@mirrors(DROPOUT,
         "for (int e = 0; e < 2; ++e) visit(2 * fp + (r >> 1), 2 * (r & 1) + e, Drop::kept_of(masks[r], e));")
def st_frag_words(n_frags: int, key_lanes, query_lanes):
    """Per lane {(f, k): (word label, byte)} of its S^T fragments s[f][k] (walk_st_frags), and the
    calls of st_unit_words."""
    calls, units = st_unit_words(n_frags, key_lanes, query_lanes)
    elements = {lane: {(2 * fp + (r >> 1), 2 * (r & 1) + e): halves[e]
                       for (fp, r), halves in unit.items() for e in range(2)} for lane, unit in units.items()}
    return calls, elements


@mirrors(DROPOUT,
         "static __device__ __forceinline__ unsigned addend_of(unsigned threshold) { return (256u - threshold) * 0x01010101u; }",
         "const unsigned low = (word & 0x7F7F7F7Fu) + (addend & 0x7F7F7F7Fu);",
         "return (word & addend) | (word & low) | (addend & low);")
def byte_flags(word, threshold: int):
    """DropoutFn::byte_flags on uint32 words (NumPy arrays), in 32-bit arithmetic."""
    word = np.asarray(word, np.uint64)
    addend = np.uint64(((256 - int(threshold)) * 0x01010101) & 0xFFFFFFFF)
    low = ((word & np.uint64(0x7F7F7F7F)) + (addend & np.uint64(0x7F7F7F7F))) & np.uint64(0xFFFFFFFF)
    return (word & addend) | (word & low) | (addend & low)


@mirrors(DROPOUT,
         "static __device__ __forceinline__ bool kept_in(unsigned flags, int n) { return !(flags & (0x80u << (8 * n))); }")
def kept_in(flags, n: int):
    return (np.asarray(flags, np.uint64) & np.uint64(0x80 << (8 * n))) == 0


@mirrors(DROPOUT,
         "static __device__ __forceinline__ bool kept_of(unsigned mask, int e) { return !(mask & (e ? 0x80000000u : 0x8000u)); }")
def kept_of(mask, e: int):
    return (np.asarray(mask, np.uint64) & np.uint64(0x80000000 if e else 0x8000)) == 0


def prmt_sign(x, y, selector: int):
    """PTX prmt in its default mode: result byte n is byte s = (selector >> 4 n) & 7 of (x bytes
    0-3, y bytes 4-7), or, where bit 3 of that nibble is set, that byte's top bit replicated."""
    x, y = np.asarray(x, np.uint64), np.asarray(y, np.uint64)
    out = np.zeros(np.broadcast(x, y).shape, np.uint64)
    for n in range(4):
        nibble = (selector >> (4 * n)) & 0xF
        src = nibble & 7
        byte = ((x if src < 4 else y) >> np.uint64(8 * (src % 4))) & np.uint64(0xFF)
        if nibble & 8:
            byte = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        out |= byte << np.uint64(8 * n)
    return out


@mirrors(DROPOUT,
         "constexpr unsigned SELECTOR = (8u + N) * 0x11u | (12u + N) * 0x1100u;",
         'asm("prmt.b32 %0, %1, %2, %3;" : "=r"(m) : "r"(flags0), "r"(flags1), "n"(SELECTOR));')
def spread_pair(flags0, flags1, n: int):
    selector = (8 + n) * 0x11 | (12 + n) * 0x1100
    return prmt_sign(flags0, flags1, selector)


@mirrors(DROPOUT, "for (int r = 0; r < 4; ++r) p[i][fp][r] &= ~masks[r];")
def drop_packed(packed, mask):
    """drop_packed_p on one register: the packed pair with its dropped halves cleared."""
    return np.asarray(packed, np.uint64) & ~np.asarray(mask, np.uint64) & np.uint64(0xFFFFFFFF)


@mirrors(DROPOUT, "constexpr unsigned DROPPED_BITS = 0x80008000u;",
         "for (int r = 0; r < 4; ++r) p[fp][r] ^= masks[r] & DROPPED_BITS;")
def mark_packed(packed, mask):
    """mark_packed_pt on one register: the packed pair with its dropped halves' signs flipped."""
    return np.asarray(packed, np.uint64) ^ (np.asarray(mask, np.uint64) & np.uint64(0x80008000))


@mirrors(DROPOUT,
         "const uint4 w = words(i & ~9, j & ~9);",
         "return kept_in(byte_flags(word_of(w, i & 1, j & 1)), 2 * ((i >> 3) & 1) + ((j >> 3) & 1));")
def keep_word(query: int, key: int):
    """DropoutFn::keep's (word label, byte) of element (query, key)."""
    origin = (query & ~9, key & ~9)
    return word_of(group_words(origin), query & 1, key & 1), 2 * ((query >> 3) & 1) + ((key >> 3) & 1)


def s_frag_element(i: int, f: int, k: int, row_lane: int, key_lane: int) -> tuple[int, int]:
    """(query, key) of s[i][f][k] in an m16n8 C fragment (mma.cuh): rows + 8 for k >= 2."""
    return row_lane + 16 * i + 8 * (k >> 1), key_lane + 8 * f + (k & 1)


def st_frag_element(f: int, k: int, key_lane: int, query_lane: int) -> tuple[int, int]:
    """(query, key) of s[f][k] in a fragment of S^T: key rows + 8 for k >= 2, query columns."""
    return query_lane + 8 * f + (k & 1), key_lane + 8 * (k >> 1)


def documented_word(query: int, key: int):
    """cupyflash.dropout's definition: ((group origin, word 2 (i & 1) + (j & 1)), byte 2 a + c)."""
    origin = (query & ~9, key & ~9)
    return (origin, 2 * (query & 1) + (key & 1)), 2 * ((query >> 3) & 1) + ((key >> 3) & 1)


def lanes(row0: int, col0: int):
    """(row_lane, col_lane) of the 32 lanes of a warp whose fragments start at (row0, col0)."""
    lane = np.arange(32)
    return row0 + lane // 4, col0 + 2 * (lane % 4)

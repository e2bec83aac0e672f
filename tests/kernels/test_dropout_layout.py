"""dropout.cuh's walks and word arithmetic (models/dropout.py) against cupyflash.dropout's
definition: every element of a warp's S and S^T fragments gets the word and half the definition
assigns to its (query, key); the flags of a unit's register r are those of the two elements that
pack_p / pack_a_frags put in packed register r, low half first; each of an S lane's Philox calls
serves eight of its own elements (no half computed and thrown away), and so does each of an S^T
lane's, four of them its own and four its partner's (lane ^ 4), handed over by a shuffle; the
flags, their spread and the packed drop / mark are the definition's keep test."""
from __future__ import annotations

import numpy as np
import pytest
from models.dropout import (DROPOUT, documented_word, drop_packed, dropped_flags, kept_of, lanes, mark_packed,
                            s_frag_element, s_frag_words, s_unit_words, spread_flags, st_frag_element, st_frag_words,
                            st_unit_words)
from models.fragments import pack_a_frags
from models.mirrors import missing_statements

THRESHOLDS = [1, 2, 3, 0x3FFF, 0x4000, 0x4001, 0x7FFE, 0x7FFF, 0x8000]


def test_mirrors_match_the_header():
    assert not (missing := missing_statements(DROPOUT)), f"mirrored statements no longer in {DROPOUT}: {missing}"


def packed_layout(n_frags: int):
    """{(kk, r, e): (f, k)}: the accumulator element that pack_a_frags (pack_p's packing) puts in
    half e of register r of k-step kk."""
    labels = np.arange(n_frags * 4, dtype=np.float64).reshape(1, n_frags, 4)
    a = pack_a_frags(labels)[0]
    return {(kk, r, e): divmod(int(a[kk, r, e]), 4) for kk in range(n_frags // 2) for r in range(4) for e in range(2)}


@pytest.mark.parametrize("m_strips, n_frags, row0, col0", [(1, 8, 0, 0), (2, 8, 32, 64), (1, 16, 48, 128),
                                                           (2, 4, 16, 96)])
def test_s_fragments_get_the_documented_words(m_strips, n_frags, row0, col0):
    seen = set()
    layout = packed_layout(n_frags)
    for row_lane, key_lane in zip(*lanes(row0, col0)):
        row_lane, key_lane = int(row_lane), int(key_lane)
        groups = {}
        for (i, f, k), (origin, a, c, e) in s_frag_words(m_strips, n_frags, row_lane, key_lane).items():
            element = s_frag_element(i, f, k, row_lane, key_lane)
            assert (origin, a, c, e) == documented_word(*element)
            seen.add(element)
            groups.setdefault(origin, set()).add((a, c, e))
        assert all(len(words) == 8 for words in groups.values())
        # flags[r] of a unit: half e is the element in half e of pack_p's register r
        for (i, fp, r), (origin, a, c) in s_unit_words(m_strips, n_frags, row_lane, key_lane).items():
            for e in range(2):
                f, k = layout[(fp, r, e)]
                assert (origin, a, c, e) == documented_word(*s_frag_element(i, f, k, row_lane, key_lane))
    assert len(seen) == 32 * 4 * m_strips * n_frags  # the warp's 16 m_strips x 8 n_frags elements, once each


@pytest.mark.parametrize("n_frags, key0, query0", [(4, 0, 0), (8, 16, 64), (16, 112, 32)])
def test_st_fragments_get_the_documented_words(n_frags, key0, query0):
    key_lanes, query_lanes = (x.tolist() for x in lanes(key0, query0))
    calls, elements = st_frag_words(n_frags, key_lanes, query_lanes)
    _, units = st_unit_words(n_frags, key_lanes, query_lanes)
    layout = packed_layout(n_frags)
    seen = set()
    for lane, (key_lane, query_lane) in enumerate(zip(key_lanes, query_lanes)):
        for (f, k), word in elements[lane].items():
            element = st_frag_element(f, k, key_lane, query_lane)
            assert word == documented_word(*element)
            seen.add(element)
        # flags[r] of a unit: half e is the element in half e of pack_a_frags' register r
        for (fp, r), words in units[lane].items():
            for e in range(2):
                f, k = layout[(fp, r, e)]
                assert words[e] == documented_word(*st_frag_element(f, k, key_lane, query_lane))
    assert len(seen) == 32 * 4 * n_frags
    # one call per eight elements: the warp's calls are distinct groups, and each lane makes
    # n_frags / 2 of them for its 4 n_frags elements
    made = [origin for lane in range(32) for origin in calls[lane]]
    assert len(made) == len(set(made)) == 32 * n_frags // 2


@pytest.mark.parametrize("threshold", THRESHOLDS)
def test_flags_are_the_definitions_keep_test(threshold):
    """dropped_flags sets bit 15 + 16 e exactly where half e's low 15 bits are at least threshold
    (the element dropped), for every value of that half against other halves 0, 1, 0x7FFF, 0x8000
    and 0xFFFF (no carry crosses between the halves); kept_of reads it; threshold 2^15 keeps all."""
    halves = np.arange(1 << 16, dtype=np.uint64)
    dropped = (halves & np.uint64(0x7FFF)) >= threshold
    for other in (0, 1, 0x7FFF, 0x8000, 0xFFFF):
        for e in range(2):
            word = (halves << np.uint64(16 * e)) | (np.uint64(other) << np.uint64(16 * (1 - e)))
            flags = dropped_flags(word, threshold)
            assert np.array_equal(~kept_of(flags, e), dropped)
            assert np.array_equal(kept_of(flags, 1 - e), np.full(halves.shape, (other & 0x7FFF) < threshold))
    if threshold == 0x8000:
        assert not dropped.any()


def test_packed_drop_and_mark():
    """spread_flags spreads each half's flag (bit 15 of the half) over the half, whatever the
    other bits of the flags word; drop_packed clears exactly the dropped halves of a packed pair,
    mark_packed flips exactly their sign bits (the packing of -P)."""
    rng = np.random.default_rng(5)
    noise = rng.integers(0, 1 << 32, 4096, dtype=np.uint64) & np.uint64(0x7FFF7FFF)
    packed = rng.integers(0, 1 << 32, 4096, dtype=np.uint64)
    for lo in (0, 1):
        for hi in (0, 1):
            flags = noise | np.uint64(lo * 0x8000 + hi * 0x80000000)
            assert np.all(spread_flags(flags) == np.uint64(lo * 0xFFFF + hi * 0xFFFF0000))
            keep_mask = np.uint64((0 if lo else 0xFFFF) | (0 if hi else 0xFFFF0000))
            assert np.array_equal(drop_packed(packed, flags), packed & keep_mask)
            assert np.array_equal(mark_packed(packed, flags), packed ^ np.uint64(lo * 0x8000 + hi * 0x80000000))

"""dropout.cuh's walks and word arithmetic (models/dropout.py) against cupyflash.dropout's
definition: every element of a warp's S and S^T fragments gets the word and byte the definition
assigns to its (query, key), with the lane pairs' shuffles followed; the masks of a unit's
register r are those of the two elements that pack_p / pack_a_frags put in packed register r, low
half first; the warp makes one call per group of sixteen (two where a lane pair's units are odd in
number: the last one both call); byte_flags, the spread and the packed drop / mark are the
definition's keep test."""
from __future__ import annotations

import numpy as np
import pytest
from models.dropout import (DROPOUT, byte_flags, documented_word, drop_packed, keep_word, kept_in, kept_of, lanes,
                            mark_packed, s_frag_element, s_frag_words, s_frag_words_paired, s_unit_words,
                            spread_pair, st_frag_element, st_frag_words, st_unit_words)
from models.fragments import pack_a_frags
from models.mirrors import missing_statements

THRESHOLDS = [1, 2, 3, 127, 128, 129, 200, 230, 255, 256]


def test_mirrors_match_the_header():
    assert not (missing := missing_statements(DROPOUT)), f"mirrored statements no longer in {DROPOUT}: {missing}"


def packed_layout(n_frags: int):
    """{(kk, r, e): (f, k)}: the accumulator element that pack_a_frags (pack_p's packing) puts in
    half e of register r of k-step kk."""
    labels = np.arange(n_frags * 4, dtype=np.float64).reshape(1, n_frags, 4)
    a = pack_a_frags(labels)[0]
    return {(kk, r, e): divmod(int(a[kk, r, e]), 4) for kk in range(n_frags // 2) for r in range(4) for e in range(2)}


def check_calls(calls, units_per_lane: int):
    """Each lane makes ceil(units / 2) calls (its half of each unit pair, and a last odd unit);
    the warp calls each group once, the last odd unit's groups twice (both lanes of a pair)."""
    per_lane = (units_per_lane + 1) // 2
    assert all(len(c) == per_lane for c in calls.values())
    made = [origin for lane in range(32) for origin in calls[lane]]
    counts = {}
    for origin in made:
        counts[origin] = counts.get(origin, 0) + 1
    twice = sum(1 for n in counts.values() if n == 2)
    assert set(counts.values()) <= ({1, 2} if units_per_lane % 2 else {1})
    assert twice == (16 if units_per_lane % 2 else 0)  # 16 lane pairs, one odd unit each
    return len(counts)


@pytest.mark.parametrize("m_strips, n_frags, row0, col0", [(1, 8, 0, 0), (2, 8, 32, 64), (1, 16, 48, 128),
                                                           (2, 4, 16, 96), (1, 2, 0, 32), (3, 2, 16, 0),
                                                           (1, 6, 64, 16)])
def test_s_fragments_get_the_documented_bytes(m_strips, n_frags, row0, col0):
    row_lanes, key_lanes = (x.tolist() for x in lanes(row0, col0))
    layout = packed_layout(n_frags)
    calls, units = s_unit_words(m_strips, n_frags, row_lanes, key_lanes)
    paired_calls, paired = s_frag_words_paired(m_strips, n_frags, row_lanes, key_lanes)
    assert paired_calls == calls
    groups = check_calls(calls, m_strips * n_frags // 2)
    assert groups == 16 * m_strips * n_frags // 2  # 32 x 4 m_strips n_frags elements, sixteen a group
    seen = set()
    for lane, (row_lane, key_lane) in enumerate(zip(row_lanes, key_lanes)):
        unpaired_calls, unpaired = s_frag_words(m_strips, n_frags, row_lane, key_lane)
        assert len(unpaired_calls) == m_strips * n_frags // 2
        for (i, f, k), word in paired[lane].items():
            element = s_frag_element(i, f, k, row_lane, key_lane)
            assert word == documented_word(*element) == keep_word(*element)
            assert unpaired[(i, f, k)] == word
            seen.add(element)
        # masks[r] of a unit: half e is the element in half e of pack_p's register r
        for (i, fp, r), halves in units[lane].items():
            for e in range(2):
                f, k = layout[(fp, r, e)]
                assert halves[e] == documented_word(*s_frag_element(i, f, k, row_lane, key_lane))
    assert len(seen) == 32 * 4 * m_strips * n_frags


@pytest.mark.parametrize("n_frags, key0, query0", [(4, 0, 0), (8, 16, 64), (16, 112, 32), (2, 32, 16), (6, 0, 48)])
def test_st_fragments_get_the_documented_bytes(n_frags, key0, query0):
    key_lanes, query_lanes = (x.tolist() for x in lanes(key0, query0))
    calls, elements = st_frag_words(n_frags, key_lanes, query_lanes)
    _, units = st_unit_words(n_frags, key_lanes, query_lanes)
    layout = packed_layout(n_frags)
    groups = check_calls(calls, n_frags // 2)
    assert groups == 16 * n_frags // 2
    seen = set()
    for lane, (key_lane, query_lane) in enumerate(zip(key_lanes, query_lanes)):
        for (f, k), word in elements[lane].items():
            element = st_frag_element(f, k, key_lane, query_lane)
            assert word == documented_word(*element)
            seen.add(element)
        # masks[r] of a unit: half e is the element in half e of pack_a_frags' register r
        for (fp, r), halves in units[lane].items():
            for e in range(2):
                f, k = layout[(fp, r, e)]
                assert halves[e] == documented_word(*st_frag_element(f, k, key_lane, query_lane))
    assert len(seen) == 32 * 4 * n_frags


@pytest.mark.parametrize("threshold", THRESHOLDS)
def test_byte_flags_are_the_definitions_keep_test(threshold):
    """byte_flags sets bit 7 of byte n exactly where byte n is at least threshold (the element
    dropped), for every value of that byte against other bytes 0, 1, 0x7F, 0x80, 0xFF in the other
    positions (no carry crosses between bytes); kept_in reads it; threshold 256 keeps all."""
    values = np.arange(256, dtype=np.uint64)
    dropped = values >= threshold
    for other in (0, 1, 0x7F, 0x80, 0xFF):
        for n in range(4):
            word = np.uint64(0)
            for m in range(4):
                if m != n:
                    word |= np.uint64(other) << np.uint64(8 * m)
            words = word | (values << np.uint64(8 * n))
            flags = byte_flags(words, threshold)
            assert np.array_equal(~kept_in(flags, n), dropped)
            for m in range(4):
                if m != n:
                    assert np.all(kept_in(flags, m) == (other < threshold))
    if threshold == 256:
        assert not dropped.any()


def test_spread_drop_and_mark():
    """spread_pair spreads byte n's flag of each of two flag words over one half, whatever the
    other bits; drop_packed clears exactly the dropped halves of a packed pair, mark_packed flips
    exactly their sign bits (the packing of -P)."""
    rng = np.random.default_rng(5)
    packed = rng.integers(0, 1 << 32, 4096, dtype=np.uint64)
    for n in range(4):
        noise0, noise1 = (rng.integers(0, 1 << 32, 4096, dtype=np.uint64) & ~np.uint64(0x80 << (8 * n))
                          for _ in range(2))
        for lo in (0, 1):
            for hi in (0, 1):
                f0 = noise0 | np.uint64(lo * (0x80 << (8 * n)))
                f1 = noise1 | np.uint64(hi * (0x80 << (8 * n)))
                mask = spread_pair(f0, f1, n)
                assert np.all(mask == np.uint64(lo * 0xFFFF + hi * 0xFFFF0000))
                assert np.all(kept_of(mask, 0) == (not lo)) and np.all(kept_of(mask, 1) == (not hi))
                keep_mask = np.uint64((0 if lo else 0xFFFF) | (0 if hi else 0xFFFF0000))
                assert np.array_equal(drop_packed(packed, mask), packed & keep_mask)
                assert np.array_equal(mark_packed(packed, mask), packed ^ np.uint64(lo * 0x8000 + hi * 0x80000000))

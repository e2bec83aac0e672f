"""dropout.cuh's fragment walks (models/dropout.py) against cupyflash.dropout's definition: every
element of a warp's S and S^T fragments gets the word and half the definition assigns to its
(query, key); each of an S lane's Philox calls serves eight of its own elements (no half computed
and thrown away), and so does each of an S^T lane's, four of them its own and four its partner's (lane ^ 4), handed
over by a shuffle."""
from __future__ import annotations

import numpy as np
import pytest
from models.dropout import (DROPOUT, documented_word, kept_half, kept_in, lanes, s_frag_element, s_frag_words, st_frag_element,
                            st_frag_words)
from models.mirrors import missing_statements


def test_mirrors_match_the_header():
    assert not (missing := missing_statements(DROPOUT)), f"mirrored statements no longer in {DROPOUT}: {missing}"


@pytest.mark.parametrize("m_strips, n_frags, row0, col0", [(1, 8, 0, 0), (2, 8, 32, 64), (1, 16, 48, 128),
                                                           (2, 4, 16, 96)])
def test_s_fragments_get_the_documented_words(m_strips, n_frags, row0, col0):
    seen = set()
    for row_lane, key_lane in zip(*lanes(row0, col0)):
        groups = {}
        for (i, f, k), (origin, a, c, e) in s_frag_words(m_strips, n_frags, int(row_lane), int(key_lane)).items():
            element = s_frag_element(i, f, k, int(row_lane), int(key_lane))
            assert (origin, a, c, e) == documented_word(*element)
            seen.add(element)
            groups.setdefault(origin, set()).add((a, c, e))
        assert all(len(halves) == 8 for halves in groups.values())
    assert len(seen) == 32 * 4 * m_strips * n_frags  # the warp's 16 m_strips x 8 n_frags elements, once each


@pytest.mark.parametrize("n_frags, key0, query0", [(4, 0, 0), (8, 16, 64), (16, 112, 32)])
def test_st_fragments_get_the_documented_words(n_frags, key0, query0):
    key_lanes, query_lanes = lanes(key0, query0)
    calls, elements = st_frag_words(n_frags, [int(x) for x in key_lanes], [int(x) for x in query_lanes])
    seen = set()
    for lane, (key_lane, query_lane) in enumerate(zip(key_lanes, query_lanes)):
        for (f, k), word in elements[lane].items():
            element = st_frag_element(f, k, int(key_lane), int(query_lane))
            assert word == documented_word(*element)
            seen.add(element)
    assert len(seen) == 32 * 4 * n_frags
    # one call per eight elements: the warp's calls are distinct groups, and each lane makes
    # n_frags / 2 of them for its 4 n_frags elements
    made = [origin for lane in range(32) for origin in calls[lane]]
    assert len(made) == len(set(made)) == 32 * n_frags // 2


@pytest.mark.parametrize("threshold", [1, 2, 0x7FFF, 0x8000, 0xFFFF, 0x10000])
def test_word_comparison_is_the_half_comparison(threshold):
    """kept_in (a whole-word compare against threshold 2^16 - 1) keeps exactly the elements whose
    16-bit half is below threshold, whatever the other half holds: every half value, against
    other halves 0, 1, 0x8000 and 0xFFFF; threshold 2^16 keeps all (limit 2^32 - 1); kept_half
    (the half against limit >> 16) the same."""
    halves = np.arange(1 << 16, dtype=np.uint32)
    for other in (0, 1, 0x8000, 0xFFFF):
        assert np.array_equal(kept_in((halves << np.uint32(16)) | np.uint32(other), 1, threshold), halves < threshold)
        assert np.array_equal(kept_in(halves | (np.uint32(other) << np.uint32(16)), 0, threshold), halves < threshold)
    assert np.array_equal(kept_half(halves, threshold), halves < threshold)

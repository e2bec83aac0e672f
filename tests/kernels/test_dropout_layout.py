"""dropout.cuh's fragment walks (models/dropout.py) against cupyflash.dropout's definition: every
element of a warp's S and S^T fragments gets the word the definition assigns to its (query, key),
and each lane's Philox calls serve only its own elements (no word computed and thrown away)."""
from __future__ import annotations

import pytest
from models.dropout import (DROPOUT, documented_word, lanes, s_frag_element, s_frag_words, st_frag_element,
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
        for (i, f, k), (origin, a, c) in s_frag_words(m_strips, n_frags, int(row_lane), int(key_lane)).items():
            element = s_frag_element(i, f, k, int(row_lane), int(key_lane))
            assert (origin, a, c) == documented_word(*element)
            seen.add(element)
            groups.setdefault(origin, set()).add((a, c))
        assert all(words == {(0, 0), (0, 1), (1, 0), (1, 1)} for words in groups.values())
    assert len(seen) == 32 * 4 * m_strips * n_frags  # the warp's 16 m_strips x 8 n_frags elements, once each


@pytest.mark.parametrize("n_frags, key0, query0", [(4, 0, 0), (8, 16, 64), (16, 112, 32)])
def test_st_fragments_get_the_documented_words(n_frags, key0, query0):
    seen = set()
    for key_lane, query_lane in zip(*lanes(key0, query0)):
        groups = {}
        for (f, k), (origin, a, c) in st_frag_words(n_frags, int(key_lane), int(query_lane)).items():
            element = st_frag_element(f, k, int(key_lane), int(query_lane))
            assert (origin, a, c) == documented_word(*element)
            seen.add(element)
            groups.setdefault(origin, set()).add((a, c))
        assert all(words == {(0, 0), (0, 1), (1, 0), (1, 1)} for words in groups.values())
    assert len(seen) == 32 * 4 * n_frags

"""The variants bench counts visible pairs from the definition and renders its tables."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from cupyflash.bench.variants import Row, Variant, speedups, table, visible_pairs


def brute_force_pairs(sq, sk, left, right):
    i = np.arange(sq)[:, None] + sk - sq
    j = np.arange(sk)[None, :]
    visible = np.ones((sq, sk), dtype=bool)
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    return int(visible.sum())


@given(st.integers(0, 70), st.integers(0, 70), st.integers(-1, 80), st.integers(-1, 80))
def test_visible_pairs_match_the_definition(sq, sk, left, right):
    assert visible_pairs(sq, sk, left, right) == brute_force_pairs(sq, sk, left, right)


@pytest.mark.parametrize("variant, expected", [
    (Variant("full", False), (-1, -1)), (Variant("causal", True), (-1, 0)),
    (Variant("w", True, (1024, 0)), (1024, 0)), (Variant("w", True, (8, 8)), (8, 0)),
    (Variant("w", False, (512, 512)), (512, 512))])
def test_causal_folds_into_the_right_bound(variant, expected):
    assert variant.bounds() == expected


def test_tables_show_ratios_and_speedups():
    rows = [Row("causal", 16384, "cupyflash", "fwd", 10.0, 400.0),
            Row("causal", 16384, "flex", "fwd", 12.0, 333.0),
            Row("causal window 1024", 16384, "cupyflash", "fwd", 1.0, 380.0),
            Row("causal window 1024", 16384, "flex", "fwd", None, None, "not supported")]
    text = table(rows)
    assert "| causal | 16384 | fwd | 400.0 | 333.0 | 1.20 |" in text
    assert "| causal window 1024 | 16384 | fwd | 380.0 | — | — |" in text
    assert "| causal window 1024 | 16384 | causal | 10.0x | — |" in speedups(rows)
    rows += [Row("full", 16384, "cupyflash", "fwd", 16.0, 400.0), Row("documents 2048", 16384, "cupyflash", "fwd", 2.0, 400.0)]
    assert "| documents 2048 | 16384 | full | 8.0x | — |" in speedups(rows)


def test_document_pairs_are_each_documents_own():
    from cupyflash.bench.variants import VARIANTS, pairs_of

    by_name = {v.name: v for v in VARIANTS}
    assert pairs_of(by_name["documents 2048"], 16384) == 8 * 2048 * 2048
    assert pairs_of(by_name["causal documents 2048"], 16384) == 8 * 2048 * 2049 // 2
    assert pairs_of(by_name["documents 2048"], 5000) == 2 * 2048 ** 2 + 904 ** 2

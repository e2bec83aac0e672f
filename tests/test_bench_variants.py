"""The variants bench counts visible pairs from the definition and renders its tables."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from cupyflash.bench.variants import (VARIANTS, PairedRow, Row, Variant, baseline_of, paired_ratio, paired_table,
                                      speedups, table, visible_pairs)


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


def test_each_variant_is_paired_with_the_plain_kernel_of_its_bar():
    by_name = {v.name: v for v in VARIANTS}
    expected = {"full": None, "causal": None, "causal window 1024": "causal", "window (512, 512)": "causal",
                "causal softcap 30": "causal", "causal alibi": "causal", "causal sink": "causal",
                "causal dropout 0.1": "causal", "dropout 0.1": "full", "causal softcap 30 (score_mod)": "causal",
                "causal alibi (score_mod)": "causal", "documents 2048": "full", "causal documents 2048": "causal",
                "causal 192/128": None, "causal 192/192": None, "192/128": None}
    assert set(expected) == set(by_name)
    for name, base in expected.items():
        got = baseline_of(by_name[name])
        assert (got.name if got else None) == base, name
        if got is not None:
            assert got == Variant(got.name, got.causal) and got.causal == (base == "causal")


def test_paired_ratios_take_the_medians_and_the_rounds_spread():
    """Variant 2 ms, baseline 1 ms, same flops: 0.5 of it; a round's pair is the variant timed
    after the main row with the baseline timed just before it."""
    row = PairedRow("causal dropout 0.1", 8192, "causal", "fwd", variant_ms=[2.0, 2.2, 1.8, 2.0],
                    baseline_ms=[1.0, 1.2, 0.9], variant_flops=10.0, baseline_flops=10.0)
    ratio, lo, hi = paired_ratio(row)
    assert ratio == pytest.approx(1.0 / 2.0)
    assert (lo, hi) == (pytest.approx(0.9 / 2.0), pytest.approx(1.2 / 1.8))
    # a window: fewer visible pairs, so its TFLOP/s ratio is the time ratio times the flops ratio
    window = PairedRow("causal window 1024", 16384, "causal", "bwd", [1.0, 1.0], [7.0], 1.0, 8.25)
    assert paired_ratio(window)[0] == pytest.approx(7.0 / 8.25)
    text = paired_table([row, window])
    assert "| causal dropout 0.1 | 8192 | causal | fwd | 3 | 0.500 | 0.450-0.667 | 0.50x |" in text
    assert "| causal window 1024 | 16384 | causal | bwd | 1 | 0.848 | 0.848-0.848 | 7.00x |" in text


def test_paired_rounds_alternate_variant_and_baseline(monkeypatch):
    """run(paired=2) on stand-ins for the GPU pieces: each variant's main rows, then per mode the
    baseline and the variant alternated twice on the same inputs; plain rows get no pairing."""
    import contextlib

    import cupy
    import torch

    from cupyflash.bench import variants as V

    class FakeStream:
        ptr = 0

        def __init__(self, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(cupy.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda ptr: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(V, "_inputs", lambda *a: ["set0", "set1"])
    timed = []
    fixed_ms = {"causal": 1.0, "causal dropout 0.1": 1.25}

    def runs(variant, sets):
        assert sets == ["set0", "set1"]
        return tuple((lambda name=variant.name, mode=mode: (name, mode)) for mode in ("fwd", "bwd"))

    def time(fn, n_sets, stream):
        name, mode = fn()
        timed.append((name, mode))
        return fixed_ms[name] * (2.0 if mode == "bwd" else 1.0)

    monkeypatch.setattr(V, "_cupyflash_runs", runs)
    monkeypatch.setattr(V, "_time", time)
    by_name = {v.name: v for v in V.VARIANTS}
    paired = []
    rows = V.run(1, 1, 64, [256], [by_name["causal"], by_name["causal dropout 0.1"]], ["cupyflash"], paired=2,
                 paired_rows=paired)
    assert [(r.variant, r.mode, r.ms) for r in rows] == [("causal", "fwd", 1.0), ("causal", "bwd", 2.0),
                                                          ("causal dropout 0.1", "fwd", 1.25),
                                                          ("causal dropout 0.1", "bwd", 2.5)]
    d, c = "causal dropout 0.1", "causal"
    assert timed == [(c, "fwd"), (c, "bwd"), (d, "fwd"), (d, "bwd"),
                     (c, "fwd"), (d, "fwd"), (c, "fwd"), (d, "fwd"), (c, "bwd"), (d, "bwd"), (c, "bwd"), (d, "bwd")]
    assert [(p.variant, p.baseline, p.mode, p.variant_ms, p.baseline_ms) for p in paired] == [
        (d, c, "fwd", [1.25] * 3, [1.0] * 2), (d, c, "bwd", [2.5] * 3, [2.0] * 2)]
    assert all(V.paired_ratio(p)[0] == pytest.approx(0.8) for p in paired)

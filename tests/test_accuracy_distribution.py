"""The distribution form of issue 18's accuracy bars (tests/accuracy_distribution.py, used by
tests/saturation.py and tests/tf32_accuracy.py) can fail: its rule on fixed ratios, the assertion
on fake ratio functions, and the saturated-softmax assertion end to end on small NumPy cases,
standard attention in another order passing and the saved statistics failing. CPU, seconds."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import strategies as st

import cupyflash
from accuracy_distribution import Rule, assert_distribution, p99

import saturation


def _ratios(n, over=(), rest=0.3):
    """n ratios: ``rest`` everywhere but the values of ``over`` at the end."""
    return np.array([rest] * (n - len(over)) + list(over))


@pytest.mark.parametrize("ratios, broken", [
    (_ratios(200, [1.5] * 8), []),                        # 4%: as many over as allowed
    (_ratios(200, [1.5] * 9), ["9 over 1 > 8 allowed"]),
    (_ratios(200, [3.0, 3.0, 3.5]), ["p99 3.00 > 2.5"]),  # 3 of 200 above 2.5: the 99th percentile too
    (_ratios(200, [1.5, 3.0, 3.5]), []),                  # 2 of 200 above 2.5: not yet
    (_ratios(200, [8.5]), ["max 8.50 > 8.0"]),
    (_ratios(200, [np.inf]), ["max inf > 8.0"]),
    (_ratios(25, [1.5, 7.5]), []),                        # two draws over, always; no p99 below 100 draws
    (_ratios(25, [1.5] * 3), ["3 over 1 > 2 allowed"]),
    (_ratios(60, [1.1, 1.1]), []),                        # the ci profile: 4% of 60 is 2
])
def test_saturation_rule(ratios, broken):
    assert saturation.RULE.failures(ratios) == broken


def test_rule_median_and_draw_count():
    rule = Rule(max_share_over=0.02, max_median=0.4, max_p99=1.2, max_ratio=4.0)  # tf32_accuracy's
    assert rule.failures(_ratios(200, rest=0.5)) == ["median 0.50 > 0.4"]
    assert rule.failures(_ratios(10), requested=25) == ["10 draws of 25 requested"]
    assert p99(np.arange(101.0)) == pytest.approx(99.0) and p99([0.0, np.inf]) == np.inf


def _fake_ratio(drawn: int, share_over: float) -> float:
    """A ratio for a drawn integer: over 1 (1.5) on about ``share_over`` of them, else 0.3."""
    u = (drawn * 2654435761 % 2 ** 32) / 2 ** 32
    return 1.5 if u < share_over else 0.3


def test_distribution_assertion_passes_and_fails_on_fake_ratios(capsys):
    assert_distribution("fake standard", st.integers(0, 2 ** 30), lambda i: _fake_ratio(i, 0.0), saturation.RULE)
    assert "fake standard:" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="over 1 >"):
        assert_distribution("fake broken", st.integers(0, 2 ** 30), lambda i: _fake_ratio(i, 0.5), saturation.RULE)


SMALL_CASES = saturation.cases(max_seqlen=12).filter(saturation.saturating)


def _twin_gradients(case, statistics):
    q, k, v, do = case.arrays()
    options = dict(softmax_scale=case.softmax_scale, causal=case.causal, backend="numpy")
    o, lse = cupyflash.flash_attn_func(q, k, v, return_lse=True, **options)
    with np.errstate(all="ignore"):
        return cupyflash.flash_attn_backward(do, q, k, v, o, lse, statistics=statistics, **options)


def test_saturated_softmax_assertion_end_to_end():
    """Standard attention in another order (the definition of as accurate as standard) passes on
    the derandomized small draws; the saved statistics, which miss the bar on nearly every
    saturating draw (issue 18), fail it."""
    saturation.assert_as_accurate_as_standard(
        "standard reordered", SMALL_CASES, lambda case: saturation.standard_reordered_gradients(case, "shuffled"),
        more_baselines_of=lambda case: (saturation.standard_reordered_gradients(case),))
    with pytest.raises(AssertionError, match="over 1 >"):
        saturation.assert_as_accurate_as_standard("saved statistics", SMALL_CASES,
                                                  lambda case: _twin_gradients(case, "saved"))


def test_ratio_is_checks_verdict():
    """ratio() and check() are one bar: the one-hot case's saved statistics far over it, the
    recomputed ones under it."""
    case = saturation.Case(np.dtype(np.float32), 48, 48, 2, 32, False, 1e4, 1.0, 20261203)
    saved, recomputed = _twin_gradients(case, "saved"), _twin_gradients(case, "recomputed")
    assert saturation.ratio(case, saved) > 1e3
    with pytest.raises(AssertionError, match=r"d[qk]: error .* exceeds the floor .* standard attention's max error"):
        saturation.check(case, saved)
    assert saturation.ratio(case, recomputed) <= 1
    saturation.check(case, recomputed)

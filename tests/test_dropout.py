"""Dropout on the CPU: the Philox4x32 twin against Random123's known answers (7 and 10
rounds), the mask's statistics and layout, the float64 reference against finite differences, the NumPy twin of the
kernels against the reference, and the API's argument checks."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupyflash
from cupyflash import reference
from cupyflash.backward_plans import own_forward_statistics
from cupyflash.dropout import PHILOX_ROUNDS, Dropout, check_dropout, dropout_mask, keep_threshold, philox4x32
from strategies import attention_case, make_inputs
from kernel_paths import check_against_reference
from variants import variant_kwargs
from windows import window_size

# Random123's kat_vectors for philox4x32: (rounds, counter, key, result). The mask runs 7 rounds.
PI_COUNTER, PI_KEY = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)
PHILOX_KNOWN_ANSWERS = [
    (7, (0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    (7, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
    (7, PI_COUNTER, PI_KEY, (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
    (10, (0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (10, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (10, PI_COUNTER, PI_KEY, (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("rounds, counter, key, expected", PHILOX_KNOWN_ANSWERS)
def test_philox_known_answers(rounds, counter, key, expected):
    assert tuple(int(w) for w in philox4x32(counter, key, rounds)) == expected
    if rounds == PHILOX_ROUNDS:
        assert tuple(int(w) for w in philox4x32(counter, key)) == expected


def test_mask_words_follow_the_documented_layout():
    """Element (i, j) is kept iff byte 2 ((i >> 3) & 1) + ((j >> 3) & 1) of word 2 (i & 1) +
    (j & 1) of the 7-round call at (j & ~9, i & ~9) is below the threshold."""
    d = Dropout(0.5, seed=(7 << 32) | 3, offset=11)
    batch, nheads, sq, sk = 2, 3, 40, 37
    mask = dropout_mask(batch, nheads, sq, sk, d.p, d.seed, d.offset)
    rng = np.random.default_rng(0)
    for _ in range(200):
        b, h, i, j = (int(rng.integers(n)) for n in (batch, nheads, sq, sk))
        words = philox4x32((j & ~9, i & ~9, b * nheads + h, d.offset), (3, 7), rounds=7)
        word = int(words[2 * (i & 1) + (j & 1)])
        byte = (word >> (8 * (2 * ((i >> 3) & 1) + ((j >> 3) & 1)))) & 0xFF
        assert mask[b, h, i, j] == (byte < keep_threshold(d.p))


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.9])
def test_mask_keeps_one_minus_p(p):
    """The keep rate is threshold / 256, within 2^-9 of 1 - p."""
    mask = dropout_mask(2, 4, 256, 256, p, seed=12345)
    rate = keep_threshold(p) / 256
    assert abs(rate - (1 - p)) <= 2**-9
    n = mask.size
    sigma = np.sqrt(rate * (1 - rate) / n)
    assert abs(mask.mean() - rate) < 5 * sigma
    # no position of the groups' sixteen bytes is biased: each position of a 16 x 16 tile keeps
    # that rate of its elements too
    tiles = mask.reshape(2, 4, 16, 16, 16, 16).mean(axis=(0, 1, 2, 4))
    assert np.abs(tiles - rate).max() < 5 * np.sqrt(rate * (1 - rate) / (n / 256))
    # and the neighbours that share a call are independent: keys j, j + 1 of one row (two words),
    # and keys j, j + 8 (two bytes of one word): both kept rate^2 of the time
    q = rate**2
    for both, pairs in (((mask[..., 0::2] & mask[..., 1::2]).mean(), n / 2),
                        ((mask.reshape(2, 4, 256, 16, 2, 8)[..., 0, :] & mask.reshape(2, 4, 256, 16, 2, 8)[..., 1, :])
                         .mean(), n / 2)):
        assert abs(both - q) < 5 * np.sqrt(q * (1 - q) / pairs)


def test_mask_depends_on_seed_offset_and_head():
    base = dropout_mask(1, 2, 64, 64, 0.5, seed=1, offset=0)
    assert not np.array_equal(base, dropout_mask(1, 2, 64, 64, 0.5, seed=2, offset=0))
    assert not np.array_equal(base, dropout_mask(1, 2, 64, 64, 0.5, seed=1, offset=1))
    assert not np.array_equal(base[0, 0], base[0, 1])
    assert np.array_equal(base, dropout_mask(1, 2, 64, 64, 0.5, seed=1, offset=0))
    # a sub-problem's mask is the same elements' mask: it depends on indices, not on shapes
    assert np.array_equal(base[:, :, :33, :17], dropout_mask(1, 2, 33, 17, 0.5, seed=1, offset=0))


def test_threshold_edges():
    assert keep_threshold(0.0) == 256  # every byte is below it
    assert keep_threshold(0.5) == 128
    assert keep_threshold(0.1) == 230  # flash-attn's keep rate for p = 0.1 too: 230 / 256
    assert keep_threshold(2**-10) == 256  # p below 2^-9 keeps everything: 8 bits a comparison
    assert keep_threshold(1 - 2**-10) == 0  # refused by check_dropout: it would keep nothing
    assert keep_threshold(1 - 2**-8) == 1


@settings(max_examples=10)
@given(st.integers(0, 2**32 - 1), st.booleans())
def test_reference_gradients_match_finite_differences(seed, causal):
    """The reference's dropout backward, from the definition, against central differences."""
    rng = np.random.default_rng(seed)
    b, s, h, d = 1, 11, 2, 5
    q, k, v, do = (rng.standard_normal((b, s, h, d)) for _ in range(4))
    keep = rng.random((b, h, s, s)) > 0.4
    kw = dict(causal=causal, dropout_p=0.4, dropout_mask=keep)
    grads = reference.attention_backward(do, q, k, v, **kw)
    for which, x in enumerate((q, k, v)):
        idx = tuple(int(rng.integers(n)) for n in x.shape)
        e = np.zeros_like(x)
        e[idx] = 1e-6
        args = [q, k, v]
        args[which] = x + e
        plus = (reference.attention(*args, **kw)[0] * do).sum()
        args[which] = x - e
        minus = (reference.attention(*args, **kw)[0] * do).sum()
        assert abs((plus - minus) / 2e-6 - grads[which][idx]) < 1e-6 * (1 + abs(grads[which][idx]))


@given(attention_case(), window_size(), st.floats(0.01, 0.95), st.integers(0, 2**64 - 1))
def test_numpy_twin_with_dropout_matches_reference(case, window, p, seed):
    """The NumPy twin (the kernels' algorithm) with the mask the kernels compute, against the
    float64 reference given that mask, forward and backward, under the tolerance rule."""
    q, k, v, do = make_inputs(case)
    kwargs = dict(softmax_scale=case.softmax_scale, causal=case.causal, window_size=window)
    o, lse = cupyflash.flash_attn_func(q, k, v, dropout_p=p, seed=seed, return_lse=True, backend="numpy", **kwargs)
    grads = cupyflash.flash_attn_backward(do, q, k, v, o, lse, dropout_p=p, seed=seed, backend="numpy", **kwargs)
    keep = dropout_mask(case.batch, case.nheads, case.seqlen_q, case.seqlen_k, p, seed)
    check_against_reference(case, window, q, k, v, do, o, lse, grads, {"dropout_p": p, "dropout_mask": keep})


def test_vjp_uses_one_seed_for_both_directions():
    rng = np.random.default_rng(3)
    q, k, v, do = (rng.standard_normal((1, 40, 2, 16)).astype(np.float32) for _ in range(4))
    o, vjp = cupyflash.flash_attn_vjp(q, k, v, dropout_p=0.3, backend="numpy")
    dq, dk, dv = vjp(do)
    # the seed the vjp drew is not returned; the mask it used is found from dv = W^T dO: a
    # backward with another seed disagrees, the true one reproduces o and every gradient exactly
    o_again, vjp_again = cupyflash.flash_attn_vjp(q, k, v, dropout_p=0.3, seed=5, backend="numpy")
    assert not np.allclose(o_again, o)
    o5 = cupyflash.flash_attn_func(q, k, v, dropout_p=0.3, seed=5, backend="numpy")
    assert np.array_equal(o5, o_again)
    assert all(np.array_equal(a, b) for a, b in zip(vjp_again(do), cupyflash.flash_attn_backward(
        do, q, k, v, *cupyflash.flash_attn_func(q, k, v, dropout_p=0.3, seed=5, backend="numpy", return_lse=True),
        dropout_p=0.3, seed=5, backend="numpy", statistics=own_forward_statistics(q.dtype))))
    assert all(np.isfinite(g).all() for g in (dq, dk, dv))


def test_dropout_zero_is_plain_attention():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 20, 2, 8)).astype(np.float32) for _ in range(3))
    assert np.array_equal(cupyflash.flash_attn_func(q, k, v, dropout_p=0.0, seed=9, backend="numpy"),
                          cupyflash.flash_attn_func(q, k, v, backend="numpy"))
    assert check_dropout(0.0, None, 0).on is False


@pytest.mark.parametrize("p, seed, offset, error", [
    (-0.1, 1, 0, ValueError), (1.0, 1, 0, ValueError), ("0.1", 1, 0, TypeError), (True, 1, 0, TypeError),
    (0.1, -1, 0, ValueError), (0.1, 2**64, 0, ValueError), (0.1, 1, 2**32, ValueError), (0.1, 1.5, 0, ValueError),
    (1 - 2**-10, 1, 0, ValueError)])
def test_bad_dropout_arguments_are_refused(p, seed, offset, error):
    q = np.zeros((1, 4, 1, 8), np.float32) + 1
    with pytest.raises(error, match="dropout_p|seed|offset"):
        cupyflash.flash_attn_func(q, q, q, dropout_p=p, seed=seed, offset=offset, backend="numpy")


def test_backward_with_dropout_needs_the_seed():
    q = np.ones((1, 4, 1, 8), np.float32)
    o, lse = cupyflash.flash_attn_func(q, q, q, dropout_p=0.2, seed=1, backend="numpy", return_lse=True)
    with pytest.raises(ValueError, match="seed"):
        cupyflash.flash_attn_backward(q, q, q, q, o, lse, dropout_p=0.2, backend="numpy")


@settings(max_examples=15, suppress_health_check=[HealthCheck.large_base_example])
@given(attention_case(), window_size(), st.floats(0.05, 0.9), st.integers(0, 2**64 - 1), st.data())
def test_numpy_twin_with_dropout_and_score_variants_matches_reference(case, window, p, seed, data):
    """Dropout with softcap, ALiBi and a sink together (the variants enter before the softmax,
    dropout after it), against the reference given the mask; dsink too."""
    variant = data.draw(variant_kwargs(case.batch, case.nheads))
    q, k, v, do = make_inputs(case)
    kwargs = dict(softmax_scale=case.softmax_scale, causal=case.causal, window_size=window, **variant)
    o, lse = cupyflash.flash_attn_func(q, k, v, dropout_p=p, seed=seed, return_lse=True, backend="numpy", **kwargs)
    grads = cupyflash.flash_attn_backward(do, q, k, v, o, lse, dropout_p=p, seed=seed, backend="numpy", **kwargs)
    keep = dropout_mask(case.batch, case.nheads, case.seqlen_q, case.seqlen_k, p, seed)
    dsink = grads[3] if "sink" in variant else None
    check_against_reference(case, window, q, k, v, do, o, lse, grads[:3],
                            {**variant, "dropout_p": p, "dropout_mask": keep}, dsink=dsink)

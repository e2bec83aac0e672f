"""flash_fwd_wgmma's persistent instances (sm_90 at d64 and d128: about one CTA per SM taking
query-block tiles in turn, each tile's last block loading the next tile's Q and first K, V)
against the same kernel on the grid of query blocks, bit for bit: a tile's arithmetic is the
grid kernel's, so every output must be the same bits, whatever tiles a CTA ran before it. NaN-
poisoned outputs, fresh random inputs. The shapes give each CTA many tiles (hundreds of tiles
on 132 or 264 CTAs), tiles whose rows see no key between tiles that do (causal with more
queries than keys, windows), GQA, and rows past the end of the last query block. The default
kernels' accuracy against the float64 reference: test_api_gpu.py and test_window_gpu.py, which
now run these instances.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from strategies import attention_case, make_inputs
from tolerance import SIXTEEN_BIT
from windows import window_size

pytestmark = pytest.mark.gpu


def _on_sm90():
    from cupyflash.kernels import mma_fwd

    if mma_fwd.current_arch() != "90":
        pytest.skip("the persistent forward is sm_90's (wgmma)")


def _forward(q, k, v, *, persistent: bool, causal: bool, window, scale: float):
    """(o, lse) as NumPy arrays from flash_fwd_wgmma with its tiles for this head dim, persistent
    or on the grid of query blocks."""
    import cupy

    from cupyflash.kernels import mma_fwd
    from cupyflash.plans import WgmmaFwdConfig

    batch, seqlen_q, nheads, headdim = q.shape
    block_n = 64 if mma_fwd.d_tile(headdim) == 64 else 128
    config = WgmmaFwdConfig(128, block_n, persistent=persistent)
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    o = cupy.full(q.shape, np.nan, q.dtype)
    lse = cupy.full((batch, nheads, seqlen_q), np.nan, np.float32)
    mma_fwd.forward(qd, kd, vd, o, lse, softmax_scale=scale, causal=causal, window_size=window, config=config)
    cupy.cuda.get_current_stream().synchronize()
    return o.get(), lse.get()


def _assert_same_bits(persistent, grid, what):
    for name, a, b in zip(("o", "lse"), persistent, grid):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{what}: {name} differs from the grid kernel's"
        assert not np.isnan(a.astype(np.float32)).any(), f"{what}: {name} has a poisoned (unwritten) entry"


def _inputs(rng, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim):
    q = rng.standard_normal((batch, seqlen_q, nheads, headdim)).astype(dtype)
    k, v = (rng.standard_normal((batch, seqlen_k, nheads_kv, headdim)).astype(dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("headdim", [64, 128])
@pytest.mark.parametrize("shape, causal, window", [
    ((4, 1000, 1000, 40, 8), False, (-1, -1)),  # 1280 tiles: ~10 per CTA at d128
    ((4, 1000, 1000, 40, 8), True, (-1, -1)),   # heaviest ranks first, rows past the last block
    ((3, 1100, 300, 24, 24), True, (-1, -1)),   # causal, more queries than keys: rows with no key
    ((2, 2048, 2048, 32, 4), True, (128, 0)),   # a causal window: short walks
    ((2, 1500, 1500, 16, 16), False, (300, 77)),
    ((2, 900, 1300, 16, 2), False, (0, 0)),     # the diagonal only
    ((2, 700, 700, 36, 12), False, (50, -1)),   # a left bound only
    ((5, 129, 129, 64, 64), True, (1, 0)),      # two query blocks, the second of one row
])
def test_persistent_forward_is_the_grid_kernel_bit_for_bit(headdim, shape, causal, window):
    _on_sm90()
    import ml_dtypes

    batch, seqlen_q, seqlen_k, nheads, nheads_kv = shape
    rng = np.random.default_rng(headdim * 1000 + seqlen_q)
    for dtype in (np.float16, ml_dtypes.bfloat16):
        q, k, v = _inputs(rng, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim)
        scale = 1.0 / np.sqrt(headdim)
        got = _forward(q, k, v, persistent=True, causal=causal, window=window, scale=scale)
        want = _forward(q, k, v, persistent=False, causal=causal, window=window, scale=scale)
        _assert_same_bits(got, want, f"{np.dtype(dtype).name} {shape} causal={causal} window={window}")


@given(attention_case(dtypes=tuple(SIXTEEN_BIT), max_cost=4e7).filter(
    lambda c: c.headdim % 8 == 0 and c.headdim <= 128), window_size(), st.booleans())
def test_persistent_forward_matches_the_grid_kernel(case, window, use_window):
    _on_sm90()
    q, k, v, _ = make_inputs(case)
    window = window if use_window else (-1, -1)
    got = _forward(q, k, v, persistent=True, causal=case.causal, window=window, scale=case.scale)
    want = _forward(q, k, v, persistent=False, causal=case.causal, window=window, scale=case.scale)
    _assert_same_bits(got, want, repr(case))

"""Defined edge cases, determinism, streams, threads and 64-bit offsets on the GPU (marker ``gpu``)."""
import threading

import ml_dtypes
import numpy as np
import pytest

import cupyflash
from cupyflash import reference
from cupyflash.kernels import _module
from cupyflash.testing import poisoned_outputs

from tolerance import assert_close, max_abs, output_rounding_allowance

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
FAMILIES = [("simt", np.float32), ("simt", np.float64), ("simt", BF16), ("mma", BF16), ("mma", np.float16)]
FAMILY_IDS = [f"{b}-{np.dtype(d).name}" for b, d in FAMILIES]
# float32's default: the tf32 tensor-core forward (on sm_90 at head dims up to 64 the wgmma
# producer kernel, tf32-wgmma-route) and, up to head dim 128, the tf32x3 backward (tf32x3-route). Not in test_huge_scores_stay_finite,
# whose bound (4 eps |s| max|v|) is float32's own rounding of the scores; the tf32 products' error
# is held to standard float32 attention's elsewhere (tests/test_tf32_gpu.py, tf32_accuracy.py).
EDGE_FAMILIES = FAMILIES + [("auto", np.float32)]
EDGE_FAMILY_IDS = FAMILY_IDS + ["auto-float32"]


def randn(shape, dtype, rng=None):
    import cupy

    rng = rng or np.random.default_rng()
    return cupy.asarray(rng.standard_normal(shape).astype(dtype))


def fwd_bwd(q, k, v, do, backend, causal=False, **kw):
    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_func(q, k, v, causal=causal, return_lse=True, backend=backend, **kw)
        grads = cupyflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal, backend=backend, **kw)
    return (o, lse, *grads)


@pytest.mark.parametrize("backend,dtype", EDGE_FAMILIES, ids=EDGE_FAMILY_IDS)
def test_repeated_runs_are_bitwise_identical(backend, dtype):
    shape_q, shape_kv = (2, 333, 4, 64), (2, 301, 2, 64)
    q, do = randn(shape_q, dtype), randn(shape_q, dtype)
    k, v = randn(shape_kv, dtype), randn(shape_kv, dtype)
    first = [x.get() for x in fwd_bwd(q, k, v, do, backend, causal=True)]
    for _ in range(100):
        again = fwd_bwd(q, k, v, do, backend, causal=True)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b.get())


@pytest.mark.parametrize("version,d", [("v1", 128), ("v3", 128), ("v4", 128), ("v6", 128), ("v6", 256),
                                       ("v7", 64), ("v7", 128), ("v9", 64), ("v9", 128),
                                       ("v10", 64), ("v10", 128), ("v10", 256)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_deterministic_dq_is_bitwise_reproducible_under_contention(version, d, causal, monkeypatch):
    # 16 to 32 key blocks add to every dQ block at once (v4 and v6 order the adds through
    # per-block counters; on an H200 v6 runs the wgmma kernels, here at every head dim, and v7
    # the wgmma kernel with fixed-point adds, here at d64 and d128, v9 the same into panel-major
    # rows; v10 computes dQ without adds, one CTA per query block); uneven lengths, GQA.
    from cupyflash.bench import tune
    from cupyflash.kernels import mma_bwd

    dev = tune.load_dev_backward()  # the versions are dev/mma_bwd.py's
    monkeypatch.setattr(dev, "WGMMA_ORDERED_D_TILES", mma_bwd.D_TILES)
    monkeypatch.setattr(dev, "WGMMA_FIXED_D_TILES", mma_bwd.WGMMA_FIXED_KERNEL_D_TILES)
    monkeypatch.setattr(dev, "WGMMA_PANEL_D_TILES", mma_bwd.WGMMA_FIXED_KERNEL_D_TILES)

    q, do = randn((2, 1999, 8, d), BF16), randn((2, 1999, 8, d), BF16)
    k, v = randn((2, 2011, 2, d), BF16), randn((2, 2011, 2, d), BF16)
    o, lse = cupyflash.flash_attn_func(q, k, v, causal=causal, return_lse=True, backend="mma")
    kwargs = dict(softmax_scale=d ** -0.5, causal=causal, version=version, deterministic=True)
    first = [cupy_empty_like(x) for x in (q, k, v)]
    mma_bwd.backward(do, q, k, v, o, lse, *first, **kwargs)
    first = [x.get() for x in first]
    assert all(np.isfinite(x.astype(np.float32)).all() for x in first)
    for _ in range(20):
        again = [cupy_empty_like(x) for x in (q, k, v)]
        mma_bwd.backward(do, q, k, v, o, lse, *again, **kwargs)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b.get())


def cupy_empty_like(x):
    import cupy

    return cupy.full(x.shape, np.nan, dtype=x.dtype)


@pytest.mark.parametrize("backend,dtype", EDGE_FAMILIES, ids=EDGE_FAMILY_IDS)
def test_fully_masked_rows_give_zero_output_minus_inf_lse_zero_grads(backend, dtype):
    # causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k query rows see no key
    q, do = randn((1, 150, 2, 32), dtype), randn((1, 150, 2, 32), dtype)
    k, v = randn((1, 40, 2, 32), dtype), randn((1, 40, 2, 32), dtype)
    o, lse, dq, dk, dv = (x.get() for x in fwd_bwd(q, k, v, do, backend, causal=True))
    blind = 150 - 40
    assert np.all(o[:, :blind].astype(np.float64) == 0)
    assert np.all(lse[:, :, :blind] == -np.inf)
    assert np.all(dq[:, :blind].astype(np.float64) == 0)
    assert np.all(np.isfinite(o[:, blind:].astype(np.float64)))
    assert np.all(np.isfinite(lse[:, :, blind:]))


@pytest.mark.parametrize("backend,dtype", EDGE_FAMILIES, ids=EDGE_FAMILY_IDS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(0, 17), (17, 0), (0, 0)])
def test_zero_length_sequences(backend, dtype, seqlen_q, seqlen_k):
    q, do = randn((2, seqlen_q, 2, 16), dtype), randn((2, seqlen_q, 2, 16), dtype)
    k, v = randn((2, seqlen_k, 1, 16), dtype), randn((2, seqlen_k, 1, 16), dtype)
    o, lse, dq, dk, dv = (x.get() for x in fwd_bwd(q, k, v, do, backend))
    assert o.shape == q.shape and lse.shape == (2, 2, seqlen_q)
    assert np.all(o.astype(np.float64) == 0) and np.all(lse == -np.inf)
    for g in (dq, dk, dv):
        assert np.all(g.astype(np.float64) == 0)


@pytest.mark.parametrize("backend,dtype", EDGE_FAMILIES, ids=EDGE_FAMILY_IDS)
@pytest.mark.parametrize("causal", [False, True])
# softcap: the tensor-core forwards' tanh clamps its argument, with a max / min that must keep NaN
# (score.cuh's tanh_rational; fmaxf / fminf would make the poisoned row finite)
@pytest.mark.parametrize("softcap", [0.0, 30.0], ids=["plain", "softcap"])
# a sink of -inf (no sink, as a value): the sink epilogue's row that weighs nothing finite
# (score.cuh's finish_row_log2) must keep a NaN row NaN too
@pytest.mark.parametrize("sink", [None, -np.inf], ids=["no_sink", "sink_neg_inf"])
def test_nan_in_a_query_row_stays_in_that_row(backend, dtype, causal, softcap, sink):
    import cupy

    q = randn((1, 100, 2, 64), dtype)
    k, v = randn((1, 100, 2, 64), dtype), randn((1, 100, 2, 64), dtype)
    q[0, 37, 1, 5] = np.nan
    sinks = None if sink is None else np.full(2, sink, np.float32)
    o = cupyflash.flash_attn_func(q, k, v, causal=causal, softcap=softcap, sink=sinks, backend=backend)
    o = o.get().astype(np.float64)
    bad = ~np.isfinite(o)
    assert bad[0, 37, 1].all(), "the poisoned row must be NaN"
    bad[0, 37, 1] = False
    assert not bad.any(), "NaN leaked into other rows"
    o_ref, _ = reference.attention(q.get(), k.get(), v.get(), causal=causal, softcap=softcap, sink=sinks)
    assert np.isnan(o_ref[0, 37, 1]).all()
    del cupy


@pytest.mark.parametrize("backend,dtype", FAMILIES, ids=FAMILY_IDS)
def test_huge_scores_stay_finite(backend, dtype):
    # scores around 1e4 in magnitude: a softmax without the running max would overflow
    q, k, v = (randn((1, 130, 2, 64), dtype) for _ in range(3))
    o, lse = cupyflash.flash_attn_func(q, k, v, softmax_scale=1000.0, return_lse=True, backend=backend)
    o64, lse64 = o.get().astype(np.float64), lse.get()
    assert np.isfinite(o64).all() and np.isfinite(lse64).all()
    assert np.abs(lse64).max() > 1e3
    o_ref, lse_ref = reference.attention(q.get(), k.get(), v.get(), softmax_scale=1000.0)
    # A score s is held to eps * |s| ~ 1e-3 in float32 here (1e-12 in float64), and the softmax
    # turns that into the same relative error of P: allow 4x eps * max|s| times max|v|.
    eps = np.finfo(np.float64 if np.dtype(dtype) == np.float64 else np.float32).eps
    score_max = float(np.abs(lse_ref).max())
    allowed = 4 * eps * score_max * float(np.abs(v.get().astype(np.float64)).max())
    if np.dtype(dtype) in (np.dtype(np.float16), BF16):
        o_std, _ = reference.standard_attention(q.get(), k.get(), v.get(), softmax_scale=1000.0, dtype=dtype)
        allowed += 2 * float(np.abs(o_std.astype(np.float64) - o_ref).max())
    assert np.abs(o64 - o_ref).max() <= allowed


@pytest.mark.parametrize("backend,dtype", EDGE_FAMILIES, ids=EDGE_FAMILY_IDS)
def test_a_row_does_not_depend_on_its_tile_position(backend, dtype):
    # shifting the query rows by one moves every row to another place in its tile
    q, k, v = randn((1, 200, 2, 64), dtype), randn((1, 180, 2, 64), dtype), randn((1, 180, 2, 64), dtype)
    full = cupyflash.flash_attn_func(q, k, v, backend=backend).get()
    shifted = cupyflash.flash_attn_func(q[:, 1:], k, v, backend=backend).get()
    np.testing.assert_array_equal(full[:, 1:], shifted)


@pytest.mark.parametrize("backend,dtype", EDGE_FAMILIES, ids=EDGE_FAMILY_IDS)
def test_non_blocking_stream(backend, dtype):
    import cupy

    q, k, v, do = (randn((2, 257, 4, 64), dtype) for _ in range(4))
    expected = [x.get() for x in fwd_bwd(q, k, v, do, backend)]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        results = fwd_bwd(q, k, v, do, backend)
        assert cupy.cuda.get_current_stream() == stream
    stream.synchronize()
    for a, b in zip(expected, results):
        np.testing.assert_array_equal(a, b.get())


def test_concurrent_first_calls_compile_once(monkeypatch):
    import cupy

    built = []
    real = cupy.RawModule

    def counting(*args, **kwargs):
        built.append(kwargs.get("name_expressions"))
        return real(*args, **kwargs)

    monkeypatch.setattr(cupy, "RawModule", counting)
    monkeypatch.setattr(_module, "_functions", {})
    rng = np.random.default_rng()
    q, k, v = (cupy.asarray(rng.standard_normal((1, 300, 2, 72)).astype(np.float32)) for _ in range(3))
    results, errors = [None] * 8, []

    def worker(i):
        try:
            results[i] = cupyflash.flash_attn_func(q, k, v, causal=True, backend="simt").get()
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(built) == 1, f"compiled {len(built)} times"
    for r in results[1:]:
        np.testing.assert_array_equal(results[0], r)


@pytest.mark.parametrize("backend,dtype", [("simt", BF16), ("mma", BF16)], ids=["simt", "mma"])
def test_offsets_beyond_2_pow_31_elements(backend, dtype):
    """Views into buffers of 2^31+ elements: the second batch starts past element 2^31."""
    import cupy

    nheads, headdim = 2, 64
    rows = 2**31 // (nheads * headdim) + 64
    assert rows * nheads * headdim > 2**31
    rng = np.random.default_rng()
    views = []
    for _ in range(3):
        buffer = cupy.empty((2, rows, nheads, headdim), dtype=dtype)
        view = buffer[:, -100:]  # the last rows of each batch, so batch 1 lies past 2^31 elements
        view[...] = cupy.asarray(rng.standard_normal(view.shape).astype(dtype))
        views.append(view)
    q, k, v = views
    do = randn(q.shape, dtype)
    o, lse, dq, dk, dv = fwd_bwd(q, k, v, do, backend, causal=True)
    qh, kh, vh, doh = (x.get() for x in (q, k, v, do))
    o_ref, _ = reference.attention(qh, kh, vh, causal=True)
    o_std, _ = reference.standard_attention(qh, kh, vh, causal=True, dtype=dtype)
    assert_close("o", o.get(), o_ref, o_std, dtype=dtype)
    refs = reference.attention_backward(doh, qh, kh, vh, causal=True)
    stds = reference.standard_attention_backward(doh, qh, kh, vh, causal=True, dtype=dtype)
    allowances = output_rounding_allowance(doh, qh, kh, vh, o.get(), o_ref, softmax_scale=None, causal=True)
    grad_scale = max(max_abs(r) for r in refs)
    for name, g, ref, std, atol in zip(("dq", "dk", "dv"), (dq, dk, dv), refs, stds, allowances):
        assert_close(name, g.get(), ref, std, dtype=dtype, factor=3.0, scale=grad_scale, atol=atol)


def test_torch_tensors_in_cupy_out():
    torch = pytest.importorskip("torch")
    import cupy

    q, k, v = (torch.randn(1, 64, 2, 32, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o = cupyflash.flash_attn_func(q, k, v)
    assert isinstance(o, cupy.ndarray)
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                           v.transpose(1, 2)).transpose(1, 2)
    diff = (torch.from_dlpack(o).float() - ref.float()).abs().max().item()
    assert diff < 2e-2

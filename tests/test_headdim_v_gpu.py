"""A V head dimension different from Q/K's (d_v != d_qk, DeepSeek MLA's 192/128) on every GPU kernel
family, against the float64 reference under tolerance.py's rule, NaN-poisoned outputs, fresh random
inputs: the SIMT kernels (float32, float64), the tensor-core kernels through backend='mma' (on
sm_90 the wgmma forward and backward where the plans pick them; deterministic and atomic dQ), the
sm_80 mma.sync kernels through their overrides (tests/kernel_paths.py), the decode path of
flash_attn_func (the KV-cache kernel), varlen, the KV cache (contiguous and paged), the score
variants and dropout, cupyflash.torch on CUDA tensors, and one bounded hypothesis property over
(d_qk, d_v) in [1, 256]. The problems and checks are tests/test_headdim_v.py's (CPU).

Cost: explicit cases of at most a few hundred tokens (one 2k MLA case per mask); the float64
reference runs on the host. Kernels are specialized by head-dim tile, not by head dim, so the
drawn head dims compile nothing new once the tiles are warm.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupyflash
from cupyflash.dropout import dropout_mask
from cupyflash.testing import poisoned_outputs
from kernel_paths import MMA_SYNC_BWD, SM80_FWD
from test_headdim_v import (BF16, F16, F32, F64, HEADDIM_PAIRS, PAIR_IDS, _as_host, check_against_reference,
                            check_kvcache, check_varlen, kvcache_inputs, problem, problems, varlen_inputs)

pytestmark = pytest.mark.gpu

# Pairs the tensor cores take without padding (multiples of 8), MLA's first.
MMA_PAIRS = [(192, 128), (128, 192), (64, 256), (256, 64), (40, 72), (8, 256), (128, 64)]
MLA = [(192, 128), (128, 192)]


def _ids(pairs):
    return [f"{a}-{b}" for a, b in pairs]


def on_device(*arrays):
    import cupy

    return tuple(None if x is None else cupy.asarray(x) for x in arrays)


def run_device(inputs, backend, deterministic=True, **options):
    """flash_attn_func and flash_attn_backward on CuPy copies of ``inputs`` (q, k, v, do), outputs
    poisoned; (o, lse, grads) as CuPy arrays."""
    import cupy

    q, k, v, do = on_device(*inputs)
    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_func(q, k, v, return_lse=True, backend=backend, **options)
        grads = cupyflash.flash_attn_backward(do, q, k, v, o, lse, backend=backend, deterministic=deterministic,
                                              **options)
    cupy.cuda.get_current_stream().synchronize()
    assert isinstance(o, cupy.ndarray) and all(isinstance(g, cupy.ndarray) for g in grads)
    return o, lse, grads


def _device_options(options):
    """The call's keywords with NumPy per-head arrays (slopes, sinks) as CuPy arrays."""
    import cupy

    return {name: cupy.asarray(x) if isinstance(x, np.ndarray) else x for name, x in options.items()}


def check_device(p, backend, deterministic=True, variant=None, dropout=None):
    """The public API on the device for problem ``p`` against the reference; returns (o, lse, grads)."""
    inputs = p.arrays()
    call = dict(p.kwargs, **(variant or {}))
    ref = dict(call)
    if dropout is not None:
        rate, seed = dropout
        call.update(dropout_p=rate, seed=seed)
        ref.update(dropout_p=rate, dropout_mask=dropout_mask(p.batch, p.nheads, p.seqlen_q, p.seqlen_k, rate, seed))
    o, lse, grads = run_device(inputs, backend, deterministic, **_device_options(call))
    with_sink = call.get("sink") is not None
    assert len(grads) == (4 if with_sink else 3)
    check_against_reference(inputs, o, lse, grads[:3], dtype=p.dtype, options=ref,
                            dsink=grads[3] if with_sink else None)
    return o, lse, grads


# --- SIMT: float32 and float64 ------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [F32, F64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("d_qk, d_v", HEADDIM_PAIRS, ids=PAIR_IDS)
def test_simt_matches_reference(d_qk, d_v, dtype, causal):
    check_device(problem(d_qk, d_v, dtype, seqlen_q=130, seqlen_k=201, causal=causal), "simt")


def test_simt_with_hidden_rows_and_a_window():
    """More queries than keys, causal (rows that see no key), then a sliding window, MQA."""
    check_device(problem(192, 128, F32, seqlen_q=150, seqlen_k=70, causal=True), "simt")
    check_device(problem(40, 72, F64, nheads_kv=1, group=4, seqlen_q=160, seqlen_k=170, window_size=(33, 7)), "simt")


# --- tensor cores: backend='mma' (wgmma on sm_90 where the plans say so) ---------------------------------

MMA_CASES = ([(pair, BF16, True, True) for pair in HEADDIM_PAIRS]
             + [(pair, BF16, False, False) for pair in HEADDIM_PAIRS]
             + [(pair, F16, causal, deterministic) for pair in MLA for causal in (False, True)
                for deterministic in (True, False)])


@pytest.mark.parametrize("pair, dtype, causal, deterministic", MMA_CASES,
                         ids=[f"{a}-{b}-{d.name}-{'causal' if c else 'full'}-{'det' if det else 'atomic'}"
                              for (a, b), d, c, det in MMA_CASES])
def test_mma_matches_reference(pair, dtype, causal, deterministic):
    """GQA, lengths off the tiles; (1, 3) runs the padded path (head dims not multiples of 8)."""
    d_qk, d_v = pair
    check_device(problem(d_qk, d_v, dtype, seqlen_q=300, seqlen_k=333, causal=causal), "mma",
                 deterministic=deterministic)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d_qk, d_v, seqlen", [(192, 128, 2048), (128, 192, 1024), (64, 256, 1024),
                                               (256, 64, 1024), (128, 64, 1024)],
                         ids=["192-128-2k", "128-192-1k", "64-256-1k", "256-64-1k", "128-64-1k"])
def test_mma_long_sequence_matches_reference(d_qk, d_v, seqlen, causal):
    """One long sequence in bfloat16: many blocks inside and across the mask, the plans' main tiles."""
    check_device(problem(d_qk, d_v, BF16, batch=1, seqlen_q=seqlen, seqlen_k=seqlen, causal=causal), "mma")


@pytest.mark.parametrize("d_qk, d_v", MLA + [(40, 72)], ids=_ids(MLA + [(40, 72)]))
def test_deterministic_mma_backward_is_bitwise_repeatable(d_qk, d_v):
    p = problem(d_qk, d_v, BF16, seqlen_q=257, seqlen_k=300, causal=True)
    first = run_device(p.arrays(), "mma", deterministic=True, **p.kwargs)
    again = run_device(p.arrays(), "mma", deterministic=True, **p.kwargs)
    for a, b in zip((first[0], first[1], *first[2]), (again[0], again[1], *again[2])):
        a, b = a.get(), b.get()
        assert np.array_equal(a.view(np.uint16) if a.itemsize == 2 else a, b.view(np.uint16) if b.itemsize == 2 else b)


@pytest.mark.parametrize("version, deterministic", MMA_SYNC_BWD)
@pytest.mark.parametrize("d_qk, d_v", MLA + [(64, 256), (128, 64)], ids=_ids(MLA + [(64, 256), (128, 64)]))
def test_mma_sync_kernels_match_reference(d_qk, d_v, version, deterministic):
    """flash_fwd_mma and the mma.sync backward (sm_80's kernels) through their overrides, on
    whatever device runs the test: the forward's tiles of the head-dim tile that holds both."""
    import cupy

    from cupyflash.kernels import mma_bwd, mma_fwd

    p = problem(d_qk, d_v, BF16, seqlen_q=200, seqlen_k=211, causal=True)
    q, k, v, do = inputs = p.arrays()
    qd, kd, vd, dod = on_device(q, k, v, do)
    tile = next(t for t in (64, 128, 256) if max(d_qk, d_v) <= t)
    o = cupy.full(p.o_shape, np.nan, BF16)
    lse = cupy.full((p.batch, p.nheads, p.seqlen_q), np.nan, np.float32)
    grads = [cupy.full(x.shape, np.nan, BF16) for x in (q, k, v)]
    mma_fwd.forward(qd, kd, vd, o, lse, softmax_scale=1 / np.sqrt(d_qk), causal=True,
                    config=mma_fwd.FwdConfig(**SM80_FWD[tile]))
    mma_bwd.backward(dod, qd, kd, vd, o, lse, *grads, softmax_scale=1 / np.sqrt(d_qk), causal=True,
                     deterministic=deterministic, version=version)
    cupy.cuda.get_current_stream().synchronize()
    check_against_reference(inputs, o, lse, grads, dtype=BF16, options=dict(causal=True))


# --- the decode path: seqlen_q = 1 in flash_attn_func runs the KV-cache kernel ------------------------

@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("d_qk, d_v", MMA_PAIRS, ids=_ids(MMA_PAIRS))
def test_decode_shaped_call_runs_the_kvcache_kernel(d_qk, d_v, group, monkeypatch):
    """One query token (GQA: up to 16 (query, head) rows per kv head) over 1000 keys: the forward
    comes from kvcache_mma.forward, and matches the reference; the backward too."""
    from cupyflash.kernels import kvcache_mma

    calls = []
    real = kvcache_mma.forward

    def spy(*args, **kwargs):
        calls.append(args[2].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(kvcache_mma, "forward", spy)
    p = problem(d_qk, d_v, BF16, batch=3, seqlen_q=1, seqlen_k=1000, nheads_kv=2, group=group, causal=True)
    check_device(p, "mma")
    assert calls and calls[0] == p.v_shape, "the decode-shaped forward did not run the KV-cache kernel with v"


@pytest.mark.parametrize("d_qk, d_v", [(1, 3), (40, 20)], ids=["1-3", "40-20"])
def test_decode_shaped_call_with_other_head_dims(d_qk, d_v):
    """Head dims the KV-cache kernel does not take (not multiples of 8): the dense kernels answer."""
    check_device(problem(d_qk, d_v, F16, batch=2, seqlen_q=1, seqlen_k=500, group=4), "mma")


# --- variants and dropout ---------------------------------------------------------------------------------

@pytest.mark.parametrize("backend, dtype", [("simt", F32), ("mma", BF16)], ids=["simt-fp32", "mma-bf16"])
@pytest.mark.parametrize("d_qk, d_v", MLA + [(40, 72)], ids=_ids(MLA + [(40, 72)]))
def test_softcap_alibi_and_sink(d_qk, d_v, backend, dtype):
    rng = np.random.default_rng(d_qk + d_v)
    p = problem(d_qk, d_v, dtype, seqlen_q=190, seqlen_k=260, causal=True, window_size=(100, -1))
    variant = dict(softcap=5.0, alibi_slopes=(2.0 ** (-8.0 * np.arange(1, 5) / 4)).astype(np.float32),
                   sink=(2 * rng.standard_normal(p.nheads)).astype(np.float32))
    check_device(p, backend, variant=variant)


@pytest.mark.parametrize("backend, dtype, deterministic", [("simt", F32, True), ("mma", BF16, True),
                                                           ("mma", BF16, False)],
                         ids=["simt-fp32", "mma-bf16-det", "mma-bf16-atomic"])
@pytest.mark.parametrize("d_qk, d_v", MLA + [(64, 256)], ids=_ids(MLA + [(64, 256)]))
def test_dropout(d_qk, d_v, backend, dtype, deterministic):
    """dropout_p with a seed against the reference given the mask cupyflash.dropout_mask (the NumPy
    twin of the kernels' Philox words) computes: a kernel whose mask differed in one element would
    miss the reference by that weight."""
    p = problem(d_qk, d_v, dtype, seqlen_q=150, seqlen_k=170, causal=True)
    check_device(p, backend, deterministic=deterministic, dropout=(0.25, 2**40 + d_qk))


# --- varlen ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend, dtype", [("simt", F32), ("simt", F64), ("mma", BF16), ("mma", F16)],
                         ids=["simt-fp32", "simt-fp64", "mma-bf16", "mma-fp16"])
@pytest.mark.parametrize("d_qk, d_v", [(192, 128), (128, 192), (40, 72), (1, 3)],
                         ids=["192-128", "128-192", "40-72", "1-3"])
def test_varlen_matches_reference(d_qk, d_v, backend, dtype):
    """One launch per kernel for the packed batch (sequences without queries or keys among them),
    every sequence against its dense reference."""
    inputs, sequences = varlen_inputs(d_qk, d_v, dtype, seed=d_qk * 3 + d_v)
    q, k, v, do = on_device(*inputs)
    cu_q, cu_k = on_device(*sequences[:2])
    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, *sequences[2:], causal=True, return_lse=True,
                                                  backend=backend)
        grads = cupyflash.flash_attn_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, *sequences[2:], causal=True,
                                                     backend=backend)
    check_varlen(inputs, sequences, o, lse, grads, dtype=dtype, causal=True)


# --- the KV cache ---------------------------------------------------------------------------------------

KVCACHE_CASES = ([(pair, BF16, page) for pair in MLA + [(64, 256), (40, 72)] for page in (None, 1, 16, 256)]
                 + [(pair, F32, page) for pair in MLA for page in (None, 16)])


@pytest.mark.parametrize("pair, dtype, page_size", KVCACHE_CASES,
                         ids=[f"{a}-{b}-{d.name}-{'rows' if page is None else f'page{page}'}"
                              for (a, b), d, page in KVCACHE_CASES])
def test_kvcache_appends_in_place_and_matches_reference(pair, dtype, page_size):
    """Contiguous and paged caches on the device (16-bit: the KV-cache kernel reading them in
    place; float32: per sequence), ragged lengths up to 700, one decode token per sequence with 8
    query heads per kv head, the append byte for byte."""
    d_qk, d_v = pair
    capacity = 768
    host = kvcache_inputs(d_qk, d_v, dtype, page_size, seqlen_q=1, seqlen_new=1, capacity=capacity,
                          seed=d_qk + d_v, cached=(5, 0, 700, 256), nheads=16, nheads_kv=2)
    before = _as_host(host)
    inputs = dict(zip(host, on_device(*host.values())))
    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_with_kvcache(**inputs, causal=True, return_lse=True)
    check_kvcache(before, inputs, o, lse, dtype=dtype, causal=True)


@pytest.mark.parametrize("d_qk, d_v", MLA, ids=_ids(MLA))
def test_kvcache_prefill_chunk(d_qk, d_v):
    """Several new tokens with several queries (a prefill chunk, causal within it), paged."""
    host = kvcache_inputs(d_qk, d_v, BF16, 16, seqlen_q=9, seqlen_new=9, capacity=256, seed=5,
                          cached=(0, 100, 200))
    before = _as_host(host)
    inputs = dict(zip(host, on_device(*host.values())))
    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_with_kvcache(**inputs, causal=True, return_lse=True)
    check_kvcache(before, inputs, o, lse, dtype=BF16, causal=True)


# --- cupyflash.torch on CUDA tensors --------------------------------------------------------------------

def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d_qk, d_v", MLA + [(40, 72)], ids=_ids(MLA + [(40, 72)]))
def test_torch_autograd_equals_cupyflash_bitwise(d_qk, d_v, causal):
    import cupy

    torch = _torch_cuda()
    from cupyflash.torch import flash_attn_func

    generator = torch.Generator(device="cuda").manual_seed(d_qk)
    shapes = [(2, 200, 8, d_qk), (2, 300, 2, d_qk), (2, 300, 2, d_v)]
    q, k, v = (torch.randn(s, generator=generator, device="cuda").to(torch.bfloat16).requires_grad_(True)
               for s in shapes)
    o, lse, _ = flash_attn_func(q, k, v, causal=causal, deterministic=True, return_attn_probs=True)
    assert o.shape == (2, 200, 8, d_v) and o.device == q.device
    do = torch.randn_like(o)
    o.backward(do)
    arrays = [cupy.from_dlpack(t.detach()) for t in (q, k, v)]
    o_ref, lse_ref = cupyflash.flash_attn_func(*arrays, causal=causal, return_lse=True)
    grads = cupyflash.flash_attn_backward(cupy.from_dlpack(do), *arrays, o_ref, lse_ref, causal=causal,
                                          deterministic=True)
    assert torch.equal(o.detach(), torch.from_dlpack(o_ref)) and torch.equal(lse.detach(), torch.from_dlpack(lse_ref))
    for name, t, g in zip("qkv", (q, k, v), grads):
        assert t.grad.shape == t.shape and torch.equal(t.grad, torch.from_dlpack(g)), f"d{name} differs"
    check_against_reference([x.get() for x in (*arrays, cupy.from_dlpack(do))], o_ref, lse_ref, grads, dtype=BF16,
                            options=dict(causal=causal))


@pytest.mark.parametrize("d_qk, d_v", [(3, 5), (8, 16)], ids=["3-5", "8-16"])
def test_torch_gradcheck_float64_on_cuda(d_qk, d_v):
    """float64 SIMT kernels through autograd, the output's and the lse's gradients."""
    torch = _torch_cuda()
    from cupyflash.torch import flash_attn_func

    generator = torch.Generator(device="cuda").manual_seed(1)
    shapes = [(1, 5, 4, d_qk), (1, 7, 2, d_qk), (1, 7, 2, d_v)]
    q, k, v = (torch.randn(s, generator=generator, device="cuda", dtype=torch.float64).requires_grad_(True)
               for s in shapes)
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attn_func(q, k, v, causal=True), (q, k, v))
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[1], (q, k, v))


# --- one bounded property over any (d_qk, d_v) ------------------------------------------------------------

@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(problems(max_seqlen=400, max_cost=4e7), st.booleans(), st.booleans())
def test_property_any_headdims_on_the_default_kernels(p, deterministic, no_window):
    """backend 'auto': the plans' kernels (tensor cores for 16-bit; for float32 the tf32 forward and
    tf32x3 backward, for float64 DMMA, up to d128; SIMT past it), padded where a head dim is not a
    multiple of 8; masks, windows, GQA and scales drawn."""
    if no_window:  # half the examples without a window, so that long unmasked rows are common
        p = replace(p, window_size=(-1, -1))
    check_device(p, "auto", deterministic=deterministic)

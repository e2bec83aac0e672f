"""Calls without host synchronisation and inside CUDA-graph capture (cupyflash.capture), on the GPU.

- no_host_sync(): varlen (device cu_seqlens, the grid from max_seqlen) and the KV cache (device
  cache_seqlens / block_table / cache_batch_idx, the append a device scatter, the grid from the
  capacity) against the float64 reference and, for the caches, byte for byte; nothing is read
  back (a read would raise inside a capture, which the graph tests below make);
- cupy.cuda.Graph: a dense forward + backward, a varlen forward + backward and a decode step of
  several layers with appends captured once and replayed over new inputs and growing lengths
  written in place, each replay against an eager call on the same values (bitwise where the
  kernels and their grid are the same, the tolerance rule otherwise), with the default pool's
  memory churned between replays (a captured call's memory is its own);
- the errors: host index arrays under capture, the per-sequence paths under no_host_sync().
Marker ``gpu``."""
from __future__ import annotations

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings

import cupyflash
from cupyflash.testing import KVCacheProblem, assert_varlen_close, poisoned_outputs
from cupyflash.testing.strategies import kvcache_problems, varlen_problems
from kvcache_checks import assert_call_result, assert_same_bytes

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
SIXTEEN_BIT = [np.dtype(np.float16), BF16]
EXAMPLES = 40
GPU_COST = 8e6


def _device(inputs):
    import cupy

    return {name: x if x is None or np.ndim(x) == 0 else cupy.asarray(x) for name, x in inputs.items()}


def _churn(cupy):
    """Allocate, fill and free from the default pool: a captured call's memory must not be among it."""
    blocks = [cupy.full(n, 7.0, np.float32) for n in (1 << 10, 1 << 16, 1 << 20, 1 << 22)]
    del blocks


class Sentinels:
    """Blocks of the default pool allocated after a capture and kept across its replays, filled with
    one byte: had the captured calls' memory gone back to that pool, some of these would be handed
    it, and a replay would overwrite them."""

    SIZES = tuple(1 << e for e in range(8, 25, 2))

    def __init__(self, cupy):
        self.blocks = [cupy.full(n, 0x5A, np.uint8) for n in self.SIZES for _ in range(4)]

    def intact(self) -> bool:
        return all(bool((b == 0x5A).all()) for b in self.blocks)


# --- no_host_sync -----------------------------------------------------------------------------------

@settings(max_examples=EXAMPLES)
@given(problem=varlen_problems(dtypes=SIXTEEN_BIT + [np.dtype(np.float32)], max_seqlen=300, max_cost=GPU_COST,
                               windows=True))
def test_varlen_without_host_reads_matches_the_reference(problem):
    import cupy

    q, k, v, do = (cupy.asarray(x) for x in problem.arrays())
    cu_q, cu_k, max_q, max_k = problem.sequences
    cu_q, cu_k = cupy.asarray(cu_q), cupy.asarray(cu_k)
    slack = problem.seed % 3  # a max_seqlen above the longest sequence sizes a larger grid
    with poisoned_outputs(), cupyflash.no_host_sync():
        o, lse = cupyflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q + slack, max_k + slack, return_lse=True,
                                                  **problem.kwargs)
        grads = cupyflash.flash_attn_varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, max_q + slack, max_k + slack,
                                                     **problem.kwargs)
    assert_varlen_close(problem, o.get(), lse.get(), [g.get() for g in grads])


def test_varlen_without_host_reads_equals_the_checked_call_bitwise():
    import cupy

    lengths = [0, 1, 129, 77, 300]
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    rng = np.random.default_rng(3)
    q, k, v, do = (cupy.asarray(rng.standard_normal((sum(lengths), 4, 64)).astype(BF16)) for _ in range(4))
    for causal in (False, True):
        checked = cupyflash.flash_attn_varlen_vjp(q, k, v, cu, cu, 300, 300, causal=causal)
        with cupyflash.no_host_sync():
            unread = cupyflash.flash_attn_varlen_vjp(q, k, v, cu, cu, 512, 512, causal=causal)
            grads = unread[1](do)
        for a, b in zip((checked[0], *checked[1](do)), (unread[0], *grads)):
            assert (a.view(np.uint16) == b.view(np.uint16)).all()


def _kvcache_check(problem: KVCacheProblem):
    before = problem.inputs()
    inputs = _device(problem.inputs())
    with poisoned_outputs(), cupyflash.no_host_sync():
        o, lse = cupyflash.flash_attn_with_kvcache(**inputs, return_softmax_lse=True, **problem.kwargs)
    assert_call_result(problem, before, inputs, o, lse)


@settings(max_examples=EXAMPLES)
@given(problem=kvcache_problems(dtypes=SIXTEEN_BIT, windows=True, max_capacity=1100, max_new=8, max_seqlen_q=8,
                                max_headdim=256, max_group=8, max_cost=GPU_COST).filter(lambda p: p.headdim % 8 == 0))
def test_kvcache_without_host_reads_appends_and_matches_the_reference(problem):
    _kvcache_check(problem)


@pytest.mark.parametrize("page_size", [None, 1, 7, 16, 256])
def test_kvcache_without_host_reads_every_layout(page_size):
    capacity = 512 if page_size is None else -(-512 // page_size) * page_size
    base = KVCacheProblem(cache_seqlens=(5, 0, 300, 77), seqlen_q=1, seqlen_new=1, capacity=capacity,
                          page_size=page_size, spare=5, shuffle=True, nheads_kv=2, group=4, headdim=128, causal=True,
                          softmax_scale=None, magnitude=1.0, dtype=BF16, seed=17)
    for problem in (base, replace(base, seqlen_new=3, seqlen_q=3), replace(base, shuffle=False),
                    replace(base, cache_seqlens=(40, 40, 40, 40), seqlens_as_int=True)):
        _kvcache_check(problem)


# --- CUDA graphs --------------------------------------------------------------------------------

def _capture(fn):
    """(graph, outputs) of fn() captured on a fresh non-blocking stream, after one eager warm-up
    inside no_host_sync() (the captured path's kernels compiled and loaded outside the capture)."""
    import cupy

    with cupyflash.no_host_sync():
        fn()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            outputs = fn()
        finally:
            graph = stream.end_capture()
    return graph, outputs, stream


def _replay(graph, stream):
    """graph replayed on its non-blocking stream after the current stream's work (the new inputs
    written into the captured buffers, _churn), then waited for. A non-blocking stream is not
    ordered after the legacy default stream: without the event a replay may read inputs that are
    still being written."""
    import cupy

    stream.wait_event(cupy.cuda.get_current_stream().record())
    graph.launch(stream)
    stream.synchronize()


def _same_bits(a, b):
    a, b = a.get(), b.get()
    return a.shape == b.shape and (a.view(np.uint8) == b.view(np.uint8)).all()


def test_dense_forward_and_backward_replay_in_a_graph():
    import cupy

    rng = np.random.default_rng(5)
    shape = (2, 300, 8, 128)
    q, k, v, do = (cupy.asarray(rng.standard_normal(shape).astype(BF16)) for _ in range(4))

    def step():
        o, lse = cupyflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
        return (o, lse, *cupyflash.flash_attn_backward(do, q, k, v, o, lse, causal=True))

    graph, captured, stream = _capture(step)
    sentinels = Sentinels(cupy)
    for trial in range(3):
        for x in (q, k, v, do):  # new inputs, written into the captured buffers
            x[...] = cupy.asarray(rng.standard_normal(shape).astype(BF16))
        _churn(cupy)
        _replay(graph, stream)
        assert sentinels.intact(), trial
        for got, want in zip(captured, step()):
            assert _same_bits(got, want), trial


def test_varlen_forward_and_backward_replay_in_a_graph():
    import cupy

    rng = np.random.default_rng(6)
    total, heads, dim = 900, 4, 64
    q, k, v, do = (cupy.asarray(rng.standard_normal((total, heads, dim)).astype(BF16)) for _ in range(4))
    cu = cupy.asarray(np.array([0, 100, 350, 900], np.int32))

    def step():
        o, lse = cupyflash.flash_attn_varlen_func(q, k, v, cu, cu, 600, 600, causal=True, return_lse=True)
        return (o, lse, *cupyflash.flash_attn_varlen_backward(do, q, k, v, o, lse, cu, cu, 600, 600, causal=True))

    graph, captured, stream = _capture(step)
    sentinels = Sentinels(cupy)
    for cuts in ([0, 100, 350, 900], [0, 600, 601, 900], [0, 0, 300, 900]):  # other sequences, same total
        cu[...] = cupy.asarray(np.array(cuts, np.int32))
        q[...] = cupy.asarray(rng.standard_normal((total, heads, dim)).astype(BF16))
        _churn(cupy)
        _replay(graph, stream)
        assert sentinels.intact(), cuts
        for got, want in zip(captured, step()):
            assert _same_bits(got, want), cuts


def test_decode_step_of_several_layers_replays_with_growing_caches():
    """A decode step as a model makes it: per layer one token appended to a paged cache and attended,
    the lengths advanced on the device at the end of the step. Captured once and replayed while the
    sequences grow; each replay against eager calls on a mirror of the caches (the same pages),
    made under no_host_sync() so that they run the captured path (its grid from the capacity) and
    must agree bit for bit; that path against the reference: the properties above."""
    import cupy

    layers, batch, heads_kv, group, dim, page = 3, 4, 2, 4, 128, 16
    pages_per_seq = 20
    rng = np.random.default_rng(7)
    num_pages = batch * pages_per_seq + 3
    table = cupy.asarray(rng.permutation(num_pages)[: batch * pages_per_seq].reshape(batch, pages_per_seq)
                         .astype(np.int32))
    caches = [[cupy.asarray(rng.standard_normal((num_pages, page, heads_kv, dim)).astype(BF16)) for _ in range(2)]
              for _ in range(layers)]
    mirror = [[c.copy() for c in pair] for pair in caches]
    seqlens = cupy.asarray(np.array([0, 5, 130, 299], np.int32))
    seqlens_mirror = seqlens.copy()
    q = cupy.empty((layers, batch, 1, heads_kv * group, dim), BF16)
    kv = cupy.empty((layers, 2, batch, 1, heads_kv, dim), BF16)

    def step(caches, lengths):
        outputs = [cupyflash.flash_attn_with_kvcache(q[layer], caches[layer][0], caches[layer][1], kv[layer, 0],
                                                     kv[layer, 1], cache_seqlens=lengths, block_table=table,
                                                     causal=True, return_lse=True) for layer in range(layers)]
        lengths += 1
        return outputs

    q[...] = cupy.asarray(rng.standard_normal(q.shape).astype(BF16))
    kv[...] = cupy.asarray(rng.standard_normal(kv.shape).astype(BF16))
    # The warm-up step runs on the real caches; the mirror takes the same step.
    with cupyflash.no_host_sync():
        step(mirror, seqlens_mirror)
    graph, captured, stream = _capture(lambda: step(caches, seqlens))
    cupy.cuda.get_current_stream().synchronize()
    sentinels = Sentinels(cupy)
    for trial in range(4):
        q[...] = cupy.asarray(rng.standard_normal(q.shape).astype(BF16))
        kv[...] = cupy.asarray(rng.standard_normal(kv.shape).astype(BF16))
        _churn(cupy)
        _replay(graph, stream)
        assert sentinels.intact(), trial
        with cupyflash.no_host_sync():
            expected = step(mirror, seqlens_mirror)
        for (o, lse), (o_want, lse_want) in zip(captured, expected):
            assert _same_bits(o, o_want) and _same_bits(lse, lse_want), trial
        assert (seqlens == seqlens_mirror).all()
    for pair, pair_mirror in zip(caches, mirror):
        for c, m in zip(pair, pair_mirror):
            assert_same_bytes("cache", c.get(), m.get())


def test_contiguous_cache_rows_and_an_int_length_replay_in_a_graph():
    """A contiguous cache addressed through a device cache_batch_idx, and an int cache_seqlens
    (every replay appends at that position): replays against eager no_host_sync calls on a mirror."""
    import cupy

    rng = np.random.default_rng(10)
    batch, rows, capacity, heads_kv, group, dim = 3, 6, 320, 2, 4, 128
    caches = [cupy.asarray(rng.standard_normal((rows, capacity, heads_kv, dim)).astype(BF16)) for _ in range(2)]
    mirror = [c.copy() for c in caches]
    row_of = cupy.asarray(np.array([4, 0, 2], np.int32))
    q = cupy.empty((batch, 2, heads_kv * group, dim), BF16)
    kv = cupy.empty((2, batch, 2, heads_kv, dim), BF16)

    def step(pair):
        return cupyflash.flash_attn_with_kvcache(q, pair[0], pair[1], kv[0], kv[1], cache_seqlens=100,
                                                 cache_batch_idx=row_of, causal=True, return_lse=True)

    def fill():
        q[...] = cupy.asarray(rng.standard_normal(q.shape).astype(BF16))
        kv[...] = cupy.asarray(rng.standard_normal(kv.shape).astype(BF16))

    _check_replays(step, fill, caches, mirror, trials=3)


def _check_replays(step, fill, caches, mirror, trials, after=lambda: True):
    """step(pair of caches) captured on ``caches`` (its warm-up step taken on ``mirror`` too), then
    replayed ``trials`` times, each after fill() writes new inputs, against an eager no_host_sync
    step on the mirror: the outputs bit for bit, after() true; at the end the caches byte for byte."""
    import cupy

    fill()
    with cupyflash.no_host_sync():
        step(mirror)
    graph, captured, stream = _capture(lambda: step(caches))
    sentinels = Sentinels(cupy)
    for trial in range(trials):
        fill()
        _replay(graph, stream)
        with cupyflash.no_host_sync():
            expected = step(mirror)
        assert sentinels.intact(), trial
        assert all(_same_bits(a, b) for a, b in zip(captured, expected)), trial
        assert after(), trial
    for c, m in zip(caches, mirror):
        assert_same_bytes("cache", c.get(), m.get())


def test_a_decode_step_with_rotary_and_leftpad_replays_with_growing_caches():
    """Rotary embeddings (positions from the device lengths) and left-padded sequences in a captured
    decode step: replays while the sequences grow, against eager no_host_sync calls on a mirror,
    bit for bit, the caches too."""
    import cupy

    rng = np.random.default_rng(12)
    batch, capacity, heads_kv, group, dim = 3, 256, 2, 4, 128
    caches = [cupy.asarray(rng.standard_normal((batch, capacity, heads_kv, dim)).astype(BF16)) for _ in range(2)]
    mirror = [c.copy() for c in caches]
    theta = rng.uniform(0, 2 * np.pi, (capacity, dim // 4))
    cos, sin = (cupy.asarray(f(theta).astype(BF16)) for f in (np.cos, np.sin))
    leftpad = cupy.asarray(np.array([0, 7, 30], np.int32))
    seqlens = cupy.asarray(np.array([10, 40, 31], np.int32))
    seqlens_mirror = seqlens.copy()
    q = cupy.empty((batch, 1, heads_kv * group, dim), BF16)
    kv = cupy.empty((2, batch, 1, heads_kv, dim), BF16)

    def step(pair):
        lengths = seqlens if pair is caches else seqlens_mirror
        out = cupyflash.flash_attn_with_kvcache(q, pair[0], pair[1], kv[0], kv[1], cache_seqlens=lengths,
                                                cache_leftpad=leftpad, rotary_cos=cos, rotary_sin=sin,
                                                rotary_interleaved=False, causal=True, return_lse=True)
        lengths += 1
        return out

    def fill():
        q[...] = cupy.asarray(rng.standard_normal(q.shape).astype(BF16))
        kv[...] = cupy.asarray(rng.standard_normal(kv.shape).astype(BF16))

    _check_replays(step, fill, caches, mirror, trials=3, after=lambda: bool((seqlens == seqlens_mirror).all()))


# --- errors ---------------------------------------------------------------------------------------

def test_host_arrays_and_the_numpy_backend_are_refused_under_capture():
    import cupy

    rng = np.random.default_rng(11)
    x = rng.standard_normal((1, 64, 2, 64)).astype(BF16)
    dev = cupy.asarray(x)
    cupyflash.flash_attn_func(dev, dev, dev)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            with pytest.raises(ValueError, match="q is a host array"):
                cupyflash.flash_attn_func(x, dev, dev)
            with pytest.raises(ValueError, match="backend='numpy'"):
                cupyflash.flash_attn_func(dev, dev, dev, backend="numpy")
        finally:
            stream.end_capture()


def test_host_index_arrays_cannot_be_captured():
    import cupy

    rng = np.random.default_rng(8)
    q, k, v = (cupy.asarray(rng.standard_normal((200, 2, 64)).astype(BF16)) for _ in range(3))
    cu = np.array([0, 50, 200], np.int32)
    cupyflash.flash_attn_varlen_func(q, k, v, cu, cu, 150, 150)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            with pytest.raises(ValueError, match="cannot be captured"):
                cupyflash.flash_attn_varlen_func(q, k, v, cu, cu, 150, 150)
        finally:
            stream.end_capture()


def test_sequence_by_sequence_paths_refuse_unread_lengths():
    import cupy

    rng = np.random.default_rng(9)
    cache = cupy.asarray(rng.standard_normal((2, 64, 1, 32)).astype(np.float32))
    q = cupy.asarray(rng.standard_normal((2, 1, 1, 32)).astype(np.float32))
    with cupyflash.no_host_sync(), pytest.raises(ValueError, match="needs cache_seqlens"):
        cupyflash.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=cupy.asarray(np.array([3, 9], np.int32)))
    x = cupy.asarray(rng.standard_normal((20, 2, 32)).astype(BF16))
    cu = cupy.asarray(np.array([0, 5, 20], np.int32))
    with cupyflash.no_host_sync(), pytest.raises(ValueError, match="needs cu_seqlens on the host"):
        cupyflash.flash_attn_varlen_func(x.get(), x.get(), x.get(), cu, cu, 15, 15, backend="numpy")

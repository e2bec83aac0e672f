"""Context parallelism on a GPU: the merge kernel against its NumPy twin, and the ring schedule on
one GPU (LocalRing over CuPy: P "ranks" with their own compute and copy streams, transfers as
device copies ordered by events, the same code that runs over NCCL) against the float64 reference
under the ring's rule (tests/ring_check.py) and against flash_attn_func / flash_attn_backward on
the whole sequence. NCCL itself: one process (the launcher, the communicator, no transfer), and
two processes on two GPUs (skipped with fewer). Outputs start as NaN (poisoned). Marked ``gpu``."""
from __future__ import annotations


import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings

import cupyflash
from cupyflash.distributed import (LocalRing, launch, ring_flash_attn_backward, ring_flash_attn_func, zigzag_shard,
                                   zigzag_unshard)
from cupyflash.merge import merge_attention_states, merge_attention_states_numpy
from cupyflash.testing import AttentionProblem, assert_attention_close, poisoned_outputs

import distributed_workers
from ring_check import assert_ring_close, shard_functions
from test_distributed import BF16, F16, F32, F64, merge_inputs, ring_problems

pytestmark = pytest.mark.gpu


def _cupy():
    import cupy

    return cupy


# --- the merge kernel ------------------------------------------------------------------------------


def assert_kernel_matches_twin(o, lse, o_twin, lse_twin, out_dtype, scale):
    """The kernel and the twin take the same steps; exp2/log2 and FMA contraction differ by a few
    float32 ulps, which can move o across one rounding boundary of its dtype."""
    acc_eps = float(np.finfo(F64 if out_dtype == F64 else F32).eps)
    out_eps = float(ml_dtypes.finfo(out_dtype).eps)
    lse, o = lse.get(), o.get()
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(lse_twin))
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_twin))
    finite = np.isfinite(lse_twin)
    np.testing.assert_allclose(lse[finite], lse_twin[finite], rtol=8 * acc_eps, atol=8 * acc_eps)
    np.testing.assert_array_equal(lse[~finite], lse_twin[~finite])  # -inf, +inf and NaN where the twin has them
    np.testing.assert_array_equal(np.isnan(o.astype(np.float64)), np.isnan(o_twin.astype(np.float64)))
    np.testing.assert_allclose(o.astype(np.float64), o_twin.astype(np.float64), rtol=0,
                               atol=(16 * acc_eps + out_eps) * scale)


@settings(max_examples=100)
@given(merge_inputs())
def test_the_merge_kernel_matches_its_twin(inputs):
    cupy = _cupy()
    o_a, lse_a, o_b, lse_b = inputs
    out = cupy.full(o_a.shape, np.nan, o_a.dtype)  # every element must be written
    lse_out = cupy.full(lse_a.shape, np.nan, lse_a.dtype)
    o, lse = merge_attention_states(*(cupy.asarray(x) for x in inputs), out=out, lse_out=lse_out)
    assert o is out and lse is lse_out
    o_twin, lse_twin = merge_attention_states_numpy(o_a, lse_a, o_b, lse_b)
    scale = max(float(np.abs(x.astype(np.float64)).max()) for x in (o_a, o_b))
    assert_kernel_matches_twin(o, lse, o_twin, lse_twin, o_a.dtype, scale)


def test_the_merge_kernel_edge_cases_and_in_place_strided_rows():
    cupy = _cupy()
    inf, nan = np.inf, np.nan
    lse_a = np.array([[[-inf, -inf, 2.0, 0.0, nan, 0.0, inf, -200.0]]], np.float32)
    lse_b = np.array([[[-inf, 1.0, -inf, nan, 0.0, -inf, 0.0, 0.0]]], np.float32)
    o_a = np.full((1, 8, 1, 40), 3.0, np.float32)
    o_b = np.full((1, 8, 1, 40), 5.0, BF16)
    o_a[0, 1] = nan
    o_b[0, 2] = nan
    o_a[0, 7] = nan
    o, lse = merge_attention_states(*(cupy.asarray(x) for x in (o_a, lse_a, o_b, lse_b)))
    o_twin, lse_twin = merge_attention_states_numpy(o_a, lse_a, o_b, lse_b)
    np.testing.assert_array_equal(o.get(), o_twin)  # exact here: weights are 0 or 1, or NaN
    np.testing.assert_array_equal(lse.get(), lse_twin)

    rng = np.random.default_rng(5)
    o_acc = rng.standard_normal((2, 300, 3, 200)).astype(np.float32)  # headdim 200: lanes loop
    lse_acc = rng.standard_normal((2, 3, 300)).astype(np.float32)
    o_part = rng.standard_normal((2, 150, 3, 200)).astype(BF16)
    lse_part = rng.standard_normal((2, 3, 150)).astype(np.float32) * 5
    twin = merge_attention_states_numpy(o_acc[:, 150:], lse_acc[:, :, 150:], o_part, lse_part)
    o_gpu, lse_gpu = cupy.asarray(o_acc), cupy.asarray(lse_acc)
    rows, lse_rows = o_gpu[:, 150:], lse_gpu[:, :, 150:]
    merge_attention_states(rows, lse_rows, cupy.asarray(o_part), cupy.asarray(lse_part), out=rows, lse_out=lse_rows)
    np.testing.assert_array_equal(o_gpu[:, :150].get(), o_acc[:, :150])  # rows outside the view: untouched
    np.testing.assert_array_equal(lse_gpu[:, :, :150].get(), lse_acc[:, :, :150])
    assert_kernel_matches_twin(rows, lse_rows, *twin, np.dtype(np.float32), 5.0)


# --- the ring on one GPU -------------------------------------------------------------------------


def run_gpu_ring(problem, size, layout, *, overlap=True, backend="auto", deterministic=True, softcap=0.0):
    """(o, lse, dq, dk, dv) of the whole sequence (CuPy), from a LocalRing of ``size`` ranks on
    this GPU, outputs poisoned."""
    cupy = _cupy()
    shard, unshard = shard_functions(layout)
    q_s, k_s, v_s, do_s = ([cupy.asarray(s) for s in shard(x, size)] for x in problem.arrays())
    options = dict(softmax_scale=problem.softmax_scale, causal=problem.causal, window_size=problem.window_size,
                   softcap=softcap, layout=layout, backend=backend, overlap=overlap)

    def rank_main(comm):
        r = comm.rank
        o, lse = ring_flash_attn_func(q_s[r], k_s[r], v_s[r], comm=comm, return_lse=True, **options)
        grads = ring_flash_attn_backward(do_s[r], q_s[r], k_s[r], v_s[r], o, lse, comm=comm,
                                         deterministic=deterministic, **options)
        return (o, lse, *grads)

    with poisoned_outputs():
        per_rank = LocalRing(size, cupy).run(rank_main)
    return tuple(unshard([result[i] for result in per_rank], axis=2 if i == 1 else 1) for i in range(5))


def whole_sequence(problem, backend="auto", softcap=0.0):
    """flash_attn_func and flash_attn_backward on the whole sequence, on this GPU."""
    cupy = _cupy()
    q, k, v, do = (cupy.asarray(x) for x in problem.arrays())
    with poisoned_outputs():
        o, lse = cupyflash.flash_attn_func(q, k, v, return_lse=True, backend=backend, softcap=softcap,
                                           **problem.kwargs)
        grads = cupyflash.flash_attn_backward(do, q, k, v, o, lse, backend=backend, softcap=softcap,
                                              **problem.kwargs)
    return (o, lse, *grads)


def problem_of(dtype, causal, *, seqlen=512, headdim=128, seed=0, window_size=(-1, -1)):
    return AttentionProblem(batch=2, seqlen_q=seqlen, seqlen_k=seqlen, nheads_kv=2, group=2, headdim=headdim,
                            causal=causal, softmax_scale=None, magnitude=1.0, dtype=dtype, seed=seed,
                            window_size=window_size)


# (causal, window_size, softcap): the bars' mask, and windows narrower and wider than a chunk
# (512 rows: 64 to 128 a chunk), one side unbounded, with and without a cap.
MASKS = {"full": (False, (-1, -1), 0.0), "causal": (True, (-1, -1), 0.0), "causal_softcap": (True, (-1, -1), 30.0),
         "window_40_0": (False, (40, 0), 0.0), "window_100_7_softcap": (False, (100, 7), 5.0),
         "causal_window_200": (True, (200, -1), 0.0)}


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_one_gpu_ring_matches_the_whole_sequence(dtype, mask, size):
    causal, window, softcap = MASKS[mask]
    problem = problem_of(dtype, causal, window_size=window)
    layout = "contiguous" if mask == "full" else "zigzag"
    ring = run_gpu_ring(problem, size, layout, softcap=softcap)
    whole = whole_sequence(problem, softcap=softcap)
    assert_ring_close(problem, size, layout, ring[0], ring[1], ring[2:], softcap=softcap)
    if not softcap:
        assert_attention_close(problem, whole[0], whole[1], whole[2:])
    # The two differ by the ring's roundings only: far less than either's error against float64
    # in 16-bit (the rule above), and float32 noise in float32.
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), ring, whole):
        a, b = a.get().astype(np.float64), b.get().astype(np.float64)
        tolerance = (4e-2 if problem.dtype in (BF16, F16) else 1e-4) * (1 + np.abs(b).max())
        assert np.abs(a - b).max() <= tolerance, (name, float(np.abs(a - b).max()), tolerance)


@settings(max_examples=30)
@given(ring_problems(dtypes=(BF16, F16, F32), min_ranks=2, headdims=(64, 128)))  # few kernels to compile
def test_the_one_gpu_ring_matches_the_reference(case):
    problem, size, layout, softcap = case
    o, lse, *grads = run_gpu_ring(problem, size, layout, softcap=softcap)
    assert_ring_close(problem, size, layout, o, lse, grads, softcap=softcap)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_one_gpu_ring_with_a_sink_matches_the_whole_sequence(dtype):
    """Sinks with a causal window: o, lse, gradients and the ranks' dsink shares summed against one
    call on the whole sequence (float32 noise; 16-bit: the ring's roundings, as above)."""
    cupy = _cupy()
    problem = problem_of(dtype, True, window_size=(150, 0))
    sink = np.random.default_rng(3).standard_normal(problem.nheads).astype(np.float32) * 2
    q, k, v, do = (cupy.asarray(x) for x in problem.arrays())
    size = 2
    q_s, k_s, v_s, do_s = (zigzag_shard(x, size) for x in (q, k, v, do))
    options = dict(softmax_scale=problem.softmax_scale, causal=True, window_size=(150, 0), sink=cupy.asarray(sink))

    def rank_main(comm):
        r = comm.rank
        o, lse = ring_flash_attn_func(q_s[r], k_s[r], v_s[r], comm=comm, return_lse=True, **options)
        return (o, lse, *ring_flash_attn_backward(do_s[r], q_s[r], k_s[r], v_s[r], o, lse, comm=comm, **options))

    with poisoned_outputs():
        per_rank = LocalRing(size, cupy).run(rank_main)
        ring = [zigzag_unshard([result[i] for result in per_rank], axis=2 if i == 1 else 1) for i in range(5)]
        ring.append(sum(result[5] for result in per_rank))
        o, lse = cupyflash.flash_attn_func(q, k, v, return_lse=True, **options)
        whole = [o, lse, *cupyflash.flash_attn_backward(do, q, k, v, o, lse, **options)]
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv", "dsink"), ring, whole):
        a, b = a.get().astype(np.float64), b.get().astype(np.float64)
        tolerance = (4e-2 if problem.dtype in (BF16, F16) else 1e-4) * (1 + np.abs(b).max())
        assert np.abs(a - b).max() <= tolerance, (name, float(np.abs(a - b).max()), tolerance)


@pytest.mark.parametrize("dtype, layout, mask", [("bfloat16", "zigzag", (True, (150, 0), 0.0)),
                                                 ("float32", "zigzag", (True, (-1, -1), 20.0)),
                                                 ("bfloat16", "contiguous", (False, (-1, -1), 0.0))])
def test_the_one_gpu_ring_with_alibi_matches_the_whole_sequence(dtype, layout, mask):
    """ALiBi on the ring (a score_mod per chunk-pair block at the whole sequence's distance, the
    cap inside it): o, lse and gradients against one call with alibi_slopes on the whole sequence
    (float32 noise; 16-bit: the ring's roundings, as above)."""
    cupy = _cupy()
    causal, window, softcap = mask
    problem = problem_of(dtype, causal, window_size=window)
    slopes = np.random.default_rng(4).uniform(0.0, 0.3, problem.nheads).astype(np.float32)
    q, k, v, do = (cupy.asarray(x) for x in problem.arrays())
    size = 2
    shard, unshard = shard_functions(layout)
    q_s, k_s, v_s, do_s = (shard(x, size) for x in (q, k, v, do))
    options = dict(softmax_scale=problem.softmax_scale, causal=causal, window_size=window, softcap=softcap,
                   alibi_slopes=cupy.asarray(slopes))

    def rank_main(comm):
        r = comm.rank
        o, lse = ring_flash_attn_func(q_s[r], k_s[r], v_s[r], comm=comm, return_lse=True, layout=layout,
                                      **options)
        return (o, lse, *ring_flash_attn_backward(do_s[r], q_s[r], k_s[r], v_s[r], o, lse, comm=comm,
                                                  layout=layout, **options))

    with poisoned_outputs():
        per_rank = LocalRing(size, cupy).run(rank_main)
        ring = [unshard([result[i] for result in per_rank], axis=2 if i == 1 else 1) for i in range(5)]
        o, lse = cupyflash.flash_attn_func(q, k, v, return_lse=True, **options)
        whole = [o, lse, *cupyflash.flash_attn_backward(do, q, k, v, o, lse, **options)]
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), ring, whole):
        a, b = a.get().astype(np.float64), b.get().astype(np.float64)
        assert np.isfinite(a).all(), name
        tolerance = (4e-2 if problem.dtype in (BF16, F16) else 1e-4) * (1 + np.abs(b).max())
        assert np.abs(a - b).max() <= tolerance, (name, float(np.abs(a - b).max()), tolerance)


def test_the_one_gpu_ring_is_deterministic_and_the_overlap_changes_no_bit():
    problem = problem_of("bfloat16", True, seqlen=1024)
    first = run_gpu_ring(problem, 4, "zigzag")
    for again in (run_gpu_ring(problem, 4, "zigzag"), run_gpu_ring(problem, 4, "zigzag", overlap=False)):
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a.get().view(np.uint8), b.get().view(np.uint8))


# --- NCCL ------------------------------------------------------------------------------------------


def _nccl_or_skip():
    from cupy.cuda import nccl

    if not getattr(nccl, "available", False):
        pytest.skip("NCCL not loadable by CuPy (pip install nvidia-nccl-cu13)")


def _launch_ring(problem, nprocs, layout):
    shard, unshard = shard_functions(layout)
    shards = [shard(x, nprocs) for x in problem.arrays()]
    options = dict(softmax_scale=problem.softmax_scale, causal=problem.causal, layout=layout)
    per_rank = launch(distributed_workers.ring_on_gpu, nprocs, args=(shards, options), timeout=300)
    return tuple(unshard([result[i] for result in per_rank], axis=2 if i == 1 else 1) for i in range(5))


def test_nccl_ring_of_one_process():
    """The launcher, an NCCL communicator of one rank and the ring in a spawned process (no
    transfer happens with one rank)."""
    _nccl_or_skip()
    problem = problem_of("bfloat16", True, seqlen=256)
    o, lse, *grads = _launch_ring(problem, 1, "zigzag")
    assert_ring_close(problem, 1, "zigzag", o, lse, grads)


def test_nccl_ring_of_two_gpus():
    _nccl_or_skip()
    if _cupy().cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    problem = problem_of("bfloat16", True, seqlen=1024)
    o, lse, *grads = _launch_ring(problem, 2, "zigzag")
    assert_ring_close(problem, 2, "zigzag", o, lse, grads)
    ring = run_gpu_ring(problem, 2, "zigzag")
    for a, b in zip((o, lse, *grads), ring):  # NCCL and the one-GPU ring: the same arithmetic
        np.testing.assert_array_equal(a, b.get())


@pytest.mark.parametrize("extra", [[], ["--window", "300", "0", "--softcap", "30"], ["--alibi"]],
                         ids=["causal", "window_softcap", "causal_alibi"])
def test_the_bench_runs_on_one_gpu(capsys, extra):
    """python -m cupyflash.distributed.bench --local: the bars' measurement, small, on one GPU; its
    rows agree with the whole sequence's."""
    import json

    from cupyflash.distributed import bench

    assert bench.main(["--local", "--ranks", "2", "--seqlen", "2048", "--heads", "4", "--kv-heads", "2",
                       "--headdim", "64", "--repeats", "1", *extra]) == 0
    out = capsys.readouterr().out.strip()
    last = out.splitlines()[-1]
    assert last.startswith("ring ") and "efficiency" in last and "communication hidden" in last
    report = json.loads(out[:out.rindex("\nring ")])
    assert report["ranks"][0]["o_rel_fro_diff"] < 2e-2, report["ranks"][0]

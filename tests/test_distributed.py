"""Context parallelism on the CPU: the ring schedule run by P simulated ranks (LocalRing over
NumPy, cupyflash's NumPy twin for each step) against the float64 reference under the library's
tolerance rule, forward and backward; the merge's NumPy twin against the merge's formula and
against attention over the union of two key sets; zigzag sharding; which (query, key) pairs the
schedule visits; the communicators' and the launcher's plumbing; validation errors.

The same schedule code runs on one GPU (LocalRing over CuPy) and over NCCL:
tests/test_distributed_gpu.py."""
from __future__ import annotations

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cupyflash import flash_attn_backward, flash_attn_func, reference
from cupyflash.distributed import (
    LocalRing,
    RingAborted,
    RingBlock,
    RingStep,
    contiguous_shard,
    contiguous_unshard,
    launch,
    merge_attention_states,
    ring_flash_attn_backward,
    ring_flash_attn_func,
    ring_flash_attn_vjp,
    ring_schedule,
    zigzag_shard,
    zigzag_unshard,
)
from cupyflash.merge import merge_attention_states_numpy, merge_attention_states_reference
from cupyflash.testing import assert_attention_close
from cupyflash.testing.strategies import attention_problems

import distributed_workers
from ring_check import assert_ring_close, shard_functions

BF16, F16, F32, F64 = (np.dtype(t) for t in (ml_dtypes.bfloat16, np.float16, np.float32, np.float64))
MAX_ROWS = 128  # global sequence length: every rank's shard stays within one or two tiles
RING_MAX_COST = 4e6  # batch * heads * seqlen_q * seqlen_k * headdim of one ring example


# --- the ring against the float64 reference ------------------------------------------------------


@st.composite
def ring_problems(draw, dtypes=(BF16, F16, F32, F64), min_ranks=1, max_ranks=4, headdims=None):
    """(AttentionProblem, P, layout, softcap) with sequence lengths the layout can shard: multiples
    of 2P (zigzag) or P (contiguous); masked problems (causal, or a sliding window, one side
    possibly unbounded, as often narrower than a chunk as wider) are self-attention, the others
    may have another key length; softcap 0 (none) half the time. GQA groups, head dims (or one of
    ``headdims``), scales and magnitudes as the library's strategies draw them."""
    size = draw(st.integers(min_ranks, max_ranks))
    causal = draw(st.booleans())
    layout = draw(st.sampled_from(["zigzag", "zigzag", "contiguous"]))
    parts = 2 * size if layout == "zigzag" else size
    seqlen_q = parts * draw(st.integers(1, MAX_ROWS // parts))
    side = st.one_of(st.just(-1), st.integers(0, seqlen_q // parts + 2), st.integers(0, seqlen_q))
    window = (draw(side), 0 if causal else draw(side)) if draw(st.booleans()) else (-1, -1)
    masked = causal or window != (-1, -1)
    seqlen_k = seqlen_q if masked else parts * draw(st.integers(1, MAX_ROWS // parts))
    problem = draw(attention_problems(dtypes=dtypes, causal=causal, min_seqlen=seqlen_q, max_seqlen=seqlen_q,
                                      same_seqlens=True, headdims=headdims, max_cost=RING_MAX_COST))
    softcap = draw(st.one_of(st.just(0.0), st.sampled_from([1.0, 5.0, 30.0])))
    return replace(problem, seqlen_k=seqlen_k, window_size=window), size, layout, softcap


def run_ring(problem, size, layout, *, overlap=True, inputs=None, softcap=0.0):
    """(o, lse, dq, dk, dv) of the whole sequence from P simulated ranks, each running
    ring_flash_attn_func then ring_flash_attn_backward on its shards."""
    shard, unshard = shard_functions(layout)
    arrays = problem.arrays() if inputs is None else inputs
    q_shards, k_shards, v_shards, do_shards = (shard(x, size) for x in arrays)
    options = dict(softmax_scale=problem.softmax_scale, causal=problem.causal, window_size=problem.window_size,
                   softcap=softcap, layout=layout, backend="numpy", overlap=overlap)

    def rank_main(comm):
        r = comm.rank
        o, lse = ring_flash_attn_func(q_shards[r], k_shards[r], v_shards[r], comm=comm, return_lse=True, **options)
        grads = ring_flash_attn_backward(do_shards[r], q_shards[r], k_shards[r], v_shards[r], o, lse, comm=comm,
                                         **options)
        return (o, lse, *grads)

    per_rank = LocalRing(size).run(rank_main)
    return tuple(unshard([result[i] for result in per_rank], axis=2 if i == 1 else 1) for i in range(5))


def ring_and_whole(problem, size, layout, options):
    """(ring, whole): the ring's (o, lse, dq, dk, dv, and the ranks' extra outputs summed, e.g.
    dsink) unsharded, and one flash_attn_func / flash_attn_backward over the whole sequence with the
    same ``options`` (the NumPy twin)."""
    shard, unshard = shard_functions(layout)
    arrays = problem.arrays()
    q_s, k_s, v_s, do_s = (shard(x, size) for x in arrays)

    def rank_main(comm):
        r = comm.rank
        o, lse = ring_flash_attn_func(q_s[r], k_s[r], v_s[r], comm=comm, return_lse=True, layout=layout, **options)
        return (o, lse, *ring_flash_attn_backward(do_s[r], q_s[r], k_s[r], v_s[r], o, lse, comm=comm, layout=layout,
                                                  **options))

    per_rank = LocalRing(size).run(rank_main)
    ring = [unshard([result[i] for result in per_rank], axis=2 if i == 1 else 1) for i in range(5)]
    ring += [np.sum([result[i] for result in per_rank], axis=0) for i in range(5, len(per_rank[0]))]
    q, k, v, do = arrays
    o, lse = flash_attn_func(q, k, v, return_lse=True, **options)
    return ring, [o, lse, *flash_attn_backward(do, q, k, v, o, lse, **options)]


@given(ring_problems())
def test_ring_simulation_matches_the_reference(case):
    problem, size, layout, softcap = case
    o, lse, dq, dk, dv = run_ring(problem, size, layout, softcap=softcap)
    assert_ring_close(problem, size, layout, o, lse, (dq, dk, dv), softcap=softcap)


@given(ring_problems(dtypes=(F32, F64)), st.floats(0.0, 4.0), st.data())
def test_a_sink_joins_each_row_once_and_its_gradient_is_the_sum_of_the_ranks_shares(case, sink_std, data):
    """With attention sinks (and whatever mask and cap were drawn) the ring's o, lse, gradients and
    the ranks' dsink shares summed equal one flash_attn_func / flash_attn_backward over the whole
    sequence (the NumPy twin, itself checked against float64 elsewhere) to the dtype's rounding."""
    problem, size, layout, softcap = case
    if problem.seqlen_k != problem.seqlen_q:
        problem = replace(problem, seqlen_k=problem.seqlen_q)
    seed = data.draw(st.integers(0, 2**32 - 1), label="sink seed")
    sink = (np.random.default_rng(seed).standard_normal(problem.nheads) * sink_std).astype(np.float32)
    options = dict(softmax_scale=problem.softmax_scale, causal=problem.causal, window_size=problem.window_size,
                   softcap=softcap, sink=sink, backend="numpy")
    ring, whole = ring_and_whole(problem, size, layout, options)
    do = problem.arrays()[3]
    # dsink sums exp(sink - lse) D over every row: its terms, not its sum, set the noise (the sum
    # may cancel), and it is float32 whatever the inputs, each rank's share rounded once more
    o64, lse64 = whole[0].astype(np.float64), whole[1].astype(np.float64)
    d_rows = np.moveaxis(np.sum(do.astype(np.float64) * o64, axis=-1), 1, 2)
    terms = float(np.abs(np.exp(sink.astype(np.float64)[None, :, None] - lse64) * d_rows).sum(axis=(0, 2)).max())
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv", "dsink"), ring, whole):
        a, b = a.astype(np.float64), b.astype(np.float64)
        if name == "dsink":
            assert np.abs(a - b).max() <= (4e-6 if problem.dtype == F64 else 2e-5) * (1 + terms), name
        else:
            rtol = 1e-11 if problem.dtype == F64 else 2e-5
            assert np.abs(a - b).max(initial=0.0) <= rtol * (1 + np.abs(b).max(initial=0.0)), name


def test_ring_results_are_deterministic_and_the_overlap_changes_no_bit():
    problem = replace(next_problem(), dtype=BF16)
    first = run_ring(problem, 3, "zigzag")
    for again in (run_ring(problem, 3, "zigzag"), run_ring(problem, 3, "zigzag", overlap=False)):
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def next_problem():
    """A small causal GQA problem with a zigzag-shardable length for P in 1, 2, 3, 4 (24 rows)."""
    from cupyflash.testing import AttentionProblem

    return AttentionProblem(batch=2, seqlen_q=24, seqlen_k=24, nheads_kv=2, group=2, headdim=16, causal=True,
                            softmax_scale=None, magnitude=1.0, dtype="float32", seed=7)


def test_the_vjp_is_the_forward_and_the_backward():
    problem = next_problem()
    q, k, v, do = (zigzag_shard(x, 2) for x in problem.arrays())

    def rank_main(comm):
        r = comm.rank
        o, vjp = ring_flash_attn_vjp(q[r], k[r], v[r], comm=comm, causal=True, backend="numpy")
        o2, lse = ring_flash_attn_func(q[r], k[r], v[r], comm=comm, causal=True, return_lse=True, backend="numpy")
        grads = ring_flash_attn_backward(do[r], q[r], k[r], v[r], o2, lse, comm=comm, causal=True, backend="numpy")
        return o, o2, vjp(do[r]), grads

    for o, o2, grads_vjp, grads in LocalRing(2).run(rank_main):
        np.testing.assert_array_equal(o, o2)
        for a, b in zip(grads_vjp, grads):
            np.testing.assert_array_equal(a, b)


# --- which pairs the schedule visits ------------------------------------------------------------


def global_rows(layout, rank, size, length):
    """Global positions of a rank's local rows (written out, not through the shard helpers)."""
    if layout == "contiguous":
        return rank * length + np.arange(length)
    chunk = length // 2
    return np.concatenate([rank * chunk + np.arange(chunk), (2 * size - 1 - rank) * chunk + np.arange(chunk)])


WINDOWS = [(-1, -1), (0, 0), (1, 0), (2, 5), (7, -1), (-1, 4), (13, 13)]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8])
def test_the_schedule_visits_every_visible_pair_once_and_no_other(size, window, causal, layout):
    """Each block's own flash-attn mask (bottom-right on the block) on its rows and keys, mapped to
    global positions, covers the whole sequence's mask exactly once; every block is cut to rows
    that see a key and keys that are seen."""
    length = 6  # rows per rank (zigzag: two chunks of 3)
    seqlen = size * length
    visits = np.zeros((seqlen, seqlen), int)
    work = np.zeros((size, size), int)  # pairs computed per (rank, step)
    for rank in range(size):
        rows = global_rows(layout, rank, size, length)
        steps = ring_schedule(rank, size, length, causal=causal, window_size=window, layout=layout)
        assert len(steps) == size
        for t, step in enumerate(steps):
            source = (rank - t) % size
            assert step.source == source
            keys = global_rows(layout, source, size, length)
            for block in step.blocks:
                q_local, k_local = np.arange(*block.rows), np.arange(*block.keys)
                seen = reference.visible_keys(len(q_local), len(k_local), block.causal, block.window_size)
                assert seen.any(axis=1).all() and seen.any(axis=0).all(), block
                qi, kj = np.nonzero(seen)
                np.add.at(visits, (rows[q_local[qi]], keys[k_local[kj]]), 1)
                work[rank, t] += len(qi)
    np.testing.assert_array_equal(visits, reference.visible_keys(seqlen, seqlen, causal, window).astype(int))
    if causal and window == (-1, -1) and layout == "zigzag":
        # balanced: every rank does the same work at every step, one block a step
        assert (work == work[:1]).all(), work
        assert (work[:, 1:] == (length // 2) * length).all()
        for rank in range(size):
            assert all(len(step.blocks) == 1 for step in ring_schedule(rank, size, length, causal=True))


def test_a_window_computes_only_near_the_diagonal():
    """A window narrower than a shard (contiguous, causal (3, 0)): each rank's own shard as one
    block under the window, the previous rank's last 3 keys for its first 3 rows, no block on the
    steps whose keys lie outside the window."""
    size, length = 4, 64
    for rank in range(size):
        steps = ring_schedule(rank, size, length, window_size=(3, 0), layout="contiguous")
        assert steps[0].blocks == (RingBlock((0, length), (0, length), window_size=(3, 0)),)
        previous = (RingBlock((0, 3), (length - 3, length), window_size=(0, -1)),) if rank > 0 else ()
        assert steps[1].blocks == previous
        assert all(not step.blocks for step in steps[2:])


# --- zigzag and contiguous sharding --------------------------------------------------------------


@given(size=st.integers(1, 6), chunk=st.integers(1, 5), axis=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_shard_and_unshard_are_inverse(size, chunk, axis, seed):
    shape = [2, 3, 4]
    shape[axis] = 2 * size * chunk
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    shards = zigzag_shard(x, size, axis=axis)
    assert len(shards) == size
    for rank, shard in enumerate(shards):
        rows = global_rows("zigzag", rank, size, 2 * chunk)
        np.testing.assert_array_equal(shard, np.take(x, rows, axis=axis))
        np.testing.assert_array_equal(shard, zigzag_shard(x, size, rank, axis=axis))
    np.testing.assert_array_equal(zigzag_unshard(shards, axis=axis), x)
    pieces = contiguous_shard(x, size, axis=axis)
    np.testing.assert_array_equal(contiguous_unshard(pieces, axis=axis), x)
    np.testing.assert_array_equal(pieces[-1], contiguous_shard(x, size, size - 1, axis=axis))


def test_sharding_says_what_must_divide_the_sequence():
    x = np.zeros((1, 10, 2, 4))
    with pytest.raises(ValueError, match="multiple of 8"):
        zigzag_shard(x, 4)
    with pytest.raises(ValueError, match="multiple of 4"):
        contiguous_shard(x, 4)
    with pytest.raises(ValueError, match="positive int"):
        zigzag_shard(x, 0)
    with pytest.raises(ValueError, match="rank 5"):
        zigzag_shard(x, 5, 5)
    with pytest.raises(ValueError, match="two chunks"):
        zigzag_unshard([np.zeros((1, 3, 2, 4))])


# --- the merge ------------------------------------------------------------------------------------

MERGE_PAIRS = [(F16, F16), (BF16, BF16), (F32, F32), (F64, F64), (F32, F16), (F32, BF16)]


@st.composite
def merge_inputs(draw):
    """(o_a, lse_a, o_b, lse_b): o of one of MERGE_PAIRS' dtype pairs, lse of the accumulator dtype
    with finite values of any spread, and rows where one or both sides saw no key (-inf)."""
    dtype_a, dtype_b = draw(st.sampled_from(MERGE_PAIRS))
    batch, seqlen, nheads = draw(st.integers(1, 2)), draw(st.integers(1, 9)), draw(st.integers(1, 3))
    headdim = draw(st.sampled_from([1, 3, 8, 33, 64, 130]))
    spread = draw(st.sampled_from([0.0, 1.0, 30.0, 200.0]))  # 200: one side's weight underflows
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    acc = F64 if dtype_a == F64 else F32
    o_a = rng.standard_normal((batch, seqlen, nheads, headdim)).astype(dtype_a)
    o_b = rng.standard_normal((batch, seqlen, nheads, headdim)).astype(dtype_b)
    lse_a, lse_b = (rng.standard_normal((batch, nheads, seqlen)) * spread + rng.standard_normal() * 10
                    for _ in range(2))
    empty = rng.random((2, batch, nheads, seqlen)) < draw(st.sampled_from([0.0, 0.3]))
    lse_a[empty[0]], lse_b[empty[1]] = -np.inf, -np.inf
    return o_a, lse_a.astype(acc), o_b, lse_b.astype(acc)


def assert_merge_close(o, lse, o_ref, lse_ref, out_dtype, inputs):
    """o, lse within the accumulator's rounding of the exponentials and one rounding of o."""
    acc_eps = float(np.finfo(F64 if out_dtype == F64 else F32).eps)
    out_eps = float(ml_dtypes.finfo(out_dtype).eps)
    np.testing.assert_array_equal(lse == -np.inf, lse_ref == -np.inf)
    finite = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[finite], lse_ref[finite], rtol=4 * acc_eps, atol=4 * acc_eps)
    scale = max(float(np.abs(x.astype(np.float64)).max()) for x in inputs)
    # The float64 formula's weights exp(lse_side - lse) carry lse's own rounding, eps64 * |lse|.
    reference_eps = float(np.finfo(F64).eps) * float(np.abs(lse_ref[finite]).max(initial=0.0))
    np.testing.assert_allclose(o.astype(np.float64), o_ref, rtol=0,
                               atol=(16 * acc_eps + 4 * reference_eps + out_eps) * scale)


@given(merge_inputs())
def test_the_merge_twin_matches_the_merge_formula(inputs):
    o_a, lse_a, o_b, lse_b = inputs
    o, lse = merge_attention_states(o_a, lse_a, o_b, lse_b)
    assert o.dtype == o_a.dtype and lse.dtype == lse_a.dtype and lse.shape == lse_a.shape
    o_ref, lse_ref = merge_attention_states_reference(o_a, lse_a, o_b, lse_b)
    assert_merge_close(o, lse, o_ref, lse_ref, o_a.dtype, (o_a, o_b))
    both_empty = np.moveaxis((lse_a == -np.inf) & (lse_b == -np.inf), 1, 2)
    assert (o[both_empty] == 0).all()


@given(attention_problems(dtypes=["float32", "float64"], causal=False, max_seqlen=40, max_cost=1e6),
       st.floats(0, 1))
def test_merging_attention_over_two_key_sets_is_attention_over_their_union(problem, cut):
    """The merge rule from the definition: halves of the keys merged (the float64 formula, and the
    twin on the NumPy backend's partials) give attention over all of them. A half may be empty
    (o = 0, lse = -inf)."""
    q, k, v, _ = problem.arrays()
    split = int(round(cut * problem.seqlen_k))
    options = dict(softmax_scale=problem.softmax_scale)
    halves = [(k[:, part], v[:, part]) for part in (slice(0, split), slice(split, None))]
    exact = [reference.attention(q, k_h, v_h, **options) for k_h, v_h in halves]
    o_ref, lse_ref = reference.attention(q, k, v, **options)
    o64, lse64 = merge_attention_states_reference(exact[0][0], exact[0][1], exact[1][0], exact[1][1])
    np.testing.assert_allclose(o64, o_ref, rtol=0, atol=1e-12 * (1 + np.abs(o_ref).max()))
    np.testing.assert_allclose(lse64, lse_ref, rtol=1e-13, atol=1e-13)
    tiled = [flash_attn_func(q, k_h, v_h, return_lse=True, backend="numpy", **options) for k_h, v_h in halves]
    o, lse = merge_attention_states(tiled[0][0], tiled[0][1], tiled[1][0], tiled[1][1])
    assert_attention_close(problem, o, lse)


def test_the_merge_edge_cases():
    """No key on a side: not read (a NaN there stays out); on both: o = 0, lse = -inf. A finite
    side is read even when its weight underflows. NaN lse: NaN. +inf lse: lse +inf, o NaN. The
    twin and the float64 formula agree on each."""
    inf, nan = np.inf, np.nan
    lse_a = np.array([[[-inf, -inf, 2.0, 0.0, nan, 0.0, inf, -200.0]]], np.float32)
    lse_b = np.array([[[-inf, 1.0, -inf, nan, 0.0, -inf, 0.0, 0.0]]], np.float32)
    o_a = np.full((1, 8, 1, 2), 3.0, np.float32)
    o_b = np.full((1, 8, 1, 2), 5.0, np.float32)
    o_a[0, 1] = nan  # not read: lse_a = -inf
    o_b[0, 2] = nan  # not read: lse_b = -inf
    o_a[0, 7] = nan  # read: its weight exp(-200) is 0 in float32, but its lse is finite
    o, lse = merge_attention_states_numpy(o_a, lse_a, o_b, lse_b)
    o64, lse64 = merge_attention_states_reference(o_a, lse_a, o_b, lse_b)
    expect_lse = [-inf, 1.0, 2.0, nan, nan, 0.0, inf, 0.0]
    expect_o = [0.0, 5.0, 3.0, nan, nan, 3.0, nan, nan]
    for got_o, got_lse in ((o, lse), (o64, lse64)):
        np.testing.assert_allclose(got_lse[0, 0], expect_lse, rtol=1e-6, atol=1e-30)
        np.testing.assert_allclose(got_o[0, :, 0, 0], expect_o, rtol=1e-6)


def test_the_merge_works_in_place_on_strided_rows():
    rng = np.random.default_rng(3)
    o_acc = rng.standard_normal((2, 8, 3, 5)).astype(np.float32)
    lse_acc = rng.standard_normal((2, 3, 8)).astype(np.float32)
    o_b = rng.standard_normal((2, 4, 3, 5)).astype(BF16)
    lse_b = rng.standard_normal((2, 3, 4)).astype(np.float32)
    fresh = merge_attention_states(o_acc[:, 4:].copy(), lse_acc[:, :, 4:].copy(), o_b, lse_b)
    before = o_acc[:, :4].copy(), lse_acc[:, :, :4].copy()
    rows, lse_rows = o_acc[:, 4:], lse_acc[:, :, 4:]
    merge_attention_states(rows, lse_rows, o_b, lse_b, out=rows, lse_out=lse_rows)
    np.testing.assert_array_equal(o_acc[:, 4:], fresh[0])
    np.testing.assert_array_equal(lse_acc[:, :, 4:], fresh[1])
    np.testing.assert_array_equal(o_acc[:, :4], before[0])  # the other rows are untouched
    np.testing.assert_array_equal(lse_acc[:, :, :4], before[1])


def test_the_merge_checks_its_arguments():
    o16, o_bf = np.zeros((1, 2, 1, 4), F16), np.zeros((1, 2, 1, 4), BF16)
    lse = np.zeros((1, 1, 2), np.float32)
    with pytest.raises(ValueError, match="o_b must have o_a's dtype"):
        merge_attention_states(o16, lse, o_bf, lse)
    with pytest.raises(ValueError, match="lse_b"):
        merge_attention_states(o16, lse, o16, np.zeros((1, 2, 1), np.float32))
    with pytest.raises(ValueError, match="expected float32"):
        merge_attention_states(o16, lse, o16, lse.astype(np.float64))
    with pytest.raises(ValueError, match="out"):
        merge_attention_states(o16, lse, o16, lse, out=np.zeros((1, 2, 1, 4), np.float32))
    with pytest.raises(TypeError, match="NumPy or CuPy"):
        merge_attention_states(o16.tolist(), lse, o16, lse)


# --- the communicators, the launcher, validation --------------------------------------------------


def test_a_failing_rank_fails_the_run_without_leaving_others_waiting():
    ring = LocalRing(3, timeout=60)
    buffers = [np.zeros(4) for _ in range(3)]

    def rank_main(comm):
        if comm.rank == 2:
            raise KeyError("rank 2 fails on purpose")
        comm.start_exchange([buffers[comm.rank]], [np.zeros(4)]).wait()

    with pytest.raises(KeyError, match="on purpose"):
        ring.run(rank_main)
    # The ring is usable again, and an exchange moves each rank's buffer to the next rank.
    out = ring.run(lambda comm: _exchange_rank(comm))
    assert [int(x[0]) for x in out] == [2, 0, 1]


def _exchange_rank(comm):
    received = np.zeros(4)
    comm.start_exchange([np.full(4, float(comm.rank))], [received]).wait()
    return received


def test_shards_of_different_shapes_are_an_error():
    def rank_main(comm):
        comm.start_exchange([np.zeros(3 + comm.rank)], [np.zeros(3 + comm.rank)]).wait()

    with pytest.raises((ValueError, RingAborted), match="one shape|another rank"):
        LocalRing(2, timeout=60).run(rank_main)


@pytest.mark.parametrize("options", [dict(causal=True), dict(window_size=(3, 0)), dict()], ids=["causal", "window", "full"])
def test_empty_shards(options):
    """Shards of no rows: o and the gradients empty, lse (batch, heads, 0), with or without a mask."""
    q = np.zeros((1, 0, 2, 8), np.float32)

    def rank_main(comm):
        o, lse = ring_flash_attn_func(q, q, q, comm=comm, return_lse=True, backend="numpy", **options)
        return o, lse, ring_flash_attn_backward(q, q, q, q, o, lse, comm=comm, backend="numpy", **options)

    for o, lse, grads in LocalRing(2).run(rank_main):
        assert o.shape == q.shape and lse.shape == (1, 2, 0)
        assert all(g.shape == q.shape for g in grads)


def test_the_ring_says_what_it_cannot_take():
    q = np.zeros((1, 5, 2, 8), np.float32)
    comm = LocalRing(1).comms[0]
    with pytest.raises(ValueError, match="even shard length"):
        ring_flash_attn_func(q, q, q, comm=comm, causal=True)
    with pytest.raises(ValueError, match="window_size=\\(4, 0\\) and the zigzag layout needs an even"):
        ring_flash_attn_func(q, q, q, comm=comm, window_size=(4, 0))
    with pytest.raises(ValueError, match="window_size must be a pair"):
        ring_flash_attn_func(q, q, q, comm=comm, window_size=(-2, 0), layout="contiguous")
    with pytest.raises(ValueError, match="window_size=\\(3, 3\\) is self-attention"):
        ring_flash_attn_func(q, q[:, :4], q[:, :4], comm=comm, window_size=(3, 3), layout="contiguous")
    with pytest.raises(ValueError, match="layout"):
        ring_flash_attn_func(q, q, q, comm=comm, layout="striped")
    with pytest.raises(ValueError, match="self-attention"):
        ring_flash_attn_func(q, q[:, :4], q[:, :4], comm=comm, causal=True, layout="contiguous")
    with pytest.raises(TypeError, match="moves numpy arrays"):
        ring_flash_attn_func(q.tolist(), q, q, comm=comm)
    with pytest.raises(TypeError, match="ring communicator"):
        ring_flash_attn_func(q, q, q, comm=object())


def test_the_launcher_runs_one_process_per_rank_and_reports_failures():
    results = launch(distributed_workers.report, 2, args=(10,), use_gpu=False, timeout=120,
                     make_comm=distributed_workers.stand_in_comm, make_unique_id=distributed_workers.stand_in_unique_id)
    for rank, (unique_id, got_rank, size, array) in enumerate(results):
        assert (unique_id, got_rank, size) == (("unique id", 42), rank, 2)
        np.testing.assert_array_equal(array, np.arange(3) + 10)
    with pytest.raises(RuntimeError, match="rank 1:(.|\n)*on purpose"):
        launch(distributed_workers.fail_on_rank_one, 2, use_gpu=False, timeout=120,
               make_comm=distributed_workers.stand_in_comm, make_unique_id=distributed_workers.stand_in_unique_id)


def test_the_rule_fails_a_ring_that_drops_a_step(monkeypatch):
    """The check can fail: a schedule that forgets the last step's keys is far outside the rule."""
    from cupyflash.distributed import ring as ring_module

    def forgetful(rank, size, length, **options):
        steps = ring_schedule(rank, size, length, **options)
        return steps[:-1] + [RingStep(steps[-1].source)]

    problem = replace(next_problem(), dtype=BF16, causal=False)
    monkeypatch.setattr(ring_module, "ring_schedule", forgetful)
    o, lse, dq, dk, dv = run_ring(problem, 2, "contiguous")
    with pytest.raises(AssertionError, match="o \\(bfloat16\\)"):
        assert_ring_close(problem, 2, "contiguous", o, lse, (dq, dk, dv))


# --- ALiBi on the ring ----------------------------------------------------------------------------

def _global_positions(rank, size, length, layout):
    """The whole sequence's position of each local row of rank's shard."""
    if layout == "zigzag":
        c = length // 2
        return np.concatenate([rank * c + np.arange(c), (2 * size - 1 - rank) * c + np.arange(c)])
    return rank * length + np.arange(length)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (True, (5, 0)), (False, (3, 7))])
def test_per_chunk_blocks_know_the_whole_sequences_distance(layout, causal, window):
    """ring_schedule(per_chunk=True): every block lies in one query chunk and one key chunk, the
    blocks still cover every visible pair once, and each block's distance is i - j of the whole
    sequence minus the block's own q_idx - kv_idx, for every pair of it."""
    length = 6  # each shard's rows (zigzag: two chunks of 3)
    for size in (1, 2, 3, 4):
        for rank in range(size):
            rows_g = _global_positions(rank, size, length, layout)
            seen = {}
            for step in ring_schedule(rank, size, length, causal=causal, window_size=window, layout=layout,
                                      per_chunk=True):
                keys_g = _global_positions(step.source, size, length, layout)
                for block in step.blocks:
                    assert block.distance is not None
                    i = np.arange(*block.rows)[:, None]
                    j = np.arange(*block.keys)[None, :]
                    want = rows_g[i] - keys_g[j]
                    assert (want == (i - block.rows[0]) - (j - block.keys[0]) + block.distance).all()
                    visible = reference.visible_keys(block.rows[1] - block.rows[0], block.keys[1] - block.keys[0],
                                                     block.causal, block.window_size)
                    for a, b in zip(*np.nonzero(visible)):
                        pair = (int(rows_g[block.rows[0] + a]), int(keys_g[block.keys[0] + b]))
                        assert pair not in seen
                        seen[pair] = True
            total = reference.visible_keys(size * length, size * length, causal, window)[rows_g].sum()
            assert len(seen) == total


@given(ring_problems(dtypes=(F32, F64)), st.booleans(), st.data())
def test_alibi_on_the_ring_is_the_whole_sequences(case, per_batch, data):
    """alibi_slopes through the ring (a score_mod per block at the whole sequence's distance, the cap
    first when there is one) equals one flash_attn_func / flash_attn_backward with alibi_slopes over
    the whole sequence (the NumPy twin), and float64's the reference."""
    problem, size, layout, softcap = case
    if problem.seqlen_k != problem.seqlen_q:
        problem = replace(problem, seqlen_k=problem.seqlen_q)
    seed = data.draw(st.integers(0, 2**32 - 1), label="slopes seed")
    shape = (problem.batch, problem.nheads) if per_batch else (problem.nheads,)
    slopes = np.random.default_rng(seed).uniform(0.0, 0.5, shape).astype(np.float32)
    options = dict(softmax_scale=problem.softmax_scale, causal=problem.causal, window_size=problem.window_size,
                   softcap=softcap, alibi_slopes=slopes, backend="numpy")
    ring, whole = ring_and_whole(problem, size, layout, options)
    # dq and dk cancel to 0 where a row sees one key; their terms, and the noise those leave, are
    # dv's size (the tolerance rule's scale, cupyflash.testing.tolerance.bound)
    terms = np.abs(whole[4].astype(np.float64)).max(initial=0.0)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), ring, whole):
        a, b = a.astype(np.float64), b.astype(np.float64)
        rtol = 1e-11 if problem.dtype == F64 else 2e-5
        scale = max(np.abs(b).max(initial=0.0), terms if name in ("dq", "dk") else 0.0)
        assert np.abs(a - b).max(initial=0.0) <= rtol * (1 + scale), name
    if problem.dtype == F64:
        reference_options = {key: value for key, value in options.items() if key != "backend"}
        o_ref, _ = reference.attention(*problem.arrays()[:3], **reference_options)
        np.testing.assert_allclose(ring[0], o_ref, rtol=1e-10, atol=1e-10)


def test_alibi_on_the_ring_says_what_it_cannot_take():
    q = np.zeros((1, 4, 2, 8))
    k = np.zeros((1, 6, 2, 8))

    def rank_main(comm):
        with pytest.raises(ValueError, match="alibi_slopes must be"):
            ring_flash_attn_func(q, q, q, comm=comm, alibi_slopes=np.ones(3, np.float32), backend="numpy")
        with pytest.raises(ValueError, match="q and k shards of one length"):
            ring_flash_attn_func(q, k, k, comm=comm, alibi_slopes=np.ones(2, np.float32), backend="numpy")
        odd = np.zeros((1, 3, 2, 8))  # zigzag chunks of 1.5 rows: positions would overlap
        with pytest.raises(ValueError, match="even shard length"):
            ring_flash_attn_func(odd, odd, odd, comm=comm, alibi_slopes=np.ones(2, np.float32), backend="numpy")
        ring_flash_attn_func(odd, odd, odd, comm=comm, alibi_slopes=np.ones(2, np.float32), layout="contiguous",
                             backend="numpy")
        return None

    LocalRing(1).run(rank_main)

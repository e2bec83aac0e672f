"""The tolerance rule for ring attention's results, shared by the CPU simulation and the GPU tests.

A ring rounds more often than one pass: each step's o and gradients come back from
flash_attn_func / flash_attn_backward in the input dtype (16-bit) before the ring adds them in
float32, then the sum is rounded once more. On small problems (a few keys per row) that can
exceed 3x standard attention's error: 2 steps, a dv of 6.28 in bfloat16 (ulp 1/32) measured 2.9e-2
against an allowed 2.6e-2. So, as the library does for the rounding of P (flash_rounding_baseline),
the rule gets one more baseline: the ring's own rounding, i.e. every step's partial results
computed exactly (float64), rounded to the dtype once, summed exactly and rounded again
(``ring_rounding_baseline``). A result may be the rule's factor times the worst baseline's error.
float32 and float64 keep their bounds (their partial roundings are far below them).
"""
from __future__ import annotations

import numpy as np

from cupyflash import numpy_backend
from cupyflash.distributed import ring_schedule, zigzag_shard, zigzag_unshard
from cupyflash.distributed.sharding import contiguous_shard, contiguous_unshard
from cupyflash.merge import merge_attention_states_reference
from cupyflash.testing import as_numpy
from cupyflash.testing.tolerance import (
    GRADIENT_FACTOR,
    OUTPUT_FACTOR,
    SIXTEEN_BIT,
    assert_close,
    flash_rounding_baseline,
    max_abs,
    output_rounding_allowance,
    references_and_baselines,
    worse_baseline,
)


def shard_functions(layout):
    return (zigzag_shard, zigzag_unshard) if layout == "zigzag" else (contiguous_shard, contiguous_unshard)


def ring_rounding_baseline(problem, size, layout, o_exact, lse_exact, softcap=0.0):
    """(o, dq, dk, dv) of the ring schedule with float64 steps whose outputs are rounded to the
    dtype, as the API rounds them, accumulated in float64 and rounded once at the end. The
    backward's steps get the exact global o and lse (the o the ring really used is the rule's
    output_rounding_allowance)."""
    from cupyflash.scores import Variant

    dtype = problem.dtype
    rnd = lambda x: np.asarray(x).astype(dtype).astype(np.float64)  # noqa: E731
    shard, unshard = shard_functions(layout)
    q, k, v, do = (x.astype(np.float64) for x in problem.arrays())
    qs, ks, vs, dos, os_ = (shard(x, size) for x in (q, k, v, do, o_exact))
    lses = shard(lse_exact, size, axis=2)
    o_out, dq_out = [None] * size, [None] * size
    dk_out = [np.zeros(s.shape) for s in ks]
    dv_out = [np.zeros(s.shape) for s in vs]
    variant = Variant(softcap=softcap)
    for rank in range(size):
        o_acc = np.zeros(qs[rank].shape)
        lse_acc = np.full(lses[rank].shape, -np.inf)
        dq_acc = np.zeros(qs[rank].shape)
        steps = ring_schedule(rank, size, qs[rank].shape[1], causal=problem.causal, window_size=problem.window_size,
                              layout=layout, key_length=ks[rank].shape[1])
        for step in steps:
            s = step.source
            for block in step.blocks:
                rows, keys = block.row_slice, block.key_slice
                options = dict(softmax_scale=problem.scale, causal=block.causal, window_size=block.window_size,
                               variant=variant)
                o_t, lse_t = numpy_backend.forward(qs[rank][:, rows], ks[s][:, keys], vs[s][:, keys], **options)
                o_acc[:, rows], lse_acc[:, :, rows] = merge_attention_states_reference(
                    o_acc[:, rows], lse_acc[:, :, rows], rnd(o_t), lse_t)
                dq_t, dk_t, dv_t = numpy_backend.backward(dos[rank][:, rows], qs[rank][:, rows], ks[s][:, keys],
                                                          vs[s][:, keys], os_[rank][:, rows], lses[rank][:, :, rows],
                                                          **options)
                dq_acc[:, rows] += rnd(dq_t)
                dk_out[s][:, keys] += rnd(dk_t)
                dv_out[s][:, keys] += rnd(dv_t)
        o_out[rank], dq_out[rank] = o_acc, dq_acc
    return tuple(rnd(unshard(parts)) for parts in (o_out, dq_out, dk_out, dv_out))


def assert_ring_close(problem, size, layout, o, lse, grads, softcap=0.0):
    """The ring's whole-sequence (o, lse, (dq, dk, dv)) against float64 under the library's rule
    with the ring's rounding as one more baseline (module docstring); one AssertionError naming
    every output that fails. With a softcap the flash rounding baseline (a model of the plain
    softmax's backward) is left out: standard attention with the cap and the ring's own rounding
    remain."""
    q, k, v, do = problem.arrays()
    dtype = problem.dtype
    kwargs = dict(problem.kwargs, softcap=softcap) if softcap else problem.kwargs
    o, lse = as_numpy(o), as_numpy(lse)
    grads = tuple(as_numpy(g) for g in grads)
    failures = []
    for name, x, want in (("o", o, dtype), ("dq", grads[0], dtype), ("dk", grads[1], dtype),
                          ("dv", grads[2], dtype), ("lse", lse, np.float64 if dtype == np.float64 else np.float32)):
        if x.dtype != want:
            failures.append(f"{name}: dtype {x.dtype}, expected {np.dtype(want).name}")
    (o_ref, lse_ref, grads_ref), (o_std, lse_std, grads_std) = references_and_baselines(do, q, k, v, dtype=dtype,
                                                                                         **kwargs)
    if dtype in SIXTEEN_BIT:
        o_ring, *grads_ring = ring_rounding_baseline(problem, size, layout, o_ref, lse_ref, softcap)
        o_base = worse_baseline(o_ref, o_std, o_ring)
        if softcap:
            grad_bases = [worse_baseline(r, s, g) for r, s, g in zip(grads_ref, grads_std, grads_ring)]
        else:
            flash = flash_rounding_baseline(do, q, k, v, dtype=dtype, o=o, **kwargs)
            grad_bases = [worse_baseline(r, s, f, g) for r, s, f, g in zip(grads_ref, grads_std, flash, grads_ring)]
    else:
        o_base, grad_bases = None, (None, None, None)

    def check(*args, **options):
        try:
            assert_close(*args, dtype=dtype, **options)
        except AssertionError as failure:
            failures.append(str(failure))

    check("o", o, o_ref, o_base, factor=OUTPUT_FACTOR)
    check("lse", lse, lse_ref, lse_std, factor=OUTPUT_FACTOR)
    allowances = output_rounding_allowance(do, q, k, v, o, o_ref, **kwargs)
    grad_scale = max(max_abs(r) for r in grads_ref)
    for name, grad, ref, base, atol in zip(("dq", "dk", "dv"), grads, grads_ref, grad_bases, allowances):
        check(name, grad, ref, base, factor=GRADIENT_FACTOR, scale=grad_scale, atol=atol)
    if failures:
        raise AssertionError(f"ring of {size} ({layout}) for {problem}:\n" + "\n".join(f"  {f}" for f in failures))

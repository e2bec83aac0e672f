"""User modifiers (score_mod, mask_mod and the block map) on every GPU kernel family, against the
float64 reference (tolerance.py's rule), NaN-poisoned outputs and fresh inputs per example: the
modifiers of tests/modifier_zoo.py compiled into the kernels the plans launch (the device's
defaults; sm_80's mma.sync kernels through their overrides); the block map made by the GPU kernel
against the host's; a mask_mod equal to causal=True bit for bit; ALiBi as a score_mod."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import cupyflash as cf
from cupyflash import modifiers as M
from kernel_paths import MMA_SYNC_BWD, check_against_reference, run_path
from modifier_zoo import GPU_COMBOS, MASKS, make_mask_mod, modifiers_for
import modifier_zoo as zoo
from strategies import attention_case, make_inputs
from tolerance import SIXTEEN_BIT
from windows import window_size

pytestmark = pytest.mark.gpu
GPU_MAX_COST = 4e7
SMALL_COST = 4e6


def _case(max_cost=GPU_MAX_COST, **kw):
    return attention_case(max_cost=max_cost, max_seqlen=300, **kw).filter(
        lambda c: c.dtype not in SIXTEEN_BIT or (c.headdim % 8 == 0 and c.headdim <= 256))


@st.composite
def _problem(draw, max_cost=GPU_MAX_COST, **kw):
    case = draw(_case(max_cost, **kw))
    window = draw(st.one_of(st.just((-1, -1)), window_size()))
    score_mod, mask_mod = draw(modifiers_for(case, combos=GPU_COMBOS))
    return case, window, score_mod, mask_mod


def _run(case, window, score_mod, mask_mod, deterministic=True, mma_sync=None):
    import cupy

    q, k, v, do = make_inputs(case)
    mods = M.check_modifiers(score_mod, mask_mod, None, batch=case.batch, nheads=case.nheads, seqlen_q=case.seqlen_q,
                             seqlen_k=case.seqlen_k, on_gpu=True)
    o, lse, *grads = run_path(case, window, q, k, v, do, deterministic, mma_sync=mma_sync,
                              variant={"mods": mods.to(cupy)})
    check_against_reference(case, window, q, k, v, do, o, lse, grads,
                            {"score_mod": score_mod, "mask_mod": mask_mod})


@given(_problem(), st.booleans())
def test_modifiers_match_reference(problem, deterministic):
    """kernel_paths.run_path's kernels: SIMT for fp32, DMMA for fp64 up to d128 (SIMT past it), the
    tensor-core defaults for fp16/bf16."""
    _run(*problem, deterministic=deterministic)


@given(_problem(SMALL_COST, dtypes=tuple(SIXTEEN_BIT)), st.sampled_from(MMA_SYNC_BWD))
def test_mma_sync_kernels_with_modifiers_match_reference(problem, path):
    _run(*problem, mma_sync=path)


@given(case=_case(dtypes=tuple(SIXTEEN_BIT)), data=st.data())
def test_public_api_with_modifiers(case, data):
    """flash_attn_func / flash_attn_backward on CuPy arrays with a block_mask made on the GPU and
    the modifiers' tensors on the GPU."""
    import cupy

    score_mod, mask_mod = data.draw(modifiers_for(case, combos=GPU_COMBOS))
    q, k, v, do = make_inputs(case)
    device = [cupy.asarray(x) for x in (q, k, v, do)]
    on_gpu = lambda mod: None if mod is None else type(mod)(mod.fn, **{t.name: cupy.asarray(t.array)  # noqa: E731
                                                                          for t in mod.tensors})
    block_mask = None if mask_mod is None else cf.create_block_mask(on_gpu(mask_mod), case.batch, case.nheads,
                                                                   case.seqlen_q, case.seqlen_k)
    kwargs = dict(case.kwargs, score_mod=on_gpu(score_mod), block_mask=block_mask)
    with cf.testing.poisoned_outputs():
        o, lse = cf.flash_attn_func(*device[:3], **kwargs, return_lse=True)
        grads = cf.flash_attn_backward(device[3], *device[:3], o, lse, **kwargs)
    cf.testing.assert_attention_close(case, o, lse, grads, inputs=(q, k, v, do),
                                      variant={"score_mod": score_mod, "mask_mod": mask_mod})


@given(sizes=st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(0, 700), st.integers(0, 700)),
       mask=st.sampled_from(MASKS), seed=st.integers(0, 2**32 - 1))
def test_block_map_on_the_gpu_is_the_hosts(sizes, mask, seed):
    batch, nheads, seqlen_q, seqlen_k = sizes
    case = replace(zoo_case(), batch=batch, nheads_kv=nheads, group=1, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    mask_mod = make_mask_mod(mask, case, seed)
    gpu = M.BlockMask(mask_mod, batch, nheads, seqlen_q, seqlen_k, device="cuda")
    host = M.BlockMask(mask_mod, batch, nheads, seqlen_q, seqlen_k, device="cpu")
    np.testing.assert_array_equal(gpu.key_ranges, host.key_ranges)
    np.testing.assert_array_equal(gpu.query_ranges, host.query_ranges)
    np.testing.assert_array_equal(gpu.key_runs, host.key_runs)
    np.testing.assert_array_equal(gpu.query_runs, host.query_runs)


def documents_per_head_window(b, h, q_idx, kv_idx, doc, width):
    return (doc[q_idx] == doc[kv_idx]) & (abs(q_idx - kv_idx) <= width[h])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("headdim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mma_sync", [None, ("v5", True), ("v3", False)], ids=["default", "v5det", "v3"])
def test_whole_blocks_skip_the_predicate_and_match_reference(dtype, headdim, causal, mma_sync):
    """Documents of a few hundred tokens and a per-head window (the map per head, GQA group 2):
    most visited blocks are whole, so the kernels skip the predicate there (mask.cuh's map_full,
    by query granules in the forward and dQ, by key granules' group intersection in dK/dV), and
    the edges' blocks evaluate it. Against the float64 reference, forward and backward."""
    import cupy

    if mma_sync is not None and (dtype == "bfloat16" or headdim == 256):
        pytest.skip("the sm_80 paths: float16, d64 and d128 (the default path covers the rest)")
    seqlen = 1100
    case = replace(zoo_case(), batch=1, nheads_kv=2, group=2, seqlen_q=seqlen, seqlen_k=seqlen, headdim=headdim,
                   headdim_v=headdim,
                   causal=causal, dtype=np.dtype(dtype) if dtype != "bfloat16" else cf.testing.problem.as_dtype("bfloat16"),
                   seed=11 + headdim)
    doc = np.repeat(np.arange(4, dtype=np.int32), [300, 260, 390, 150])
    width = np.array([2000, 2000, 2000, 200], np.int32)  # head 3 narrows its group's runs
    mask_mod = cf.MaskMod(documents_per_head_window, doc=doc, width=width)
    bm = M.BlockMask(mask_mod, 1, case.nheads, seqlen, seqlen, device="cpu")
    assert bm.full_density() > 0.5 * bm.density()  # mostly whole blocks: the skipping is exercised
    q, k, v, do = make_inputs(case)
    mods = M.check_modifiers(None, mask_mod, None, batch=case.batch, nheads=case.nheads, seqlen_q=seqlen,
                             seqlen_k=seqlen, on_gpu=True)
    o, lse, *grads = run_path(case, (-1, -1), q, k, v, do, True, mma_sync=mma_sync, variant={"mods": mods.to(cupy)})
    check_against_reference(case, (-1, -1), q, k, v, do, o, lse, grads, {"mask_mod": mask_mod})


def zoo_case():
    return cf.testing.AttentionProblem(batch=1, seqlen_q=1, seqlen_k=1, nheads_kv=1, group=1, headdim=64, causal=False,
                                       softmax_scale=None, magnitude=1.0, dtype=np.float16, seed=0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("seqlen", [77, 1000])
def test_causal_by_mask_mod_is_causal_bitwise(dtype, seqlen):
    """A mask_mod equal to causal=True gives causal's o, lse and gradients bit for bit: the same
    key blocks (the block map's ranges are causal's), the same scores where the mask keeps them."""
    import cupy

    case = replace(zoo_case(), batch=2, nheads_kv=2, group=2, seqlen_q=seqlen, seqlen_k=seqlen, headdim=64,
                   dtype=np.dtype(dtype) if dtype != "bfloat16" else cf.testing.problem.as_dtype("bfloat16"), seed=9)
    q, k, v, do = (cupy.asarray(x) for x in make_inputs(case))
    causal = cf.flash_attn_func(q, k, v, causal=True, return_lse=True)
    masked = cf.flash_attn_func(q, k, v, mask_mod=zoo.causal, return_lse=True)
    g_causal = cf.flash_attn_backward(do, q, k, v, *causal, causal=True)
    g_masked = cf.flash_attn_backward(do, q, k, v, *masked, mask_mod=zoo.causal)
    bits = lambda x: x.view(cupy.uint16) if x.itemsize == 2 else x  # noqa: E731
    for a, b in zip((*causal, *g_causal), (*masked, *g_masked)):
        assert bool((bits(a) == bits(b)).all())


def test_alibi_by_score_mod_is_alibi_slopes():
    import cupy

    case = replace(zoo_case(), batch=2, nheads_kv=4, group=1, seqlen_q=700, seqlen_k=700, headdim=128,
                   dtype=cf.testing.problem.as_dtype("bfloat16"), seed=10)
    q, k, v, do = make_inputs(case)
    slopes = (2.0 ** (-np.arange(1, 5) * 2.0)).astype(np.float32)
    o_a = cf.flash_attn_func(*(cupy.asarray(x) for x in (q, k, v)), causal=True, alibi_slopes=slopes)
    o_s = cf.flash_attn_func(*(cupy.asarray(x) for x in (q, k, v)), causal=True,
                             score_mod=cf.ScoreMod(zoo.alibi, slopes=slopes))
    cf.testing.assert_attention_close(replace(case, causal=True), o_s, inputs=(q, k, v, do),
                                      variant={"alibi_slopes": slopes})
    assert float(cupy.abs(o_a.astype(cupy.float32) - o_s.astype(cupy.float32)).max()) < 2e-2


@given(_problem(SMALL_COST, dtypes=tuple(SIXTEEN_BIT)))
def test_deterministic_backward_with_modifiers_is_bitwise_repeatable(problem):
    import cupy

    case, window, score_mod, mask_mod = problem
    q, k, v, do = make_inputs(case)
    mods = M.check_modifiers(score_mod, mask_mod, None, batch=case.batch, nheads=case.nheads, seqlen_q=case.seqlen_q,
                             seqlen_k=case.seqlen_k, on_gpu=True).to(cupy)
    first = run_path(case, window, q, k, v, do, deterministic=True, variant={"mods": mods})
    again = run_path(case, window, q, k, v, do, deterministic=True, variant={"mods": mods})
    for a, b in zip(first, again):
        assert np.array_equal(a.view(np.uint16) if a.itemsize == 2 else a, b.view(np.uint16) if b.itemsize == 2 else b)

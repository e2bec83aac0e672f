"""The 16-bit backward's kernels with a producer warpgroup (kernels_cu/flash_bwd_wgmma_ws.cu,
flash_bwd_dq_wgmma_ws.cu; docs/perf-log.md wgmma-bwd-ws-v0, v13's pair at d64 and d128): v13's
pair of each head-dim tile (dev/mma_bwd.py's WGMMA_WS_ROUTE), launched through
mma_bwd.backward(wgmma_ws=..., dq_ws=...) with every score variant (the plans' own choice for them
too since v13), gives dQ, dK and dV bitwise equal to v10's kernels' on the same tiles
(mma_bwd.backward(wgmma=..., dq_config=...): flash_bwd_wgmma<...,
DqAdd::none> and flash_bwd_dq_wgmma, whose own tests hold them to the float64 reference), over
shapes, causal and windows, GQA and the score variants, fresh random inputs and NaN-poisoned
outputs; and the pair and every other candidate of dev/mma_bwd.py meet the float64 reference on
one odd shape. sm_90 only. The tuner's check of every dev entry (tests/dev/test_dev_mma_bwd.py)
covers the candidates too. On the CPU: the plain and window masks compile for sm_90a without
spills, at the launch's 168 registers."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cupyflash.bench import tune
from cupyflash.scores import Variant
from cupyflash.testing import attention_problems


DEV = tune.load_dev_backward()  # a source checkout's dev/mma_bwd.py
CANDIDATES = [(dt, config) for dt, configs in (DEV.WGMMA_WS_CANDIDATES if DEV else {}).items() for config in configs]
DQ_CANDIDATES = [(dt, config) for dt, configs in (DEV.DQ_WS_CANDIDATES if DEV else {}).items() for config in configs]
# the bitwise test's: v13's pair of each head-dim tile (dev/bench_wgmma_bwd_ws.py warm compiles what
# it draws)
PAIRS = [(dt, *DEV.WGMMA_WS_ROUTE[dt]) for dt in DEV.WGMMA_WS_ROUTE] if DEV else []
HEADDIMS = {64: (8, 40, 64), 128: (72, 96, 128)}
VARIANTS = ("plain", "softcap", "alibi")


def test_the_candidates_compile_for_sm90a_without_spills_on_the_plain_masks():
    """No mask, causal, a window, a packed causal batch and ALiBi with a window compile at 168
    registers (setmaxnreg: 128 x 40 + 256 x 232 = 384 x 168) without spills or serialized wgmma.
    (softcap, dropout and user modifiers spill 16-184 bytes: not candidates for those yet.)"""
    from cupyflash.backward_plans import dq_wgmma_ws_spec, wgmma_ws_spec
    from cupyflash.kernels import compile_check
    from cupyflash.masks import Causal, Local, NoMask
    from cupyflash.scores import Score

    try:
        compile_check.nvrtc_version()
    except Exception as exc:  # pragma: no cover - the CI installs NVRTC
        pytest.skip(f"NVRTC not available: {exc}")
    masks = (NoMask(), Causal(), Local(64, 0), Causal().as_packed(), Local(64, 0, score=Score(alibi=True)))
    specs = {wgmma_ws_spec(dtype, dt, mask, w) for dt, w, _ in PAIRS for mask in masks
             for dtype in ("bfloat16", "float16")}
    specs |= {dq_wgmma_ws_spec(dtype, dt, mask, q) for dt, _, q in PAIRS for mask in masks
              for dtype in ("bfloat16", "float16")}
    specs |= {wgmma_ws_spec("bfloat16", dt, Causal(), config) for dt, config in CANDIDATES}
    specs |= {dq_wgmma_ws_spec("bfloat16", dt, Causal(), config) for dt, config in DQ_CANDIDATES}
    specs = sorted(specs, key=lambda s: s.name)
    report, mangled, serialized = {}, {}, set()
    for source in ("flash_bwd_wgmma_ws.cu", "flash_bwd_dq_wgmma_ws.cu"):
        group = [s.expression for s in specs if s.source_file == source]
        _, names, log = compile_check.compile_cubin(source, group, "90a")
        mangled.update(names)
        report.update(compile_check.ptxas_report(log))
        serialized |= compile_check.wgmma_serialized_from_log(log)
    for s in specs:
        usage = report[mangled[s.expression]]
        assert usage["spill_stores"] == usage["spill_loads"] == 0, (s.name, usage)
        assert usage["registers"] == 168, (s.name, usage)
        assert mangled[s.expression] not in serialized, s.name
        assert s.smem_bytes <= 227 * 1024 and s.threads == 384, s.name


def _variant(name: str, nheads: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"softcap": {"softcap": 5.0},
            "alibi": {"alibi_slopes": rng.uniform(0.01, 0.5, nheads).astype(np.float32)}}.get(name, {})


def _backward(problem, options, deterministic=True, **tiles):
    """dq, dk, dv of mma_bwd.backward on the problem's inputs (o, lse from the plan's forward)."""
    import cupy

    from cupyflash.kernels import mma_bwd, mma_fwd

    q, k, v, do = (cupy.asarray(x) for x in problem.arrays())
    values = Variant(softcap=options.get("softcap", 0.0),
                     **{n: cupy.asarray(options[n]) for n in ("alibi_slopes",) if n in options})
    o = cupy.full(q.shape[:3] + v.shape[3:], np.nan, q.dtype)
    lse = cupy.full((problem.batch, problem.nheads, problem.seqlen_q), np.nan, np.float32)
    mma_fwd.forward(q, k, v, o, lse, softmax_scale=problem.scale, causal=problem.causal,
                    window_size=problem.window_size, variant=values)
    grads = [cupy.full(x.shape, np.nan, x.dtype) for x in (q, k, v)]
    mma_bwd.backward(do, q, k, v, o, lse, *grads, softmax_scale=problem.scale, causal=problem.causal,
                     deterministic=deterministic, window_size=problem.window_size, variant=values, **tiles)
    return [cupy.asnumpy(g) for g in grads]


@pytest.mark.gpu
@pytest.mark.parametrize("d_tile,config,dq_config", PAIRS, ids=[f"d{dt}" for dt, _, _ in PAIRS])
@settings(max_examples=40, deadline=None)
@given(data=st.data(), variant=st.sampled_from(VARIANTS))
def test_the_candidates_are_bitwise_the_shipped_kernels_on_their_tiles(d_tile, config, dq_config, data, variant):
    from cupyflash.kernels._module import device_arch

    if device_arch() != "90":
        pytest.skip("flash_bwd_wgmma_ws is sm_90a only")
    problem = data.draw(attention_problems(dtypes=("float16", "bfloat16"), windows=True, max_seqlen=700,
                                           headdims=HEADDIMS[d_tile]), label="problem")
    options = _variant(variant, problem.nheads, problem.seed)
    shipped = _backward(problem, options, wgmma=config[:2], dq_config=DEV.DQ_WGMMA_CONFIG[d_tile])
    candidate = _backward(problem, options, wgmma_ws=config, dq_ws=dq_config)
    for name, a, b in zip(("dq", "dk", "dv"), shipped, candidate):
        assert not np.isnan(a).any() or np.isnan(b).any(), name
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16), err_msg=f"{name} {config}")


@pytest.mark.gpu
@pytest.mark.parametrize("d_tile", sorted(HEADDIMS))
@settings(max_examples=20, deadline=None)
@given(data=st.data(), variant=st.sampled_from(VARIANTS))
def test_without_determinism_the_plan_runs_the_same_pair(d_tile, data, variant):
    """v14 / v15 (perf log wgmma-bwd-ws-nondet, -nondet-d64): on sm_90 ``deterministic=False`` at
    d64 and d128 runs the deterministic plan's kernels, so its dQ, dK and dV are bitwise the
    deterministic call's (float32 atomic adds in arrival order would not be)."""
    from cupyflash.kernels._module import device_arch

    if device_arch() != "90":
        pytest.skip("the producer pair is sm_90's")
    problem = data.draw(attention_problems(dtypes=("float16", "bfloat16"), windows=True, max_seqlen=700,
                                           headdims=HEADDIMS[d_tile]), label="problem")
    options = _variant(variant, problem.nheads, problem.seed)
    deterministic = _backward(problem, options)
    without = _backward(problem, options, deterministic=False)
    for name, a, b in zip(("dq", "dk", "dv"), deterministic, without):
        assert not np.isnan(a).any(), name
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16), err_msg=name)


def _tiles():
    return ([(dt, dict(wgmma_ws=c)) for dt, c in CANDIDATES] + [(dt, dict(dq_ws=c)) for dt, c in DQ_CANDIDATES]
            + [(dt, dict(wgmma_ws=w, dq_ws=q)) for dt, w, q in PAIRS])


@pytest.mark.gpu
@pytest.mark.parametrize("d_tile,tiles", _tiles(), ids=[f"d{dt}-{t}" for dt, t in _tiles()])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (40, 0))])
def test_the_candidate_meets_the_float64_reference(d_tile, tiles, causal, window):
    """The tuner's check (error within twice standard attention's in bfloat16) on its odd shape."""
    from cupyflash._dtypes import SUPPORTED
    from cupyflash.kernels._module import device_arch

    if device_arch() != "90":
        pytest.skip("flash_bwd_wgmma_ws is sm_90a only")
    ratio = tune._check_bwd(dict(deterministic=True, **tiles), d_tile, SUPPORTED["bfloat16"], causal, window=window)
    assert ratio <= 1, ratio

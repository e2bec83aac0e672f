"""The 16-bit forward with a producer warpgroup (kernels_cu/flash_fwd_wgmma_ws.cu, docs/perf-log.md
wgmma-fwd-ws-v0; sm_90's d128 row since wgmma-fwd-ws-route): each configuration of dev/mma_fwd.py's
WS_CANDIDATES and the shipped version's producer rows (v7's d128) launched as
mma_fwd.forward(config=...) at every head dim of its tile against the float64 reference under the
16-bit rule (cupyflash.testing.tolerance: twice standard attention's error in the dtype), over
shapes, causal and windows, GQA and the score variants, fresh random inputs, NaN-poisoned
outputs; sm_90 only. On the CPU, the compile test: the candidate's specializations compile for
sm_90a without spills and without serialized wgmma."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cupyflash.bench import tune
from cupyflash.kernels import mma_fwd
from cupyflash.scores import Variant
from cupyflash.testing import attention_problems

from tolerance import assert_attention_close

VARIANTS = ("plain", "softcap", "alibi")
# The kernel is launched directly, so without the API's padding: head dims it runs as they are.
HEADDIMS = {64: (8, 16, 40, 64), 128: (72, 96, 128), 256: (136, 200, 256)}


def _candidates():
    return tune.load_dev_forward().producer_configs()  # a source checkout's dev/mma_fwd.py


CANDIDATES = _candidates()


def test_the_candidates_compile_for_sm90a_without_spills():
    """Every mask and score variant of each candidate (the plain band, causal, a window, packed,
    softcap, ALiBi, a sink, dropout), compiled by NVRTC as the compile check does."""
    from cupyflash import plans
    from cupyflash.kernels import compile_check
    from cupyflash.masks import Causal, Local, NoMask
    from cupyflash.scores import Score

    try:
        compile_check.nvrtc_version()
    except Exception as exc:  # pragma: no cover - the CI installs NVRTC
        pytest.skip(f"NVRTC not available: {exc}")
    masks = (NoMask(), Causal(), Local(64, 0), Causal().as_packed(), Causal(score=Score(softcap=True)),
             Local(64, 0, score=Score(alibi=True)), Causal(score=Score(sink=True)), Causal(score=Score(dropout=True)))
    # every mask with the first candidate of each head-dim tile; causal float16 with all of them
    firsts = {dt: config for _, dt, config in reversed(CANDIDATES)}
    specs = {plans.specialization_for("bfloat16", dt, mask, config) for dt, config in firsts.items() for mask in masks}
    specs |= {plans.specialization_for("float16", dt, Causal(), config) for _, dt, config in CANDIDATES}
    specs = sorted(specs, key=lambda s: s.name)
    _, mangled, log = compile_check.compile_cubin("flash_fwd_wgmma_ws.cu", [s.expression for s in specs], "90a")
    report, serialized = compile_check.ptxas_report(log), compile_check.wgmma_serialized_from_log(log)
    for s in specs:
        usage = report[mangled[s.expression]]
        assert usage["spill_stores"] == usage["spill_loads"] == 0, (s.name, usage)
        # setmaxnreg moves registers within the launch allocation: the consumers' raise to 240
        # waits forever unless the kernel launches with all 168 (128 x 24 + 256 x 240 = 384 x 168)
        assert usage["registers"] == 168, (s.name, usage)
        assert mangled[s.expression] not in serialized, s.name
        assert s.smem_bytes <= 227 * 1024, s.name


def _variant_options(name: str, nheads: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"softcap": {"softcap": 5.0},
            "alibi": {"alibi_slopes": rng.uniform(0.01, 0.5, nheads).astype(np.float32)}}.get(name, {})


@pytest.mark.gpu
@pytest.mark.parametrize("label,d_tile,config", CANDIDATES, ids=[c[0] for c in CANDIDATES])
@given(data=st.data(), variant=st.sampled_from(VARIANTS))
def test_the_candidate_meets_the_16_bit_rule(label, d_tile, config, data, variant):
    import cupy

    from cupyflash.kernels._module import device_arch

    if device_arch() != "90":
        pytest.skip("flash_fwd_wgmma_ws is sm_90a only")
    problem = data.draw(attention_problems(dtypes=("float16", "bfloat16"), windows=True, max_seqlen=600,
                                           headdims=HEADDIMS[d_tile], distinct_v=False), label="problem")
    q, k, v, _ = problem.arrays()
    options = _variant_options(variant, problem.nheads, problem.seed)
    values = Variant(softcap=options.get("softcap", 0.0),
                     **{n: cupy.asarray(options[n]) for n in ("alibi_slopes",) if n in options})
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    o = cupy.full(q.shape[:3] + v.shape[3:], np.nan, q.dtype)
    lse = cupy.full((problem.batch, problem.nheads, problem.seqlen_q), np.nan, np.float32)
    mma_fwd.forward(qd, kd, vd, o, lse, softmax_scale=problem.scale, causal=problem.causal,
                    window_size=problem.window_size, variant=values, config=config)
    assert_attention_close(problem, cupy.asnumpy(o), cupy.asnumpy(lse), variant=options)

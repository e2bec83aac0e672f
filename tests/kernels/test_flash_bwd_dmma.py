"""flash_bwd_dkdv_dmma, flash_bwd_dq_dmma and flash_bwd_stats_dmma (kernels_cu/), the float64 backward
on the FP64 tensor cores: its plans and specializations on the CPU, and on a GPU its gradients
against the float64 reference and against the SIMT backward, which takes the same policies through
the same calls, through its launcher (cupyflash.kernels.dmma.backward)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from models.mirrors import MIRRORED, missing_statements
from models.mma_bwd_walks import dmma_walk, simt_walk
from windows import window_size

from cupyflash import backward_plans, plans, reference
from cupyflash.backward_plans import DMMA_BACKWARD_TILES, MMA_SYNC, SM90, DmmaBwdConfig, Tf32WgmmaBwdConfig
from cupyflash.kernels import dmma
from cupyflash.masks import KINDS, PACKED_KINDS, VARIANT_KINDS, as_mask, mask_for


def test_float64_backward_plans_run_dmma_up_to_d128():
    """Every device class and head dim up to 128: statistics (or D), dK/dV, dQ on one DmmaBwdConfig,
    sm_90's wide (m16n8k8), its d128 dK/dV kernel on warp pairs; past 128 the SIMT kernels."""
    for arch, where in (("90", SM90), ("80", MMA_SYNC), (None, MMA_SYNC)):
        for headdim, dt in ((8, 16), (40, 64), (64, 64), (100, 128), (128, 128)):
            config = DMMA_BACKWARD_TILES[(where, dt)]
            for statistics, first in (("saved", "flash_bwd_preprocess_fp64"), ("recomputed", "flash_bwd_stats_dmma")):
                plan = backward_plans.plan_backward(arch, np.float64, headdim, True, None, True, statistics=statistics)
                assert (plan.family, plan.d_tile, plan.kernels, plan.dq_add) == ("mma", dt, config, "none")
                names = [launch.spec.name for launch in plan.launches]
                assert names[0].startswith(first) and names[1].startswith("flash_bwd_dkdv_dmma_" + ("pairs_" if config.dkdv_pairs else "") + "fp64")
                assert names[2].startswith("flash_bwd_dq_dmma_fp64")
                assert all(launch.spec.arch == ("90" if config.wide else "") for launch in plan.launches[1:])
            assert config.wide == (where == SM90) and config.dkdv_pairs == (where == SM90 and dt == 128)
    assert backward_plans.plan_backward("90", np.float64, 136, True, None, True).family == "simt"
    assert backward_plans.backward_family(np.float64, 128) == "mma"
    assert backward_plans.backward_family(np.float32, 64) == "mma"
    assert backward_plans.backward_family(np.float32, 136) == "simt"


def test_float32_backward_plans_run_tf32x3_up_to_d128():
    """float32's backward up to d128 (padded to a multiple of 8) is the DMMA backward's three kernels
    on T = float with TF32X3_BACKWARD_CONFIGS' tiles on every device class from sm_80, both
    statistics (but sm_90's saved-statistics rows at the d64 and d128 tiles, below); past d128, and before
    sm_80, the SIMT kernels."""
    for arch, smem in (("80", 163 * 1024), ("86", 99 * 1024), ("89", 99 * 1024), ("90", 227 * 1024), ("90", None)):
        for headdim, dt in ((1, 16), (8, 16), (24, 32), (40, 64), (64, 64), (100, 128), (128, 128)):
            config = backward_plans.tf32x3_backward_config(headdim)
            for statistics, first in (("saved", "flash_bwd_preprocess_fp32"), ("recomputed", "flash_bwd_stats_dmma_fp32")):
                if arch == "90" and dt in (64, 128) and statistics == "saved":
                    continue  # TF32_WGMMA_BACKWARD_ROUTE's
                plan = backward_plans.plan_backward(arch, np.float32, plans.mma_headdim(headdim), True, smem, True,
                                                    statistics=statistics)
                assert (plan.family, plan.d_tile, plan.kernels, plan.dq_add) == ("mma", dt, config, "none")
                names = [launch.spec.name for launch in plan.launches]
                assert names[0].startswith(first)
                assert names[1].startswith(f"flash_bwd_dkdv_dmma_fp32_hdim{dt}_") and names[1].endswith("_tf32x3")
                assert names[2].startswith(f"flash_bwd_dq_dmma_fp32_hdim{dt}_") and names[2].endswith("_tf32x3")
                assert all(launch.spec.arch == "" and (smem is None or launch.spec.smem_bytes <= smem)
                           for launch in plan.launches)
    assert backward_plans.plan_backward("90", np.float32, 136, True, None, True).family == "simt"
    assert backward_plans.plan_backward("75", np.float32, 64, True, 64 * 1024, True).family == "simt"


def test_float32_saved_statistics_at_sm90_d64_run_the_tf32_wgmma_route(monkeypatch):
    """sm_90's float32 backward with statistics "saved" at the d64 tile (head dims 40-64): dK / dV
    on the producer warpgroup's tf32 wgmma kernel and dQ on its producer kernel too
    (tf32_wgmma_route), deterministic or not, every mask and score of the compile check (with a
    user modifier, where ptxas finds
    no spills in its kernels: tf32x3 otherwise); tf32x3 where the arrays do not fit its loaders,
    with statistics "recomputed", at other tiles and other archs."""
    from cupyflash.masks import KINDS, PACKED_KINDS, VARIANT_KINDS

    spilling = set()  # ptxas's answer, as without_spills asks it (plans._spills), made up here
    monkeypatch.setattr(plans, "_spills", lambda spec, arch: any(part in spec.name for part in spilling))

    table = backward_plans.TF32_WGMMA_BACKWARD_ROUTE[(SM90, 64)]
    assert table.producer and table.sums_apart and table.precision == "ieee" and not table.fused_dq
    # dQ by its producer kernel copying key blocks split once, two consumers (tf32-split-once); dK / dV's
    # producer copying query blocks split once (tf32-split-once-dkdv)
    assert table.dq_producer and table.dq_presplit and table.dq_consumers == 2 and table.dq_raw_stages == 0
    assert table.presplit and table.raw_stages == 0
    for mask in [*KINDS, *(m.backward() for m in VARIANT_KINDS + PACKED_KINDS)]:
        route = backward_plans.tf32_wgmma_route(SM90, 64, mask)
        dq_kernel = "flash_bwd_dq_tf32_wgmma_ws" if route.dq_producer else "flash_bwd_dq_tf32_wgmma"
        for headdim in (40, 64):
            for deterministic in (True, False):
                plan = backward_plans.plan_backward("90", np.float32, headdim, mask, 227 * 1024, deterministic)
                names = [launch.spec.name for launch in plan.launches]
                assert plan.kernels == route and plan.dq_add == "none" and plan.device_class == SM90, names
                assert names[0] == "flash_bwd_preprocess_fp32"
                packed = "_packed" if mask.packed else ""
                # the query blocks split once (tf32-split-once-dkdv), then dK / dV from them
                assert names[1] == f"flash_bwd_split_q_tf32_fp32_hdim64_bm32{packed}", names
                assert names[2].startswith(f"flash_bwd_dkdv_tf32_wgmma_ws_fp32_hdim64_{mask.name}_"), names
                assert names[2].endswith("_presplit"), names
                assert names[3] == f"flash_bwd_split_kv_tf32_fp32_hdim64_bn32{packed}", names
                assert names[4].startswith(f"{dq_kernel}_fp32_hdim64_{mask.name}_"), names
                assert names[4].endswith("_apart_presplit" if mask.score.dropout else "_c2_presplit"), names
                assert all(launch.spec.arch == "90a" and launch.spec.smem_bytes <= 227 * 1024
                           for launch in plan.launches[1:])
    spilling.add("_tf32_wgmma_")
    users = [m.backward() for m in VARIANT_KINDS + PACKED_KINDS if m.score.user is not None]
    assert users
    for mask in [*KINDS, *users]:
        plan = backward_plans.plan_backward("90", np.float32, 64, mask, 227 * 1024, True)
        assert plan.kernels == (backward_plans.tf32x3_backward_config(64) if mask.score.user is not None
                                else backward_plans.tf32_wgmma_route(SM90, 64, mask))
    tf32x3 = backward_plans.tf32x3_backward_config(64)
    for arch, statistics, layout, smem in (("90", "recomputed", True, None), ("90", "saved", False, None),
                                           ("90", "saved", True, 160 * 1024), ("80", "saved", True, None)):
        plan = backward_plans.plan_backward(arch, np.float32, 64, True, smem, True, statistics=statistics,
                                            tf32_wgmma_layout=layout)
        assert plan.kernels == tf32x3, (arch, statistics, layout, smem)
    assert backward_plans.plan_backward("90", np.float32, 24, True, None, True).kernels == tf32x3
    assert backward_plans.plan_backward("90", np.float64, 64, True, None, True).kernels == \
        backward_plans.DMMA_BACKWARD_TILES[(SM90, 64)]


def test_a_two_consumer_dq_route_takes_one_consumer_with_dropout(monkeypatch):
    """tf32_wgmma_route: a route row with two dQ consumers keeps them for every mask but dropout's,
    whose keep bits spill beside the second consumer's dQ rows (ptxas at sm_90a), and the plan and
    the compile check's list follow it."""
    two = Tf32WgmmaBwdConfig(32, 1, producer=True, dq_raw_stages=1, dq_producer=True, dq_consumers=2)
    monkeypatch.setitem(backward_plans.TF32_WGMMA_BACKWARD_ROUTE, (SM90, 64), two)
    masks = [*KINDS, *(m.backward() for m in VARIANT_KINDS + PACKED_KINDS)]
    assert any(m.score.dropout for m in masks) and any(not m.score.dropout for m in masks)
    listed = {spec.name for spec in dmma.specializations()}
    for mask in masks:
        route = backward_plans.tf32_wgmma_route(SM90, 64, mask)
        assert route.dq_consumers == (1 if mask.score.dropout else 2) and route.dq_producer, mask.name
        if mask.score.user is None:  # (with one, the plan asks ptxas: the test above)
            assert backward_plans.plan_backward("90", np.float32, 64, mask, 227 * 1024, True).kernels == route
        assert {backward_plans.tf32_wgmma_spec(kind, 64, mask, route).name for kind in ("dkdv", "dq")} <= listed
    assert backward_plans.tf32_wgmma_route(MMA_SYNC, 64, as_mask(True)) is None


def test_specializations_mirror_the_kernels_tiles():
    config = DmmaBwdConfig(16, 4, 2, 16, 4, 2, True)
    mask = as_mask(True)
    dkdv = backward_plans.dmma_spec("dkdv", 64, mask, config)
    assert dkdv.name == "flash_bwd_dkdv_dmma_fp64_hdim64_causal_bm16_bn64_w4_mt2_wide"
    assert dkdv.expression == "cf::flash_bwd_dkdv_dmma<64, cf::Causal, 16, 4, 2, true>"
    # K and V of 64 keys, two stages of Q, dO (16 rows) and four statistics; rows of 64 + 4 doubles
    assert dkdv.threads == 128 and dkdv.smem_bytes == 8 * (2 * 64 * 68 + 2 * (2 * 16 * 68 + 4 * 16))
    dq = backward_plans.dmma_spec("dq", 64, mask, config)
    assert dq.name == "flash_bwd_dq_dmma_fp64_hdim64_causal_bm64_bn16_w4_mt2_wide"
    assert dq.expression == "cf::flash_bwd_dq_dmma<64, cf::Causal, 16, 4, 2, true>"
    assert dq.smem_bytes == 8 * (2 * 64 * 68 + 4 * 16 * 68) and dq.arch == "90"
    stats = backward_plans.dmma_spec("stats", 64, mask, config)
    assert stats.name == dq.name.replace("_dq_", "_stats_") and stats.smem_bytes == dq.smem_bytes
    with pytest.raises(ValueError, match="no DMMA backward kernel"):
        backward_plans.dmma_spec("fwd", 64, mask, config)
    # the warp pairs' dK/dV kernel (sm_90's d128 row): 4 pairs of 16 keys, each dV warp handing its
    # partner 2 x 2 x 2 entries of P a lane per step
    pairs = DmmaBwdConfig(16, 8, 2, 16, 4, 2, True, True)
    spec = backward_plans.dmma_spec("dkdv", 128, mask, pairs)
    assert spec.name == "flash_bwd_dkdv_dmma_pairs_fp64_hdim128_causal_bm16_bn64_w8" and spec.arch == "90"
    assert spec.expression == "cf::flash_bwd_dkdv_dmma_pairs<128, cf::Causal, 16, 8>" and spec.threads == 256
    assert spec.smem_bytes == 8 * (2 * 64 * 132 + 2 * (2 * 16 * 132 + 4 * 16) + 4 * 8 * 32)
    assert backward_plans.dmma_spec("dq", 128, mask, pairs).name == "flash_bwd_dq_dmma_fp64_hdim128_causal_bm64_bn16_w4_mt2_wide"
    with pytest.raises(ValueError, match="warp pairs"):
        backward_plans.dmma_spec("dkdv", 128, mask, DmmaBwdConfig(16, 8, 1, 16, 4, 1, False, True))
    # every tile row's three kernels for every mask kind the compile check builds, beside the forward's
    names = {s.name for s in dmma.specializations()}
    kinds = len(KINDS) + len(VARIANT_KINDS) + len(PACKED_KINDS)
    distinct = {(dt, c) for (_, dt), c in DMMA_BACKWARD_TILES.items()}
    tf32 = len(dmma.D_TILES)  # float32's rows: tf32x3 at each DMMA head-dim tile
    # and its wgmma candidates: the one-warpgroup and the producer dK/dV kernels, and the
    # one-warpgroup and the producer dQ kernels, the latter also copying key blocks split once;
    # the split's own kernel, dense and packed
    wgmma = {backward_plans.tf32_wgmma_spec(kind, dt, as_mask(True), c).name
             for dt, configs in backward_plans.TF32_WGMMA_BACKWARD_CONFIGS.items() for c in configs
             for kind in ("dkdv", "dq")}
    assert len(wgmma) == 6
    splits = {n for n in names if n.startswith(("flash_bwd_split_kv_tf32_", "flash_bwd_split_q_tf32_"))}
    assert splits == {"flash_bwd_split_kv_tf32_fp32_hdim64_bn32", "flash_bwd_split_kv_tf32_fp32_hdim64_bn32_packed",
                      "flash_bwd_split_q_tf32_fp32_hdim64_bm32", "flash_bwd_split_q_tf32_fp32_hdim64_bm32_packed"}
    # and the route's kernels as each mask takes them (tf32_wgmma_route), where no candidate row is
    # the same (a route with two dQ consumers adds its dQ kernel for the masks without dropout)
    masks = [*KINDS, *(m.backward() for m in VARIANT_KINDS + PACKED_KINDS)]
    candidates = {(dt, c) for dt, configs in backward_plans.TF32_WGMMA_BACKWARD_CONFIGS.items() for c in configs}

    def route_spec(kind, where, dt, mask):
        return backward_plans.tf32_wgmma_spec(kind, dt, mask, backward_plans.tf32_wgmma_route(where, dt, mask))

    # (no route where tf32_wgmma_route gives none, nor at d128 with a user modifier: dmma.specializations)
    routed = sum(1 for where, dt in backward_plans.TF32_WGMMA_BACKWARD_ROUTE for mask in masks
                 for kind in ("dkdv", "dq")
                 if backward_plans.tf32_wgmma_route(where, dt, mask) is not None
                 and not (dt == 128 and mask.score.user is not None)
                 and not any(backward_plans.tf32_wgmma_spec(kind, dt, mask, c).name
                             == route_spec(kind, where, dt, mask).name for d, c in candidates if d == dt))
    assert sum(1 for n in names if "_bwd_" in n) == (3 * kinds * (len(distinct) + tf32) + kinds * len(wgmma) + routed
                                                     + len(splits))


WALK_SOURCES = ("flash_bwd_dkdv_dmma", "flash_bwd_dkdv_dmma_pairs", "flash_bwd_dkdv_simt", "block_walk.cuh")


@pytest.mark.parametrize("source", WALK_SOURCES)
def test_walk_mirrors_match_the_kernel_sources(source):
    """The float64 and SIMT dK/dV kernels' walks (models/mma_bwd_walks.py: dmma_walk, simt_walk) are
    still the statements of their kernels and of block_walk.cuh, whitespace aside."""
    assert any(m.source == source for m in MIRRORED)
    assert not (missing := missing_statements(source)), f"mirrored statements no longer in {source}: {missing}"


class _QueryRange:
    """A mask policy reduced to one key block's query range [begin, end): any pair of non-negative
    rows, an empty one (end <= begin) too, as the band's and the block map's ranges are."""

    def __init__(self, begin, end):
        self.begin, self.end = begin, end

    def query_begin(self, n0, seqlen_q, seqlen_k):
        return self.begin

    def query_end(self, n0, cols, seqlen_q, seqlen_k):
        return self.end


def _row_offset_walk(mask, n0, block_n, block_m, seqlen_q, seqlen_k, group, head_kv):
    """The steps flash_bwd_dkdv_dmma and _pairs counted from row offsets before they took
    QueryBlockWalk: blocks = ceil((m_end - m_first) / BLOCK_M) from m_first, the first block's row."""
    m_first = mask.query_begin(n0, seqlen_q, seqlen_k) // block_m * block_m
    m_end = mask.query_end(n0, block_n, seqlen_q, seqlen_k)
    blocks = -(-(m_end - m_first) // block_m) if m_end > m_first else 0
    return [(head_kv * group + step // blocks, m_first + step % blocks * block_m) for step in range(blocks * group)]


@given(st.integers(0, 400), st.integers(0, 400), st.sampled_from([8, 16, 32, 64]), st.integers(1, 4),
       st.integers(0, 3))
def test_the_float64_and_simt_walks_are_query_block_walks(begin, end, block_m, group, head_kv):
    """flash_bwd_dkdv_dmma (and _pairs) step through QueryBlockWalk's iterations, and
    flash_bwd_dkdv_simt walks rows from its m_first while below its unrounded end m_end: the same
    (query head, query block) pairs in the same order, which are those these kernels counted from
    row offsets before, for any query range. Rounded to blocks, an empty range (end <= begin) whose
    end lies past the first block's first row walks that block (every pair of it hidden), in all
    three counts alike."""
    mask = _QueryRange(begin, end)
    args = (mask, 0, 64, block_m, 512, 512, group, head_kv)
    steps = dmma_walk(*args)
    assert steps == simt_walk(*args) == _row_offset_walk(*args)
    blocks = range(begin // block_m, -(-end // block_m))
    assert steps == [(head_kv * group + h, b * block_m) for h in range(group) for b in blocks]


@given(st.integers(1, 300), st.integers(1, 300), st.booleans(), window_size(), st.sampled_from([8, 16, 32]),
       st.sampled_from([16, 32, 64]))
def test_the_float64_and_simt_walks_visit_the_masks_query_blocks(seqlen_q, seqlen_k, causal, window, block_m,
                                                                 block_n):
    """For the band policies the walks visit exactly the query blocks the policy says see the key
    block (masks.Mask.query_blocks, checked against brute force in tests/test_masks.py)."""
    mask = mask_for(causal, window)
    for n0 in range(0, seqlen_k, block_n):
        args = (mask, n0, block_n, block_m, seqlen_q, seqlen_k, 1, 0)
        expected = [(0, b * block_m) for b in mask.query_blocks(n0, block_n, block_m, seqlen_q, seqlen_k)]
        assert dmma_walk(*args) == simt_walk(*args) == _row_offset_walk(*args) == expected


def test_a_row_past_the_devices_shared_memory_runs_simt():
    """sm_86 / sm_89 (99 KiB a block) cannot take the d128 dK/dV block of the other archs' row: the
    SIMT plan runs there, as before the DMMA backward; d64 fits."""
    for statistics in ("saved", "recomputed"):
        plan = backward_plans.plan_backward("86", np.float64, 128, True, 99 * 1024, True, statistics=statistics)
        assert plan.family == "simt" and all("_simt_" in launch.spec.name for launch in plan.launches[1:])
        assert plan.spec("stats") is not None if statistics == "recomputed" else plan.spec("preprocess") is not None
        assert backward_plans.plan_backward("86", np.float64, 64, True, 99 * 1024, True,
                                            statistics=statistics).kernels == DMMA_BACKWARD_TILES[(MMA_SYNC, 64)]
    assert backward_plans.plan_backward("80", np.float64, 128, True, 163 * 1024, True).kernels == \
        DMMA_BACKWARD_TILES[(MMA_SYNC, 128)]
    assert backward_plans.plan_backward("75", np.float64, 64, True, 64 * 1024, True).family == "simt"  # no DMMA


def test_smem_fits_the_device_classes():
    """sm_90's blocks 227 KiB; the others' rows fit an A100 (163 KiB), d64 also sm_86 / sm_89 (99 KiB)."""
    for (where, dt), config in DMMA_BACKWARD_TILES.items():
        for kind in ("dkdv", "dq"):
            need = backward_plans.dmma_smem_bytes(kind, dt, config)
            assert need <= (227 if where == SM90 else 163) * 1024
            if where == MMA_SYNC and dt <= 64:
                assert need <= 99 * 1024


# --- on the GPU -------------------------------------------------------------------------------

def _gradients(do, q, k, v, *, causal, backward, window_size=(-1, -1), packed=None, statistics="saved",
               softmax_scale=None, **variant):
    """(dq, dk, dv) of ``backward`` (dmma.backward with its options, or simt.backward) on the float64
    forward's o and lse, NaN-poisoned outputs."""
    import cupy

    from cupyflash.dropout import check_dropout
    from cupyflash.kernels import simt
    from cupyflash.scores import Variant

    dropout = check_dropout(variant.pop("dropout_p", 0.0), variant.pop("seed", None), 0)
    values = Variant(softcap=variant.get("softcap", 0.0), dropout=dropout, statistics=statistics,
                     **{name: cupy.asarray(np.asarray(variant[name], np.float32))
                        for name in ("alibi_slopes", "sink") if name in variant})
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    o = cupy.full(q.shape[:-1] + v.shape[-1:], np.nan, q.dtype)
    lse = cupy.full((q.shape[0], q.shape[2], q.shape[1]), np.nan, q.dtype)
    simt.forward(qd, kd, vd, o, lse, softmax_scale=scale, causal=causal, window_size=window_size, variant=values,
                 packed=packed)
    grads = [cupy.full(x.shape, np.nan, x.dtype) for x in (qd, kd, vd)]
    backward(dod, qd, kd, vd, o, lse, *grads, softmax_scale=scale, causal=causal, window_size=window_size,
             variant=values, packed=packed)
    return [g.get() for g in grads]


def _assert_close(got, want, rtol=1e-11):
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert np.isfinite(a).all(), name
        assert np.abs(a - b).max() <= rtol * (1 + np.abs(b).max()), name


def _config_or_skip(config):
    from cupyflash.kernels._module import device_arch
    from cupyflash.kernels.mma_fwd import current_smem_optin

    if config is not None and config.wide and device_arch() != "90":
        pytest.skip("m16n8k8 .f64: the wide layout is compiled for sm_90")
    if config is not None and any(backward_plans.dmma_smem_bytes(kind, 128, config) > current_smem_optin()
                                  for kind in ("dkdv", "dq")):
        pytest.skip("more shared memory than this device's blocks may take")


@pytest.mark.gpu
@pytest.mark.parametrize("headdim", [8, 40, 64, 100, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_the_reference(headdim, causal):
    import functools

    rng = np.random.default_rng(headdim + causal)
    q = rng.standard_normal((2, 150, 4, headdim))
    k, v = (rng.standard_normal((2, 173, 2, headdim)) for _ in range(2))
    do = rng.standard_normal(q.shape)
    got = _gradients(do, q, k, v, causal=causal, backward=functools.partial(dmma.backward))
    _assert_close(got, reference.attention_backward(do, q, k, v, causal=causal))


# Against the SIMT backward: the same policies through the same calls, to float64's rounding.
SIMT_VARIANTS = {
    "window": dict(causal=False, window_size=(17, 5)),
    "softcap+sink": dict(causal=True, softcap=2.5, sink=[0.5, -1.0, 2.0, 0.0]),
    "alibi": dict(causal=True, alibi_slopes=[0.25, 0.0625, 0.5, 0.125]),
    "dropout": dict(causal=True, dropout_p=0.2, seed=5),
    "recomputed": dict(causal=True, statistics="recomputed"),
    "recomputed+sink+dropout": dict(causal=False, statistics="recomputed", sink=[0.5, -1.0, 2.0, 0.0],
                                    dropout_p=0.1, seed=3),
}
# sm_90's plan rows and the other archs' (m8n8k4) on this GPU
CONFIGS = [None, DMMA_BACKWARD_TILES[(MMA_SYNC, 64)], DMMA_BACKWARD_TILES[(MMA_SYNC, 128)],
           DmmaBwdConfig(32, 2, 2, 32, 2, 2, True),
           DMMA_BACKWARD_TILES[(SM90, 128)]]  # sm_90's d128 row (warp pairs) at every head dim


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS, ids=["plan", "sm80_d64", "sm80_d128", "wide_bm32", "pairs"])
@pytest.mark.parametrize("name", list(SIMT_VARIANTS))
@pytest.mark.parametrize("headdim, headdim_v", [(24, 24), (64, 40), (128, 128)])
def test_gradients_match_the_simt_backward(config, name, headdim, headdim_v):
    import functools

    from cupyflash.kernels import simt

    _config_or_skip(config)
    if config is CONFIGS[3] and headdim > 64:
        pytest.skip("two m-tiles of dK and dV at d128 take 256 registers")
    if config is CONFIGS[1] and headdim > 64:
        pytest.skip("2 warps copy rows of at most 64 doubles a step (cp_async_rows_scalar): a d64 row")
    rng = np.random.default_rng(headdim + 3)
    q = rng.standard_normal((2, 150, 4, headdim))
    k = rng.standard_normal((2, 173, 2, headdim))
    v = rng.standard_normal((2, 173, 2, headdim_v))
    do = rng.standard_normal(q.shape[:-1] + (headdim_v,))
    options = dict(SIMT_VARIANTS[name])
    got = _gradients(do, q, k, v, backward=functools.partial(dmma.backward, config=config), **dict(options))
    want = _gradients(do, q, k, v, backward=simt.backward, **dict(options))
    _assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("statistics", ["saved", "recomputed"])
@pytest.mark.parametrize("config", [None, DMMA_BACKWARD_TILES[(MMA_SYNC, 64)], CONFIGS[4]], ids=["plan", "sm80", "pairs"])
def test_gradients_match_the_simt_backward_on_a_packed_batch(config, statistics):
    import functools

    import cupy

    from cupyflash.kernels import simt
    from cupyflash.kernels.params import PackedBatch

    _config_or_skip(config)
    rng = np.random.default_rng(5)
    lengths_q, lengths_k = [0, 33, 190, 7, 64], [5, 40, 150, 0, 64]
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    q = rng.standard_normal((1, cu_q[-1], 4, 64))
    k, v = (rng.standard_normal((1, cu_k[-1], 2, 64)) for _ in range(2))
    do = rng.standard_normal(q.shape)
    packed = PackedBatch(cupy.asarray(cu_q), cupy.asarray(cu_k), max(lengths_q), max(lengths_k))
    got = _gradients(do, q, k, v, causal=True, packed=packed, statistics=statistics,
                     backward=functools.partial(dmma.backward, config=config))
    want = _gradients(do, q, k, v, causal=True, packed=packed, statistics=statistics, backward=simt.backward)
    _assert_close(got, want)


@pytest.mark.gpu
def test_the_api_runs_the_dmma_backward_for_float64():
    """flash_attn_backward on float64 up to d128 launches the DMMA kernels (backend auto and mma),
    past it the SIMT ones; backend="simt" keeps SIMT."""
    import cupy

    import cupyflash
    from cupyflash.kernels import _module

    rng = np.random.default_rng(11)
    launched = []
    real_launch = _module.launch

    def spy(spec, *args, **kwargs):
        launched.append(spec.name)
        return real_launch(spec, *args, **kwargs)

    for headdim, backend, family in ((64, "auto", "_dmma_"), (72, "mma", "_dmma_"), (64, "simt", "_simt_"),
                                     (136, "auto", "_simt_")):
        q, k, v, do = (cupy.asarray(rng.standard_normal((1, 70, 2, headdim))) for _ in range(4))
        o, lse = cupyflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
        launched.clear()
        import cupyflash.kernels.simt as simt_module

        simt_module.launch, saved = spy, simt_module.launch
        try:
            grads = cupyflash.flash_attn_backward(do, q, k, v, o, lse, causal=True, backend=backend)
        finally:
            simt_module.launch = saved
        assert [name for name in launched if "_bwd_" in name and "preprocess" not in name], (headdim, backend)
        assert all(family in name for name in launched if "dkdv" in name or "_dq_" in name), launched
        want = reference.attention_backward(*(x.get() for x in (do, q, k, v)), causal=True)
        _assert_close([g.get() for g in grads], want)


# --- float32's backward (tf32x3; the plan's rows up to d128 since tf32x3-route): the same kernels
# on float, each product three tf32 products of split operands (perf log tf32-bwd-v0) ----------

@pytest.mark.gpu
@pytest.mark.parametrize("statistics", ["saved", "recomputed"])
@pytest.mark.parametrize("name", ["window", "softcap+sink", "alibi", "dropout"])
# head dims 8 and 24: the d16 and d32 tiles, which the route added to the plans (never run before it)
@pytest.mark.parametrize("headdim, dkdv", [(8, "mma"), (24, "mma"), (40, "mma"), (64, "mma"), (128, "mma"),
                                           (40, "wgmma"), (64, "wgmma"), (64, "wgmma_fused")])
def test_tf32x3_experiment_is_as_accurate_as_the_simt_float32_backward(headdim, dkdv, name, statistics, monkeypatch):
    """Against the float64 reference (the SIMT float32 backward's gradients on the same float32
    inputs as the measure): within 4x the SIMT kernels' error, plus float32's rounding of the
    largest gradient; the experiment's kernels are the ones that ran (dkdv "wgmma": dK, dV and dQ
    on the candidates flash_bwd_dkdv_tf32_wgmma and flash_bwd_dq_tf32_wgmma, sm_90 only;
    "wgmma_fused": dQ by the dK/dV kernel's atomics)."""
    import functools

    from cupyflash.kernels import simt

    launched = _tf32x3_or_skip(monkeypatch)
    if dkdv != "mma":
        _wgmma_or_skip()

    rng = np.random.default_rng(headdim + 5)
    q = rng.standard_normal((2, 150, 4, headdim)).astype(np.float32)
    k, v = (rng.standard_normal((2, 173, 2, headdim)).astype(np.float32) for _ in range(2))
    do = rng.standard_normal(q.shape).astype(np.float32)
    options = {key: value for key, value in SIMT_VARIANTS[name].items()}
    config = (backward_plans.tf32x3_backward_config(headdim) if dkdv == "mma" else
              Tf32WgmmaBwdConfig(fused_dq=dkdv == "wgmma_fused"))
    backward = functools.partial(dmma.backward, config=config,
                                 deterministic=not getattr(config, "fused_dq", False))  # fused: dQ by atomics
    got = _gradients(do, q, k, v, backward=backward, statistics=statistics, **dict(options))
    simt_grads = _gradients(do, q, k, v, backward=simt.backward, statistics=statistics, **dict(options))
    want = _gradients(*(x.astype(np.float64) for x in (do, q, k, v)), backward=simt.backward, statistics=statistics,
                      **dict(options))
    for which, a, s, w in zip(("dq", "dk", "dv"), got, simt_grads, want):
        assert np.isfinite(a).all(), which
        error, simt_error = np.abs(a - w).max(), np.abs(s - w).max()
        assert error <= 4 * simt_error + 2.0 ** -23 * np.abs(w).max(), (which, error, simt_error)
    tf32x3 = {name.split("_")[2] for name in launched if name.endswith("_tf32x3")}
    if dkdv == "mma":
        assert {"dkdv", "dq"} <= tf32x3
    else:
        assert not {"dkdv", "dq"} & tf32x3
        wanted = (["flash_bwd_dkdv_tf32_wgmma_fp32_hdim64_"] if dkdv == "wgmma_fused" else
                  ["flash_bwd_dkdv_tf32_wgmma_fp32_hdim64_", "flash_bwd_dq_tf32_wgmma_fp32_hdim64_"])
        for kernel in wanted:
            assert any(name.startswith(kernel) for name in launched), launched


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_tf32_wgmma_precision_tf32_is_the_rounded_operands_backward(causal, fused, monkeypatch):
    """precision "tf32" on the wgmma candidates: each product's operands rounded to tf32 where they
    enter it (Q, K, V, dO, and P and dS), the products summed in float32. That arithmetic in
    float64, from the same o and lse, is what the kernels must give to within float32 sums and a
    rare tf32 rounding tie of P or dS falling the other way (2^-10 of the largest gradient); a
    value at another key, query or column, or a lost product, is O(1) off."""
    import cupy

    from cupyflash.kernels import simt
    from cupyflash.precision import round_tf32

    launched = _tf32x3_or_skip(monkeypatch)
    _wgmma_or_skip()
    rng = np.random.default_rng(3 + 2 * causal + fused)
    q, do = (rng.standard_normal((2, 97, 4, 48)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((2, 131, 2, 48)).astype(np.float32) for _ in range(2))
    scale = 48 ** -0.5
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    o, lse = cupy.empty_like(qd), cupy.empty((2, 4, 97), np.float32)
    simt.forward(qd, kd, vd, o, lse, softmax_scale=scale, causal=causal)
    grads = [cupy.full(x.shape, np.nan, np.float32) for x in (qd, kd, vd)]
    config = Tf32WgmmaBwdConfig(32, 2, False, fused_dq=fused, precision="tf32")
    dmma.backward(dod, qd, kd, vd, o, lse, *grads, softmax_scale=scale, causal=causal, config=config,
                  deterministic=not fused)
    got = [g.get() for g in grads]
    assert any(name.endswith("_tf32") and "_tf32_wgmma_" in name for name in launched), launched

    def r(x):
        return round_tf32(np.asarray(x, np.float32)).astype(np.float64)

    o, lse = o.get().astype(np.float64), lse.get().astype(np.float64)
    want = [np.zeros(x.shape) for x in (q, k, v)]
    visible = np.arange(131)[None, :] <= np.arange(97)[:, None] + 131 - 97 if causal else np.ones((97, 131), bool)
    for b in range(2):
        for h in range(4):
            hk = h // 2
            qh, kh, vh, doh = r(q[b, :, h]), r(k[b, :, hk]), r(v[b, :, hk]), r(do[b, :, h])
            p = np.where(visible, np.exp(qh @ kh.T * scale - lse[b, h][:, None]), 0.0)
            delta = (do[b, :, h].astype(np.float64) * o[b, :, h]).sum(axis=1)
            ds = r(p * (doh @ vh.T - delta[:, None]))
            want[2][b, :, hk] += r(p).T @ doh
            want[0][b, :, h] = scale * ds @ kh
            want[1][b, :, hk] += scale * ds.T @ qh
    for which, a, w in zip(("dq", "dk", "dv"), got, want):
        assert np.isfinite(a).all(), which
        assert np.abs(a - w).max() <= 2.0 ** -10 * (1 + np.abs(w).max()), (which, np.abs(a - w).max())


def _wgmma_or_skip() -> None:
    from cupyflash.kernels import _module

    if _module.device_arch() != "90":
        pytest.skip("flash_bwd_dkdv_tf32_wgmma is sm_90a only")


# the candidates' staging and sums: the row's, 64-row blocks with chained sums (dK/dV unstaged, dQ
# one block ahead), no staging at all (the splits read global memory), dQ by the dK/dV kernel's
# atomics, the producer warpgroup's dK/dV (two stages; a barrier parity wrong hangs here), and
# with it the producer warpgroup's dQ, with one consumer and with two (tf32-wgmma-dq-ws), and
# with key blocks split once for the grid and copied in (tf32-split-once)
WGMMA_CONFIGS = {"row": Tf32WgmmaBwdConfig(), "bm64_chained": Tf32WgmmaBwdConfig(64, 0, False, 64, 1),
                 "sync": Tf32WgmmaBwdConfig(32, 0, True, 32, 0), "fused": Tf32WgmmaBwdConfig(fused_dq=True),
                 "producer": Tf32WgmmaBwdConfig(32, 1, producer=True),
                 "producer_dq": Tf32WgmmaBwdConfig(32, 1, producer=True, dq_raw_stages=1, dq_producer=True),
                 "producer_dq_c2": Tf32WgmmaBwdConfig(32, 1, producer=True, dq_raw_stages=1, dq_producer=True,
                                                      dq_consumers=2),
                 "producer_dq_presplit": Tf32WgmmaBwdConfig(32, 1, producer=True, dq_raw_stages=0, dq_producer=True,
                                                            dq_presplit=True),
                 "presplit_both": Tf32WgmmaBwdConfig(32, 0, producer=True, presplit=True, dq_raw_stages=0,
                                                     dq_producer=True, dq_presplit=True)}


@pytest.mark.gpu
@pytest.mark.parametrize("statistics", ["saved", "recomputed"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("config_name", list(WGMMA_CONFIGS))
def test_tf32_wgmma_backward_on_a_packed_batch_and_long_rows(config_name, causal, statistics, monkeypatch):
    """The wgmma dK/dV and dQ candidates (each staging and sums) on a packed batch of ragged sequences (empty ones, a sequence past
    two key blocks, query blocks cut short), GQA, head dim 64, against the SIMT float32 backward
    within 4x its error to the float64 reference; then a 1k-key problem, where dV and dK chain
    32 query blocks and dQ 32 key blocks (the fresh accumulators' case)."""
    import functools

    from cupyflash.kernels import simt

    launched = _tf32x3_or_skip(monkeypatch)
    _wgmma_or_skip()
    rng = np.random.default_rng(9 + causal)
    problems = _packed_and_long_rows(64, (1, 1024, 2, 64))
    for q_shape, k_shape, packed in problems:
        q = rng.standard_normal(q_shape).astype(np.float32)
        k, v = (rng.standard_normal(k_shape).astype(np.float32) for _ in range(2))
        do = rng.standard_normal(q.shape).astype(np.float32)
        got = _gradients(do, q, k, v, causal=causal, packed=packed, statistics=statistics,
                         backward=functools.partial(dmma.backward, config=WGMMA_CONFIGS[config_name],
                                                    deterministic=not WGMMA_CONFIGS[config_name].fused_dq))
        simt_grads = _gradients(do, q, k, v, causal=causal, packed=packed, statistics=statistics,
                                backward=simt.backward)
        want = _gradients(*(x.astype(np.float64) for x in (do, q, k, v)), causal=causal, packed=packed,
                          statistics=statistics, backward=simt.backward)
        # chained sums: dV and dK chain every query block's products (32 here), dQ every key block's
        allowed = 4 if WGMMA_CONFIGS[config_name].sums_apart else 16
        for which, a, s, w in zip(("dq", "dk", "dv"), got, simt_grads, want):
            assert np.isfinite(a).all(), which
            error, simt_error = np.abs(a - w).max(), np.abs(s - w).max()
            assert error <= allowed * simt_error + 2.0 ** -23 * np.abs(w).max(), (which, packed is None, error,
                                                                                  simt_error)
    assert any(name.startswith("flash_bwd_dkdv_tf32_wgmma_") for name in launched), launched
    fused = WGMMA_CONFIGS[config_name].fused_dq
    assert any(name.startswith("flash_bwd_dq_tf32_wgmma_") for name in launched) != fused, launched
    assert any(name.startswith("flash_bwd_dq_tf32_wgmma_ws_") for name in launched) == \
        WGMMA_CONFIGS[config_name].dq_producer, launched
    assert any(name.startswith("flash_bwd_split_kv_tf32_") for name in launched) == \
        WGMMA_CONFIGS[config_name].dq_presplit, launched
    assert any(name.startswith("flash_bwd_split_q_tf32_") for name in launched) == \
        WGMMA_CONFIGS[config_name].presplit, launched
    # the tf32 wgmma dK/dV kernel adds dQ itself iff fused (the SIMT baseline's kernels launch here too)
    assert all(name.endswith("_dq") == fused for name in launched if name.startswith("flash_bwd_dkdv_tf32_wgmma_")), \
        launched


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_the_plans_float32_backward_takes_the_wgmma_route_where_the_layout_fits(causal, monkeypatch):
    """dmma.backward without a config at sm_90, float32, d64, statistics "saved": the route's
    kernels run (tf32_wgmma_route) and give the SIMT backward's accuracy; the same
    problem on arrays whose row stride is not a multiple of 4 elements runs tf32x3 instead."""
    import cupy

    from cupyflash.kernels import simt

    launched = _tf32x3_or_skip(monkeypatch)
    _wgmma_or_skip()
    rng = np.random.default_rng(21 + causal)
    q, do = (rng.standard_normal((2, 300, 4, 64)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((2, 257, 2, 64)).astype(np.float32) for _ in range(2))
    got = _gradients(do, q, k, v, causal=causal, backward=dmma.backward)
    assert any(name.startswith("flash_bwd_dkdv_tf32_wgmma_ws_fp32_hdim64_") for name in launched), launched
    route = backward_plans.tf32_wgmma_route(SM90, 64, as_mask(causal))
    dq_kernel = "flash_bwd_dq_tf32_wgmma_ws" if route.dq_producer else "flash_bwd_dq_tf32_wgmma"
    assert any(name.startswith(f"{dq_kernel}_fp32_hdim64_") for name in launched), launched
    simt_grads = _gradients(do, q, k, v, causal=causal, backward=simt.backward)
    want = _gradients(*(x.astype(np.float64) for x in (do, q, k, v)), causal=causal, backward=simt.backward)
    for which, a, b, w in zip(("dq", "dk", "dv"), got, simt_grads, want):
        assert np.isfinite(a).all(), which
        error, simt_error = np.abs(a - w).max(), np.abs(b - w).max()
        assert error <= 4 * simt_error + 2.0 ** -23 * np.abs(w).max(), (which, error, simt_error)

    launched.clear()

    def strided_backward(do, q, k, v, o, lse, dq, dk, dv, **options):
        # every input a view whose head stride (65 elements) the 16-byte loaders cannot take
        views = []
        for x in (do, q, k, v, o):
            wide = cupy.full(x.shape[:-1] + (65,), np.nan, x.dtype)
            wide[..., :64] = x
            views.append(wide[..., :64])
        dmma.backward(*views, lse, dq, dk, dv, **options)

    strided = _gradients(do, q, k, v, causal=causal, backward=strided_backward)
    assert not any("_tf32_wgmma" in name for name in launched), launched
    assert any(name.startswith("flash_bwd_dkdv_dmma_fp32_") and name.endswith("_tf32x3") for name in launched)
    for which, a, w in zip(("dq", "dk", "dv"), strided, want):
        assert np.isfinite(a).all(), which
        assert np.abs(a - w).max() <= 1e-4 * (1 + np.abs(w).max()), which


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_the_producer_dq_kernel_is_the_one_warpgroup_kernel_bitwise(causal, monkeypatch):
    """flash_bwd_dq_tf32_wgmma_ws computes what flash_bwd_dq_tf32_wgmma does, value for value (the
    same products in the same order; only who splits the tiles, and when, differs): dQ bit for bit
    on a packed batch of ragged sequences with GQA and on 1k rows, both statistics; dK and dV
    (the same kernel in both plans) too. So does its PRESPLIT form, whose tiles are the same bytes
    split by flash_bwd_split_kv_tf32 and copied in (a block landed at another block's offset, or
    not yet landed, shows here)."""
    import functools

    launched = _tf32x3_or_skip(monkeypatch)
    _wgmma_or_skip()
    rng = np.random.default_rng(31 + causal)
    problems = _packed_and_long_rows(60, (1, 1000, 1, 64))
    one = Tf32WgmmaBwdConfig(32, 1, producer=True, dq_raw_stages=1)
    two = Tf32WgmmaBwdConfig(32, 1, producer=True, dq_raw_stages=1, dq_producer=True)
    three = Tf32WgmmaBwdConfig(32, 1, producer=True, dq_raw_stages=0, dq_producer=True, dq_presplit=True)
    both = Tf32WgmmaBwdConfig(32, 0, producer=True, presplit=True, dq_raw_stages=0, dq_producer=True, dq_presplit=True)
    for q_shape, k_shape, packed in problems:
        q, do = (rng.standard_normal(q_shape).astype(np.float32) for _ in range(2))
        k, v = (rng.standard_normal(k_shape).astype(np.float32) for _ in range(2))
        for statistics in ("saved", "recomputed"):
            want, got, presplit, presplit_both = (
                _gradients(do, q, k, v, causal=causal, packed=packed, statistics=statistics,
                           backward=functools.partial(dmma.backward, config=config))
                for config in (one, two, three, both))
            for which, a, c, e, b in zip(("dq", "dk", "dv"), got, presplit, presplit_both, want):
                assert np.isfinite(a).all() and np.array_equal(a.view(np.uint32), b.view(np.uint32)), which
                assert np.isfinite(c).all() and np.array_equal(c.view(np.uint32), b.view(np.uint32)), which
                assert np.isfinite(e).all() and np.array_equal(e.view(np.uint32), b.view(np.uint32)), which
    assert any(name.startswith("flash_bwd_dq_tf32_wgmma_ws_") for name in launched), launched
    assert any(name.endswith("_presplit") for name in launched), launched
    assert any(name.startswith("flash_bwd_split_q_tf32_") for name in launched), launched
    assert any(name.startswith("flash_bwd_dq_tf32_wgmma_fp32_") for name in launched), launched


def _packed_and_long_rows(headdim: int, long_k_shape: tuple) -> list:
    """(q shape, k shape, packed) of the wgmma candidates' GPU tests: a packed batch of ragged
    sequences (an empty one, one past two key blocks, query blocks cut short) with GQA at
    ``headdim``, then 1,024 query rows of two heads at d64 against keys of ``long_k_shape``."""
    import cupy

    from cupyflash.kernels.params import PackedBatch

    lengths_q, lengths_k = [0, 33, 190, 7, 64], [5, 40, 150, 0, 64]
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    return [((1, cu_q[-1], 4, headdim), (1, cu_k[-1], 2, headdim),
             PackedBatch(cupy.asarray(cu_q), cupy.asarray(cu_k), max(lengths_q), max(lengths_k))),
            ((1, 1024, 2, 64), long_k_shape, None)]


def _tf32x3_or_skip(monkeypatch) -> list:
    """The names of the kernels launched from here on in the test (simt.run_backward's launches);
    skips below sm_80 (no tf32 tensor cores)."""
    from cupyflash.kernels import _module, simt

    if int(_module.device_arch()) < 80:
        pytest.skip("m16n8k8 .tf32 needs sm_80")
    launched = []
    real = simt.launch

    def spy(spec, *args, **kwargs):
        launched.append(spec.name)
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(simt, "launch", spy)
    return launched


@pytest.mark.gpu
# d24: the d64 tiles on the d32 tile. (At d32 these inputs are not one-hot: two keys of a row come
# within ~2.5e-3 of each other, and the reference's dq is ~1e-11.)
@pytest.mark.parametrize("headdim, dkdv", [(24, "mma"), (128, "mma"), (24, "wgmma")])
def test_tf32x3_experiment_cancels_one_hot_rows_exactly(headdim, dkdv, monkeypatch):
    """softmax_scale 1e4, statistics "recomputed": every row one-hot, so each row's top key gets
    dS = -D' exactly and dq is far below any true gradient's rounding; this holds only if the dK/dV
    kernel's S^T and dP^T are the statistics kernel's S and dP to the bit (TRANSPOSED's order)."""
    import functools

    launched = _tf32x3_or_skip(monkeypatch)
    if dkdv == "wgmma":  # dK and dV on wgmma must stay finite; dQ stays on the kernel whose S the
        _wgmma_or_skip()  # statistics kernel's is to the bit (dq_block_n 0)
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 48, 2, headdim)).astype(np.float32)
    k, v = (rng.standard_normal((1, 48, 2, headdim)).astype(np.float32) for _ in range(2))
    do = rng.standard_normal(q.shape).astype(np.float32)
    config = backward_plans.tf32x3_backward_config(headdim) if dkdv == "mma" else Tf32WgmmaBwdConfig(dq_block_n=0)
    dq, dk, dv = _gradients(do, q, k, v, causal=False, softmax_scale=1e4, statistics="recomputed",
                            backward=functools.partial(dmma.backward, config=config))
    assert any(name.startswith("flash_bwd_stats_dmma_fp32") for name in launched), launched
    assert np.isfinite(dk).all() and np.isfinite(dv).all()
    exact_dq = reference.attention_backward(*(x.astype(np.float64) for x in (do, q, k, v)), softmax_scale=1e4)[0]
    assert float(np.abs(exact_dq).max()) < 1e-30, "the inputs are not one-hot"
    assert float(np.abs(dq).max()) < 1e-30


@pytest.mark.gpu
@pytest.mark.parametrize("config_name", ["producer_dq_presplit", "presplit_both"])
def test_presplit_walks_stop_at_a_short_packed_sequences_end(config_name, monkeypatch):
    """A packed batch with a mask_mod: the block map is made for the longest sequence, so a shorter
    sequence's granules without kept pairs point past its end and a walk may take one block there
    (zero rows where the producer splits). The presplit producers copy image blocks instead, so
    their walks stop at the sequence's end: the gradients through the public varlen API with the
    presplit config as the route are finite and equal to the shipped route's (q lengths 200, 40,
    72 against keys 128, 128, 96, kv_idx < 64: the review's case of a copy past the image)."""
    import cupy

    import cupyflash

    launched = _tf32x3_or_skip(monkeypatch)
    _wgmma_or_skip()
    rng = np.random.default_rng(43)
    lengths_q, lengths_k = [200, 40, 72], [128, 128, 96]
    cu_q = cupy.asarray(np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32))
    cu_k = cupy.asarray(np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32))
    q, do = (cupy.asarray(rng.standard_normal((sum(lengths_q), 2, 64)).astype(np.float32)) for _ in range(2))
    k, v = (cupy.asarray(rng.standard_normal((sum(lengths_k), 1, 64)).astype(np.float32)) for _ in range(2))
    mask = cupyflash.MaskMod(lambda b, h, q_idx, kv_idx: kv_idx < 64)
    args = (cu_q, cu_k, max(lengths_q), max(lengths_k))

    def gradients():
        o, lse = cupyflash.flash_attn_varlen_func(q, k, v, *args, mask_mod=mask, return_lse=True)
        return [g.get() for g in cupyflash.flash_attn_varlen_backward(do, q, k, v, o, lse, *args, mask_mod=mask)]

    shipped = gradients()
    monkeypatch.setitem(backward_plans.TF32_WGMMA_BACKWARD_ROUTE, (SM90, 64), WGMMA_CONFIGS[config_name])
    launched.clear()
    presplit = gradients()
    assert any(name.startswith("flash_bwd_split_kv_tf32_") for name in launched), launched
    assert any(name.startswith("flash_bwd_split_q_tf32_") for name in launched) == \
        WGMMA_CONFIGS[config_name].presplit, launched
    for which, a, b in zip(("dq", "dk", "dv"), presplit, shipped):
        assert np.isfinite(a).all() and np.array_equal(a, b), which


# The pair's kernels at the d128 tile (perf log tf32-wgmma-bwd-pair) and what they meet there: the
# masks and score variants of the element steps they share with the d64 kernels, GQA, a head dim of
# v its own and head dims that leave part of the tile (and of warpgroup 1's half, or all of it: d48)
# empty. dQ on the
# tf32x3 kernel beside the pair's dK/dV, or on the pair's dQ kernel (raw K and V one block ahead);
# pair_dq_pf: the dK/dV kernel asking the next query block into L1 (perf log tf32-pair-prefetch).
PAIR_CONFIGS = {"pair": Tf32WgmmaBwdConfig(32, 0, dq_block_n=0, pair=True),
                "pair_dq": Tf32WgmmaBwdConfig(32, 0, dq_raw_stages=1, pair=True, dq_pair=True),
                "pair_dq_pf": Tf32WgmmaBwdConfig(32, 0, dq_raw_stages=1, pair=True, dq_pair=True, prefetch=True)}
PAIR_CASES = {
    "causal": dict(causal=True),
    "window": dict(causal=False, window_size=(40, 7)),
    "softcap+sink": dict(causal=True, softcap=2.5, sink=[0.5, -1.0, 2.0, 0.0]),
    "alibi": dict(causal=True, alibi_slopes=[0.25, 0.0625, 0.5, 0.125]),
    "dropout": dict(causal=True, dropout_p=0.2, seed=5),
    "recomputed": dict(causal=False, statistics="recomputed"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("headdim, headdim_v", [(128, 128), (100, 68), (48, 128)])
@pytest.mark.parametrize("case", list(PAIR_CASES))
@pytest.mark.parametrize("config_name", list(PAIR_CONFIGS))
def test_the_pair_kernels_match_the_simt_backward_at_d128(config_name, case, headdim, headdim_v, monkeypatch):
    """Tf32WgmmaBwdConfig(pair=True): dK and dV on flash_bwd_dkdv_tf32_wgmma_pair, dQ on the tf32x3
    kernel or (dq_pair) on flash_bwd_dq_tf32_wgmma_pair, against the SIMT float32 backward within
    4x its error to the float64 reference (plus
    float32's rounding of the largest gradient), on a packed batch of ragged sequences (an empty
    one, one past two key blocks, query blocks cut short) with GQA, then 1k queries against 1k
    keys (dV and dK summing 32 query blocks); NaN-poisoned outputs, every value finite."""
    import functools

    import cupy

    from cupyflash.kernels import simt
    from cupyflash.kernels.params import PackedBatch

    launched = _tf32x3_or_skip(monkeypatch)
    _wgmma_or_skip()
    options = dict(PAIR_CASES[case])
    config = PAIR_CONFIGS[config_name]
    rng = np.random.default_rng(headdim + headdim_v + len(case))
    lengths_q, lengths_k = [0, 33, 190, 7, 64], [5, 40, 150, 0, 64]
    cu_q = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
    packed = PackedBatch(cupy.asarray(cu_q), cupy.asarray(cu_k), max(lengths_q), max(lengths_k))
    for q_rows, k_rows, packed_batch in ((cu_q[-1], cu_k[-1], packed), (1024, 1024, None)):
        if packed_batch is not None and case == "window":
            packed_batch = None  # (a window over ragged sequences: the 1k rows run it)
        q = rng.standard_normal((1, q_rows, 4, headdim)).astype(np.float32)
        k = rng.standard_normal((1, k_rows, 2, headdim)).astype(np.float32)
        v = rng.standard_normal((1, k_rows, 2, headdim_v)).astype(np.float32)
        do = rng.standard_normal((1, q_rows, 4, headdim_v)).astype(np.float32)
        got = _gradients(do, q, k, v, packed=packed_batch, backward=functools.partial(dmma.backward, config=config),
                         **dict(options))
        simt_grads = _gradients(do, q, k, v, packed=packed_batch, backward=simt.backward, **dict(options))
        want = _gradients(*(x.astype(np.float64) for x in (do, q, k, v)), packed=packed_batch,
                          backward=simt.backward, **dict(options))
        for which, a, s, w in zip(("dq", "dk", "dv"), got, simt_grads, want):
            assert np.isfinite(a).all(), which
            error, simt_error = np.abs(a - w).max(), np.abs(s - w).max()
            assert error <= 4 * simt_error + 2.0 ** -23 * np.abs(w).max(), (which, packed_batch is None, error,
                                                                             simt_error)
    assert any(name.startswith("flash_bwd_dkdv_tf32_wgmma_pair_fp32_hdim128_") for name in launched), launched
    dq_kernel = "flash_bwd_dq_tf32_wgmma_pair_fp32_hdim128_" if config.dq_pair else "flash_bwd_dq_dmma_fp32_hdim128_"
    assert any(name.startswith(dq_kernel) for name in launched), launched

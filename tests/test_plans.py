"""cupyflash.plans: the forward plan of every device class, dtype, head dim and mask is the
specialization (name, source, template instantiation, threads, shared memory, arch, rows per block)
that the dispatch before plans chose, the launchers launch what the plan says, and the compile
check still sees every shipped forward specialization."""
from __future__ import annotations

import itertools
from dataclasses import replace
import math
import re

import numpy as np
import pytest

from cupyflash import dispatch, plans
from cupyflash._dtypes import SUPPORTED
from cupyflash.kernels import mma_fwd, simt
from cupyflash.masks import KINDS, PACKED_KINDS, VARIANT_KINDS, Causal, Local, NoMask, example_modifiers
from cupyflash.scores import Score
from launch_fakes import FakeArray, LaunchRecorder, assert_forward_launch

ARCHS = ("80", "86", "89", "90")
SMEM_OPTINS = (163 * 1024, 227 * 1024, 99 * 1024)  # A100, H100/H200, sm_86/sm_89 opt-in per block

# The choice of the dispatch before plans (commit b4b7741: dispatch.choose("auto", ...) on a GPU, then
# mma_fwd.default_config or the SIMT tiles), printed by dev/forward_dispatch_before_plans.py from
# that tree: (dtype, the (arch, opt-in bytes) that chose alike, rows). A row covers the head dims
# up to its bound and above the previous row's: (name, source, expression, threads, shared memory
# bytes, arch, query rows per block). The old tree had two masks and named them "full" and
# "causal", with the kernels' template argument a bool (false, true); it chose the same tiles for
# both, which that script checks.
OLD_FORWARD = (
    ('float16', (('80', 166912), ('80', 101376), ('86', 166912), ('86', 101376), ('89', 166912), ('89', 101376)), (
        (64, ('flash_fwd_mma_fp16_hdim64_{mask}_bm128_bn64_w4_qreg_s2_mb2_all_lanes', 'flash_fwd_mma.cu', 'cf::flash_fwd_mma<cf::half_t, 64, {mask_cpp}, 128, 64, 4, true, 2, 2, cf::RowState::ALL_LANES>', 128, 49184, '', 128)),
        (128, ('flash_fwd_mma_fp16_hdim128_{mask}_bm128_bn32_w4_qsmem_s2_mb2_one_lane', 'flash_fwd_mma.cu', 'cf::flash_fwd_mma<cf::half_t, 128, {mask_cpp}, 128, 32, 4, false, 2, 2, cf::RowState::ONE_LANE>', 128, 65568, '', 128)),
        (256, ('flash_fwd_mma_fp16_hdim256_{mask}_bm128_bn32_w8_qsmem_s2_mb1_one_lane', 'flash_fwd_mma.cu', 'cf::flash_fwd_mma<cf::half_t, 256, {mask_cpp}, 128, 32, 8, false, 2, 1, cf::RowState::ONE_LANE>', 256, 131104, '', 128)),
    )),
    ('float16', (('80', 232448), ('86', 232448), ('89', 232448)), (
        (64, ('flash_fwd_mma_fp16_hdim64_{mask}_bm128_bn64_w4_qreg_s2_mb2_all_lanes', 'flash_fwd_mma.cu', 'cf::flash_fwd_mma<cf::half_t, 64, {mask_cpp}, 128, 64, 4, true, 2, 2, cf::RowState::ALL_LANES>', 128, 49184, '', 128)),
        (128, ('flash_fwd_mma_fp16_hdim128_{mask}_bm128_bn64_w4_qsmem_s2_mb2_one_lane', 'flash_fwd_mma.cu', 'cf::flash_fwd_mma<cf::half_t, 128, {mask_cpp}, 128, 64, 4, false, 2, 2, cf::RowState::ONE_LANE>', 128, 98336, '', 128)),
        (256, ('flash_fwd_mma_fp16_hdim256_{mask}_bm128_bn64_w8_qsmem_s2_mb1_one_lane', 'flash_fwd_mma.cu', 'cf::flash_fwd_mma<cf::half_t, 256, {mask_cpp}, 128, 64, 8, false, 2, 1, cf::RowState::ONE_LANE>', 256, 196640, '', 128)),
    )),
    ('float16', (('90', 166912), ('90', 232448), ('90', 101376)), (
        (64, ('flash_fwd_wgmma_fp16_hdim64_{mask}_bm128_bn64', 'flash_fwd_wgmma.cu', 'cf::flash_fwd_wgmma<cf::half_t, 64, {mask_cpp}, 128, 64>', 256, 58368, '90a', 128)),
        (128, ('flash_fwd_wgmma_fp16_hdim128_{mask}_bm128_bn128', 'flash_fwd_wgmma.cu', 'cf::flash_fwd_wgmma<cf::half_t, 128, {mask_cpp}, 128, 128>', 256, 197632, '90a', 128)),
        (256, ('flash_fwd_wgmma_fp16_hdim256_{mask}_bm128_bn64', 'flash_fwd_wgmma.cu', 'cf::flash_fwd_wgmma<cf::half_t, 256, {mask_cpp}, 128, 64>', 256, 230400, '90a', 128)),
    )),
    ('bfloat16', (('80', 166912), ('80', 101376), ('86', 166912), ('86', 101376), ('89', 166912), ('89', 101376)), (
        (64, ('flash_fwd_mma_bf16_hdim64_{mask}_bm128_bn64_w4_qreg_s2_mb2_all_lanes', 'flash_fwd_mma.cu', 'cf::flash_fwd_mma<cf::bf16_t, 64, {mask_cpp}, 128, 64, 4, true, 2, 2, cf::RowState::ALL_LANES>', 128, 49184, '', 128)),
        (128, ('flash_fwd_mma_bf16_hdim128_{mask}_bm128_bn32_w4_qsmem_s2_mb2_one_lane', 'flash_fwd_mma.cu', 'cf::flash_fwd_mma<cf::bf16_t, 128, {mask_cpp}, 128, 32, 4, false, 2, 2, cf::RowState::ONE_LANE>', 128, 65568, '', 128)),
        (256, ('flash_fwd_mma_bf16_hdim256_{mask}_bm128_bn32_w8_qsmem_s2_mb1_one_lane', 'flash_fwd_mma.cu', 'cf::flash_fwd_mma<cf::bf16_t, 256, {mask_cpp}, 128, 32, 8, false, 2, 1, cf::RowState::ONE_LANE>', 256, 131104, '', 128)),
    )),
    ('bfloat16', (('80', 232448), ('86', 232448), ('89', 232448)), (
        (64, ('flash_fwd_mma_bf16_hdim64_{mask}_bm128_bn64_w4_qreg_s2_mb2_all_lanes', 'flash_fwd_mma.cu', 'cf::flash_fwd_mma<cf::bf16_t, 64, {mask_cpp}, 128, 64, 4, true, 2, 2, cf::RowState::ALL_LANES>', 128, 49184, '', 128)),
        (128, ('flash_fwd_mma_bf16_hdim128_{mask}_bm128_bn64_w4_qsmem_s2_mb2_one_lane', 'flash_fwd_mma.cu', 'cf::flash_fwd_mma<cf::bf16_t, 128, {mask_cpp}, 128, 64, 4, false, 2, 2, cf::RowState::ONE_LANE>', 128, 98336, '', 128)),
        (256, ('flash_fwd_mma_bf16_hdim256_{mask}_bm128_bn64_w8_qsmem_s2_mb1_one_lane', 'flash_fwd_mma.cu', 'cf::flash_fwd_mma<cf::bf16_t, 256, {mask_cpp}, 128, 64, 8, false, 2, 1, cf::RowState::ONE_LANE>', 256, 196640, '', 128)),
    )),
    ('bfloat16', (('90', 166912), ('90', 232448), ('90', 101376)), (
        (64, ('flash_fwd_wgmma_bf16_hdim64_{mask}_bm128_bn64', 'flash_fwd_wgmma.cu', 'cf::flash_fwd_wgmma<cf::bf16_t, 64, {mask_cpp}, 128, 64>', 256, 58368, '90a', 128)),
        (128, ('flash_fwd_wgmma_bf16_hdim128_{mask}_bm128_bn128', 'flash_fwd_wgmma.cu', 'cf::flash_fwd_wgmma<cf::bf16_t, 128, {mask_cpp}, 128, 128>', 256, 197632, '90a', 128)),
        (256, ('flash_fwd_wgmma_bf16_hdim256_{mask}_bm128_bn64', 'flash_fwd_wgmma.cu', 'cf::flash_fwd_wgmma<cf::bf16_t, 256, {mask_cpp}, 128, 64>', 256, 230400, '90a', 128)),
    )),
    ('float32', (('80', 166912), ('80', 232448), ('80', 101376), ('86', 166912), ('86', 232448), ('86', 101376), ('89', 166912), ('89', 232448), ('89', 101376), ('90', 166912), ('90', 232448), ('90', 101376)), (
        (16, ('flash_fwd_simt_fp32_hdim16_{mask}_bm64_bn64_tpr4', 'flash_fwd_simt.cu', 'cf::flash_fwd_simt<float, 16, {mask_cpp}, 64, 64, 4>', 256, 29696, '', 64)),
        (32, ('flash_fwd_simt_fp32_hdim32_{mask}_bm64_bn64_tpr4', 'flash_fwd_simt.cu', 'cf::flash_fwd_simt<float, 32, {mask_cpp}, 64, 64, 4>', 256, 41984, '', 64)),
        (64, ('flash_fwd_simt_fp32_hdim64_{mask}_bm64_bn64_tpr4', 'flash_fwd_simt.cu', 'cf::flash_fwd_simt<float, 64, {mask_cpp}, 64, 64, 4>', 256, 66560, '', 64)),
        (128, ('flash_fwd_simt_fp32_hdim128_{mask}_bm32_bn32_tpr8', 'flash_fwd_simt.cu', 'cf::flash_fwd_simt<float, 128, {mask_cpp}, 32, 32, 8>', 256, 53760, '', 32)),
        (256, ('flash_fwd_simt_fp32_hdim256_{mask}_bm32_bn32_tpr8', 'flash_fwd_simt.cu', 'cf::flash_fwd_simt<float, 256, {mask_cpp}, 32, 32, 8>', 256, 102912, '', 32)),
    )),
    ('float64', (('80', 166912), ('80', 232448), ('80', 101376), ('86', 166912), ('86', 232448), ('86', 101376), ('89', 166912), ('89', 232448), ('89', 101376), ('90', 166912), ('90', 232448), ('90', 101376)), (
        (16, ('flash_fwd_simt_fp64_hdim16_{mask}_bm32_bn32_tpr4', 'flash_fwd_simt.cu', 'cf::flash_fwd_simt<double, 16, {mask_cpp}, 32, 32, 4>', 128, 21504, '', 32)),
        (32, ('flash_fwd_simt_fp64_hdim32_{mask}_bm32_bn32_tpr4', 'flash_fwd_simt.cu', 'cf::flash_fwd_simt<double, 32, {mask_cpp}, 32, 32, 4>', 128, 33792, '', 32)),
        (64, ('flash_fwd_simt_fp64_hdim64_{mask}_bm32_bn32_tpr4', 'flash_fwd_simt.cu', 'cf::flash_fwd_simt<double, 64, {mask_cpp}, 32, 32, 4>', 128, 58368, '', 32)),
        (128, ('flash_fwd_simt_fp64_hdim128_{mask}_bm16_bn16_tpr8', 'flash_fwd_simt.cu', 'cf::flash_fwd_simt<double, 128, {mask_cpp}, 16, 16, 8>', 128, 51712, '', 16)),
        (256, ('flash_fwd_simt_fp64_hdim256_{mask}_bm16_bn16_tpr16', 'flash_fwd_simt.cu', 'cf::flash_fwd_simt<double, 256, {mask_cpp}, 16, 16, 16>', 256, 100864, '', 16)),
    )),
)

OLD_MASKS = {"full": "false", "causal": "true"}


def old_choice(arch: str, smem_optin: int, dtype: str, headdim: int, mask_name: str) -> tuple:
    """OLD_FORWARD's row, with the old mask token and template argument filled in."""
    [rows] = [rows for name, devices, rows in OLD_FORWARD if name == dtype and (arch, smem_optin) in devices]
    name, source, expression, *launch = next(row for bound, row in rows if headdim <= bound)
    return (name.replace("{mask}", mask_name), source, expression.replace("{mask_cpp}", OLD_MASKS[mask_name]),
            *launch)


def new_choice(plan: plans.ForwardPlan, mask, old_mask_cpp: str) -> tuple:
    """The plan in OLD_FORWARD's terms: the policy type ``mask.cpp``, which replaced the bool,
    spelled ``old_mask_cpp``."""
    s = plan.spec
    return (s.name, s.source_file, s.expression.replace(f", {mask.cpp},", f", {old_mask_cpp},", 1),
            s.threads, s.smem_bytes, s.arch, plan.block_m)


def test_old_table_covers_every_device_and_dtype_once():
    for dtype in SUPPORTED:
        devices = [d for name, ds, _ in OLD_FORWARD if name == dtype for d in ds]
        assert sorted(devices) == sorted(itertools.product(ARCHS, SMEM_OPTINS))
    assert all(rows[-1][0] == 256 for _, _, rows in OLD_FORWARD)


@pytest.mark.parametrize("dtype", list(SUPPORTED))
def test_the_plan_is_the_old_dispatch_choice(dtype):
    """Every (arch, opt-in shared memory, head dim 1..256, mask): NoMask and Causal as the old tree
    chose them; Local the Causal choice's kernel and tiles with its own mask token and argument
    (on LOCAL_FORWARD_TILES' rows, compared with the Causal choice's tiles: the window's own are
    test_a_window_has_its_own_row's). float32's default is the tf32 kernel now
    (test_float32_runs_on_tensor_cores), float64's up to d128 the DMMA kernel
    (test_float64_runs_on_dmma_up_to_d128); their old choice, the SIMT kernel, is what
    family="simt" (backend="simt") runs."""
    compared = 0
    family = "simt" if dtype in ("float32", "float64") else None
    for arch, smem, headdim in itertools.product(ARCHS, SMEM_OPTINS, range(1, 257)):
        for mask, old_name in ((NoMask(), "full"), (Causal(), "causal"), (Local(100, 3), "causal")):
            plan = plans.plan_forward(arch, SUPPORTED[dtype], headdim, mask, smem, family=family)
            old = old_choice(arch, smem, dtype, headdim, old_name)
            if isinstance(mask, Local):
                if (plan.family, plan.device_class, plan.d_tile) in plans.LOCAL_FORWARD_TILES:
                    plan = plans.forward_plan(SUPPORTED[dtype], plan.headdim, mask,
                                              plans.plan_forward(arch, SUPPORTED[dtype], headdim, Causal(), smem,
                                                                 family=family).tiles)
                old = (old[0].replace("_causal_", "_local_", 1), *old[1:])
            if isinstance(plan.tiles, plans.WgmmaFwdConfig) and plan.tiles.producer:
                # wgmma-fwd-ws-route: the row's producer kernel replaced the old choice, which is
                # the one-role row (test_sm90_d128_runs_the_producer_kernel)
                plan = plans.forward_plan(SUPPORTED[dtype], plan.headdim, mask,
                                          plans.ONE_ROLE_FORWARD_TILES[("mma", plans.SM90, plan.d_tile)])
            assert new_choice(plan, mask, OLD_MASKS[old_name]) == old, (arch, smem, dtype, headdim, mask)
            compared += 1
    assert compared == len(ARCHS) * len(SMEM_OPTINS) * 256 * 3


@pytest.mark.parametrize("dtype", list(SUPPORTED))
def test_the_family_is_the_dispatch_choice(dtype, monkeypatch):
    monkeypatch.setattr(dispatch, "gpu_available", lambda: True)
    for headdim in range(1, 257):
        plan = plans.plan_forward("80", SUPPORTED[dtype], headdim, NoMask(), 163 * 1024)
        assert plan.family == dispatch.choose("auto", SUPPORTED[dtype], headdim, "fwd")
        tensor_core_source = {"float32": "flash_fwd_tf32.cu", "float64": "flash_fwd_dmma.cu"}.get(dtype, "flash_fwd_mma.cu")
        assert plan.spec.source_file == {"mma": tensor_core_source, "simt": "flash_fwd_simt.cu"}[plan.family]
        if plan.family == "mma":
            assert plan.headdim == dispatch.mma_headdim(headdim) and plan.headdim % 8 == 0
            assert plans.plan_forward("80", SUPPORTED[dtype], headdim, NoMask(), 163 * 1024, family="simt").family == "simt"


def test_one_row_answers_what_runs():
    """What runs on sm_90 at d128 bf16 causal is one row of FORWARD_TILES."""
    plan = plans.plan_forward("90", SUPPORTED["bfloat16"], 128, Causal(), 227 * 1024)
    assert plan.tiles is plans.FORWARD_TILES[("mma", plans.SM90, 128)]
    assert (plan.kernel, plan.device_class, plan.d_tile) == ("flash_fwd_wgmma_ws", plans.SM90, 128)
    assert plan.spec.name == "flash_fwd_wgmma_ws_bf16_hdim128_causal_bn128_s3_pingpong"
    assert plans.plan_forward(None, SUPPORTED["float16"], 100, False, None).tiles is \
        plans.FORWARD_TILES[("mma", plans.PORTABLE, 128)]
    for (family, where, dt), tiles in plans.FORWARD_TILES.items():
        dtype = ("float64" if where == plans.ACC_FP64 or family == "dmma" else "float32" if family == "tf32"
                 else "bfloat16")
        assert dt in plans._D_TILES[family]
        assert plans.forward_plan(SUPPORTED[dtype], dt, Causal(), tiles).tiles == tiles


def test_presplit_rows_need_enough_readers_of_each_key_block():
    """WGMMA_FLOAT32_PRESPLIT_FORWARD_TILES' rows replace the producer forward only where each key
    block's split image has PRESPLIT_MIN_IMAGE_READERS query blocks or more to read it (query blocks
    of 128 rows times the query heads of a kv head), and never for a plan made without the
    problem's length; the rows are the shipped ones (sm_90, d64, both precisions)."""
    assert plans.image_readers(1, 1) == 1 and plans.image_readers(1024, 1) == 8
    assert plans.image_readers(1025, 1) == 9 and plans.image_readers(4096, 4) == 128
    rows = {("tf32", plans.SM90, 64, precision): plans.WgmmaTf32FwdConfig(32, raw_stages=0, producer=True, stages=4,
                                                                          sums_apart=precision == "ieee",
                                                                          presplit=True)
            for precision in ("ieee", "tf32")}
    # d128 (tf32-wgmma-d128): the split-once image whatever the readers, so its rows are its route's
    d128 = {("tf32", plans.SM90, 128, precision): plans.WgmmaTf32FwdConfig(32, raw_stages=0, producer=True, stages=2,
                                                                           sums_apart=precision == "ieee",
                                                                           presplit=True, q_staged=True)
            for precision in ("ieee", "tf32")}
    assert plans.WGMMA_FLOAT32_PRESPLIT_FORWARD_TILES == {**rows, **d128}
    assert all(plans.WGMMA_FLOAT32_FORWARD_TILES[key] == row for key, row in d128.items())
    least = plans.PRESPLIT_MIN_IMAGE_READERS
    for precision in ("ieee", "tf32"):
        producer = plans.WGMMA_FLOAT32_FORWARD_TILES[("tf32", plans.SM90, 64, precision)]
        for readers, expected in ((None, producer), (least - 1, producer), (least, rows[("tf32", plans.SM90, 64, precision)]),
                                  (10 * least, rows[("tf32", plans.SM90, 64, precision)])):
            for mask in (NoMask(), Causal(), Causal().as_packed(), Local()):
                plan = plans.plan_forward("90", SUPPORTED["float32"], 64, mask, None, precision=precision,
                                          image_readers=readers)
                assert plan.tiles == expected, (precision, readers, mask)
                assert (plan.split_kv is not None) == expected.presplit
        # d128 splits once whatever the readers; other device classes have no such row
        for readers in (None, 1, 10 * least):
            plan = plans.plan_forward("90", SUPPORTED["float32"], 128, Causal(), None, precision=precision,
                                      image_readers=readers)
            assert plan.split_kv is not None and plan.tiles == d128[("tf32", plans.SM90, 128, precision)]
        assert plans.plan_forward("80", SUPPORTED["float32"], 64, Causal(), None, precision=precision,
                                  image_readers=10 * least).kernel == "flash_fwd_tf32"
    # bfloat16 has none either
    assert plans.plan_forward("90", SUPPORTED["bfloat16"], 64, Causal(), None, image_readers=10 * least).split_kv is None

def test_float32_runs_on_tensor_cores():
    """float32's default forward is flash_fwd_tf32 on every device class, in the precision asked
    (three tf32 products for "ieee", one for "tf32"), with the row of its class and head-dim tile:
    IEEE_FORWARD_TILES' where "ieee" has one (K and V split once per tile, lo tiles of their own in
    shared memory), FORWARD_TILES' otherwise."""
    for arch, smem in itertools.product(ARCHS, SMEM_OPTINS):
        where = plans.device_class(arch, smem)
        for headdim, dt in ((1, 64), (40, 64), (64, 64), (100, 128), (128, 128), (200, 256), (256, 256)):
            for precision, products in (("ieee", 3), ("tf32", 1)):
                plan = plans.plan_forward(arch, SUPPORTED["float32"], headdim, Causal(), smem, precision=precision)
                tiles = plans.FORWARD_TILES[("tf32", where, dt)]
                if (where, dt) == (plans.SM90, 128):  # tf32-wgmma-d128: the producer kernel, Q staged
                    config = plans.WgmmaTf32FwdConfig(32, raw_stages=0, producer=True, stages=2,
                                                      sums_apart=precision == "ieee", presplit=True, q_staged=True)
                    assert (plan.kernel, plan.tiles, plan.d_tile, plan.spec.arch) == \
                        ("flash_fwd_tf32_wgmma_ws", config, 128, "90a")
                    assert plan.spec.name == (f"flash_fwd_tf32_wgmma_ws_fp32_hdim128_causal_bm128_bn32_{precision}"
                                              f"_s2_raw0{'_apart' if precision == 'ieee' else ''}_presplit_qstaged")
                    for mask in (Causal().as_packed(), Causal(score=Score(dropout=True)),
                                 NoMask(score=Score(user=example_modifiers()))):
                        other = plans.plan_forward(arch, SUPPORTED["float32"], headdim, mask, smem, precision=precision)
                        assert (other.kernel, other.tiles) == ("flash_fwd_tf32_wgmma_ws", config), (mask, other.spec.name)
                    continue
                if (where, dt) == (plans.SM90, 64):  # tf32-wgmma-route: v2, the producer kernel
                    config = plans.WgmmaTf32FwdConfig(32, raw_stages=2, producer=True, stages=4,
                                                      sums_apart=precision == "ieee")
                    assert (plan.kernel, plan.tiles, plan.d_tile, plan.spec.arch) == \
                        ("flash_fwd_tf32_wgmma_ws", config, 64, "90a")
                    assert plan.spec.name == (f"flash_fwd_tf32_wgmma_ws_fp32_hdim64_causal_bm128_bn32_{precision}"
                                              f"_s4_raw2{'_apart' if precision == 'ieee' else ''}")
                    apart = ", true" if precision == "ieee" else ""
                    assert plan.spec.expression.endswith(f", {products}, 4, 2{apart}>")
                    # every mask class on the same kernel: a varlen sequence and a mask_mod's causal
                    # mask give the dense call's bits only from the same arithmetic
                    for mask in (Causal().as_packed(), Causal(score=Score(dropout=True)),
                                 NoMask(score=Score(user=example_modifiers()))):
                        other = plans.plan_forward(arch, SUPPORTED["float32"], headdim, mask, smem, precision=precision)
                        assert (other.kernel, other.tiles) == ("flash_fwd_tf32_wgmma_ws", config), (mask, other.spec.name)
                        assert other.spec.name.startswith("flash_fwd_tf32_wgmma_ws_"), other.spec.name
                    continue
                if precision == "ieee":
                    tiles = plans.IEEE_FORWARD_TILES.get(("tf32", where, dt), tiles)
                    accurate = where != plans.PORTABLE and dt <= 128
                    assert tiles.presplit == tiles.fresh_o == tiles.step_sums == accurate
                else:
                    assert not tiles.presplit
                assert (plan.family, plan.kernel, plan.tiles, plan.d_tile) == ("mma", "flash_fwd_tf32", tiles, dt)
                assert plan.headdim == dispatch.mma_headdim(headdim)
                assert plan.spec.name == (f"flash_fwd_tf32_fp32_hdim{dt}_causal_bm{tiles.block_m}_bn{tiles.block_n}"
                                          f"_w{tiles.warps}_s{tiles.stages}_{precision}"
                                          f"{'_fresh_o_presplit_stepsums' if tiles.step_sums else ''}")
                flags = ", true, true, true" if tiles.step_sums else ""
                assert plan.spec.expression.endswith(f", {products}{flags}>")
                kv_tiles = 4 if tiles.presplit else 2
                assert plan.spec.smem_bytes == 4 * dt * (tiles.block_m + kv_tiles * tiles.stages * tiles.block_n)
                # every sm_90 part has 227 KiB per block (the table's smaller opt-ins there are hypothetical);
                # d256 needs more than 99 KiB (sm_86 / sm_89 refuse it, as they refused the SIMT kernel's)
                limit = 227 * 1024 if where == plans.SM90 else smem
                assert plan.spec.smem_bytes <= limit or (dt == 256 and limit < 128 * 1024)
    # other dtypes ignore the precision
    assert plans.plan_forward("90", SUPPORTED["bfloat16"], 128, Causal(), 227 * 1024, precision="tf32") == \
        plans.plan_forward("90", SUPPORTED["bfloat16"], 128, Causal(), 227 * 1024)


def test_float64_runs_on_dmma_up_to_d128():
    """float64's default forward is flash_fwd_dmma up to d128 on every device class, with the row
    of its class and DMMA head-dim tile, and within the class's shared memory (sm_86 / sm_89's 99
    KiB included, where the SIMT kernels it replaces ran); past 128 it stays SIMT."""
    for arch, smem in itertools.product(ARCHS, SMEM_OPTINS):
        where = plans.device_class(arch, smem)
        for headdim, dt in ((1, 16), (16, 16), (24, 32), (40, 64), (64, 64), (100, 128), (128, 128)):
            plan = plans.plan_forward(arch, SUPPORTED["float64"], headdim, Causal(), smem)
            tiles = plans.FORWARD_TILES[("dmma", where, dt)]
            assert (plan.family, plan.kernel, plan.tiles, plan.d_tile) == ("mma", "flash_fwd_dmma", tiles, dt)
            assert plan.headdim == dispatch.mma_headdim(headdim)
            name = f"flash_fwd_dmma_fp64_hdim{dt}_causal_bm{tiles.block_m}_bn{tiles.block_n}_w{tiles.warps}"
            expression = f"cf::flash_fwd_dmma<{dt}, cf::Causal, {tiles.block_n}, {tiles.warps}"
            if where == plans.SM90:
                # dmma-fwd-v2: sm_90's m16n8k8 products over two m-tiles, Q from shared memory, two
                # blocks per SM; compiled for sm_90 alone
                assert tiles.wide and tiles.m_tiles == 2 and not tiles.q_in_regs and plan.spec.arch == "90"
                assert plan.spec.name == name + "_mt2_qsmem_mb2_wide"
                assert plan.spec.expression == expression + ", 2, false, 2, true>"
            else:
                # the template's defaults: 8-row warps of m8n8k4 products, compiled for sm_80 and sm_90
                assert not tiles.wide and tiles.m_tiles == 1 and plan.spec.arch == ""
                assert plan.spec.name == name
                assert plan.spec.expression == expression + ">"
            assert plan.spec.smem_bytes == 8 * ((tiles.block_m + tiles.block_n) * (dt + 4) + tiles.block_n * (dt + 2))
            limit = 227 * 1024 if where == plans.SM90 else smem
            assert plan.spec.smem_bytes <= limit
        for headdim in (129, 200, 256):
            assert plans.plan_forward(arch, SUPPORTED["float64"], headdim, Causal(), smem).family == "simt"


def test_plans_refuse_what_no_kernel_runs():
    with pytest.raises(ValueError, match="unknown forward family"):
        plans.plan_forward("90", SUPPORTED["bfloat16"], 64, NoMask(), None, family="wgmma")
    with pytest.raises(ValueError, match="headdim 136 > 128"):
        plans.plan_forward("90", SUPPORTED["float64"], 136, NoMask(), None, family="mma")
    with pytest.raises(ValueError, match="DmmaFwdConfig does not run float32"):
        plans.forward_plan(SUPPORTED["float32"], 64, NoMask(), plans.DmmaFwdConfig(64, 8))
    with pytest.raises(ValueError, match="Tf32FwdConfig does not run float64"):
        plans.forward_plan(SUPPORTED["float64"], 64, NoMask(), plans.Tf32FwdConfig(128, 64, 8))
    with pytest.raises(ValueError, match="Tf32FwdConfig does not run float16"):
        plans.forward_plan(SUPPORTED["float16"], 64, NoMask(), plans.Tf32FwdConfig(128, 64, 8))
    with pytest.raises(ValueError, match="FwdConfig does not run float32"):
        plans.forward_plan(SUPPORTED["float32"], 64, NoMask(), plans.FwdConfig(128, 64, 4, False))
    with pytest.raises(ValueError, match="precision must be one of"):
        plans.plan_forward("90", SUPPORTED["float32"], 64, NoMask(), None, precision="highest")
    with pytest.raises(ValueError, match="headdim 36"):
        plans.forward_plan(SUPPORTED["float16"], 36, NoMask(), plans.FwdConfig(128, 64, 4, False))
    with pytest.raises(ValueError, match="headdim 257"):
        plans.plan_forward("80", SUPPORTED["float32"], 257, NoMask(), None)
    with pytest.raises(TypeError, match="config must be"):
        mma_fwd.plan(SUPPORTED["float16"], 64, NoMask(), plans.SimtTiles(64, 64, 4))


def test_sm90_d128_runs_the_producer_kernel():
    """sm_90's d128 row is flash_fwd_wgmma_ws (wgmma-fwd-ws-route) for the plain bands, packed
    batches and the score variants; dropout and v's own narrower tile keep the one-role kernel's
    128 x 128 tiles (ONE_ROLE_FORWARD_TILES), a window its own row, user modifiers the producer
    kernel where it compiles without spills."""
    producer, one_role = plans.FORWARD_TILES[("mma", plans.SM90, 128)], plans.ONE_ROLE_FORWARD_TILES[("mma", plans.SM90, 128)]
    assert producer == plans.WgmmaFwdConfig(128, 128, producer=True, stages=3)
    assert one_role == plans.WgmmaFwdConfig(128, 128)
    for dtype in ("float16", "bfloat16"):
        for headdim in (72, 128):
            for mask in (NoMask(), Causal(), Causal().as_packed(), Causal(score=Score(softcap=True)),
                         NoMask(score=Score(alibi=True)), Causal(score=Score(sink=True))):
                plan = plans.plan_forward("90", SUPPORTED[dtype], headdim, mask, 227 * 1024)
                assert plan.tiles == producer and plan.kernel == "flash_fwd_wgmma_ws", (dtype, headdim, mask)
                assert plan.spec.threads == 384
                # v of 64 columns beside q's 128: the one-role kernel's own v tile
                plan = plans.plan_forward("90", SUPPORTED[dtype], headdim, mask, 227 * 1024, headdim_v=64)
                assert plan.tiles == one_role and "v64_" in plan.spec.name, (dtype, headdim, mask)
            for mask in (Causal(score=Score(dropout=True)), NoMask(score=Score(dropout=True)).as_packed()):
                assert plans.plan_forward("90", SUPPORTED[dtype], headdim, mask, 227 * 1024).tiles == one_role
        # v's head dim in q's tile: the producer kernel
        assert plans.plan_forward("90", SUPPORTED[dtype], 128, Causal(), 227 * 1024, headdim_v=72).tiles == producer
    # the other head dims and devices keep their rows
    assert not plans.plan_forward("90", SUPPORTED["bfloat16"], 64, Causal(), 227 * 1024).tiles.producer
    assert not plans.plan_forward("90", SUPPORTED["bfloat16"], 256, Causal(), 227 * 1024).tiles.producer


def test_a_narrow_window_has_its_own_row():
    """A sliding window narrower than LOCAL_PRODUCER_MIN_KEYS keys a row (any score, packed or not)
    at sm_90 d128 runs LOCAL_FORWARD_TILES' 64 x 64 wgmma tiles; NoMask and Causal keep
    FORWARD_TILES' row, and so do the devices and head dims LOCAL_FORWARD_TILES has no row for."""
    row = plans.LOCAL_FORWARD_TILES[("mma", plans.SM90, 128)]
    assert row == plans.WgmmaFwdConfig(64, 64)
    assert plans.LOCAL_PRODUCER_MIN_KEYS == 1024
    for mask in (Local(1022, 0), Local(511, 511), Local(0, 0), Local(3, 3, score=Score(alibi=True)),
                 Local(3, 3).as_packed(), Local(100, 200, score=Score(softcap=True, sink=True))):
        assert mask.band_keys() < plans.LOCAL_PRODUCER_MIN_KEYS
        for dtype, headdim in (("bfloat16", 128), ("float16", 96), ("bfloat16", 72)):
            plan = plans.plan_forward("90", SUPPORTED[dtype], headdim, mask, 227 * 1024)
            assert plan.tiles == row and plan.spec.name.endswith("_bm64_bn64"), (mask, dtype, headdim)
            assert plan.spec.threads == 128
        band = Causal(score=mask.score, packed=mask.packed)  # the same call with the causal band
        for arch, smem, headdim in (("90", 227 * 1024, 64), ("90", 227 * 1024, 256), ("80", 163 * 1024, 128)):
            assert plans.plan_forward(arch, SUPPORTED["bfloat16"], headdim, mask, smem).tiles == \
                plans.plan_forward(arch, SUPPORTED["bfloat16"], headdim, band, smem).tiles
    for mask in (NoMask(), Causal()):
        assert plans.plan_forward("90", SUPPORTED["bfloat16"], 128, mask, 227 * 1024).tiles == \
            plans.FORWARD_TILES[("mma", plans.SM90, 128)]


def test_a_wide_window_runs_the_producer_row():
    """A window of LOCAL_PRODUCER_MIN_KEYS keys a row or more, or with a side unbounded, at sm_90
    d128 runs FORWARD_TILES' producer row, as causal does, with its own band in the kernel's name;
    with dropout, v's own tile or a user modifier it keeps the window's 64 x 64 tiles (the producer
    kernel does not run those calls); the width is left + right + 1, whatever the split."""
    producer = plans.FORWARD_TILES[("mma", plans.SM90, 128)]
    assert producer.producer
    row = plans.LOCAL_FORWARD_TILES[("mma", plans.SM90, 128)]
    for mask in (Local(1023, 0), Local(0, 1023), Local(512, 511), Local(4096, 0), Local(-1, 7), Local(7, -1),
                 Local(2000, 0, score=Score(alibi=True)), Local(1024, 0).as_packed(),
                 Local(1024, 0, score=Score(softcap=True, sink=True))):
        keys = mask.band_keys()
        assert keys is None or keys >= plans.LOCAL_PRODUCER_MIN_KEYS
        for dtype, headdim in (("bfloat16", 128), ("float16", 96)):
            plan = plans.plan_forward("90", SUPPORTED[dtype], headdim, mask, 227 * 1024)
            assert plan.tiles == producer, (mask, dtype, headdim)
            assert plan.spec.source_file == "flash_fwd_wgmma_ws.cu" and "_local" in plan.spec.name
        # v's own tile and dropout take the one-role kernel, which the window runs on its own tiles
        assert plans.plan_forward("90", SUPPORTED["bfloat16"], 128, mask, 227 * 1024, headdim_v=64).tiles == row
        dropout = mask.with_score(replace(mask.score, dropout=True))
        assert plans.plan_forward("90", SUPPORTED["bfloat16"], 128, dropout, 227 * 1024).tiles == row
        assert not plans.producer_takes_window(producer, mask, own_v=True)
        user = mask.with_score(Score(user=example_modifiers()))
        assert plans.forward_candidates("mma", plans.SM90, 128, user)[0] == row
    # the boundary: one key fewer keeps the window's own tiles
    assert plans.plan_forward("90", SUPPORTED["bfloat16"], 128, Local(1022, 0), 227 * 1024).tiles == row
    assert plans.plan_forward("90", SUPPORTED["bfloat16"], 128, Local(1023, 0), 227 * 1024).tiles == producer
    # elsewhere a window's plan is causal's, wide or narrow
    for arch, smem, headdim in (("90", 227 * 1024, 64), ("90", 227 * 1024, 256), ("80", 163 * 1024, 128)):
        for mask in (Local(1023, 0), Local(3, 0)):
            assert plans.plan_forward(arch, SUPPORTED["bfloat16"], headdim, mask, smem).tiles == \
                plans.plan_forward(arch, SUPPORTED["bfloat16"], headdim, Causal(), smem).tiles


def test_band_forms_list_both_widths_of_a_window():
    """plans.band_forms gives a Local kind narrow and as it is (wide where it has no bounds), and
    every other kind alone; their plans at sm_90 d128 are the two rows a window can run."""
    for mask in (NoMask(), Causal(score=Score(softcap=True)), Causal().as_packed()):
        assert plans.band_forms(mask) == (mask,)
    for mask in (Local(), Local(score=Score(alibi=True)), Local(score=Score(alibi=True), packed=True)):
        narrow, wide = plans.band_forms(mask)
        assert wide == mask and narrow.band_keys() == 1 and narrow.score == mask.score
        assert narrow.packed == mask.packed and wide.band_keys() is None
        tiles = {plans.plan_forward("90", SUPPORTED["bfloat16"], 128, m, 227 * 1024).tiles for m in (narrow, wide)}
        assert tiles == {plans.LOCAL_FORWARD_TILES[("mma", plans.SM90, 128)],
                         plans.FORWARD_TILES[("mma", plans.SM90, 128)]}


def test_the_compile_check_sees_every_shipped_forward_specialization():
    """mma_fwd.specializations() is every row's specialization for both 16-bit dtypes and every
    mask: the old tree's set (its two masks) plus the same names with "local", and each of those
    kernels with the score policies of masks.VARIANT_KINDS."""
    old = {old_choice(arch, smem, dtype, hd, mask)[0] for dtype in ("float16", "bfloat16")
           for arch, smem in itertools.product(ARCHS, SMEM_OPTINS) for hd in (64, 128, 256) for mask in OLD_MASKS}
    # wgmma-fwd-ws-route: sm_90's d128 row is the producer kernel's since (the one-role kernel
    # stays for dropout and v's own tile: below)
    producer = plans.FORWARD_TILES[("mma", plans.SM90, 128)]
    one_role = {plans.specialization_for(dtype, 128, mask, plans.ONE_ROLE_FORWARD_TILES[("mma", plans.SM90, 128)]).name:
                plans.specialization_for(dtype, 128, mask, producer).name
                for dtype in ("float16", "bfloat16") for mask in (NoMask(), Causal())}
    assert one_role.keys() <= old
    old = {one_role.get(n, n) for n in old}
    all_names = [s.name for s in mma_fwd.specializations()]
    # float32: every tf32 row with every mask, in both precisions ("ieee" on IEEE_FORWARD_TILES' rows
    # where it has them)
    # (and where a key block has enough readers, WGMMA_FLOAT32_PRESPLIT_FORWARD_TILES' rows, with
    # the split kernel they launch first)
    tf32 = {n for n in all_names if n.startswith(("flash_fwd_tf32_", "flash_fwd_split_kv_tf32_"))}
    tf32_rows = {(dt, mask, precision, plans.forward_candidates(family, where, dt, mask, precision,
                                                                image_readers=readers)[0])
                 for (family, where, dt) in plans.FORWARD_TILES if family == "tf32"
                 for mask in KINDS + VARIANT_KINDS + PACKED_KINDS for precision in ("ieee", "tf32")
                 for readers in (None, plans.PRESPLIT_MIN_IMAGE_READERS)}
    assert tf32 == ({plans.specialization_for("float32", dt, mask, t, precision=precision).name
                     for dt, mask, precision, t in tf32_rows}
                    | {plans.tf32_fwd_split_kv_spec(dt, mask, t, precision).name for dt, mask, precision, t in tf32_rows
                       if isinstance(t, plans.WgmmaTf32FwdConfig) and t.presplit})
    assert any(n.endswith("_ieee_fresh_o_presplit_stepsums") for n in tf32)
    all_names = [n for n in all_names if n not in tf32]
    # packed batches: each row's plan for masks.PACKED_KINDS (PACKED_FORWARD_TILES where it differs),
    # a window narrow and wide (plans.band_forms)
    packed = {n for n in all_names if "_packed_" in n}
    assert packed == {plans.specialization_for(dtype, dt, form, plans.forward_tiles("mma", where, dt, dtype, form,
                                                                                    None)).name
                      for dtype in ("float16", "bfloat16") for (family, where, dt) in plans.FORWARD_TILES
                      if family == "mma" for mask in PACKED_KINDS for form in plans.band_forms(mask)}
    all_names = [n for n in all_names if n not in packed]
    # v in a narrower tile of its own (plans.v_tile): each SM90 row's wgmma kernel for the plain
    # masks (LOCAL_FORWARD_TILES' for the window), with every narrower tensor-core tile
    own_v = {n for n in all_names if re.search(r"_hdim\d+v\d+_", n)}
    assert own_v == {plans.specialization_for(dtype, dt, mask, plans.forward_tiles("mma", plans.SM90, dt, dtype, mask,
                                                                                   None, own_v=True), dvt).name
                     for dtype in ("float16", "bfloat16") for dt in (128, 256) for mask in KINDS
                     for dvt in (64, 128) if dvt < dt}
    all_names = [n for n in all_names if n not in own_v]
    # softcap with the cap as each row's maximum (plans.takes_fixed_max): bfloat16's softcap kinds
    # on the kernels that ask for it, beside the same kinds without it
    fixed = {n for n in all_names if "_fixedmax" in n}
    assert fixed == {plans.specialization_for("bfloat16", dt, m.with_score(replace(m.score, fixed_max=True)), t).name
                     for (family, where, dt) in plans.FORWARD_TILES if family == "mma"
                     for m in VARIANT_KINDS if m.score.softcap and not m.score.alibi and m.score.user is None
                     for t in [plans.forward_tiles("mma", where, dt, "bfloat16", m, None)]
                     if plans.specialization_for("bfloat16", dt, m, t).source_file in plans.FIXED_MAX_KERNELS}
    assert fixed and {n.replace("_fixedmax", "") for n in fixed} <= set(all_names)
    all_names = [n for n in all_names if n not in fixed]
    variant_names = {m.name for m in VARIANT_KINDS}
    names = [n for n in all_names if not any(f"_{v}_" in n for v in variant_names)]
    # user modifiers: the tiles their plans choose (some rows share them: fewer names)
    user_kinds = [m for m in VARIANT_KINDS if m.score.user is not None]
    user_names = {plans.specialization_for(dtype, dt, mask, plans.forward_tiles("mma", where, dt, dtype, mask, None)).name
                  for dtype in ("float16", "bfloat16") for (family, where, dt) in plans.FORWARD_TILES
                  if family == "mma" for mask in user_kinds}
    assert user_names <= set(all_names)
    # dropout: the tiles its plans choose (DROPOUT_FORWARD_TILES: some rows share them)
    dropout_kinds = [m for m in VARIANT_KINDS if m.score.dropout]
    dropout_names = {plans.specialization_for(dtype, dt, mask, plans.forward_tiles("mma", where, dt, dtype, mask,
                                                                                   None)).name
                     for dtype in ("float16", "bfloat16") for (family, where, dt) in plans.FORWARD_TILES
                     if family == "mma" for mask in dropout_kinds}
    assert dropout_names <= set(all_names)
    builtin = len(VARIANT_KINDS) - len(user_kinds) - len(dropout_kinds)
    # the window: narrow on LOCAL_FORWARD_TILES' tiles where a row has them, and wide (or narrow
    # elsewhere) on the causal band's kernels (plans.band_forms, plans.producer_takes_window)
    own_rows = {plans.specialization_for(dtype, dt, Local(), tiles).name for dtype in ("float16", "bfloat16")
                for (family, where, dt), tiles in plans.LOCAL_FORWARD_TILES.items()}
    # each row: full, causal, the window and the built-in variants; a row with its own window tiles
    # one more window, plain and with ALiBi (masks.VARIANT_KINDS' window)
    rows = (len(names) - len(own_rows)) // 3
    assert len(all_names) == len(set(all_names)) == (rows * (3 + builtin) + 2 * len(own_rows) + len(user_names)
                                                      + len(dropout_names))
    assert rows == len(old) // 2
    assert {n for n in names if "_local_" not in n} == old
    local = {n for n in names if "_local_" in n}
    assert local == {plans.specialization_for(dtype, dt, form, plans.forward_tiles("mma", where, dt, dtype, form,
                                                                                   None)).name
                     for dtype in ("float16", "bfloat16") for (family, where, dt) in plans.FORWARD_TILES
                     if family == "mma" for form in plans.band_forms(Local())}
    assert own_rows <= local
    assert {n.replace("_local_", "_causal_") for n in local - own_rows} == {n for n in old if "_causal_" in n}
    simt_fwd = {s.name for s in simt.specializations() if s.source_file == "flash_fwd_simt.cu"}
    assert simt_fwd == {plans.plan_forward("80", SUPPORTED[dtype], hd, mask, None, family="simt").spec.name
                        for dtype in SUPPORTED for hd in plans.SIMT_D_TILES
                        for mask in KINDS + VARIANT_KINDS + PACKED_KINDS}


def test_the_tensor_core_rows_fit_their_devices():
    """PORTABLE fits an A100 (163 KiB per block, 164 per SM: min_blocks blocks each); LARGE_SMEM
    fits 227 KiB per block and 228 per SM, within the opt-in that admits it; SM90 within 227 KiB."""
    reserved = 1024  # per block, by the driver
    for (family, where, dt), tiles in plans.FORWARD_TILES.items():
        if family == "dmma":  # PORTABLE: 99 KiB (sm_86 / sm_89); the others 227 KiB
            limit = 99 * 1024 if where == plans.PORTABLE else 227 * 1024
            assert plans.dmma_smem_bytes(dt, tiles) + reserved <= limit
        elif family == "tf32":  # PORTABLE: 99 KiB (sm_86 / sm_89) but d256 163 KiB (A100); the others 227 KiB
            limit = (163 if dt == 256 else 99) * 1024 if where == plans.PORTABLE else 227 * 1024
            assert plans.tf32_smem_bytes(dt, tiles) + reserved <= limit
        elif where == plans.PORTABLE:
            assert tiles.min_blocks * (plans.smem_bytes(dt, tiles) + reserved) <= 164 * 1024
        elif where == plans.LARGE_SMEM:
            assert tiles.min_blocks * (plans.smem_bytes(dt, tiles) + reserved) <= 228 * 1024
            assert plans.smem_bytes(dt, tiles) <= plans.LARGE_SMEM_BYTES
        elif where == plans.SM90:
            assert plans.wgmma_smem_bytes(dt, tiles) <= 227 * 1024
            spec = plans.specialization_for(SUPPORTED["float16"], dt, Causal(), tiles)
            assert spec.arch == "90a" and spec.threads == tiles.threads == (384 if tiles.producer else tiles.block_m // 64 * 128)


def _fake_qkvo(shape_q, shape_k, dtype):
    q, o = FakeArray(shape_q, dtype), FakeArray(shape_q, dtype)
    k, v = FakeArray(shape_k, dtype), FakeArray(shape_k, dtype)
    return q, k, v, o


@pytest.mark.parametrize("arch,smem", [("90", 227 * 1024), ("80", 163 * 1024), ("89", 99 * 1024), (None, None)])
def test_the_launchers_launch_their_plan(arch, smem, monkeypatch):
    """mma_fwd.forward and simt.forward launch the plan of the current device (stand-in arrays,
    launch recorded) with its grid and one FwdParams of the call, and mma_fwd.forward(config=...)
    the given tiles."""
    monkeypatch.setattr(mma_fwd, "current_arch", lambda: arch)
    monkeypatch.setattr(mma_fwd, "current_smem_optin", lambda: smem)
    recorder = LaunchRecorder(monkeypatch, [mma_fwd, simt])
    b, sq, sk, h, hkv = 2, 300, 200, 4, 2
    for (dtype, d), window in itertools.product([("float16", 64), ("bfloat16", 200), ("float32", 40),
                                                  ("float64", 256)], [(-1, -1), (-1, 0), (64, 0)]):
        q, k, v, o = _fake_qkvo((b, sq, h, d), (b, sk, hkv, d), SUPPORTED[dtype])
        lse = FakeArray((b, h, sq), np.float64 if dtype == "float64" else np.float32)
        family = plans.forward_family(SUPPORTED[dtype], d)
        kernels = {"mma": mma_fwd, "simt": simt}[family]
        kernels.forward(q, k, v, o, lse, softmax_scale=0.1, causal=False, window_size=window)
        mask = {(-1, -1): NoMask(), (-1, 0): Causal(), (64, 0): Local(64, 0)}[window]
        plan = plans.plan_forward(arch, SUPPORTED[dtype], d, mask, smem)
        [launch] = recorder.take()
        assert (launch.spec, launch.grid) == (plan.spec, (math.ceil(sq / plan.block_m), h, b))
        assert_forward_launch(launch, q, k, v, o, lse, softmax_scale=0.1, mask=mask)
    tiles = plans.WgmmaFwdConfig(128, 64) if arch == "90" else plans.FwdConfig(128, 64, 8, False)
    q, k, v, o = _fake_qkvo((b, sq, h, 128), (b, sk, hkv, 128), SUPPORTED["bfloat16"])
    lse = FakeArray((b, h, sq), np.float32)
    mma_fwd.forward(q, k, v, o, lse, softmax_scale=0.1, causal=True, config=tiles)
    [launch] = recorder.take()
    assert (launch.spec, launch.grid) == (plans.specialization_for(SUPPORTED["bfloat16"], 128, Causal(), tiles),
                                          (math.ceil(sq / tiles.block_m), h, b))
    assert_forward_launch(launch, q, k, v, o, lse, softmax_scale=0.1, mask=Causal())


@pytest.mark.gpu
def test_the_plan_of_this_device_is_what_the_launchers_run_and_fits_it():
    """The launchers' device numbers are the device's, and every plan of it (sm_90: the wgmma rows
    for 16-bit dtypes; float32's tf32 and float64's DMMA kernels on every arch) is for its arch and
    fits its shared memory."""
    import cupy

    from cupyflash.kernels._module import _max_smem_optin, device_arch, runs_on_device

    arch, smem = device_arch(), _max_smem_optin(cupy.cuda.Device().id)
    assert (mma_fwd.current_arch(), mma_fwd.current_smem_optin()) == (arch, smem)
    for dtype, headdim, mask in itertools.product(SUPPORTED, (24, 64, 96, 128, 256), KINDS):
        plan = plans.plan_forward(arch, SUPPORTED[dtype], headdim, mask, smem)
        if plan.family == "mma":
            assert plan == mma_fwd.plan(SUPPORTED[dtype], plan.headdim, mask)
            own = {"float32": "flash_fwd_tf32", "float64": "flash_fwd_dmma"}.get(dtype)
            # tf32-wgmma-route: the producer kernel up to d64, and at d128 its staged-Q form (tf32-wgmma-d128)
            if dtype == "float32" and arch == "90" and plan.d_tile <= 128:
                own = "flash_fwd_tf32_wgmma_ws"
            if own is None and arch == "90":  # wgmma-fwd-ws-route: d128's row is the producer kernel,
                # and a window's where its band is wide (window-fwd-producer: KINDS' Local is unbounded)
                wide = mask.band != "local" or mask.band_keys() is None or mask.band_keys() >= plans.LOCAL_PRODUCER_MIN_KEYS
                own = "flash_fwd_wgmma_ws" if plan.d_tile == 128 and wide else "flash_fwd_wgmma"
            assert plan.kernel == (own or "flash_fwd_mma"), (dtype, headdim, mask, plan.kernel)
        assert runs_on_device(plan.spec) and plan.spec.smem_bytes <= smem, plan.spec.name


def test_the_fixed_row_maximum_is_softcap_only_and_stays_in_the_forward():
    """Score.fixed_max (softcap-fixed-max) needs softcap, names the forward's specialization
    ("fixedmax") and its ScoreMod's last argument, and goes away in the backward's score; the
    rule's range: 2 c log2(e) <= FIXED_MAX_LOG2_RANGE (96, so P >= 2^-96 in bfloat16)."""
    fixed = Score(softcap=True, fixed_max=True)
    assert fixed.name == "softcap_fixedmax" and fixed.cpp == "cf::ScoreMod<true, false, false, false, true>"
    assert Score(softcap=True, sink=True, fixed_max=True).name == "softcap_fixedmax_sink"
    assert fixed.backward() == Score(softcap=True) and Causal(score=fixed).backward().score == Score(softcap=True)
    for score in (Score(alibi=True), Score(softcap=True, alibi=True), Score(softcap=True, user=example_modifiers())):
        with pytest.raises(ValueError, match="softcap"):
            replace(score, fixed_max=True)
    assert plans.FIXED_MAX_LOG2_RANGE == 96.0
    softcap = Causal(score=Score(softcap=True))
    producer = plans.plan_forward("90", SUPPORTED["bfloat16"], 128, softcap, 227 * 1024).spec
    assert producer.source_file in plans.FIXED_MAX_KERNELS
    assert plans.takes_fixed_max(producer, SUPPORTED["bfloat16"], softcap, 33.27)
    assert not plans.takes_fixed_max(producer, SUPPORTED["bfloat16"], softcap, 33.28)
    assert not plans.takes_fixed_max(producer, SUPPORTED["float16"], softcap, 30.0)
    assert not plans.takes_fixed_max(producer, SUPPORTED["bfloat16"], softcap, 0.0)
    # ALiBi can hold a whole row far under the bound (a first row of seqlen_q > seqlen_k without the
    # causal band), so softcap with ALiBi keeps the running maximum
    for mask in (NoMask(score=Score(softcap=True, alibi=True)), Causal(score=Score(softcap=True, alibi=True))):
        spec = plans.plan_forward("90", SUPPORTED["bfloat16"], 128, mask, 227 * 1024).spec
        assert spec.source_file in plans.FIXED_MAX_KERNELS
        assert not plans.takes_fixed_max(spec, SUPPORTED["bfloat16"], mask, 30.0)
    assert plans.takes_fixed_max(producer, SUPPORTED["bfloat16"], Causal(score=Score(softcap=True, sink=True)), 30.0)

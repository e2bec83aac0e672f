"""flash_bwd_dkdv_tf32_wgmma on the CPU (models/flash_bwd_dkdv_tf32_wgmma.py): its mirrors are the
kernel's statements, its shared memory is the plan's, and one key block against one query block,
emulated product by product from what the tensor cores read, is S^T = K Q^T, dP^T = V dO^T,
dV = P^T dO and dK = dS^T Q on the valid rows and columns, the epilogue storing each value at its
key and column. The GPU tests (tests/kernels/test_flash_bwd_dmma.py's float32 part) check the
kernel's numbers."""
from __future__ import annotations

import numpy as np
import pytest

from cupyflash import backward_plans
from cupyflash.backward_plans import TF32_WGMMA_BACKWARD_CONFIGS, Tf32WgmmaBwdConfig
from cupyflash.masks import as_mask
import models.flash_bwd_dkdv_tf32_wgmma as dkdv_model
from models.flash_bwd_dkdv_tf32_wgmma import (BLOCK_N, KERNEL, acc_from_matrix, backward_smem, element_positions,
                                              fused_dq, load_tiles, products)
from models.mirrors import missing_statements, unmirrored_statements
from models.wgmma_tf32_bwd_steps import STEPS, acc_times_tile, close, emulate, store_acc_rows
from nvrtc_check import needs_nvrtc


@pytest.mark.parametrize("source", [KERNEL, STEPS])
def test_mirrors_match_the_kernel_sources(source):
    assert not (missing := missing_statements(source)), f"mirrored statements no longer in {source}: {missing}"
    assert not (unmirrored := unmirrored_statements(source)), f"layout statements without a mirror: {unmirrored}"


@pytest.mark.parametrize("config", [Tf32WgmmaBwdConfig(32, 2), Tf32WgmmaBwdConfig(64, 1), Tf32WgmmaBwdConfig(64, 0)])
def test_smem_is_the_kernels_layout_and_fits(config):
    layout = backward_smem(64, config.block_m, config.raw_stages)
    assert backward_plans.tf32_wgmma_smem_bytes("dkdv", 64, config) == layout["BYTES"] + 1024 <= 227 * 1024
    assert all(layout[name] % 1024 == 0 for name in layout if name.endswith(("_HI", "_LO")))  # 128-byte swizzle


def test_the_spec_names_its_tiles_and_refuses_what_cannot_run():
    spec = backward_plans.tf32_wgmma_spec("dkdv", 64, as_mask(True), TF32_WGMMA_BACKWARD_CONFIGS[64][0])
    assert spec.name == "flash_bwd_dkdv_tf32_wgmma_fp32_hdim64_causal_bm32_bn64_r2_apart"
    assert spec.expression == "cf::flash_bwd_dkdv_tf32_wgmma<64, cf::Causal, 32, 2, true>"
    assert spec.arch == "90a" and spec.threads == 128
    with pytest.raises(ValueError, match="head-dim tiles"):
        backward_plans.tf32_wgmma_spec("dkdv", 32, as_mask(True), Tf32WgmmaBwdConfig())
    # at d128 only the pair fits (test_flash_bwd_dkdv_tf32_wgmma_pair.py); past it no tile
    with pytest.raises(ValueError, match="227 KiB"):
        backward_plans.tf32_wgmma_backward_plan(96, True, Tf32WgmmaBwdConfig())
    with pytest.raises(ValueError, match="head dims up to 128"):
        backward_plans.tf32_wgmma_backward_plan(136, True, Tf32WgmmaBwdConfig())
    with pytest.raises(ValueError, match="227 KiB"):
        backward_plans.tf32_wgmma_spec("dkdv", 64, as_mask(True), Tf32WgmmaBwdConfig(64, 2))
    plan = backward_plans.tf32_wgmma_backward_plan(40, False, Tf32WgmmaBwdConfig(), statistics="recomputed")
    assert [launch.role for launch in plan.launches] == ["stats", "dkdv", "dq"]
    assert plan.spec("dkdv").name.startswith("flash_bwd_dkdv_tf32_wgmma_fp32_hdim64_full_")
    assert plan.spec("dq").name == "flash_bwd_dq_tf32_wgmma_fp32_hdim64_full_bm64_bn32_r2_apart"
    assert plan.spec("stats").name.endswith("_tf32x3")  # the recomputed statistics: the tf32x3 kernel's
    # dq_block_n 0: dQ on the tf32x3 experiment's kernel, at its own head-dim tile
    plan = backward_plans.tf32_wgmma_backward_plan(24, True, Tf32WgmmaBwdConfig(dq_block_n=0))
    assert [launch.role for launch in plan.launches] == ["preprocess", "dkdv", "dq"]
    assert plan.spec("dq").name.startswith("flash_bwd_dq_dmma_fp32_hdim32_causal_") and plan.spec("dq").name.endswith(
        "_tf32x3")


@pytest.mark.parametrize("block_m, keys_valid, queries_valid, headdim, headdim_v",
                         [(32, 64, 32, 64, 64), (32, 41, 19, 60, 52), (64, 64, 64, 64, 64), (64, 7, 50, 8, 36)])
def test_one_block_emulated_is_the_backward_products(block_m, keys_valid, queries_valid, headdim, headdim_v):
    """Fresh float32 values with every mantissa bit in use: the three-product split leaves 2^-21
    relative, a value at the wrong key, query or column leaves O(1)."""
    got, (k64, v64, q64, do64) = emulate(dkdv_model, block_m, keys_valid, queries_valid, headdim, headdim_v,
                                               seed=block_m + keys_valid + headdim_v)
    assert close(got["st"], k64 @ q64.T) and close(got["dpt"], v64 @ do64.T)
    assert close(got["dv"], got["p_t"] @ do64) and close(got["dk"], got["ds_t"] @ q64)

    # the element step's (key, query) of each value is the accumulator's own
    keys, queries = element_positions(block_m)
    key_of, query_of = np.meshgrid(np.arange(BLOCK_N), np.arange(block_m), indexing="ij")
    assert np.array_equal(acc_from_matrix(key_of).reshape(128, -1), keys)
    assert np.array_equal(acc_from_matrix(query_of).reshape(128, -1), queries)
    # the epilogue stores value 4 j + 2 h + e at its key row and column
    assert np.array_equal(store_acc_rows(acc_from_matrix(got["dk"]).reshape(128, -1), 64), got["dk"])


@pytest.mark.parametrize("block_m, keys_valid, headdim", [(32, 64, 64), (32, 41, 60), (64, 7, 8)])
def test_fused_dq_emulated_is_ds_times_k(block_m, keys_valid, headdim):
    """DQ_ATOMIC: dS^T's accumulator stored as dS, K^T split once, dQ^T = K^T dS^T, and the values
    added at their (query, column): dS K on the valid keys and columns."""
    rng = np.random.default_rng(block_m + keys_valid)
    k = rng.standard_normal((BLOCK_N, 64)).astype(np.float32)
    ds_t = rng.standard_normal((BLOCK_N, block_m)).astype(np.float32).astype(np.float64)
    want = ds_t.T @ np.where((np.arange(BLOCK_N)[:, None] < keys_valid) & (np.arange(64)[None, :] < headdim), k, 0)
    assert close(fused_dq(k, ds_t, keys_valid, headdim, block_m), want)
    L = backward_smem(64, block_m, 2, dq_atomic=True)
    assert L["KT"] % 1024 == 0 and L["DS"] % 1024 == 0
    assert backward_plans.tf32_wgmma_smem_bytes("dkdv", 64, Tf32WgmmaBwdConfig(block_m, 2, fused_dq=True)) == (
        L["BYTES"] + 1024)


def test_a_slipped_relabelling_is_caught():
    """The emulation is not blind: dO^T's k-steps fed P^T's registers in accumulator order
    ({d0, d1, d2, d3}, the relabelling undone) put values at other queries."""
    rng = np.random.default_rng(11)
    k, v = (rng.standard_normal((BLOCK_N, 64)).astype(np.float32) for _ in range(2))
    q, do = (rng.standard_normal((32, 64)).astype(np.float32) for _ in range(2))
    smem = load_tiles(64, 32, k, v, q, do, 64, 32, 64, 64)
    L = backward_smem(64, 32, 0)
    p_t = products(smem, 64, 32)["p_t"]
    slipped = acc_from_matrix(p_t)[:, :, [0, 2, 1, 3]]  # acc_times_tile relabels it back to {d0, d1, d2, d3}
    dv = acc_times_tile(smem, 64, 32, slipped, L["DOT_HI"], L["DOT_LO"])
    want = p_t @ do.astype(np.float64)
    assert np.abs(dv - want).max() > 1e-2 * np.abs(want).max()


@needs_nvrtc
def test_the_candidates_compile_without_spills_on_every_mask():
    from cupyflash.kernels import compile_check, dmma

    specs = [s for s in dmma.specializations() if "_tf32_wgmma_" in s.name]  # the six kernels (the pairs: d128's route)
    assert {s.source_file for s in specs} == {"flash_bwd_dkdv_tf32_wgmma.cu", "flash_bwd_dq_tf32_wgmma.cu",
                                              "flash_bwd_dkdv_tf32_wgmma_ws.cu", "flash_bwd_dq_tf32_wgmma_ws.cu",
                                              "flash_bwd_dkdv_tf32_wgmma_pair.cu", "flash_bwd_dq_tf32_wgmma_pair.cu"}
    assert specs
    results = compile_check.check("90a", specs, with_sass=True)
    assert not [(r.name, r.spill_bytes, r.stack_bytes) for r in results if r.spill_bytes or r.stack_bytes]
    assert not [r.name for r in results if r.wgmma_serialized or "HGMMA" not in r.sass_opcodes]


@needs_nvrtc
def test_the_bench_candidates_compile_without_spills_unmasked_and_causal():
    """dev/bench_dmma_bwd.py's other candidates (and the GPU tests'), on the masks it times: at d64,
    and the pair's dK/dV kernel at d128."""
    import sys
    from pathlib import Path

    from cupyflash.kernels import compile_check

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dev"))
    from bench_dmma_bwd import WGMMA_CANDIDATES, WGMMA_D128_CANDIDATES

    specs = {spec.name: spec for headdim, table in ((64, WGMMA_CANDIDATES), (128, WGMMA_D128_CANDIDATES))
             for config in table.values() for causal in (False, True)
             for spec in backward_plans.tf32_wgmma_backward_plan(headdim, causal, config).launches
             for spec in [spec.spec] if "_tf32_wgmma_" in spec.name}
    results = compile_check.check("90a", list(specs.values()), with_sass=True)
    assert len(results) == len(specs) > 8
    assert any(r.name.startswith("flash_bwd_dkdv_tf32_wgmma_pair_") for r in results)
    assert not [(r.name, r.spill_bytes, r.stack_bytes) for r in results if r.spill_bytes or r.stack_bytes]
    assert not [r.name for r in results if r.wgmma_serialized]

"""flash_bwd_dq_tf32_wgmma_ws on the CPU (models/flash_bwd_dq_tf32_wgmma_ws.py): its mirrors are
the kernel's statements, its shared memory is the plan's with every tile aligned for the swizzle
and no two regions overlapping, one key block landed in a later stage and emulated product by
product from what the tensor cores read is S = Q K^T, dP = dO V^T and dQ = dS K, and its
producer / consumer protocol (StageRing's, the dK/dV producer kernel's) runs through in any
interleaving. The compile check is tests/kernels/test_flash_bwd_dkdv_tf32_wgmma.py's (all four
tf32 wgmma kernels, every mask); the GPU tests are tests/kernels/test_flash_bwd_dmma.py's
"producer_dq" configuration."""
from __future__ import annotations

import random

import numpy as np
import pytest

from cupyflash import backward_plans
from cupyflash.backward_plans import Tf32WgmmaBwdConfig
from cupyflash.masks import as_mask
import models.flash_bwd_dq_tf32_wgmma_ws as ws_model
from models.flash_bwd_dkdv_tf32_wgmma_ws import run_protocol
from models.flash_bwd_dq_tf32_wgmma_ws import KERNEL, ws_smem
from models.mirrors import missing_statements, unmirrored_statements
from models.wgmma_tf32_bwd_steps import close, emulate


def test_mirrors_match_the_kernel_source():
    assert not (missing := missing_statements(KERNEL)), f"mirrored statements no longer in {KERNEL}: {missing}"
    assert not (unmirrored := unmirrored_statements(KERNEL)), f"layout statements without a mirror: {unmirrored}"


@pytest.mark.parametrize("block_n, stages, raw_stages", [(32, 2, 1), (32, 2, 2), (32, 3, 1)])
def test_smem_is_the_plans_and_every_tile_aligned(block_n, stages, raw_stages):
    config = Tf32WgmmaBwdConfig(dq_block_n=block_n, dq_raw_stages=raw_stages, dq_producer=True, dq_stages=stages)
    assert backward_plans.tf32_wgmma_smem_bytes("dq", 64, config) == ws_smem(64, block_n, stages, raw_stages)["BYTES"] + 1024
    assert backward_plans.tf32_wgmma_smem_bytes("dq", 64, config) <= 227 * 1024
    regions = []
    for stage in range(stages):
        layout = ws_smem(64, block_n, stages, raw_stages, stage)
        tiles = ["K_HI", "K_LO", "KT_HI", "KT_LO", "V_HI", "V_LO"] + (["Q_HI", "Q_LO", "DO_HI", "DO_LO"] if stage == 0 else [])
        for tile in tiles:
            assert layout[tile] % 1024 == 0, tile  # the 128-byte swizzle's atom
            size = layout["Q_TILE"] if tile.startswith(("Q", "DO")) else layout["KV_TILE"]
            regions.append((layout[tile], layout[tile] + size))
    regions.append((layout["RAW"], layout["FULL"]))
    regions.append((layout["FULL"], layout["BYTES"]))
    regions.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(regions, regions[1:])), regions
    assert regions[-1][1] == layout["BYTES"]


def test_the_spec_names_its_stages_and_refuses_what_cannot_run():
    config = Tf32WgmmaBwdConfig(32, 1, producer=True, dq_raw_stages=1, dq_producer=True)
    spec = backward_plans.tf32_wgmma_spec("dq", 64, as_mask(True), config)
    assert spec.name == "flash_bwd_dq_tf32_wgmma_ws_fp32_hdim64_causal_bm64_bn32_s2_r1_apart"
    assert spec.expression == "cf::flash_bwd_dq_tf32_wgmma_ws<64, cf::Causal, 32, 2, 1, true>"
    assert spec.threads == 256 and spec.arch == "90a" and spec.source_file == "flash_bwd_dq_tf32_wgmma_ws.cu"
    assert config in backward_plans.TF32_WGMMA_BACKWARD_CONFIGS[64]  # the compile check builds it for every mask
    plan = backward_plans.tf32_wgmma_backward_plan(64, True, config)
    assert [launch.spec.name for launch in plan.launches][2] == spec.name
    for bad in (Tf32WgmmaBwdConfig(dq_raw_stages=0, dq_producer=True),
                Tf32WgmmaBwdConfig(dq_producer=True, dq_stages=1)):
        with pytest.raises(ValueError, match="producer form"):
            backward_plans.tf32_wgmma_spec("dq", 64, as_mask(True), bad)
    two = Tf32WgmmaBwdConfig(32, 1, producer=True, dq_raw_stages=1, dq_producer=True, dq_consumers=2)
    spec = backward_plans.tf32_wgmma_spec("dq", 64, as_mask(True), two)
    assert spec.name == "flash_bwd_dq_tf32_wgmma_ws_fp32_hdim64_causal_bm64_bn32_s2_r1_apart_c2"
    assert spec.expression == "cf::flash_bwd_dq_tf32_wgmma_ws<64, cf::Causal, 32, 2, 1, true, 3, 2>"
    assert spec.threads == 384
    for bad in (Tf32WgmmaBwdConfig(dq_consumers=2), Tf32WgmmaBwdConfig(dq_producer=True, dq_raw_stages=1, dq_consumers=3)):
        with pytest.raises(ValueError, match="dQ consumers"):
            backward_plans.tf32_wgmma_spec("dq", 64, as_mask(True), bad)
    for unlaunched in (Tf32WgmmaBwdConfig(dq_producer=True, fused_dq=True), Tf32WgmmaBwdConfig(dq_block_n=0, dq_producer=True)):
        with pytest.raises(ValueError, match="does not launch"):
            backward_plans.tf32_wgmma_backward_plan(64, True, unlaunched)
    with pytest.raises(ValueError, match="227 KiB"):  # 64-key blocks: K, K^T and V of two stages, 192 KiB
        backward_plans.tf32_wgmma_spec("dq", 64, as_mask(True),
                                       Tf32WgmmaBwdConfig(dq_block_n=64, dq_raw_stages=1, dq_producer=True))


@pytest.mark.parametrize("queries_valid, keys_valid, headdim, headdim_v",
                         [(64, 32, 64, 64), (19, 23, 60, 52), (50, 7, 8, 36)])
def test_one_block_in_a_later_stage_emulated_is_the_dq_products(queries_valid, keys_valid, headdim, headdim_v):
    got, (q64, do64, k64, v64) = emulate(ws_model, 32, queries_valid, keys_valid, headdim, headdim_v,
                                         seed=keys_valid + headdim_v)
    assert close(got["s"], q64 @ k64.T) and close(got["dp"], do64 @ v64.T)
    assert close(got["dq"], got["ds"] @ k64)


def test_a_slipped_stage_offset_is_caught():
    """The emulation is not blind to the stage: reading K from stage 0 while the block landed in
    stage 1 gives garbage (0xFFFFFFFF words are NaN), not the product."""
    slices_seed = 5
    rng = np.random.default_rng(slices_seed)
    q, do = (rng.standard_normal((64, 64)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((32, 64)).astype(np.float32) for _ in range(2))
    smem = ws_model.load_tiles(64, 32, q, do, k, v, 64, 32, 64, 64)
    from models.wgmma_tf32_bwd_steps import rows_times_rows

    wrong = ws_smem(64, 32, 2, 1, ws_model.STAGE_INDEX - 1)
    s = rows_times_rows(smem, 64, 64, 32, 0, wrong["Q_LO"], wrong["K_HI"], wrong["K_LO"])
    assert not np.isfinite(s).all() or not close(s, q.astype(np.float64) @ k.astype(np.float64).T)


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("blocks", [0, 1, 2, 7])
def test_the_protocol_runs_through_in_any_interleaving(stages, blocks):
    rng = random.Random(stages * 10 + blocks)
    for _ in range(100):
        assert [i for kind, i in run_protocol(blocks, stages, rng.choice) if kind == "read"] == list(range(blocks))


@pytest.mark.parametrize("consumers", [1, 2])
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("blocks", [0, 1, 2, 3, 8, 13])
def test_two_consumers_share_the_ring_in_any_interleaving(consumers, stages, blocks):
    """dq_consumers 2: each block read once, by its consumer (block i by consumer i % 2), each
    consumer's blocks in order, no stage rewritten before its block is read, no deadlock, in 200
    random interleavings and the extremes."""
    rng = random.Random(1000 * consumers + 10 * stages + blocks)
    choosers = [rng.choice] * 200 + [lambda options: options[0], lambda options: options[-1]]
    for choose in choosers:
        events = ws_model.run_protocol_consumers(blocks, stages, consumers, choose)
        reads = [i for kind, i in events if kind == "read"]
        assert sorted(reads) == list(range(blocks))
        for c in range(consumers):
            assert [i for i in reads if i % consumers == c] == list(range(c, blocks, consumers))


def test_a_consumer_that_skips_its_wait_is_caught():
    """The two-consumer model is not blind: with full barriers that never hold anyone back, a
    consumer reads a stage the producer has not filled."""
    from models.flash_bwd_dkdv_tf32_wgmma_ws import Mbarrier

    real = Mbarrier.ready
    try:
        Mbarrier.ready = lambda self, parity: True
        with pytest.raises(RuntimeError, match="reads stage|overwrites"):
            for seed in range(50):
                rng = random.Random(seed)
                ws_model.run_protocol_consumers(9, 2, 2, lambda options: options[-1] if rng.random() < 0.9
                                                else rng.choice(options))
    finally:
        Mbarrier.ready = real

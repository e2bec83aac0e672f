"""flash_bwd_dkdv_tf32_wgmma_ws on the CPU (models/flash_bwd_dkdv_tf32_wgmma_ws.py): its mirrors are
the kernel's statements, its shared memory is the plan's with every stage's tiles aligned for the
swizzle, and its producer / consumer protocol, the barrier parities as the kernel writes them,
neither deadlocks nor lets a stage be rewritten before it is consumed, in any interleaving (and
a wrong parity is caught). Its products are tf32_dkdv_query_block's (the dK/dV kernel's tests);
the GPU tests are tests/kernels/test_flash_bwd_dmma.py's "producer" configuration."""
from __future__ import annotations

import random

import pytest

from cupyflash import backward_plans
from cupyflash.backward_plans import Tf32WgmmaBwdConfig
from cupyflash.masks import as_mask
from models.flash_bwd_dkdv_tf32_wgmma_ws import KERNEL, Mbarrier, run_protocol, ws_smem
from models.mirrors import missing_statements, unmirrored_statements


def test_mirrors_match_the_kernel_source():
    assert not (missing := missing_statements(KERNEL)), f"mirrored statements no longer in {KERNEL}: {missing}"
    assert not (missing := missing_statements("mbarrier.cuh")), f"StageRing's statements moved: {missing}"
    assert not (unmirrored := unmirrored_statements(KERNEL)), f"layout statements without a mirror: {unmirrored}"


@pytest.mark.parametrize("block_m, stages, raw_stages", [(32, 2, 1), (32, 3, 1), (64, 2, 1)])
def test_smem_is_the_plans_and_every_stage_aligned(block_m, stages, raw_stages):
    config = Tf32WgmmaBwdConfig(block_m, raw_stages, producer=True, stages=stages)
    layout = ws_smem(64 if block_m == 32 else 32, block_m, stages, raw_stages)
    if block_m == 32:
        assert backward_plans.tf32_wgmma_smem_bytes("dkdv", 64, config) == layout["BYTES"] + 1024
    assert layout["STAGE"] % 1024 == 0 and layout["STAGE0"] % 1024 == 0
    assert all(layout[t] % 1024 == 0 for t in ("Q", "DO", "QT", "DOT"))


def test_the_spec_names_its_stages_and_refuses_what_cannot_run():
    spec = backward_plans.tf32_wgmma_spec("dkdv", 64, as_mask(True), Tf32WgmmaBwdConfig(32, 1, producer=True))
    assert spec.name == "flash_bwd_dkdv_tf32_wgmma_ws_fp32_hdim64_causal_bm32_bn64_s2_r1_apart"
    assert spec.expression == "cf::flash_bwd_dkdv_tf32_wgmma_ws<64, cf::Causal, 32, 2, 1, true>"
    assert spec.threads == 256 and spec.arch == "90a" and spec.smem_bytes <= 227 * 1024
    for bad in (Tf32WgmmaBwdConfig(32, 1, producer=True, fused_dq=True), Tf32WgmmaBwdConfig(32, 0, producer=True),
                Tf32WgmmaBwdConfig(32, 1, producer=True, stages=1)):
        with pytest.raises(ValueError):
            backward_plans.tf32_wgmma_spec("dkdv", 64, as_mask(True), bad)
    with pytest.raises(ValueError, match="227 KiB"):  # two raw stages beside two stages: 227.03 KiB
        backward_plans.tf32_wgmma_spec("dkdv", 64, as_mask(True), Tf32WgmmaBwdConfig(32, 2, producer=True))


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("iters", [0, 1, 2, 5, 17])
def test_the_protocol_runs_through_in_any_interleaving(stages, iters):
    rng = random.Random(stages * 100 + iters)
    for _ in range(200):
        events = run_protocol(iters, stages, rng.choice)
        assert [it for kind, it in events if kind == "read"] == list(range(iters))
    # the two extremes: the producer as far ahead as it may go, and the consumer as soon as it may
    for choose in (lambda options: options[0], lambda options: options[-1]):
        assert [it for kind, it in run_protocol(iters, stages, choose) if kind == "read"] == list(range(iters))


def test_a_wrong_parity_is_caught():
    """The protocol check is not blind: the barrier model's parities are PTX's, and with waits that
    never wait the producer runs ahead and overwrites a stage the consumer has not finished."""
    bar = Mbarrier(1)
    assert bar.ready(1) and not bar.ready(0)  # a fresh barrier: its phase before counts as done
    bar.arrive()
    assert bar.ready(0) and not bar.ready(1)

    import models.flash_bwd_dkdv_tf32_wgmma_ws as ws

    real = Mbarrier.ready
    try:
        Mbarrier.ready = lambda self, parity: True  # waits that never wait
        with pytest.raises(RuntimeError, match="overwrites|reads stage"):
            for seed in range(50):
                rng = random.Random(seed)
                ws.run_protocol(9, 2, lambda options: "producer" if "producer" in options and rng.random() < 0.9
                                else options[-1])
    finally:
        Mbarrier.ready = real

"""flash_fwd_wgmma_ws (models/flash_fwd_wgmma_ws.py): its mirrors are the kernel's statements; its
shared memory is the plan's, every tile and stage apart and aligned for the 128-byte swizzle, every
barrier apart and 8-byte aligned; the register split fits the launch; each consumer warpgroup's
products read its own 64 rows of Q and the stage's K and V; O's staging fits the Q tile (and past
d64 lands on Q rows the other consumer reads, which named barrier 4 orders); the stage ring and
the consumers' turns neither deadlock nor rewrite a stage under a product, in any interleaving.
The products themselves are flash_fwd_wgmma's (test_flash_fwd_wgmma.py); the GPU tests are
tests/test_wgmma_ws_gpu.py."""
from __future__ import annotations

import random

import numpy as np
import pytest

from cupyflash import plans
from cupyflash.bench import tune
from cupyflash.masks import as_mask
from cupyflash.plans import WgmmaFwdConfig
from models.blocks import seeded_rng
from models.flash_bwd_dkdv_tf32_wgmma_ws import Mbarrier
from models.flash_fwd_wgmma import fwd_pv_steps
from models.flash_fwd_wgmma_ws import (WS, WS_LAYOUT_STATEMENT, consumer_rows, o_staging_bytes, q_operand_bytes,
                                       register_split, run_ring, ws_s_steps, ws_smem, ws_template_arguments,
                                       ws_tiles)
from models.mirrors import missing_statements, unmirrored_statements
from models.smem import new_smem
from models.wgmma import assert_operand, cp_async_panels

SM90_D128 = WgmmaFwdConfig(128, 128, producer=True, stages=3)


def _ws_configs() -> list[tuple[int, WgmmaFwdConfig]]:
    """(head-dim tile, config) of every producer configuration in use: dev/mma_fwd.py's
    WS_CANDIDATES, FORWARD_TILES' producer rows and sm_90's d128 row."""
    dev = tune.load_dev_forward()
    configs = [(dt, c) for dt, cs in (dev.WS_CANDIDATES if dev else {}).items() for c in cs]
    configs += [(dt, c) for (_, _, dt), c in plans.FORWARD_TILES.items()
                if isinstance(c, WgmmaFwdConfig) and c.producer]
    return list(dict.fromkeys([*configs, (128, SM90_D128)]))


WS_CONFIGS = _ws_configs()
WS_SHAPES = sorted({(dt, c.block_n, c.stages) for dt, c in WS_CONFIGS})  # the layout ignores pingpong


def test_mirrors_match_the_kernel_source():
    """Every statement a mirror names is in its source (whitespace aside), and every layout
    statement of the kernel, WS_LAYOUT_STATEMENT's wider set, is mirrored: an edit there fails here
    until the model follows."""
    for source in (WS, "mbarrier.cuh", "online_softmax.cuh", "mma.cuh"):
        assert not (missing := missing_statements(source)), f"mirrored statements no longer in {source}: {missing}"
    unmirrored = unmirrored_statements(WS, pattern=WS_LAYOUT_STATEMENT)
    assert not unmirrored, f"layout statements of {WS} without a mirror here: {unmirrored}"


@pytest.mark.parametrize("dt, config", WS_CONFIGS, ids=str)
def test_smem_and_launch_are_the_plans(dt, config):
    L = ws_smem(dt, config.block_n, config.stages)
    assert L.BYTES + 1024 == plans.wgmma_smem_bytes(dt, config) <= 227 * 1024
    spec = plans.specialization_for(np.float16, dt, as_mask(True), config)
    assert spec.source_file == f"{WS}.cu" and spec.arch == "90a"
    arguments = ws_template_arguments("cf::half_t", dt, "cf::Causal", config.block_n, config.stages, config.pingpong)
    assert spec.expression == f"cf::{WS}<{arguments}>"
    assert spec.threads == config.threads == register_split().THREADS and spec.smem_bytes == L.BYTES + 1024


@pytest.mark.parametrize("d_tile, block_n, stages", WS_SHAPES)
def test_tiles_and_barriers_are_apart_and_aligned(d_tile, block_n, stages):
    """Q, each stage's K and V, and each barrier (8 bytes) are disjoint and fill [0, BYTES); tiles,
    stages and panels start on 1024 bytes (the 128-byte swizzle's pattern, which panel_offset and
    the descriptors assume), barriers on 8; a walk's STAGES blocks in flight are in STAGES stages."""
    L = ws_smem(d_tile, block_n, stages)
    tiles = [(L.Q, L.K - L.Q)] + [(x + s * L.KV_TILE, L.KV_TILE) for x in (L.K, L.V) for s in range(stages)]
    barriers = [(x + 8 * s, 8) for x in (L.FULL, L.EMPTY) for s in range(stages)] + [(L.Q_FULL, 8)]
    regions = sorted(tiles + barriers)
    assert regions[0][0] == 0 and regions[-1][0] + regions[-1][1] == L.BYTES
    assert all(a + n == b for (a, n), (b, _) in zip(regions, regions[1:])), "gaps or overlaps"
    assert L.K - L.Q == L.BLOCK_M * d_tile * 2
    assert all(start % 1024 == 0 and n % 1024 == 0 for start, n in tiles)
    assert all(x % 1024 == 0 for x in (L.Q_PANEL, L.KV_PANEL, 64 * 128))  # 64 * 128: consumer 1's rows
    assert all(start % 8 == 0 for start, _ in barriers)
    for first in range(2 * stages):
        in_flight = [ws_tiles(L, i) for i in range(first, first + stages)]
        assert len({t.k for t in in_flight}) == len({t.v for t in in_flight}) == stages


def test_register_split_fits_the_launch():
    """setmaxnreg only moves registers within the launch's (a raise past them waits forever):
    the producer's 128 threads at 24 and the consumers' 256 at 240 take exactly 384 x 168."""
    r = register_split()
    assert r.LAUNCH == 168 and r.LAUNCH * r.THREADS <= 65536
    assert all(24 <= n <= 256 and n % 8 == 0 for n in (r.LAUNCH, r.PRODUCER, r.CONSUMER))  # setmaxnreg's range
    assert 128 * r.PRODUCER + 256 * r.CONSUMER <= r.THREADS * r.LAUNCH


def test_consumer_warps_own_disjoint_strips_of_their_64_rows():
    """Consumer warpgroup cwg (threads 128 (cwg + 1) ..) owns rows 64 cwg .. 64 cwg + 63 as its
    four warps' 16-row strips: the 128 rows once each, the rows its S = Q K^T reads."""
    strips = {}
    for tid in range(128, 384):
        cwg, strip_row0 = consumer_rows(tid)
        assert cwg == tid // 128 - 1 and 64 * cwg <= strip_row0 < 64 * cwg + 64
        strips.setdefault(strip_row0, set()).add(tid // 32)
    assert sorted(strips) == list(range(0, 128, 16)) and all(len(w) == 1 for w in strips.values())


@pytest.mark.parametrize("d_tile, block_n, stages", WS_SHAPES)
def test_operands_are_q_k_and_v_slices(d_tile, block_n, stages):
    """The producer's 128-thread copies and each consumer's k-steps: S of consumer cwg reads Q's
    rows 64 cwg .. and block i's K, P V block i's V, through every stage and a reused one (Q intact
    after them)."""
    L = ws_smem(d_tile, block_n, stages)
    rng = seeded_rng(11, d_tile, block_n, stages)
    smem = new_smem()
    q = rng.standard_normal((L.BLOCK_M, d_tile))
    cp_async_panels(smem, ws_tiles(L, 0).q, L.BLOCK_M, d_tile, 128, q, L.BLOCK_M, d_tile)
    for i in range(stages + 1):
        tiles = ws_tiles(L, i)
        k, v = rng.standard_normal((2, block_n, d_tile))
        cp_async_panels(smem, tiles.k, block_n, d_tile, 128, k, block_n, d_tile)
        cp_async_panels(smem, tiles.v, block_n, d_tile, 128, v, block_n, d_tile)
        for cwg in range(2):
            for kk, step in enumerate(ws_s_steps(L, tiles, cwg)):
                assert_operand(smem, step.a, step.trans_a, 64, q[64 * cwg: 64 * cwg + 64, 16 * kk: 16 * kk + 16])
                assert_operand(smem, step.b, step.trans_b, block_n, k[:, 16 * kk: 16 * kk + 16])
        for kk, step in enumerate(fwd_pv_steps(L, tiles)):
            assert_operand(smem, step.b, step.trans_b, d_tile, v[16 * kk: 16 * kk + 16].T)


@pytest.mark.parametrize("d_tile", [64, 128, 256])
def test_o_staging_fits_the_q_tile(d_tile):
    """store_o stages each consumer's O (64 rows of D_TILE columns) in the Q tile, the two apart;
    at d64 a consumer's staging rows are its own Q rows, past it they hold Q rows the other
    consumer's last S reads, hence named barrier 4 before the store."""
    L = ws_smem(d_tile, 64, 2)
    staged = [o_staging_bytes(L, cwg) for cwg in range(2)]
    assert staged[0] | staged[1] == set(range(L.K - L.Q)) and not staged[0] & staged[1]
    for cwg in range(2):
        assert bool(staged[cwg] & q_operand_bytes(L, 1 - cwg)) == (d_tile > 64)


@pytest.mark.parametrize("pingpong", [True, False])
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("n_blocks", [0, 1, 2, 3, 8])
def test_the_ring_runs_through_in_any_interleaving(n_blocks, stages, pingpong):
    rng = random.Random(100 * stages + n_blocks + pingpong)
    choices = [rng.choice] * 150 + [lambda options: options[0], lambda options: options[-1]]
    for choose in choices:
        steps = run_ring(n_blocks, stages, choose, pingpong)
        assert [b for name, kind, b in steps if kind == "copy"] == (["Q", *range(n_blocks)] if n_blocks else [])
        for cwg in range(2 if n_blocks else 0):  # block i's S with P V of i - 1, then the last P V
            reads = [b for name, kind, b in steps if name == f"consumer {cwg}" and kind == "complete"]
            assert [r[1] for r in reads[:-1]] == [r[2] for r in reads[1:-1]] + reads[-1] == list(range(n_blocks))


def test_the_ring_model_catches_an_early_release(monkeypatch):
    """The ring check is not blind: a stage released after its block's S but before its P V, or
    waits that never wait, let the producer rewrite a stage under a product."""
    def rewrites(**kwargs) -> bool:
        for seed in range(100):
            r = random.Random(seed)
            try:
                run_ring(6, 2, lambda options: "producer" if "producer" in options and r.random() < 0.8
                         else r.choice(options), **kwargs)
            except RuntimeError as error:
                assert "reads block" in str(error)
                return True
        return False

    assert not rewrites() and rewrites(release_lag=0)
    monkeypatch.setattr(Mbarrier, "ready", lambda self, parity: True)
    assert rewrites()

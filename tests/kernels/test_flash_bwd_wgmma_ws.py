"""flash_bwd_wgmma_ws (dK, dV) and flash_bwd_dq_wgmma_ws (dQ), the producer backward kernels, on
the CPU (models/flash_bwd_wgmma_ws.py): their mirrors are the kernels' statements; their shared
memory is the plan's for every candidate configuration, every tile and stage apart and aligned for
the 128-byte swizzle, every barrier apart and 8-byte aligned; the register split fits the launch;
each consumer owns its own 64 rows and its products read the intended slices of what the producer
copied; the stage ring, the consumers' two turns a step and the epilogue's named barrier neither
deadlock nor rewrite a tile under a read, in any interleaving, and the model notices when a piece
of that protocol is taken away. The products themselves are flash_bwd_wgmma's and
flash_bwd_dq_wgmma's (test_flash_bwd_wgmma.py, test_flash_bwd_dq_wgmma.py); the GPU tests are
tests/test_wgmma_bwd_ws_gpu.py."""
from __future__ import annotations

import random

import numpy as np
import pytest

from cupyflash import backward_plans
from cupyflash.bench import tune
from models.blocks import seeded_rng
from models.flash_bwd_dkdv_tf32_wgmma_ws import Mbarrier
from models.flash_bwd_wgmma_ws import (BWD_WS, BWD_WS_LAYOUT_STATEMENT, DQ_WS, DQ_WS_LAYOUT_STATEMENT,
                                       bwd_ws_dkdv_steps, bwd_ws_key_rows, epilogue_store, bwd_ws_smem, bwd_ws_st_steps,
                                       bwd_ws_template_arguments, bwd_ws_tiles, dq_ws_dq_steps, dq_ws_query_rows,
                                       dq_ws_s_dp_steps, dq_ws_smem, dq_ws_template_arguments, dq_ws_tiles,
                                       register_split, run_ws_ring)
from models.mirrors import missing_statements, unmirrored_statements
from models.smem import new_smem
from models.wgmma import assert_operand, cp_async_panels

# The candidates when these tests were written, (BLOCK_M, BLOCK_N, STAGES, PINGPONG) by head-dim
# tile: kept beside dev/mma_bwd.py's current ones so that the tests never run on none.
WRITTEN_DKDV = {64: ((128, 128, 3, True), (64, 128, 3, True)),
                128: ((64, 128, 3, True), (64, 128, 4, True), (64, 128, 3, False))}
WRITTEN_DQ = {64: ((128, 128, 3, True),), 128: ((128, 64, 3, True), (128, 64, 4, True))}


def _configs(name: str, written: dict) -> list[tuple[int, tuple]]:
    """(head-dim tile, tiles) of every candidate: dev/mma_bwd.py's ``name`` and the written ones."""
    dev = tune.load_dev_backward()
    configs = [(dt, tuple(c)) for dt, cs in getattr(dev, name, {}).items() for c in cs]
    configs += [(dt, c) for dt, cs in written.items() for c in cs]
    return list(dict.fromkeys(configs))


DKDV_CONFIGS = _configs("WGMMA_WS_CANDIDATES", WRITTEN_DKDV)
DQ_CONFIGS = _configs("DQ_WS_CANDIDATES", WRITTEN_DQ)
# The layouts ignore PINGPONG: (head-dim tile, BLOCK_M, STAGES) and (head-dim tile, BLOCK_N, STAGES).
DKDV_SHAPES = sorted({(dt, bm, stages) for dt, (bm, _, stages, _) in DKDV_CONFIGS})
DQ_SHAPES = sorted({(dt, bn, stages) for dt, (_, bn, stages, _) in DQ_CONFIGS})


@pytest.mark.parametrize("source, pattern", [(BWD_WS, BWD_WS_LAYOUT_STATEMENT), (DQ_WS, DQ_WS_LAYOUT_STATEMENT)],
                         ids=[BWD_WS, DQ_WS])
def test_mirrors_match_the_kernel_sources(source, pattern):
    """Every statement a mirror names is in its source (whitespace aside), the runs of statements
    the ring model follows in their order; and every layout or protocol statement of the kernel
    (its module's LAYOUT_STATEMENT) is mirrored: an edit there fails here until the model follows."""
    for s in (source, "mbarrier.cuh"):
        assert not (missing := missing_statements(s)), f"mirrored statements no longer in {s}: {missing}"
    unmirrored = unmirrored_statements(source, pattern=pattern)
    assert not unmirrored, f"layout statements of {source} without a mirror here: {unmirrored}"


@pytest.mark.parametrize("dt, config", DKDV_CONFIGS, ids=str)
def test_dkdv_smem_and_launch_are_the_plans(dt, config):
    bm, bn, stages, pingpong = config
    L = bwd_ws_smem(dt, bm, stages)
    assert bn == L.BLOCK_N == 128
    assert L.BYTES + 1024 == backward_plans.wgmma_ws_smem_bytes(dt, bm, stages) <= 227 * 1024
    spec = backward_plans.wgmma_ws_spec(np.float16, dt, True, config)
    assert spec.source_file == f"{BWD_WS}.cu" and spec.arch == "90a"
    arguments = bwd_ws_template_arguments("cf::half_t", dt, "cf::Causal", bm, stages, pingpong)
    assert spec.expression == f"cf::{BWD_WS}<{arguments}>"
    assert spec.threads == register_split().THREADS and spec.smem_bytes == L.BYTES + 1024


@pytest.mark.parametrize("dt, config", DQ_CONFIGS, ids=str)
def test_dq_smem_and_launch_are_the_plans(dt, config):
    bm, bn, stages, pingpong = config
    L = dq_ws_smem(dt, bn, stages)
    assert bm == L.BLOCK_M == 128
    assert L.BYTES + 1024 == backward_plans.dq_wgmma_ws_smem_bytes(dt, bn, stages) <= 227 * 1024
    spec = backward_plans.dq_wgmma_ws_spec(np.float16, dt, True, config)
    assert spec.source_file == f"{DQ_WS}.cu" and spec.arch == "90a"
    arguments = dq_ws_template_arguments("cf::half_t", dt, "cf::Causal", bn, stages, pingpong)
    assert spec.expression == f"cf::{DQ_WS}<{arguments}>"
    assert spec.threads == register_split().THREADS and spec.smem_bytes == L.BYTES + 1024


def _assert_apart_and_aligned(L, tiles, slots, barriers):
    """tiles, slots (lse, D) and barriers, as (start, bytes), are disjoint and fill [0, BYTES);
    tiles start on and span 1024 bytes (the 128-byte swizzle's pattern, which panel_offset and the
    descriptors assume), slots on 8 (float2 reads), barriers on 8."""
    regions = sorted(tiles + slots + barriers)
    assert regions[0][0] == 0 and regions[-1][0] + regions[-1][1] == L.BYTES
    assert all(a + n == b for (a, n), (b, _) in zip(regions, regions[1:])), "gaps or overlaps"
    assert all(start % 1024 == 0 and n % 1024 == 0 for start, n in tiles)
    assert all(start % 8 == 0 for start, _ in slots + barriers) and all(n == 8 for _, n in barriers)
    assert all(x % 1024 == 0 for x in (L.Q_PANEL, L.KV_PANEL, 64 * 128))  # 64 * 128: consumer 1's rows


@pytest.mark.parametrize("d_tile, block_m, stages", DKDV_SHAPES)
def test_dkdv_tiles_and_barriers_are_apart_and_aligned(d_tile, block_m, stages):
    """K, V, each stage's Q and dO, the dS^T tile, each stage's lse and D slots and each barrier;
    a walk's STAGES query blocks in flight are in STAGES stages."""
    L = bwd_ws_smem(d_tile, block_m, stages)
    tiles = [(L.K, L.KV_TILE), (L.V, L.KV_TILE), (L.DST, L.BLOCK_N * block_m * 2)]
    tiles += [(x + s * L.Q_TILE, L.Q_TILE) for x in (L.Q, L.DO) for s in range(stages)]
    slots = [(x + 4 * s * block_m, 4 * block_m) for x in (L.LSE, L.DELTA) for s in range(stages)]
    barriers = [(x + 8 * s, 8) for x in (L.FULL, L.EMPTY) for s in range(stages)]
    _assert_apart_and_aligned(L, tiles, slots, barriers)
    for first in range(2 * stages):
        in_flight = [bwd_ws_tiles(L, it) for it in range(first, first + stages)]
        assert all(len({getattr(t, x) for t in in_flight}) == stages for x in ("q", "do", "lse", "delta"))
        assert len({(t.k, t.v, t.dst) for t in in_flight}) == 1


@pytest.mark.parametrize("d_tile, block_n, stages", DQ_SHAPES)
def test_dq_tiles_and_barriers_are_apart_and_aligned(d_tile, block_n, stages):
    """Q, dO, each stage's K and V and each barrier; a walk's STAGES key blocks in flight are in
    STAGES stages."""
    L = dq_ws_smem(d_tile, block_n, stages)
    tiles = [(L.Q, L.Q_TILE), (L.DO, L.Q_TILE)]
    tiles += [(x + s * L.KV_TILE, L.KV_TILE) for x in (L.K, L.V) for s in range(stages)]
    barriers = [(x + 8 * s, 8) for x in (L.FULL, L.EMPTY) for s in range(stages)]
    _assert_apart_and_aligned(L, tiles, [], barriers)
    for first in range(2 * stages):
        in_flight = [dq_ws_tiles(L, i) for i in range(first, first + stages)]
        assert len({t.k for t in in_flight}) == len({t.v for t in in_flight}) == stages
        assert len({(t.q, t.do) for t in in_flight}) == 1


def test_register_split_fits_the_launch():
    """setmaxnreg only moves registers within the launch's (a raise past them waits forever): the
    producer's 128 threads at 40 and the consumers' 256 at 232 take exactly 384 x 168."""
    r = register_split()
    assert r.LAUNCH == 168 and r.LAUNCH * r.THREADS <= 65536
    assert all(24 <= n <= 256 and n % 8 == 0 for n in (r.LAUNCH, r.PRODUCER, r.CONSUMER))  # setmaxnreg's range
    assert 128 * r.PRODUCER + 256 * r.CONSUMER <= r.THREADS * r.LAUNCH == 384 * 168


def test_consumers_own_their_64_rows():
    """Consumer warpgroup cwg (threads 128 (cwg + 1) ..) holds rows 64 cwg .. 64 cwg + 63 of the
    block, the rows its first products' A operand reads (dK/dV: keys, dQ: queries), each row by one
    warp, and its warps' staging rows are 16-row strips of them."""
    for rows_of in (bwd_ws_key_rows, dq_ws_query_rows):
        rows, strips = {}, set()
        for tid in range(128, 384):
            cwg, mine, strip0 = rows_of(tid)
            assert cwg == tid // 128 - 1 and all(64 * cwg <= r < 64 * cwg + 64 for r in mine)
            assert strip0 % 16 == 0 and all(strip0 <= r < strip0 + 16 for r in mine)
            strips.add(strip0)
            for r in mine:
                rows.setdefault(r, set()).add(tid // 32)
        assert sorted(rows) == list(range(128)) and all(len(warps) == 1 for warps in rows.values())
        assert sorted(strips) == list(range(0, 128, 16))


@pytest.mark.parametrize("kernel", [BWD_WS, DQ_WS])
@pytest.mark.parametrize("d_tile", [64, 128])
def test_each_consumer_stores_the_rows_it_staged(kernel, d_tile):
    """The epilogue's store after a barrier of one warpgroup: every element of the block's valid rows
    and columns reaches its own row and column, from the consumer that staged it (a word of the
    other consumer would come out NaN), and nothing past the sequence's end or the head dim is
    written; with the block's last rows in either consumer's half, or none in consumer 1's."""
    want = np.add.outer(1000 * np.arange(128), np.arange(d_tile)).astype(float)
    for rows_valid in (128, 100, 65, 64, 40, 1):
        for headdim in (d_tile, d_tile - 8):
            out = epilogue_store(kernel, d_tile, rows_valid, headdim)
            np.testing.assert_array_equal(out[:rows_valid], want[:rows_valid, :headdim])
            assert np.isnan(out[rows_valid:]).all()


@pytest.mark.parametrize("d_tile, block_m, stages", DKDV_SHAPES)
def test_dkdv_operands_are_k_v_and_the_stages_q_and_do(d_tile, block_m, stages):
    """The producer's 128-thread copies and each consumer's k-steps over STAGES + 1 query blocks
    (every stage and a reused one): S^T of consumer cwg reads K's rows 64 cwg .. and the stage's Q,
    dP^T V's rows and the stage's dO, dV and dK the stage's dO and Q MN-major."""
    L = bwd_ws_smem(d_tile, block_m, stages)
    rng = seeded_rng(21, d_tile, block_m, stages)
    smem = new_smem()
    k, v = rng.standard_normal((2, L.BLOCK_N, d_tile))
    tiles0 = bwd_ws_tiles(L, 0)
    cp_async_panels(smem, tiles0.k, L.BLOCK_N, d_tile, 128, k, L.BLOCK_N, d_tile)
    cp_async_panels(smem, tiles0.v, L.BLOCK_N, d_tile, 128, v, L.BLOCK_N, d_tile)
    for it in range(stages + 1):
        tiles = bwd_ws_tiles(L, it)
        q, do = rng.standard_normal((2, block_m, d_tile))
        cp_async_panels(smem, tiles.q, block_m, d_tile, 128, q, block_m, d_tile)
        cp_async_panels(smem, tiles.do, block_m, d_tile, 128, do, block_m, d_tile)
        for cwg in range(2):
            keys = slice(64 * cwg, 64 * cwg + 64)
            for (key_side, query_side), steps in zip(((k, q), (v, do)), bwd_ws_st_steps(L, tiles, cwg)):
                for kk, step in enumerate(steps):
                    cols = slice(16 * kk, 16 * kk + 16)
                    assert_operand(smem, step.a, step.trans_a, 64, key_side[keys, cols])
                    assert_operand(smem, step.b, step.trans_b, block_m, query_side[:, cols])
        for query_side, steps in zip((do, q), bwd_ws_dkdv_steps(L, tiles)):
            for kk, step in enumerate(steps):
                assert_operand(smem, step.b, step.trans_b, d_tile, query_side[16 * kk: 16 * kk + 16].T)


@pytest.mark.parametrize("d_tile, block_n, stages", DQ_SHAPES)
def test_dq_operands_are_q_do_and_the_stages_k_and_v(d_tile, block_n, stages):
    """The same for dQ: S of consumer cwg reads Q's rows 64 cwg .. and the stage's K, dP dO's rows
    and the stage's V, dQ += dS K the stage's K MN-major (Q and dO intact after every stage)."""
    L = dq_ws_smem(d_tile, block_n, stages)
    rng = seeded_rng(22, d_tile, block_n, stages)
    smem = new_smem()
    q, do = rng.standard_normal((2, L.BLOCK_M, d_tile))
    tiles0 = dq_ws_tiles(L, 0)
    cp_async_panels(smem, tiles0.q, L.BLOCK_M, d_tile, 128, q, L.BLOCK_M, d_tile)
    cp_async_panels(smem, tiles0.do, L.BLOCK_M, d_tile, 128, do, L.BLOCK_M, d_tile)
    for i in range(stages + 1):
        tiles = dq_ws_tiles(L, i)
        k, v = rng.standard_normal((2, block_n, d_tile))
        cp_async_panels(smem, tiles.k, block_n, d_tile, 128, k, block_n, d_tile)
        cp_async_panels(smem, tiles.v, block_n, d_tile, 128, v, block_n, d_tile)
        for cwg in range(2):
            rows = slice(64 * cwg, 64 * cwg + 64)
            for (row_side, key_side), steps in zip(((q, k), (do, v)), dq_ws_s_dp_steps(L, tiles, cwg)):
                for kk, step in enumerate(steps):
                    cols = slice(16 * kk, 16 * kk + 16)
                    assert_operand(smem, step.a, step.trans_a, 64, row_side[rows, cols])
                    assert_operand(smem, step.b, step.trans_b, block_n, key_side[:, cols])
        for kk, step in enumerate(dq_ws_dq_steps(L, tiles)):
            assert_operand(smem, step.b, step.trans_b, d_tile, k[16 * kk: 16 * kk + 16].T)


@pytest.mark.parametrize("pingpong", [True, False])
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("n_blocks", [0, 1, 2, 3, 8])
@pytest.mark.parametrize("kernel", [BWD_WS, DQ_WS])
def test_the_ring_runs_through_in_any_interleaving(kernel, n_blocks, stages, pingpong):
    """~100 seeded random interleavings and the two extremes: every block is copied once, in
    order, after the tiles copied once; each consumer completes its products block by block in the
    kernel's order (S, dP, then the second products) and reads the stage's lse and D (dK/dV)
    between them."""
    rng = random.Random(1000 * (kernel == DQ_WS) + 100 * stages + 10 * n_blocks + pingpong)
    choices = [rng.choice] * 100 + [lambda options: options[0], lambda options: options[-1]]
    once = ["K", "V"] if kernel == BWD_WS else ["Q", "dO"]
    per_block = (lambda i: [("complete", [once[0], i]), ("read", [i]), ("complete", [once[1], i]), ("read", [i]),
                            ("complete", [i])]) if kernel == BWD_WS else \
        (lambda i: [("complete", [once[0], i]), ("complete", [once[1], i]), ("complete", [i])])
    for choose in choices:
        steps = run_ws_ring(kernel, n_blocks, stages, choose, pingpong)
        assert [b for name, kind, b in steps if kind == "copy"] == ([*once, *range(n_blocks)] if n_blocks else [])
        for cwg in range(2):
            reads = [(kind, b) for name, kind, b in steps
                     if name == f"consumer {cwg}" and kind in ("complete", "read")]
            assert reads == [r for i in range(n_blocks) for r in per_block(i)]


@pytest.mark.parametrize("kernel", [BWD_WS, DQ_WS])
def test_the_ring_model_catches_an_early_release_and_blind_waits(kernel, monkeypatch):
    """The ring check is not blind: a stage released after its block's first products (S, dP)
    instead of after the second (dV, dK / dS K), or barrier waits that never wait, let the producer
    rewrite a stage under a read, which some interleaving that favours the producer finds."""
    def rewrites(**kwargs) -> bool:
        for seed in range(100):
            r = random.Random(seed)
            try:
                run_ws_ring(kernel, 6, 2, lambda options: "producer" if "producer" in options and r.random() < 0.8
                            else r.choice(options), **kwargs)
            except RuntimeError as error:
                assert "reads block" in str(error)
                return True
        return False

    assert not rewrites() and rewrites(release_after=1)
    for stages in (3, 4):  # and with more stages, where the producer runs further ahead
        with pytest.raises(RuntimeError, match="reads block"):
            for seed in range(100):
                r = random.Random(seed)
                run_ws_ring(kernel, 8, stages, lambda options: "producer" if "producer" in options else
                            r.choice(options), release_after=1)
    monkeypatch.setattr(Mbarrier, "ready", lambda self, parity: True)
    assert rewrites()


@pytest.mark.parametrize("kernel", [BWD_WS, DQ_WS])
def test_the_ring_model_catches_unmatched_turns_and_a_missing_epilogue_barrier(kernel):
    """Without consumer 1's first pass consumer 0 never gets its first turn (deadlock); without
    consumer 0's last turn consumer 1's last pass is left unmatched (with an empty walk too);
    without named barrier 4 a consumer stages over a tile the other's last products may still read
    (without the turns: with them, the other's last products complete before the turn that lets
    this consumer past its last step)."""
    first = lambda options: options[0]  # noqa: E731
    for n_blocks in (0, 3):
        with pytest.raises(RuntimeError, match="unmatched"):
            run_ws_ring(kernel, n_blocks, 2, first, last_wait=False)
    with pytest.raises(RuntimeError, match="deadlock"):
        run_ws_ring(kernel, 3, 2, first, first_pass=False)
    assert run_ws_ring(kernel, 3, 2, first, pingpong=False, first_pass=False, last_wait=False)  # no turns to miss
    for pingpong in (False, True):
        caught = set()
        for seed in range(200):
            r = random.Random(seed)
            try:
                run_ws_ring(kernel, 3, 2, lambda options: r.choice(options), pingpong, epilogue_barrier=False)
            except RuntimeError as error:
                caught.add("reads" if "reads block" in str(error) else str(error))
        assert caught == (set() if pingpong else {"reads"})

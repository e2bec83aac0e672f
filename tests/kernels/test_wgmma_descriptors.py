"""The wgmma model's ground truth and shared helpers: the descriptor encoder is the PTX format,
panel_offset is the canonical 128-byte-swizzle layout, cp_async_panels fills each slot once, the
packed accumulators are the next product's A operand, and every wgmma kernel's shared-memory
layout is the one its launcher requests (models: tests/models/)."""
from __future__ import annotations

import numpy as np
import pytest
from models.blocks import seeded_rng
from models.flash_bwd_dq_wgmma import DQW, DQW_CONFIGS, dqw_smem
from models.flash_bwd_wgmma import BWD, BWD_CONFIGS, bwd_smem
from models.flash_bwd_wgmma_dsplit import DSPLIT, DSPLIT_CONFIG, dsplit_smem
from models.flash_fwd_wgmma import FWD, FWD_CONFIGS, FWD_SHAPES, fwd_smem
from models.fragments import pack_a_frags
from models.mirrors import MIRRORED, code, missing_statements, unmirrored_statements
from models.smem import RAW_SMEM, aligned_base, load_panels, new_smem
from models.wgmma import (K_MAJOR, MN_MAJOR, SWIZZLE_128B, Descriptor, a_fragment_matrix, acc_from_matrix,
                          acc_to_matrix, bank_conflict_free, cp_async_panels, decode_descriptor, operand_addresses,
                          panel_offset, smem_desc)

# (ROWS, DIM, NTHREADS) of every cp_async_panels the kernels issue: the forward's Q (BLOCK_M 128),
# K and V; flash_bwd_wgmma's and dsplit's; flash_bwd_dq_wgmma's Q, dO (BLOCK_M) and K, V (BLOCK_N).
# flash_fwd_wgmma_ws's producer warpgroup (128 threads): its Q (128 rows) and K, V blocks (128 keys
# at d64 / d128, 64 at d256: rows of 32 chunks, 4 rows apart).
CP_ASYNC_TILES = sorted({(r, d, 256) for r in (64, 128) for d in (64, 128, 256)} |
                        {(rows, dt, dqw_smem(dt, bm, bn, ks).NTHREADS)
                         for dt, bm, bn, ks in DQW_CONFIGS for rows in (bm, bn)} |
                        {(r, d, 128) for r, d in ((128, 64), (128, 128), (128, 256), (64, 256))})


PANEL_TILES = [(64, 64), (64, 128), (128, 128), (64, 256), (128, 64)]


@pytest.mark.parametrize("source", ["wgmma.cuh"])
def test_mirrors_match_the_kernel_sources(source):
    """Every C++ statement a mirror names is in the source (whitespace aside), and every layout
    helper of wgmma.cuh (not the Wgmma specializations' asm) is mirrored."""
    assert not (missing := missing_statements(source)), f"mirrored statements no longer in {source}: {missing}"
    text = code(source)
    text = text[text.index("panel_offset(int row"): text.index("struct Wgmma;")]
    text = text[: text.index("fence_proxy_async_shared")] + text[text.index("cp_async_panels("):]
    unmirrored = unmirrored_statements(source, text)
    assert not unmirrored, f"layout statements of {source} without a mirror here: {unmirrored}"


def test_other_mirrored_helpers_are_in_their_sources():
    """The helpers the wgmma kernels share with others (mma_bwd.cuh, online_softmax.cuh, mask.cuh,
    dq_add.cuh) still hold the statements their mirrors name."""
    others = {m.source for m in MIRRORED} - {"wgmma.cuh", FWD, BWD, DSPLIT, DQW}
    assert others >= {"mma_bwd.cuh", "online_softmax.cuh", "mask.cuh", "dq_add.cuh"}
    for source in sorted(others):
        assert not (missing := missing_statements(source)), f"mirrored statements no longer in {source}: {missing}"


def test_smem_desc_encodes_the_ptx_descriptor_fields():
    rng = seeded_rng(0)
    for _ in range(500):
        addr = int(rng.integers(0, 1 << 24)) & ~15  # bits above the shared window are dropped
        lbo, sbo = (int(x) * 16 for x in rng.integers(0, 1 << 14, size=2))
        d = decode_descriptor(smem_desc(addr, lbo, sbo))
        assert d == Descriptor(addr & 0x3FFFF, lbo, sbo, 0, SWIZZLE_128B)
    # the offsets the kernels pass fit the 14-bit fields and are whole 16-byte units
    for lbo in (16, 1024, *(rows * 128 for rows in (64, 128))):
        assert lbo % 16 == 0 and lbo >> 4 < 1 << 14


@pytest.mark.parametrize("configs", ["fwd", "bwd", "dq"])
def test_smem_layouts_are_panel_aligned_and_match_python(configs):
    """Every tile (and stage) a descriptor or panel_offset addresses starts 1024-byte aligned, the
    128-byte swizzle's pattern; BYTES plus the alignment slack is what the launcher requests; the
    configurations the launchers use are the ones modelled here."""
    from cupyflash.kernels import mma_bwd, mma_fwd

    if configs == "fwd":
        from cupyflash import plans
        from cupyflash.bench import tune

        tunable = [(dt, c) for (_, _, dt), c in plans.FORWARD_TILES.items()]  # and dev/'s, for the tuner
        tunable += [(dt, c) for dt in mma_fwd.D_TILES for _, c in tune.load_dev_forward().entries(dt)]
        launched = {(dt, c.block_m, c.block_n) for dt, c in tunable if isinstance(c, mma_fwd.WgmmaFwdConfig)}
        assert launched <= set(FWD_CONFIGS)
        assert len(FWD_SHAPES) == 5 and (256, 128) not in FWD_SHAPES
        for dt, bm, bn in launched:
            L = fwd_smem(dt, bm, bn)
            assert all(x % 1024 == 0 for x in (L.Q, L.K, L.V, L.KV_TILE, L.Q_PANEL, L.KV_PANEL))
            assert L.BYTES + 1024 == mma_fwd.wgmma_smem_bytes(dt, mma_fwd.WgmmaFwdConfig(bm, bn)) <= 227 * 1024
    elif configs == "dq":
        launched = {(dt, *cfg) for dt, cfg in mma_bwd.DQ_WGMMA_CONFIG.items()}
        from cupyflash.bench.tune import load_dev_backward  # the tuner's candidates: dev/mma_bwd.py

        launched |= {(dt, *cfg) for dt, cfgs in load_dev_backward().DQ_WGMMA_CANDIDATES.items() for cfg in cfgs}
        assert launched == set(DQW_CONFIGS) and len(DQW_CONFIGS) == 5
        assert {ks for _, _, _, ks in DQW_CONFIGS} == {2, 3}
        for dt, bm, bn, ks in DQW_CONFIGS:
            L = dqw_smem(dt, bm, bn, ks)
            tiles = [L.Q, L.DO, *(L.K + s * L.KV_TILE for s in range(ks)), *(L.V + s * L.KV_TILE for s in range(2))]
            assert all(x % 1024 == 0 for x in (*tiles, L.Q_TILE, L.KV_TILE, L.Q_PANEL, L.KV_PANEL))
            sizes = [L.Q_TILE, L.Q_TILE, *[L.KV_TILE] * (ks + 2)]  # back to back, no overlap, all inside
            assert [t + n for t, n in zip(tiles, sizes)] == [*tiles[1:], L.BYTES]
            assert L.BYTES + 1024 == mma_bwd.dq_wgmma_smem_bytes(dt, bm, bn, ks) <= 227 * 1024
            spec = mma_bwd.dq_wgmma_spec("bfloat16", dt, False, (bm, bn, ks))
            assert (spec.threads, spec.smem_bytes) == (L.NTHREADS, L.BYTES + 1024)
    else:
        assert {(dt, *cfg) for dt, cfg in mma_bwd.WGMMA_CONFIG.items()} == {*BWD_CONFIGS, DSPLIT_CONFIG}
        for dt, bm, bn in BWD_CONFIGS:
            L = bwd_smem(dt, bm, bn)
            assert all(x % 1024 == 0 for x in (L.K, L.V, L.Q, L.DO, L.DST, L.Q_TILE, L.KV_PANEL, L.Q_PANEL))
            assert L.DQ_PANELS % L.NWG == 0  # the kernel's static_assert
            assert L.BYTES + 1024 == mma_bwd.wgmma_smem_bytes(dt, bm, bn) <= 227 * 1024
        L = dsplit_smem(*DSPLIT_CONFIG)
        assert all(x % 1024 == 0 for x in (L.K, L.V, L.Q, L.DO, L.PT, L.DST, L.Q_TILE, L.KV_PANEL, L.Q_PANEL))
        assert L.BYTES + 1024 == mma_bwd.wgmma_smem_bytes(*DSPLIT_CONFIG) <= 227 * 1024
    assert aligned_base(RAW_SMEM) % 1024 == 0 and 0 <= aligned_base(RAW_SMEM) - RAW_SMEM < 1024


@pytest.mark.parametrize("rows, cols", PANEL_TILES)
def test_panel_offset_is_a_bijection_onto_the_tile(rows, cols):
    off = panel_offset(rows, np.arange(rows)[:, None], np.arange(cols // 8)[None, :])
    assert sorted(off.ravel().tolist()) == list(range(0, rows * cols * 2, 16))
    # a chunk stays in its 64-column panel and its row's 128 bytes of that panel
    chunk = np.arange(cols // 8)[None, :]
    assert np.all(off // (rows * 128) == chunk // 8)
    assert np.all(off % (rows * 128) // 128 == np.arange(rows)[:, None])


@pytest.mark.parametrize("rows, cols", PANEL_TILES)
def test_panel_tile_is_the_canonical_layout_in_both_orientations(rows, cols):
    """Element (r, c) of a panel tile is where the hardware reads it through the descriptors the
    kernels build: K-major (rows are M or N, columns the reduction: start = panel + 32 bytes per
    16-column step, SBO 1024) and MN-major (rows are the reduction: start = 2048 bytes per
    16-row step, LBO one panel, SBO 1024)."""
    tile = aligned_base(RAW_SMEM) + 3 * 1024
    element = np.arange(rows)[:, None], np.arange(cols)[None, :]
    want = tile + panel_offset(rows, element[0], element[1] // 8) + 2 * (element[1] % 8)
    for kk in range(cols // 16):  # K-major: all rows, columns 16kk..16kk+15
        start = tile + (kk // 4) * rows * 128 + (kk % 4) * 32
        got = operand_addresses(smem_desc(start, 16, 1024), K_MAJOR, rows)
        assert np.array_equal(got, want[:, 16 * kk: 16 * kk + 16])
    for kk in range(rows // 16):  # MN-major: rows 16kk..16kk+15 as k, all columns as MN
        got = operand_addresses(smem_desc(tile + kk * 2048, rows * 128, 1024), MN_MAJOR, cols)
        assert np.array_equal(got, want[16 * kk: 16 * kk + 16].T)


@pytest.mark.parametrize("rows, cols", PANEL_TILES)
def test_accumulator_pair_stores_are_bank_conflict_free(rows, cols):
    """A warp's st.shared.b32 of one C-fragment register pair: lanes write rows row0 + lane / 4
    (or + 8), columns 8j + 2 (lane % 4), +1; the 32 lanes must hit 32 distinct banks."""
    for row0 in range(0, rows, 16):
        for j in range(cols // 8):
            for half in (0, 8):
                lane = np.arange(32)
                addr = panel_offset(rows, row0 + half + lane // 4, j) + 4 * (lane % 4)
                assert bank_conflict_free(addr, 4), (row0, j, half)


@pytest.mark.parametrize("rows, dim, nthreads", CP_ASYNC_TILES)
def test_cp_async_panels_writes_each_slot_once_at_panel_offset(rows, dim, nthreads):
    rng = seeded_rng(1, rows, dim)
    tile = aligned_base(RAW_SMEM) + 2048
    for rows_valid, headdim in ((rows, dim), (rows - 5, dim - 8), (3, 8)):
        g = rng.standard_normal((rows_valid, headdim))
        smem = new_smem()
        log = []
        cp_async_panels(smem, tile, rows, dim, nthreads, g, rows_valid, headdim, log)
        slots = [dst for _, dst, _ in log]
        assert sorted(slots) == list(range(tile, tile + rows * dim * 2, 16))  # each slot once
        assert np.isnan(smem[: tile // 2]).all() and np.isnan(smem[(tile + rows * dim * 2) // 2:]).all()
        want = np.zeros((rows, dim))
        want[:rows_valid, :headdim] = g  # zero fill past rows_valid and headdim
        assert np.array_equal(load_panels(smem, tile, rows, dim), want)
        # a quarter warp's 8 16-byte copies of one issue cover the 32 banks
        by_issue = {}
        for thread, dst, i in log:
            by_issue.setdefault((thread // 8, i), []).append(dst)
        assert all(bank_conflict_free(addrs, 16) for addrs in by_issue.values())


def test_packed_accumulators_are_the_a_operand_of_the_next_product():
    """pack_a_frags / pack_p: the accumulator columns 16kk..16kk+15 of a warpgroup's 64 x N
    product, packed, are the register A operand of k-step kk (wgmma .rs)."""
    m = seeded_rng(2).standard_normal((64, 128))
    a = pack_a_frags(acc_from_matrix(m))
    assert np.array_equal(acc_to_matrix(acc_from_matrix(m)), m)
    for kk in range(8):
        assert np.array_equal(a_fragment_matrix(a[:, kk]), m[:, 16 * kk: 16 * kk + 16])


"""The mma.sync dQ kernels, flash_bwd_dq_mma and _v2 (models/flash_bwd_dq_mma.py): their mask
mirrors are the kernels' statements; v2's fragment rows cover a warp's tile once; emulated after
the v1 dK/dV kernel, v2's tiles give the float64 gradients; the v2 table's layouts are the
launcher's and fit. (v1's dQ runs in test_flash_bwd_dkdv_mma's emulations.)"""
from __future__ import annotations

import numpy as np
import pytest
from models.flash_bwd_dq_mma import bwd_dq_layout_v2
from models.flash_bwd_mma import bwd_case_id, check_bwd_case
from models.mirrors import MIRRORED, missing_statements
from models.mma import GROUP, THREAD_IN_GROUP
from models.mma_bwd_walks import DQ_KERNELS

from cupyflash.bench.tune import load_dev_backward

DEV_BWD = load_dev_backward()  # the backward's versions and candidates: dev/mma_bwd.py


@pytest.mark.parametrize("source", list(DQ_KERNELS))
def test_mirrors_match_the_kernel_sources(source):
    """Every mask statement the models of the dQ kernels name is still in its kernel (found by name) or
    header, whitespace aside: an edit of a walk or an element test there fails here until its model
    follows."""
    assert any(m.source == source for m in MIRRORED)
    assert not (missing := missing_statements(source)), f"mirrored statements no longer in {source}: {missing}"


# dkdv config as in _BWD_CASES, dq config (d_tile, BLOCK_M, BLOCK_N, NWARPS, ROW_GROUPS) of
# mma_bwd.DQ_CONFIG_V2 / DQ_CANDIDATES_V2 or a smaller variant of the same code path.
_BWD_V2_CASES = [
    ((64, 64, 64, 128, 8, 1), (64, 128, 32, 4, 2), 40, 1, 150, 70, 2, 1, True),  # empty query rows
    ((64, 64, 64, 128, 8, 1), (64, 64, 32, 2, 2), 64, 1, 70, 97, 3, 1, True),
    ((128, 64, 32, 128, 8, 1), (128, 128, 32, 4, 2), 96, 1, 100, 130, 1, 1, True),
    ((128, 64, 32, 128, 8, 1), (128, 64, 32, 2, 2), 128, 2, 45, 75, 2, 2, False),
    ((128, 64, 32, 128, 8, 1), (128, 96, 32, 2, 3), 120, 1, 131, 64, 1, 1, True),
]


@pytest.mark.parametrize("case", _BWD_V2_CASES, ids=bwd_case_id)
def test_bwd_v2_dq_emulation_matches_reference(case):
    check_bwd_case(case)


def test_bwd_v2_fragment_rows_cover_the_warp_tile_once():
    """Each (query row, key) of a warp's 16 G x BLOCK_N tile is owned by exactly one
    (lane, group, C fragment, element), and the dP slices cover the key block exactly once."""
    for d_tile, block_n, G in ((64, 32, 2), (128, 32, 2), (128, 32, 3)):
        dp_cols = 16 if d_tile >= 128 else block_n
        seen = np.zeros((16 * G, block_n), dtype=int)
        for c0 in range(0, block_n, dp_cols):
            for g in range(G):
                for j in range(dp_cols // 8):
                    for e in range(4):
                        rows = 16 * g + GROUP + 8 * (e >> 1)
                        cols = c0 + 8 * j + 2 * THREAD_IN_GROUP + (e & 1)
                        np.add.at(seen, (rows, cols), 1)
        assert np.all(seen == 1)


def test_bwd_v2_tables_match_layouts_and_fit():
    from cupyflash.kernels import mma_bwd

    for dt, configs in ((dt, (c, *DEV_BWD.DQ_CANDIDATES_V2.get(dt, ()))) for dt, c in mma_bwd.DQ_CONFIG_V2.items()):
        for bm, bn, nw, rg in configs:
            lay = bwd_dq_layout_v2(dt, bm, bn)
            assert lay["BYTES"] == mma_bwd.dq_smem_bytes_v2(dt, bm, bn) <= 227 * 1024
            assert bm == 16 * rg * nw and bn % 16 == 0 and lay["LSE"] % 128 == 0
            assert (bm * dt // 8) % (32 * nw) == 0 and (bn * dt // 8) % (32 * nw) == 0  # cp_async_tile
    assert {v.name for v in DEV_BWD.VERSIONS} >= {"v1", "v2"} and DEV_BWD.LAST_VERSION == DEV_BWD.VERSIONS[-1].name
    assert DEV_BWD.dq_tiles(256, "v2") == mma_bwd.DQ_CONFIG[256]
    with pytest.raises(ValueError):
        DEV_BWD.dq_tiles(64, "v99")

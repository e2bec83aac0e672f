"""flash_bwd_split_q_tf32 and flash_bwd_dkdv_tf32_wgmma_ws's PRESPLIT producer on the CPU
(models/flash_bwd_split_q_tf32.py): the mirrors are the kernels' statements; the image's blocks
(dense and packed, ragged and empty sequences) lie inside the plan's workspace, none over another,
and each holds the bytes the dK/dV producer's own split and statistics would have put in a stage,
so the stage's products are the producer form's; the plan splits the query blocks after D (or the
statistics) and before the dK/dV kernel. The GPU tests are tests/kernels/test_flash_bwd_dmma.py's
"presplit_both" configuration and its bitwise test against the producer form."""
from __future__ import annotations

import numpy as np
import pytest

from cupyflash import backward_plans
from cupyflash.backward_plans import Tf32WgmmaBwdConfig
from cupyflash.masks import as_mask
from models.flash_bwd_dkdv_tf32_wgmma_ws import ws_smem
from models.flash_bwd_split_q_tf32 import DKDV_KERNEL, KERNEL, copy_into_stage, write_image
from models.mirrors import missing_statements, unmirrored_statements
from models.wgmma_tf32_bwd_steps import STAT_SLOTS, q_image_offset, query_block_tiles, split_query_block

BOTH = Tf32WgmmaBwdConfig(32, 0, producer=True, presplit=True, dq_raw_stages=0, dq_producer=True, dq_presplit=True)


@pytest.mark.parametrize("source", [KERNEL, DKDV_KERNEL])
def test_mirrors_match_the_kernel_source(source):
    assert not (missing := missing_statements(source)), f"mirrored statements no longer in {source}: {missing}"
    assert not (unmirrored := unmirrored_statements(source)), f"layout statements without a mirror: {unmirrored}"


def test_the_specs_and_the_plan():
    split = backward_plans.tf32_split_q_spec(64, as_mask(True), BOTH)
    assert split.name == "flash_bwd_split_q_tf32_fp32_hdim64_bm32"
    assert split.expression == "cf::flash_bwd_split_q_tf32<64, 32, false>"
    assert split.threads == 128 and split.arch == "90a"
    assert split.smem_bytes == query_block_tiles(64, 32)["BYTES"] + 1024
    assert backward_plans.tf32_split_q_spec(64, as_mask(True).as_packed(), BOTH).name.endswith("_packed")
    dkdv = backward_plans.tf32_wgmma_spec("dkdv", 64, as_mask(True), BOTH)
    assert dkdv.name == "flash_bwd_dkdv_tf32_wgmma_ws_fp32_hdim64_causal_bm32_bn64_s2_r0_apart_presplit"
    assert dkdv.expression == "cf::flash_bwd_dkdv_tf32_wgmma_ws<64, cf::Causal, 32, 2, 0, true, 3, true>"
    assert dkdv.smem_bytes == ws_smem(64, 32, 2, 0)["BYTES"] + 1024
    for statistics, first in (("saved", "preprocess"), ("recomputed", "stats")):
        plan = backward_plans.tf32_wgmma_backward_plan(64, True, BOTH, statistics)
        assert [launch.role for launch in plan.launches] == [first, "split_q", "dkdv", "split_kv", "dq"]
        assert plan.launches[1].grid(3, 100, 1000, 8, 2, 64) == (4, 8, 3)  # query blocks, query heads, batch
    assert BOTH in backward_plans.TF32_WGMMA_BACKWARD_CONFIGS[64]  # the compile check builds it
    for bad in (Tf32WgmmaBwdConfig(presplit=True, raw_stages=0), Tf32WgmmaBwdConfig(32, 1, producer=True, presplit=True)):
        with pytest.raises(ValueError, match="presplit"):
            backward_plans.tf32_wgmma_spec("dkdv", 64, as_mask(True), bad)


def _blocks(block_m, nheads, lengths=None, batch=1, seqlen_q=0):
    if lengths is None:
        return [q_image_offset(False, 64, block_m, nheads, seqlen_q, b, b, 0, h, i)
                for b in range(batch) for h in range(nheads) for i in range(-(-seqlen_q // block_m))]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return [q_image_offset(True, 64, block_m, nheads, int(starts[-1]), b, 0, int(starts[b]), h, i)
            for b, n in enumerate(lengths) for h in range(nheads) for i in range(-(-n // block_m))]


@pytest.mark.parametrize("seed", range(30))
def test_image_blocks_lie_inside_the_workspace_and_apart(seed):
    rng = np.random.default_rng(100 + seed)
    block_m, nheads = 32, int(rng.integers(1, 5))
    size = query_block_tiles(64, block_m)["BYTES"]
    if seed % 2:
        lengths = [int(rng.choice([0, 1, 31, 32, 33, 64, 65, int(rng.integers(0, 300))])) for _ in range(rng.integers(1, 9))]
        offsets = _blocks(block_m, nheads, lengths)
        total = backward_plans.q_split_bytes(64, block_m, 1, sum(lengths), nheads, len(lengths))
    else:
        batch, seqlen_q = int(rng.integers(1, 4)), int(rng.integers(1, 300))
        offsets = _blocks(block_m, nheads, batch=batch, seqlen_q=seqlen_q)
        total = backward_plans.q_split_bytes(64, block_m, batch, seqlen_q, nheads)
    offsets.sort()
    assert all(at % 16 == 0 and 0 <= at and at + size <= total for at in offsets)
    assert all(b - a >= size for a, b in zip(offsets, offsets[1:]))


def test_a_tight_packed_workspace_is_full():
    lengths = [33] * 4
    offsets = _blocks(32, 1, lengths)
    assert max(offsets) + query_block_tiles(64, 32)["BYTES"] == backward_plans.q_split_bytes(64, 32, 1, 132, 1, 4)


@pytest.mark.parametrize("packed", [False, True])
def test_a_copied_block_is_the_producers_own_split_with_its_statistics(packed):
    """Each written block is the bytes the non-PRESPLIT producer forms in a stage (the same split
    helper, the same statistics rows, zeros past the end); a neighbour's block copied instead is
    caught."""
    rng = np.random.default_rng(7 + packed)
    d, dv, heads = 60, 52, 3
    if packed:
        lengths = [0, 45, 7, 70]
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        batch, seqlen_q = 1, int(cu[-1])
        b, batch_of, q_begin, head, i = 3, 0, int(cu[3]), 2, 1  # sequence 3's second block: rows 32..63 of 70
        rows_valid = 70 - 32
    else:
        cu, batch, seqlen_q = None, 2, 45
        b, batch_of, q_begin, head, i = 1, 1, 0, 1, 1  # the ragged last block: rows 32..44
        rows_valid = 45 - 32
    q = rng.standard_normal((batch, seqlen_q, heads, d)).astype(np.float32)
    dout = rng.standard_normal((batch, seqlen_q, heads, dv)).astype(np.float32)
    stats = rng.standard_normal((STAT_SLOTS, batch, heads, seqlen_q)).astype(np.float32)
    total = backward_plans.q_split_bytes(64, 32, batch, seqlen_q, heads, None if cu is None else len(cu) - 1)
    image = write_image(64, 32, q, dout, stats, d, dv, cu, total)
    at = q_image_offset(packed, 64, 32, heads, seqlen_q, b, batch_of, q_begin, head, i)
    neighbour = q_image_offset(packed, 64, 32, heads, seqlen_q, b, batch_of, q_begin, head, i - 1)
    layout = ws_smem(64, 32, 2, 0)
    stage = layout["STAGE0"] + layout["STAGE"]  # stage 1
    own = np.full(layout["BYTES"] // 4, 0xFFFFFFFF, np.uint32)
    rows = slice(q_begin + 32, q_begin + 32 + min(32, rows_valid))
    qb, ob = (np.zeros((32, x.shape[3]), np.float32) for x in (q, dout))
    qb[: rows.stop - rows.start], ob[: rows.stop - rows.start] = q[batch_of, rows, head], dout[batch_of, rows, head]
    st = np.zeros((STAT_SLOTS, 32), np.float32)
    st[:, : rows.stop - rows.start] = stats[:, batch_of, head, rows]
    split_query_block(own, stage, 64, 32, 128, qb, ob, rows_valid, d, dv, st)
    copied = np.full_like(own, 0xFFFFFFFF)
    copy_into_stage(copied, stage, image, at, 64, 32)
    n = query_block_tiles(64, 32)["BYTES"] // 4
    assert np.array_equal(copied[stage // 4: stage // 4 + n], own[stage // 4: stage // 4 + n])
    got_stats = copied[(stage + query_block_tiles(64, 32)["STATS"]) // 4:][: STAT_SLOTS * 32].view(np.float32)
    assert np.array_equal(got_stats.reshape(STAT_SLOTS, 32)[:, : rows.stop - rows.start],
                          stats[:, batch_of, head, rows])
    wrong = np.full_like(own, 0xFFFFFFFF)
    copy_into_stage(wrong, stage, image, neighbour, 64, 32)
    assert not np.array_equal(wrong, copied)

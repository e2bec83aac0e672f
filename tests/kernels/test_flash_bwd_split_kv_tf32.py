"""flash_bwd_split_kv_tf32 and flash_bwd_dq_tf32_wgmma_ws's PRESPLIT producer on the CPU
(models/flash_bwd_split_kv_tf32.py): the mirrors are the kernels' statements; the image's blocks
(dense and packed, ragged and empty sequences, GQA) lie inside the plan's workspace, none over
another, and each holds the bytes the dQ producer's own split would have put in a stage, so that a
block copied into a stage and emulated product by product is S = Q K^T, dP = dO V^T and dQ = dS K;
the plan launches the split before the dQ kernel on the key blocks' grid. The GPU tests are
tests/kernels/test_flash_bwd_dmma.py's "producer_dq_presplit" configuration and its bitwise test
against the one-warpgroup dQ kernel."""
from __future__ import annotations

import numpy as np
import pytest

from cupyflash import backward_plans
from cupyflash.backward_plans import Tf32WgmmaBwdConfig
from cupyflash.masks import as_mask
import models.flash_bwd_dq_tf32_wgmma_ws as ws_model
from models.flash_bwd_dq_tf32_wgmma_ws import ws_smem
from models.flash_bwd_split_kv_tf32 import DQ_KERNEL, KERNEL, copy_into_stage, write_image
from models.mirrors import missing_statements, unmirrored_statements
from models.wgmma_tf32_bwd_steps import close, key_block_tiles, kv_image_offset

PRESPLIT = Tf32WgmmaBwdConfig(32, 1, producer=True, dq_raw_stages=0, dq_producer=True, dq_presplit=True)


@pytest.mark.parametrize("source", [KERNEL, DQ_KERNEL])
def test_mirrors_match_the_kernel_source(source):
    assert not (missing := missing_statements(source)), f"mirrored statements no longer in {source}: {missing}"
    assert not (unmirrored := unmirrored_statements(source)), f"layout statements without a mirror: {unmirrored}"


def test_the_specs_and_the_plan():
    split = backward_plans.tf32_split_kv_spec(64, as_mask(True), PRESPLIT)
    assert split.name == "flash_bwd_split_kv_tf32_fp32_hdim64_bn32"
    assert split.expression == "cf::flash_bwd_split_kv_tf32<64, 32, false>"
    assert split.threads == 128 and split.arch == "90a" and split.smem_bytes == 6 * 32 * 64 * 4 + 1024
    packed = backward_plans.tf32_split_kv_spec(64, as_mask(True).as_packed(), PRESPLIT)
    assert packed.name.endswith("_packed") and packed.expression == "cf::flash_bwd_split_kv_tf32<64, 32, true>"
    dq = backward_plans.tf32_wgmma_spec("dq", 64, as_mask(True), PRESPLIT)
    assert dq.name == "flash_bwd_dq_tf32_wgmma_ws_fp32_hdim64_causal_bm64_bn32_s2_r0_apart_presplit"
    assert dq.expression == "cf::flash_bwd_dq_tf32_wgmma_ws<64, cf::Causal, 32, 2, 0, true, 3, 1, true>"
    # no raw stages: Q and dO, two stages of 48 KiB, the barriers
    assert dq.smem_bytes == ws_smem(64, 32, 2, 0)["BYTES"] + 1024
    plan = backward_plans.tf32_wgmma_backward_plan(64, True, PRESPLIT)
    assert [launch.role for launch in plan.launches] == ["preprocess", "dkdv", "split_kv", "dq"]
    assert plan.launches[2].grid(3, 100, 1000, 8, 2, 64) == (32, 2, 3)  # key blocks, kv heads, batch
    assert PRESPLIT in backward_plans.TF32_WGMMA_BACKWARD_CONFIGS[64]  # the compile check builds it
    for bad in (Tf32WgmmaBwdConfig(dq_presplit=True, dq_raw_stages=0),  # not the producer form
                Tf32WgmmaBwdConfig(dq_producer=True, dq_presplit=True, dq_raw_stages=1)):
        with pytest.raises(ValueError, match="dq_presplit"):
            backward_plans.tf32_wgmma_spec("dq", 64, as_mask(True), bad)
    with pytest.raises(ValueError, match="producer form"):  # raw stages 0 only with the split
        backward_plans.tf32_wgmma_spec("dq", 64, as_mask(True), Tf32WgmmaBwdConfig(dq_producer=True, dq_raw_stages=0))


def _blocks(block_n, nheads_kv, seqlen_k, lengths=None, batch=1):
    """(byte offset, sequence, kv head, block) of every block the split writes."""
    if lengths is None:
        return [(kv_image_offset(False, 64, block_n, nheads_kv, seqlen_k, b, b, 0, h, j), b, h, j)
                for b in range(batch) for h in range(nheads_kv) for j in range(-(-seqlen_k // block_n))]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return [(kv_image_offset(True, 64, block_n, nheads_kv, int(starts[-1]), b, 0, int(starts[b]), h, j), b, h, j)
            for b, n in enumerate(lengths) for h in range(nheads_kv) for j in range(-(-n // block_n))]


@pytest.mark.parametrize("seed", range(40))
def test_image_blocks_lie_inside_the_workspace_and_apart(seed):
    """Ragged packed lengths (zeros, ones, block multiples and one past) and dense shapes: every
    block's bytes inside kv_split_bytes, no two blocks overlapping."""
    rng = np.random.default_rng(seed)
    block_n, nheads_kv = 32, int(rng.integers(1, 4))
    bytes_ = key_block_tiles(64, block_n)["BYTES"]
    if seed % 2:
        lengths = [int(rng.choice([0, 1, 31, 32, 33, 64, 65, int(rng.integers(0, 300))])) for _ in range(rng.integers(1, 9))]
        blocks = _blocks(block_n, nheads_kv, 0, lengths)
        total = backward_plans.kv_split_bytes(64, block_n, 1, sum(lengths), nheads_kv, len(lengths))
    else:
        batch, seqlen_k = int(rng.integers(1, 4)), int(rng.integers(1, 300))
        blocks = _blocks(block_n, nheads_kv, seqlen_k, batch=batch)
        total = backward_plans.kv_split_bytes(64, block_n, batch, seqlen_k, nheads_kv)
    offsets = sorted(at for at, *_ in blocks)
    assert all(at % 16 == 0 and 0 <= at and at + bytes_ <= total for at in offsets)
    assert all(b - a >= bytes_ for a, b in zip(offsets, offsets[1:]))


def test_a_tight_packed_workspace_is_full():
    """The packed bound is reached: sequences of 33 keys fill slots k_begin / 32 + b .. to the last."""
    lengths = [33] * 5
    blocks = _blocks(32, 1, 0, lengths)
    last = max(at for at, *_ in blocks) + key_block_tiles(64, 32)["BYTES"]
    assert last == backward_plans.kv_split_bytes(64, 32, 1, sum(lengths), 1, len(lengths))


@pytest.mark.parametrize("packed", [False, True])
def test_a_copied_block_is_the_producers_own_split_and_its_products(packed):
    """Each written block is the bytes the non-PRESPLIT producer's split puts in a stage (the same
    helper), and copied into stage 1 it gives S = Q K^T, dP = dO V^T and dQ = dS K; a block copied
    from its neighbour's offset does not."""
    rng = np.random.default_rng(3 + packed)
    d, dv, hkv = 60, 52, 2
    if packed:
        lengths = [0, 45, 7, 70]
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        k = rng.standard_normal((1, int(cu[-1]), hkv, d)).astype(np.float32)
        v = rng.standard_normal((1, int(cu[-1]), hkv, dv)).astype(np.float32)
        total = backward_plans.kv_split_bytes(64, 32, 1, int(cu[-1]), hkv, len(lengths))
        b, head, j = 3, 1, 1  # sequence 3's second block: keys 32..63 of 70
        at = kv_image_offset(True, 64, 32, hkv, int(cu[-1]), b, 0, int(cu[b]), head, j)
        keys = k[0, cu[b] + 32: cu[b] + 64, head], v[0, cu[b] + 32: cu[b] + 64, head]
        neighbour = kv_image_offset(True, 64, 32, hkv, int(cu[-1]), b, 0, int(cu[b]), head, 0)
    else:
        cu = None
        k = rng.standard_normal((2, 45, hkv, d)).astype(np.float32)
        v = rng.standard_normal((2, 45, hkv, dv)).astype(np.float32)
        total = backward_plans.kv_split_bytes(64, 32, 2, 45, hkv)
        b, head, j = 1, 0, 1  # the ragged last block: keys 32..44
        at = kv_image_offset(False, 64, 32, hkv, 45, b, b, 0, head, j)
        keys = k[b, 32:45, head], v[b, 32:45, head]
        neighbour = kv_image_offset(False, 64, 32, hkv, 45, b, b, 0, head, 0)
    image = write_image(64, 32, k, v, d, dv, cu, total)
    q, do = (rng.standard_normal((64, n)).astype(np.float32) for n in (d, dv))
    kb, vb = (np.zeros((32, x.shape[1]), np.float32) for x in keys)
    kb[: len(keys[0])], vb[: len(keys[1])] = keys
    valid = len(keys[0])
    own = ws_model.load_tiles(64, 32, q, do, kb, vb, 64, valid, d, dv, stages=2, raw_stages=0)
    layout = ws_smem(64, 32, 2, 0, ws_model.STAGE_INDEX)
    copied = own.copy()
    copied[layout["K_HI"] // 4: layout["K_HI"] // 4 + key_block_tiles(64, 32)["BYTES"] // 4] = 0xFFFFFFFF
    copy_into_stage(copied, layout["K_HI"], image, at, 64, 32)
    assert np.array_equal(copied, own)
    got = ws_model.products(copied, 64, 32, stages=2, raw_stages=0)
    k64, v64 = (np.zeros((32, 64)) for _ in range(2))
    k64[:valid, :d], v64[:valid, :dv] = keys[0], keys[1]
    q64, do64 = np.zeros((64, 64)), np.zeros((64, 64))
    q64[:, :d], do64[:, :dv] = q, do
    assert close(got["s"], q64 @ k64.T) and close(got["dp"], do64 @ v64.T) and close(got["dq"], got["ds"] @ k64)
    wrong = own.copy()
    copy_into_stage(wrong, layout["K_HI"], image, neighbour, 64, 32)
    assert not np.array_equal(wrong, own)


def test_an_empty_key_range_walks_no_block_where_the_blocks_are_copied():
    """KeyBlockRange (block_walk.cuh): rounded to blocks, an empty key range [48, 48) is one block
    (harmless where a kernel loads the block's rows itself: zeros); with SKIP_EMPTY, the PRESPLIT
    dQ kernel's, it is none. A range with keys is the same either way."""
    from models.mma_bwd_walks import key_blocks

    assert key_blocks(48, 48, 32, False) == (1, 2, 1)
    assert key_blocks(48, 48, 32, True) == (1, 1, 0)
    assert key_blocks(64, 64, 32, False)[2] == key_blocks(64, 64, 32, True)[2] == 0
    for skip in (False, True):
        assert key_blocks(40, 70, 32, skip) == (1, 3, 2)

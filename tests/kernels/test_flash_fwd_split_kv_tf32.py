"""flash_fwd_split_kv_tf32 and flash_fwd_tf32_wgmma_ws's PRESPLIT producer on the CPU
(models/flash_fwd_split_kv_tf32.py): the mirrors are the kernels' statements; the plan launches the
split before the forward; the image's blocks (dense and packed, ragged and empty sequences, GQA)
lie inside the workspace, none over another; a block copied into a stage is what the tensor cores
must read there: K's and V^T's hi and lo tf32 bits, from the definition of the split, and not its
neighbour's. The GPU tests are tests/test_tf32_wgmma_gpu.py's presplit rows (bit for bit the
producer that splits in every CTA)."""
from __future__ import annotations

import numpy as np
import pytest

from cupyflash import plans
from cupyflash.masks import as_mask
from cupyflash.plans import WgmmaTf32FwdConfig
from models.flash_fwd_split_kv_tf32 import KERNEL, WS_KERNEL, copy_into_stage, kv_fwd_image_offset, write_image
from models.mirrors import missing_statements, unmirrored_statements
from models.wgmma_tf32 import (fwd_key_block_tiles, forward_ws_smem, k_major_operand_of, key_pair_order,
                               tf32_k_step_desc, tf32_operand)

PRESPLIT = WgmmaTf32FwdConfig(32, raw_stages=0, producer=True, stages=4, sums_apart=True, presplit=True)


def test_mirrors_match_the_kernel_source():
    assert not (missing := missing_statements(KERNEL)), f"mirrored statements no longer in {KERNEL}: {missing}"
    assert not (unmirrored := unmirrored_statements(KERNEL)), f"layout statements without a mirror: {unmirrored}"
    # the producer kernel's PRESPLIT statements (its other layout statements are
    # tests/kernels/test_flash_fwd_tf32.py's to check)
    assert not (missing := missing_statements(WS_KERNEL)), f"mirrored statements no longer in {WS_KERNEL}: {missing}"


def test_the_specs_and_the_plan():
    plan = plans.forward_plan(np.float32, 64, as_mask(True), PRESPLIT)
    assert plan.spec.name == "flash_fwd_tf32_wgmma_ws_fp32_hdim64_causal_bm128_bn32_ieee_s4_raw0_apart_presplit"
    assert plan.spec.expression == "cf::flash_fwd_tf32_wgmma_ws<64, cf::Causal, 32, 3, 4, 0, true, false, true>"
    # no raw stages: four stages of 32 KiB, O's staging tile (128 rows), the barriers
    assert plan.spec.smem_bytes == forward_ws_smem(64, 32, 4, 0)["BYTES"] + 1024 == 4 * 32768 + 32768 + 64 + 1024
    split = plan.split_kv
    assert split.name == "flash_fwd_split_kv_tf32_fp32_hdim64_bn32"
    assert split.expression == "cf::flash_fwd_split_kv_tf32<64, 32, false>"
    assert split.threads == 128 and split.arch == "90a" and split.smem_bytes == 4 * 32 * 64 * 4 + 1024
    packed = plans.forward_plan(np.float32, 64, as_mask(True).as_packed(), PRESPLIT).split_kv
    assert packed.name.endswith("_packed") and packed.expression == "cf::flash_fwd_split_kv_tf32<64, 32, true>"
    tf32 = plans.forward_plan(np.float32, 64, as_mask(True), PRESPLIT, precision="tf32").split_kv
    assert tf32.name.endswith("_tf32") and tf32.expression == "cf::flash_fwd_split_kv_tf32<64, 32, false, 1>"
    # the routed row splits in every CTA and launches nothing before it
    route = plans.WGMMA_FLOAT32_FORWARD_TILES[("tf32", plans.SM90, 64, "ieee")]
    assert plans.forward_plan(np.float32, 64, as_mask(True), route).split_kv is None
    for bad in (WgmmaTf32FwdConfig(32, raw_stages=2, producer=True, stages=4, presplit=True),  # raw stages
                WgmmaTf32FwdConfig(32, presplit=True)):  # not the producer kernel
        with pytest.raises(ValueError, match="presplit"):
            plans.forward_plan(np.float32, 64, as_mask(True), bad)


def _blocks(block_n, nheads_kv, seqlen_k, lengths=None, batch=1):
    """(byte offset, sequence, kv head, block) of every block the split writes."""
    if lengths is None:
        return [(kv_fwd_image_offset(False, 64, block_n, nheads_kv, seqlen_k, b, b, 0, h, j), b, h, j)
                for b in range(batch) for h in range(nheads_kv) for j in range(-(-seqlen_k // block_n))]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    return [(kv_fwd_image_offset(True, 64, block_n, nheads_kv, int(starts[-1]), b, 0, int(starts[b]), h, j), b, h, j)
            for b, n in enumerate(lengths) for h in range(nheads_kv) for j in range(-(-n // block_n))]


@pytest.mark.parametrize("seed", range(30))
def test_image_blocks_lie_inside_the_workspace_and_apart(seed):
    rng = np.random.default_rng(seed)
    block_n, nheads_kv = 32, int(rng.integers(1, 4))
    bytes_ = fwd_key_block_tiles(64, block_n)["BYTES"]
    if seed % 2:
        lengths = [int(rng.choice([0, 1, 31, 32, 33, 64, 65, int(rng.integers(0, 300))])) for _ in range(rng.integers(1, 9))]
        blocks = _blocks(block_n, nheads_kv, 0, lengths)
        total = plans.kv_fwd_split_bytes(64, block_n, 1, sum(lengths), nheads_kv, len(lengths))
    else:
        batch, seqlen_k = int(rng.integers(1, 4)), int(rng.integers(1, 300))
        blocks = _blocks(block_n, nheads_kv, seqlen_k, batch=batch)
        total = plans.kv_fwd_split_bytes(64, block_n, batch, seqlen_k, nheads_kv)
    offsets = sorted(at for at, *_ in blocks)
    assert all(at % 16 == 0 and 0 <= at and at + bytes_ <= total for at in offsets)
    assert all(b - a >= bytes_ for a, b in zip(offsets, offsets[1:]))


def _operand(smem, tile: int, rows: int, steps: int) -> np.ndarray:
    """The rows x 8 steps matrix of float32 bits the k-steps of a K-major tile read."""
    return np.concatenate([tf32_operand(smem, tf32_k_step_desc(rows, tile, s), rows) for s in range(steps)], axis=1)


@pytest.mark.parametrize("packed", [False, True])
def test_a_copied_block_is_what_the_products_read(packed):
    """A block of the image copied into stage 2 of the producer kernel's shared memory holds, where
    S = Q K^T's k-steps read, K's hi and lo bits, and where O += P V's read, V^T's in KEY_PAIRS
    order (zero past the block's keys and the head dims); the neighbour block's copy does not."""
    rng = np.random.default_rng(5 + packed)
    d, dv, hkv, block_n = 60, 52, 2, 32
    if packed:
        lengths = [0, 45, 7, 70]
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        k = rng.standard_normal((1, int(cu[-1]), hkv, d)).astype(np.float32)
        v = rng.standard_normal((1, int(cu[-1]), hkv, dv)).astype(np.float32)
        total = plans.kv_fwd_split_bytes(64, block_n, 1, int(cu[-1]), hkv, len(lengths))
        b, head, j = 3, 1, 2  # sequence 3's third block: keys 64..69 of 70
        at = kv_fwd_image_offset(True, 64, block_n, hkv, int(cu[-1]), b, 0, int(cu[b]), head, j)
        keys = k[0, cu[b] + 64: cu[b] + 70, head], v[0, cu[b] + 64: cu[b] + 70, head]
        neighbour = kv_fwd_image_offset(True, 64, block_n, hkv, int(cu[-1]), b, 0, int(cu[b]), head, 1)
    else:
        cu = None
        k = rng.standard_normal((2, 45, hkv, d)).astype(np.float32)
        v = rng.standard_normal((2, 45, hkv, dv)).astype(np.float32)
        total = plans.kv_fwd_split_bytes(64, block_n, 2, 45, hkv)
        b, head, j = 1, 0, 1  # the ragged last block: keys 32..44
        at = kv_fwd_image_offset(False, 64, block_n, hkv, 45, b, b, 0, head, j)
        keys = k[b, 32:45, head], v[b, 32:45, head]
        neighbour = kv_fwd_image_offset(False, 64, block_n, hkv, 45, b, b, 0, head, 0)
    image = write_image(64, block_n, k, v, d, dv, cu, total)
    layout = forward_ws_smem(64, block_n, 4, 0)
    smem = np.full(layout["BYTES"] // 4, 0xFFFFFFFF, np.uint32)
    stage = 2 * layout["STAGE"]
    copy_into_stage(smem, stage, image, at, 64, block_n)
    k64, v64 = np.zeros((block_n, 64), np.float32), np.zeros((block_n, 64), np.float32)
    k64[: len(keys[0]), :d], v64[: len(keys[1]), :dv] = keys
    k_hi, k_lo = k_major_operand_of(3, k64)  # S's B operand: K rows, K-major over the head dim
    assert np.array_equal(_operand(smem, stage + layout["K_HI"], block_n, 8), k_hi)
    assert np.array_equal(_operand(smem, stage + layout["K_LO"], block_n, 8), k_lo)
    vt = v64.T[:, key_pair_order(block_n)]  # P V's B operand: V^T, its keys in KEY_PAIRS slots
    v_hi, v_lo = k_major_operand_of(3, vt)
    assert np.array_equal(_operand(smem, stage + layout["V_HI"], 64, block_n // 8), v_hi)
    assert np.array_equal(_operand(smem, stage + layout["V_LO"], 64, block_n // 8), v_lo)
    wrong = np.full_like(smem, 0xFFFFFFFF)
    copy_into_stage(wrong, stage, image, neighbour, 64, block_n)
    assert not np.array_equal(_operand(wrong, stage + layout["K_HI"], block_n, 8), k_hi)

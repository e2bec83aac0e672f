"""flash_bwd_dq_tf32_wgmma on the CPU (models/flash_bwd_dq_tf32_wgmma.py): its mirrors are the
kernel's statements, its shared memory is the plan's, and one query block against one key block,
emulated product by product from what the tensor cores read, is S = Q K^T, dP = dO V^T and
dQ = dS K on the valid rows and columns, each value of the element step at its own (row, key),
the epilogue storing each value at its row and column. Its compile check is
tests/kernels/test_flash_bwd_dkdv_tf32_wgmma.py's (both kernels); the GPU tests are
tests/kernels/test_flash_bwd_dmma.py's float32 part."""
from __future__ import annotations

import numpy as np
import pytest

from cupyflash import backward_plans
from cupyflash.backward_plans import Tf32WgmmaBwdConfig
from cupyflash.masks import as_mask
import models.flash_bwd_dq_tf32_wgmma as dq_model
from models.flash_bwd_dq_tf32_wgmma import BLOCK_M, KERNEL, acc_from_matrix, dq_smem, element_positions
from models.mirrors import missing_statements, unmirrored_statements
from models.wgmma_tf32_bwd_steps import close, emulate, store_acc_rows


def test_mirrors_match_the_kernel_source():
    assert not (missing := missing_statements(KERNEL)), f"mirrored statements no longer in {KERNEL}: {missing}"
    assert not (unmirrored := unmirrored_statements(KERNEL)), f"layout statements without a mirror: {unmirrored}"


@pytest.mark.parametrize("block_n, raw_stages", [(32, 2), (64, 1), (64, 2), (32, 0)])
def test_smem_is_the_kernels_layout_and_fits(block_n, raw_stages):
    config = Tf32WgmmaBwdConfig(dq_block_n=block_n, dq_raw_stages=raw_stages)
    layout = dq_smem(64, block_n, raw_stages)
    assert backward_plans.tf32_wgmma_smem_bytes("dq", 64, config) == layout["BYTES"] + 1024 <= 227 * 1024
    assert all(layout[name] % 1024 == 0 for name in layout if name.endswith(("_HI", "_LO")))  # 128-byte swizzle


def test_the_spec_names_its_tiles_and_refuses_what_cannot_run():
    spec = backward_plans.tf32_wgmma_spec("dq", 64, as_mask(True), Tf32WgmmaBwdConfig())
    assert spec.name == "flash_bwd_dq_tf32_wgmma_fp32_hdim64_causal_bm64_bn32_r2_apart"
    assert spec.expression == "cf::flash_bwd_dq_tf32_wgmma<64, cf::Causal, 32, 2, true>"
    assert spec.arch == "90a" and spec.threads == 128
    with pytest.raises(ValueError, match="blocks of 32 or 64 rows"):
        backward_plans.tf32_wgmma_spec("dq", 64, as_mask(True), Tf32WgmmaBwdConfig(dq_block_n=48))
    with pytest.raises(ValueError, match="227 KiB"):
        backward_plans.tf32_wgmma_spec("dq", 64, as_mask(True), Tf32WgmmaBwdConfig(dq_block_n=64, dq_raw_stages=3))


@pytest.mark.parametrize("block_n, queries_valid, keys_valid, headdim, headdim_v",
                         [(32, 64, 32, 64, 64), (32, 19, 23, 60, 52), (64, 64, 64, 64, 64), (64, 50, 7, 8, 36)])
def test_one_block_emulated_is_the_dq_products(block_n, queries_valid, keys_valid, headdim, headdim_v):
    got, (q64, do64, k64, v64) = emulate(dq_model, block_n, queries_valid, keys_valid, headdim, headdim_v,
                                               seed=block_n + keys_valid + headdim_v)
    assert close(got["s"], q64 @ k64.T) and close(got["dp"], do64 @ v64.T)
    assert close(got["dq"], got["ds"] @ k64)

    rows, keys = element_positions(block_n)
    row_of, key_of = np.meshgrid(np.arange(BLOCK_M), np.arange(block_n), indexing="ij")
    assert np.array_equal(acc_from_matrix(row_of).reshape(128, -1), rows)
    assert np.array_equal(acc_from_matrix(key_of).reshape(128, -1), keys)
    assert np.array_equal(store_acc_rows(acc_from_matrix(got["dq"]).reshape(128, -1), 64), got["dq"])

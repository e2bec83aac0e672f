"""cupyflash.backward_plans: the backward plan of every device class, dtype, head dim, mask and
``deterministic`` launches the kernels (names, sources, template instantiations, threads, shared
memory, arch, grids, order) that the dispatch before plans launched; the launchers launch what the
plan says; the compile check sees the same specializations.

The OLD_* tables are what dev/backward_dispatch_before_plans.py printed from the tree before plans
(5e4395f: ``mma_bwd.backward`` walking VERSIONS to v10, ``simt.backward``), on its SHAPE, with the
mask tokens of that tree (full, causal, local: the window (100, 3)). Its expressions spell the dQ
mode of the mma.sync dK/dV and fused kernels as bools (ATOMIC_DQ, DQ_ORDERED); the kernels now take
``DqAdd DQ_ADD`` (dq_add.cuh), the same instantiations, which ``old_spec`` spells today's way. Its
sources name files that held several kernels then (SPLIT_SOURCES); each kernel now has a file of
its own named after it, which ``old_spec`` names too.
"""
from __future__ import annotations

import importlib.util
import re
import itertools
import sys
from pathlib import Path

import pytest

from cupyflash import backward_plans, plans
from cupyflash._dtypes import SUPPORTED
from cupyflash.backward_plans import BACKWARD_KERNELS, MMA_SYNC, SM90, plan_backward
from cupyflash.kernels import mma_bwd
from cupyflash import masks
from cupyflash.masks import Causal, Local, NoMask
from cupyflash.scores import Score

REPO = Path(__file__).resolve().parents[1]
MASKS = {"full": NoMask(), "causal": Causal(), "local": Local(100, 3)}


def _recorder():
    spec = importlib.util.spec_from_file_location("backward_dispatch_before_plans",
                                                  REPO / "dev" / "backward_dispatch_before_plans.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


RECORDER = _recorder()
ARCHS, SMEM_OPTINS = RECORDER.ARCHS, RECORDER.SMEM_OPTINS

OLD_SPECS = {
    'flash_bwd_dkdv_mma_bf16_hdim128_causal_bm64_ms32_bn128_w8_wd1_dqatomic': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma<cf::bf16_t, 128, cf::Causal, 64, 32, 128, 8, 1, true>', 256, 148480, ''),
    'flash_bwd_dkdv_mma_bf16_hdim128_full_bm64_ms32_bn128_w8_wd1_dqatomic': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma<cf::bf16_t, 128, cf::NoMask, 64, 32, 128, 8, 1, true>', 256, 148480, ''),
    'flash_bwd_dkdv_mma_bf16_hdim128_local_bm64_ms32_bn128_w8_wd1_dqatomic': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma<cf::bf16_t, 128, cf::Local, 64, 32, 128, 8, 1, true>', 256, 148480, ''),
    'flash_bwd_dkdv_mma_bf16_hdim256_causal_bm32_ms16_bn64_w8_wd2_dqatomic': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma<cf::bf16_t, 256, cf::Causal, 32, 16, 64, 8, 2, true>', 256, 152064, ''),
    'flash_bwd_dkdv_mma_bf16_hdim256_full_bm32_ms16_bn64_w8_wd2_dqatomic': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma<cf::bf16_t, 256, cf::NoMask, 32, 16, 64, 8, 2, true>', 256, 152064, ''),
    'flash_bwd_dkdv_mma_bf16_hdim256_local_bm32_ms16_bn64_w8_wd2_dqatomic': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma<cf::bf16_t, 256, cf::Local, 32, 16, 64, 8, 2, true>', 256, 152064, ''),
    'flash_bwd_dkdv_mma_bf16_hdim64_local_bm64_ms64_bn128_w8_wd1_dqatomic': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma<cf::bf16_t, 64, cf::Local, 64, 64, 128, 8, 1, true>', 256, 82944, ''),
    'flash_bwd_dkdv_mma_fp16_hdim128_causal_bm64_ms32_bn128_w8_wd1_dqatomic': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma<cf::half_t, 128, cf::Causal, 64, 32, 128, 8, 1, true>', 256, 148480, ''),
    'flash_bwd_dkdv_mma_fp16_hdim128_full_bm64_ms32_bn128_w8_wd1_dqatomic': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma<cf::half_t, 128, cf::NoMask, 64, 32, 128, 8, 1, true>', 256, 148480, ''),
    'flash_bwd_dkdv_mma_fp16_hdim128_local_bm64_ms32_bn128_w8_wd1_dqatomic': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma<cf::half_t, 128, cf::Local, 64, 32, 128, 8, 1, true>', 256, 148480, ''),
    'flash_bwd_dkdv_mma_fp16_hdim256_causal_bm32_ms16_bn64_w8_wd2_dqatomic': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma<cf::half_t, 256, cf::Causal, 32, 16, 64, 8, 2, true>', 256, 152064, ''),
    'flash_bwd_dkdv_mma_fp16_hdim256_full_bm32_ms16_bn64_w8_wd2_dqatomic': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma<cf::half_t, 256, cf::NoMask, 32, 16, 64, 8, 2, true>', 256, 152064, ''),
    'flash_bwd_dkdv_mma_fp16_hdim256_local_bm32_ms16_bn64_w8_wd2_dqatomic': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma<cf::half_t, 256, cf::Local, 32, 16, 64, 8, 2, true>', 256, 152064, ''),
    'flash_bwd_dkdv_mma_fp16_hdim64_local_bm64_ms64_bn128_w8_wd1_dqatomic': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma<cf::half_t, 64, cf::Local, 64, 64, 128, 8, 1, true>', 256, 82944, ''),
    'flash_bwd_dkdv_mma_split_bf16_hdim128_causal_bm64_ms32_bn128_w8_rg2': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma_split<cf::bf16_t, 128, cf::Causal, 64, 32, 128, 8, 2, false>', 256, 164864, ''),
    'flash_bwd_dkdv_mma_split_bf16_hdim128_full_bm64_ms32_bn128_w8_rg2': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma_split<cf::bf16_t, 128, cf::NoMask, 64, 32, 128, 8, 2, false>', 256, 164864, ''),
    'flash_bwd_dkdv_mma_split_bf16_hdim128_local_bm64_ms32_bn128_w8_rg2': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma_split<cf::bf16_t, 128, cf::Local, 64, 32, 128, 8, 2, false>', 256, 164864, ''),
    'flash_bwd_dkdv_mma_split_bf16_hdim256_causal_bm32_ms32_bn64_w8_rg1': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma_split<cf::bf16_t, 256, cf::Causal, 32, 32, 64, 8, 1, false>', 256, 147968, ''),
    'flash_bwd_dkdv_mma_split_bf16_hdim256_full_bm32_ms32_bn64_w8_rg1': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma_split<cf::bf16_t, 256, cf::NoMask, 32, 32, 64, 8, 1, false>', 256, 147968, ''),
    'flash_bwd_dkdv_mma_split_bf16_hdim256_local_bm32_ms32_bn64_w8_rg1': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma_split<cf::bf16_t, 256, cf::Local, 32, 32, 64, 8, 1, false>', 256, 147968, ''),
    'flash_bwd_dkdv_mma_split_fp16_hdim128_causal_bm64_ms32_bn128_w8_rg2': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma_split<cf::half_t, 128, cf::Causal, 64, 32, 128, 8, 2, false>', 256, 164864, ''),
    'flash_bwd_dkdv_mma_split_fp16_hdim128_full_bm64_ms32_bn128_w8_rg2': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma_split<cf::half_t, 128, cf::NoMask, 64, 32, 128, 8, 2, false>', 256, 164864, ''),
    'flash_bwd_dkdv_mma_split_fp16_hdim128_local_bm64_ms32_bn128_w8_rg2': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma_split<cf::half_t, 128, cf::Local, 64, 32, 128, 8, 2, false>', 256, 164864, ''),
    'flash_bwd_dkdv_mma_split_fp16_hdim256_causal_bm32_ms32_bn64_w8_rg1': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma_split<cf::half_t, 256, cf::Causal, 32, 32, 64, 8, 1, false>', 256, 147968, ''),
    'flash_bwd_dkdv_mma_split_fp16_hdim256_full_bm32_ms32_bn64_w8_rg1': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma_split<cf::half_t, 256, cf::NoMask, 32, 32, 64, 8, 1, false>', 256, 147968, ''),
    'flash_bwd_dkdv_mma_split_fp16_hdim256_local_bm32_ms32_bn64_w8_rg1': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma_split<cf::half_t, 256, cf::Local, 32, 32, 64, 8, 1, false>', 256, 147968, ''),
    'flash_bwd_dkdv_mma_v2_bf16_hdim64_causal_bm64_ms32_bn128_w4_rg2': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma_v2<cf::bf16_t, 64, cf::Causal, 64, 32, 128, 4, 2, false>', 128, 66560, ''),
    'flash_bwd_dkdv_mma_v2_bf16_hdim64_causal_bm64_ms32_bn128_w4_rg2_dqatomic': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma_v2<cf::bf16_t, 64, cf::Causal, 64, 32, 128, 4, 2, true>', 128, 82944, ''),
    'flash_bwd_dkdv_mma_v2_bf16_hdim64_full_bm64_ms32_bn128_w4_rg2': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma_v2<cf::bf16_t, 64, cf::NoMask, 64, 32, 128, 4, 2, false>', 128, 66560, ''),
    'flash_bwd_dkdv_mma_v2_bf16_hdim64_full_bm64_ms32_bn128_w4_rg2_dqatomic': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma_v2<cf::bf16_t, 64, cf::NoMask, 64, 32, 128, 4, 2, true>', 128, 82944, ''),
    'flash_bwd_dkdv_mma_v2_bf16_hdim64_local_bm64_ms32_bn128_w4_rg2': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma_v2<cf::bf16_t, 64, cf::Local, 64, 32, 128, 4, 2, false>', 128, 66560, ''),
    'flash_bwd_dkdv_mma_v2_fp16_hdim64_causal_bm64_ms32_bn128_w4_rg2': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma_v2<cf::half_t, 64, cf::Causal, 64, 32, 128, 4, 2, false>', 128, 66560, ''),
    'flash_bwd_dkdv_mma_v2_fp16_hdim64_causal_bm64_ms32_bn128_w4_rg2_dqatomic': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma_v2<cf::half_t, 64, cf::Causal, 64, 32, 128, 4, 2, true>', 128, 82944, ''),
    'flash_bwd_dkdv_mma_v2_fp16_hdim64_full_bm64_ms32_bn128_w4_rg2': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma_v2<cf::half_t, 64, cf::NoMask, 64, 32, 128, 4, 2, false>', 128, 66560, ''),
    'flash_bwd_dkdv_mma_v2_fp16_hdim64_full_bm64_ms32_bn128_w4_rg2_dqatomic': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma_v2<cf::half_t, 64, cf::NoMask, 64, 32, 128, 4, 2, true>', 128, 82944, ''),
    'flash_bwd_dkdv_mma_v2_fp16_hdim64_local_bm64_ms32_bn128_w4_rg2': ('flash_bwd_mma.cu', 'cf::flash_bwd_dkdv_mma_v2<cf::half_t, 64, cf::Local, 64, 32, 128, 4, 2, false>', 128, 66560, ''),
    'flash_bwd_dkdv_simt_fp32_hdim128_causal_bm32_bn32_tpr8': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<float, 128, cf::Causal, 32, 32, 8>', 256, 74752, ''),
    'flash_bwd_dkdv_simt_fp32_hdim128_full_bm32_bn32_tpr8': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<float, 128, cf::NoMask, 32, 32, 8>', 256, 74752, ''),
    'flash_bwd_dkdv_simt_fp32_hdim128_local_bm32_bn32_tpr8': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<float, 128, cf::Local, 32, 32, 8>', 256, 74752, ''),
    'flash_bwd_dkdv_simt_fp32_hdim16_causal_bm64_bn64_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<float, 16, cf::Causal, 64, 64, 4>', 256, 51200, ''),
    'flash_bwd_dkdv_simt_fp32_hdim16_full_bm64_bn64_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<float, 16, cf::NoMask, 64, 64, 4>', 256, 51200, ''),
    'flash_bwd_dkdv_simt_fp32_hdim16_local_bm64_bn64_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<float, 16, cf::Local, 64, 64, 4>', 256, 51200, ''),
    'flash_bwd_dkdv_simt_fp32_hdim256_causal_bm32_bn32_tpr8': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<float, 256, cf::Causal, 32, 32, 8>', 256, 140288, ''),
    'flash_bwd_dkdv_simt_fp32_hdim256_full_bm32_bn32_tpr8': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<float, 256, cf::NoMask, 32, 32, 8>', 256, 140288, ''),
    'flash_bwd_dkdv_simt_fp32_hdim256_local_bm32_bn32_tpr8': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<float, 256, cf::Local, 32, 32, 8>', 256, 140288, ''),
    'flash_bwd_dkdv_simt_fp32_hdim32_causal_bm64_bn64_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<float, 32, cf::Causal, 64, 64, 4>', 256, 67584, ''),
    'flash_bwd_dkdv_simt_fp32_hdim32_full_bm64_bn64_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<float, 32, cf::NoMask, 64, 64, 4>', 256, 67584, ''),
    'flash_bwd_dkdv_simt_fp32_hdim32_local_bm64_bn64_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<float, 32, cf::Local, 64, 64, 4>', 256, 67584, ''),
    'flash_bwd_dkdv_simt_fp32_hdim64_causal_bm64_bn64_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<float, 64, cf::Causal, 64, 64, 4>', 256, 100352, ''),
    'flash_bwd_dkdv_simt_fp32_hdim64_full_bm64_bn64_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<float, 64, cf::NoMask, 64, 64, 4>', 256, 100352, ''),
    'flash_bwd_dkdv_simt_fp32_hdim64_local_bm64_bn64_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<float, 64, cf::Local, 64, 64, 4>', 256, 100352, ''),
    'flash_bwd_dkdv_simt_fp64_hdim128_causal_bm16_bn16_tpr8': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<double, 128, cf::Causal, 16, 16, 8>', 128, 70656, ''),
    'flash_bwd_dkdv_simt_fp64_hdim128_full_bm16_bn16_tpr8': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<double, 128, cf::NoMask, 16, 16, 8>', 128, 70656, ''),
    'flash_bwd_dkdv_simt_fp64_hdim128_local_bm16_bn16_tpr8': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<double, 128, cf::Local, 16, 16, 8>', 128, 70656, ''),
    'flash_bwd_dkdv_simt_fp64_hdim16_causal_bm32_bn32_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<double, 16, cf::Causal, 32, 32, 4>', 128, 34816, ''),
    'flash_bwd_dkdv_simt_fp64_hdim16_full_bm32_bn32_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<double, 16, cf::NoMask, 32, 32, 4>', 128, 34816, ''),
    'flash_bwd_dkdv_simt_fp64_hdim16_local_bm32_bn32_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<double, 16, cf::Local, 32, 32, 4>', 128, 34816, ''),
    'flash_bwd_dkdv_simt_fp64_hdim256_causal_bm16_bn16_tpr16': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<double, 256, cf::Causal, 16, 16, 16>', 256, 136192, ''),
    'flash_bwd_dkdv_simt_fp64_hdim256_full_bm16_bn16_tpr16': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<double, 256, cf::NoMask, 16, 16, 16>', 256, 136192, ''),
    'flash_bwd_dkdv_simt_fp64_hdim256_local_bm16_bn16_tpr16': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<double, 256, cf::Local, 16, 16, 16>', 256, 136192, ''),
    'flash_bwd_dkdv_simt_fp64_hdim32_causal_bm32_bn32_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<double, 32, cf::Causal, 32, 32, 4>', 128, 51200, ''),
    'flash_bwd_dkdv_simt_fp64_hdim32_full_bm32_bn32_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<double, 32, cf::NoMask, 32, 32, 4>', 128, 51200, ''),
    'flash_bwd_dkdv_simt_fp64_hdim32_local_bm32_bn32_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<double, 32, cf::Local, 32, 32, 4>', 128, 51200, ''),
    'flash_bwd_dkdv_simt_fp64_hdim64_causal_bm32_bn32_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<double, 64, cf::Causal, 32, 32, 4>', 128, 83968, ''),
    'flash_bwd_dkdv_simt_fp64_hdim64_full_bm32_bn32_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<double, 64, cf::NoMask, 32, 32, 4>', 128, 83968, ''),
    'flash_bwd_dkdv_simt_fp64_hdim64_local_bm32_bn32_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dkdv_simt<double, 64, cf::Local, 32, 32, 4>', 128, 83968, ''),
    'flash_bwd_dq_convert_bf16': ('flash_bwd_mma.cu', 'cf::flash_bwd_dq_convert<cf::bf16_t>', 256, 0, ''),
    'flash_bwd_dq_convert_fp16': ('flash_bwd_mma.cu', 'cf::flash_bwd_dq_convert<cf::half_t>', 256, 0, ''),
    'flash_bwd_dq_mma_bf16_hdim256_causal_bm64_bn32_w4': ('flash_bwd_mma.cu', 'cf::flash_bwd_dq_mma<cf::bf16_t, 256, cf::Causal, 64, 32, 4>', 128, 131072, ''),
    'flash_bwd_dq_mma_bf16_hdim256_full_bm64_bn32_w4': ('flash_bwd_mma.cu', 'cf::flash_bwd_dq_mma<cf::bf16_t, 256, cf::NoMask, 64, 32, 4>', 128, 131072, ''),
    'flash_bwd_dq_mma_bf16_hdim256_local_bm64_bn32_w4': ('flash_bwd_mma.cu', 'cf::flash_bwd_dq_mma<cf::bf16_t, 256, cf::Local, 64, 32, 4>', 128, 131072, ''),
    'flash_bwd_dq_mma_fp16_hdim256_causal_bm64_bn32_w4': ('flash_bwd_mma.cu', 'cf::flash_bwd_dq_mma<cf::half_t, 256, cf::Causal, 64, 32, 4>', 128, 131072, ''),
    'flash_bwd_dq_mma_fp16_hdim256_full_bm64_bn32_w4': ('flash_bwd_mma.cu', 'cf::flash_bwd_dq_mma<cf::half_t, 256, cf::NoMask, 64, 32, 4>', 128, 131072, ''),
    'flash_bwd_dq_mma_fp16_hdim256_local_bm64_bn32_w4': ('flash_bwd_mma.cu', 'cf::flash_bwd_dq_mma<cf::half_t, 256, cf::Local, 64, 32, 4>', 128, 131072, ''),
    'flash_bwd_dq_mma_v2_bf16_hdim128_causal_bm128_bn32_w4_rg2': ('flash_bwd_mma.cu', 'cf::flash_bwd_dq_mma_v2<cf::bf16_t, 128, cf::Causal, 128, 32, 4, 2>', 128, 99328, ''),
    'flash_bwd_dq_mma_v2_bf16_hdim128_full_bm128_bn32_w4_rg2': ('flash_bwd_mma.cu', 'cf::flash_bwd_dq_mma_v2<cf::bf16_t, 128, cf::NoMask, 128, 32, 4, 2>', 128, 99328, ''),
    'flash_bwd_dq_mma_v2_bf16_hdim128_local_bm128_bn32_w4_rg2': ('flash_bwd_mma.cu', 'cf::flash_bwd_dq_mma_v2<cf::bf16_t, 128, cf::Local, 128, 32, 4, 2>', 128, 99328, ''),
    'flash_bwd_dq_mma_v2_bf16_hdim64_causal_bm128_bn32_w4_rg2': ('flash_bwd_mma.cu', 'cf::flash_bwd_dq_mma_v2<cf::bf16_t, 64, cf::Causal, 128, 32, 4, 2>', 128, 50176, ''),
    'flash_bwd_dq_mma_v2_bf16_hdim64_full_bm128_bn32_w4_rg2': ('flash_bwd_mma.cu', 'cf::flash_bwd_dq_mma_v2<cf::bf16_t, 64, cf::NoMask, 128, 32, 4, 2>', 128, 50176, ''),
    'flash_bwd_dq_mma_v2_bf16_hdim64_local_bm128_bn32_w4_rg2': ('flash_bwd_mma.cu', 'cf::flash_bwd_dq_mma_v2<cf::bf16_t, 64, cf::Local, 128, 32, 4, 2>', 128, 50176, ''),
    'flash_bwd_dq_mma_v2_fp16_hdim128_causal_bm128_bn32_w4_rg2': ('flash_bwd_mma.cu', 'cf::flash_bwd_dq_mma_v2<cf::half_t, 128, cf::Causal, 128, 32, 4, 2>', 128, 99328, ''),
    'flash_bwd_dq_mma_v2_fp16_hdim128_full_bm128_bn32_w4_rg2': ('flash_bwd_mma.cu', 'cf::flash_bwd_dq_mma_v2<cf::half_t, 128, cf::NoMask, 128, 32, 4, 2>', 128, 99328, ''),
    'flash_bwd_dq_mma_v2_fp16_hdim128_local_bm128_bn32_w4_rg2': ('flash_bwd_mma.cu', 'cf::flash_bwd_dq_mma_v2<cf::half_t, 128, cf::Local, 128, 32, 4, 2>', 128, 99328, ''),
    'flash_bwd_dq_mma_v2_fp16_hdim64_causal_bm128_bn32_w4_rg2': ('flash_bwd_mma.cu', 'cf::flash_bwd_dq_mma_v2<cf::half_t, 64, cf::Causal, 128, 32, 4, 2>', 128, 50176, ''),
    'flash_bwd_dq_mma_v2_fp16_hdim64_full_bm128_bn32_w4_rg2': ('flash_bwd_mma.cu', 'cf::flash_bwd_dq_mma_v2<cf::half_t, 64, cf::NoMask, 128, 32, 4, 2>', 128, 50176, ''),
    'flash_bwd_dq_mma_v2_fp16_hdim64_local_bm128_bn32_w4_rg2': ('flash_bwd_mma.cu', 'cf::flash_bwd_dq_mma_v2<cf::half_t, 64, cf::Local, 128, 32, 4, 2>', 128, 50176, ''),
    'flash_bwd_dq_simt_fp32_hdim128_causal_bm32_bn32_tpr8': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<float, 128, cf::Causal, 32, 32, 8>', 256, 70272, ''),
    'flash_bwd_dq_simt_fp32_hdim128_full_bm32_bn32_tpr8': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<float, 128, cf::NoMask, 32, 32, 8>', 256, 70272, ''),
    'flash_bwd_dq_simt_fp32_hdim128_local_bm32_bn32_tpr8': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<float, 128, cf::Local, 32, 32, 8>', 256, 70272, ''),
    'flash_bwd_dq_simt_fp32_hdim16_causal_bm64_bn64_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<float, 16, cf::Causal, 64, 64, 4>', 256, 34048, ''),
    'flash_bwd_dq_simt_fp32_hdim16_full_bm64_bn64_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<float, 16, cf::NoMask, 64, 64, 4>', 256, 34048, ''),
    'flash_bwd_dq_simt_fp32_hdim16_local_bm64_bn64_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<float, 16, cf::Local, 64, 64, 4>', 256, 34048, ''),
    'flash_bwd_dq_simt_fp32_hdim256_causal_bm32_bn32_tpr8': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<float, 256, cf::Causal, 32, 32, 8>', 256, 135808, ''),
    'flash_bwd_dq_simt_fp32_hdim256_full_bm32_bn32_tpr8': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<float, 256, cf::NoMask, 32, 32, 8>', 256, 135808, ''),
    'flash_bwd_dq_simt_fp32_hdim256_local_bm32_bn32_tpr8': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<float, 256, cf::Local, 32, 32, 8>', 256, 135808, ''),
    'flash_bwd_dq_simt_fp32_hdim32_causal_bm64_bn64_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<float, 32, cf::Causal, 64, 64, 4>', 256, 50432, ''),
    'flash_bwd_dq_simt_fp32_hdim32_full_bm64_bn64_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<float, 32, cf::NoMask, 64, 64, 4>', 256, 50432, ''),
    'flash_bwd_dq_simt_fp32_hdim32_local_bm64_bn64_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<float, 32, cf::Local, 64, 64, 4>', 256, 50432, ''),
    'flash_bwd_dq_simt_fp32_hdim64_causal_bm64_bn64_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<float, 64, cf::Causal, 64, 64, 4>', 256, 83200, ''),
    'flash_bwd_dq_simt_fp32_hdim64_full_bm64_bn64_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<float, 64, cf::NoMask, 64, 64, 4>', 256, 83200, ''),
    'flash_bwd_dq_simt_fp32_hdim64_local_bm64_bn64_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<float, 64, cf::Local, 64, 64, 4>', 256, 83200, ''),
    'flash_bwd_dq_simt_fp64_hdim128_causal_bm16_bn16_tpr8': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<double, 128, cf::Causal, 16, 16, 8>', 128, 68224, ''),
    'flash_bwd_dq_simt_fp64_hdim128_full_bm16_bn16_tpr8': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<double, 128, cf::NoMask, 16, 16, 8>', 128, 68224, ''),
    'flash_bwd_dq_simt_fp64_hdim128_local_bm16_bn16_tpr8': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<double, 128, cf::Local, 16, 16, 8>', 128, 68224, ''),
    'flash_bwd_dq_simt_fp64_hdim16_causal_bm32_bn32_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<double, 16, cf::Causal, 32, 32, 4>', 128, 25856, ''),
    'flash_bwd_dq_simt_fp64_hdim16_full_bm32_bn32_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<double, 16, cf::NoMask, 32, 32, 4>', 128, 25856, ''),
    'flash_bwd_dq_simt_fp64_hdim16_local_bm32_bn32_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<double, 16, cf::Local, 32, 32, 4>', 128, 25856, ''),
    'flash_bwd_dq_simt_fp64_hdim256_causal_bm16_bn16_tpr16': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<double, 256, cf::Causal, 16, 16, 16>', 256, 133760, ''),
    'flash_bwd_dq_simt_fp64_hdim256_full_bm16_bn16_tpr16': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<double, 256, cf::NoMask, 16, 16, 16>', 256, 133760, ''),
    'flash_bwd_dq_simt_fp64_hdim256_local_bm16_bn16_tpr16': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<double, 256, cf::Local, 16, 16, 16>', 256, 133760, ''),
    'flash_bwd_dq_simt_fp64_hdim32_causal_bm32_bn32_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<double, 32, cf::Causal, 32, 32, 4>', 128, 42240, ''),
    'flash_bwd_dq_simt_fp64_hdim32_full_bm32_bn32_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<double, 32, cf::NoMask, 32, 32, 4>', 128, 42240, ''),
    'flash_bwd_dq_simt_fp64_hdim32_local_bm32_bn32_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<double, 32, cf::Local, 32, 32, 4>', 128, 42240, ''),
    'flash_bwd_dq_simt_fp64_hdim64_causal_bm32_bn32_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<double, 64, cf::Causal, 32, 32, 4>', 128, 75008, ''),
    'flash_bwd_dq_simt_fp64_hdim64_full_bm32_bn32_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<double, 64, cf::NoMask, 32, 32, 4>', 128, 75008, ''),
    'flash_bwd_dq_simt_fp64_hdim64_local_bm32_bn32_tpr4': ('flash_bwd_simt.cu', 'cf::flash_bwd_dq_simt<double, 64, cf::Local, 32, 32, 4>', 128, 75008, ''),
    'flash_bwd_dq_wgmma_bf16_hdim128_causal_bm128_bn64_k2': ('flash_bwd_dq_wgmma.cu', 'cf::flash_bwd_dq_wgmma<cf::bf16_t, 128, cf::Causal, 128, 64, 2>', 256, 132096, '90a'),
    'flash_bwd_dq_wgmma_bf16_hdim128_full_bm128_bn64_k2': ('flash_bwd_dq_wgmma.cu', 'cf::flash_bwd_dq_wgmma<cf::bf16_t, 128, cf::NoMask, 128, 64, 2>', 256, 132096, '90a'),
    'flash_bwd_dq_wgmma_bf16_hdim128_local_bm128_bn64_k2': ('flash_bwd_dq_wgmma.cu', 'cf::flash_bwd_dq_wgmma<cf::bf16_t, 128, cf::Local, 128, 64, 2>', 256, 132096, '90a'),
    'flash_bwd_dq_wgmma_bf16_hdim256_causal_bm128_bn32_k2': ('flash_bwd_dq_wgmma.cu', 'cf::flash_bwd_dq_wgmma<cf::bf16_t, 256, cf::Causal, 128, 32, 2>', 256, 197632, '90a'),
    'flash_bwd_dq_wgmma_bf16_hdim256_full_bm128_bn32_k2': ('flash_bwd_dq_wgmma.cu', 'cf::flash_bwd_dq_wgmma<cf::bf16_t, 256, cf::NoMask, 128, 32, 2>', 256, 197632, '90a'),
    'flash_bwd_dq_wgmma_bf16_hdim256_local_bm128_bn32_k2': ('flash_bwd_dq_wgmma.cu', 'cf::flash_bwd_dq_wgmma<cf::bf16_t, 256, cf::Local, 128, 32, 2>', 256, 197632, '90a'),
    'flash_bwd_dq_wgmma_bf16_hdim64_causal_bm128_bn128_k2': ('flash_bwd_dq_wgmma.cu', 'cf::flash_bwd_dq_wgmma<cf::bf16_t, 64, cf::Causal, 128, 128, 2>', 256, 99328, '90a'),
    'flash_bwd_dq_wgmma_bf16_hdim64_full_bm128_bn128_k2': ('flash_bwd_dq_wgmma.cu', 'cf::flash_bwd_dq_wgmma<cf::bf16_t, 64, cf::NoMask, 128, 128, 2>', 256, 99328, '90a'),
    'flash_bwd_dq_wgmma_bf16_hdim64_local_bm128_bn128_k2': ('flash_bwd_dq_wgmma.cu', 'cf::flash_bwd_dq_wgmma<cf::bf16_t, 64, cf::Local, 128, 128, 2>', 256, 99328, '90a'),
    'flash_bwd_dq_wgmma_fp16_hdim128_causal_bm128_bn64_k2': ('flash_bwd_dq_wgmma.cu', 'cf::flash_bwd_dq_wgmma<cf::half_t, 128, cf::Causal, 128, 64, 2>', 256, 132096, '90a'),
    'flash_bwd_dq_wgmma_fp16_hdim128_full_bm128_bn64_k2': ('flash_bwd_dq_wgmma.cu', 'cf::flash_bwd_dq_wgmma<cf::half_t, 128, cf::NoMask, 128, 64, 2>', 256, 132096, '90a'),
    'flash_bwd_dq_wgmma_fp16_hdim128_local_bm128_bn64_k2': ('flash_bwd_dq_wgmma.cu', 'cf::flash_bwd_dq_wgmma<cf::half_t, 128, cf::Local, 128, 64, 2>', 256, 132096, '90a'),
    'flash_bwd_dq_wgmma_fp16_hdim256_causal_bm128_bn32_k2': ('flash_bwd_dq_wgmma.cu', 'cf::flash_bwd_dq_wgmma<cf::half_t, 256, cf::Causal, 128, 32, 2>', 256, 197632, '90a'),
    'flash_bwd_dq_wgmma_fp16_hdim256_full_bm128_bn32_k2': ('flash_bwd_dq_wgmma.cu', 'cf::flash_bwd_dq_wgmma<cf::half_t, 256, cf::NoMask, 128, 32, 2>', 256, 197632, '90a'),
    'flash_bwd_dq_wgmma_fp16_hdim256_local_bm128_bn32_k2': ('flash_bwd_dq_wgmma.cu', 'cf::flash_bwd_dq_wgmma<cf::half_t, 256, cf::Local, 128, 32, 2>', 256, 197632, '90a'),
    'flash_bwd_dq_wgmma_fp16_hdim64_causal_bm128_bn128_k2': ('flash_bwd_dq_wgmma.cu', 'cf::flash_bwd_dq_wgmma<cf::half_t, 64, cf::Causal, 128, 128, 2>', 256, 99328, '90a'),
    'flash_bwd_dq_wgmma_fp16_hdim64_full_bm128_bn128_k2': ('flash_bwd_dq_wgmma.cu', 'cf::flash_bwd_dq_wgmma<cf::half_t, 64, cf::NoMask, 128, 128, 2>', 256, 99328, '90a'),
    'flash_bwd_dq_wgmma_fp16_hdim64_local_bm128_bn128_k2': ('flash_bwd_dq_wgmma.cu', 'cf::flash_bwd_dq_wgmma<cf::half_t, 64, cf::Local, 128, 128, 2>', 256, 99328, '90a'),
    'flash_bwd_fused_mma_bf16_hdim128_causal_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16': ('flash_bwd_fused_mma.cu', 'cf::flash_bwd_fused_mma<cf::bf16_t, 128, cf::Causal, 64, 128, 4, 2, 2, 2, false, false, true>', 256, 164864, ''),
    'flash_bwd_fused_mma_bf16_hdim128_full_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16': ('flash_bwd_fused_mma.cu', 'cf::flash_bwd_fused_mma<cf::bf16_t, 128, cf::NoMask, 64, 128, 4, 2, 2, 2, false, false, true>', 256, 164864, ''),
    'flash_bwd_fused_mma_bf16_hdim128_local_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16': ('flash_bwd_fused_mma.cu', 'cf::flash_bwd_fused_mma<cf::bf16_t, 128, cf::Local, 64, 128, 4, 2, 2, 2, false, false, true>', 256, 164864, ''),
    'flash_bwd_fused_mma_bf16_hdim256_causal_bm64_bn64_wn2_wd4_dqm2_u16_dqatomic': ('flash_bwd_fused_mma.cu', 'cf::flash_bwd_fused_mma<cf::bf16_t, 256, cf::Causal, 64, 64, 2, 4, 2, 16, false, false, false>', 256, 214016, ''),
    'flash_bwd_fused_mma_bf16_hdim256_full_bm64_bn64_wn2_wd4_dqm2_u16_dqatomic': ('flash_bwd_fused_mma.cu', 'cf::flash_bwd_fused_mma<cf::bf16_t, 256, cf::NoMask, 64, 64, 2, 4, 2, 16, false, false, false>', 256, 214016, ''),
    'flash_bwd_fused_mma_bf16_hdim256_local_bm64_bn64_wn2_wd4_dqm2_u16_dqatomic': ('flash_bwd_fused_mma.cu', 'cf::flash_bwd_fused_mma<cf::bf16_t, 256, cf::Local, 64, 64, 2, 4, 2, 16, false, false, false>', 256, 214016, ''),
    'flash_bwd_fused_mma_fp16_hdim128_causal_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16': ('flash_bwd_fused_mma.cu', 'cf::flash_bwd_fused_mma<cf::half_t, 128, cf::Causal, 64, 128, 4, 2, 2, 2, false, false, true>', 256, 164864, ''),
    'flash_bwd_fused_mma_fp16_hdim128_full_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16': ('flash_bwd_fused_mma.cu', 'cf::flash_bwd_fused_mma<cf::half_t, 128, cf::NoMask, 64, 128, 4, 2, 2, 2, false, false, true>', 256, 164864, ''),
    'flash_bwd_fused_mma_fp16_hdim128_local_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16': ('flash_bwd_fused_mma.cu', 'cf::flash_bwd_fused_mma<cf::half_t, 128, cf::Local, 64, 128, 4, 2, 2, 2, false, false, true>', 256, 164864, ''),
    'flash_bwd_fused_mma_fp16_hdim256_causal_bm64_bn64_wn2_wd4_dqm2_u16_dqatomic': ('flash_bwd_fused_mma.cu', 'cf::flash_bwd_fused_mma<cf::half_t, 256, cf::Causal, 64, 64, 2, 4, 2, 16, false, false, false>', 256, 214016, ''),
    'flash_bwd_fused_mma_fp16_hdim256_full_bm64_bn64_wn2_wd4_dqm2_u16_dqatomic': ('flash_bwd_fused_mma.cu', 'cf::flash_bwd_fused_mma<cf::half_t, 256, cf::NoMask, 64, 64, 2, 4, 2, 16, false, false, false>', 256, 214016, ''),
    'flash_bwd_fused_mma_fp16_hdim256_local_bm64_bn64_wn2_wd4_dqm2_u16_dqatomic': ('flash_bwd_fused_mma.cu', 'cf::flash_bwd_fused_mma<cf::half_t, 256, cf::Local, 64, 64, 2, 4, 2, 16, false, false, false>', 256, 214016, ''),
    'flash_bwd_preprocess_bf16': ('flash_bwd_simt.cu', 'cf::flash_bwd_preprocess<cf::bf16_t>', 128, 0, ''),
    'flash_bwd_preprocess_fp16': ('flash_bwd_simt.cu', 'cf::flash_bwd_preprocess<cf::half_t>', 128, 0, ''),
    'flash_bwd_preprocess_fp32': ('flash_bwd_simt.cu', 'cf::flash_bwd_preprocess<float>', 128, 0, ''),
    'flash_bwd_preprocess_fp64': ('flash_bwd_simt.cu', 'cf::flash_bwd_preprocess<double>', 128, 0, ''),
    'flash_bwd_wgmma_bf16_hdim128_causal_bm64_bn128_dqatomic': ('flash_bwd_wgmma.cu', 'cf::flash_bwd_wgmma<cf::bf16_t, 128, cf::Causal, 64, 128, cf::DqAdd::atomic>', 256, 149504, '90a'),
    'flash_bwd_wgmma_bf16_hdim128_causal_bm64_bn128_dqnone': ('flash_bwd_wgmma.cu', 'cf::flash_bwd_wgmma<cf::bf16_t, 128, cf::Causal, 64, 128, cf::DqAdd::none>', 256, 149504, '90a'),
    'flash_bwd_wgmma_bf16_hdim128_full_bm64_bn128_dqatomic': ('flash_bwd_wgmma.cu', 'cf::flash_bwd_wgmma<cf::bf16_t, 128, cf::NoMask, 64, 128, cf::DqAdd::atomic>', 256, 149504, '90a'),
    'flash_bwd_wgmma_bf16_hdim128_full_bm64_bn128_dqnone': ('flash_bwd_wgmma.cu', 'cf::flash_bwd_wgmma<cf::bf16_t, 128, cf::NoMask, 64, 128, cf::DqAdd::none>', 256, 149504, '90a'),
    'flash_bwd_wgmma_bf16_hdim128_local_bm64_bn128_dqatomic': ('flash_bwd_wgmma.cu', 'cf::flash_bwd_wgmma<cf::bf16_t, 128, cf::Local, 64, 128, cf::DqAdd::atomic>', 256, 149504, '90a'),
    'flash_bwd_wgmma_bf16_hdim128_local_bm64_bn128_dqnone': ('flash_bwd_wgmma.cu', 'cf::flash_bwd_wgmma<cf::bf16_t, 128, cf::Local, 64, 128, cf::DqAdd::none>', 256, 149504, '90a'),
    'flash_bwd_wgmma_bf16_hdim64_causal_bm128_bn128_dqatomic': ('flash_bwd_wgmma.cu', 'cf::flash_bwd_wgmma<cf::bf16_t, 64, cf::Causal, 128, 128, cf::DqAdd::atomic>', 256, 134144, '90a'),
    'flash_bwd_wgmma_bf16_hdim64_causal_bm128_bn128_dqnone': ('flash_bwd_wgmma.cu', 'cf::flash_bwd_wgmma<cf::bf16_t, 64, cf::Causal, 128, 128, cf::DqAdd::none>', 256, 134144, '90a'),
    'flash_bwd_wgmma_bf16_hdim64_full_bm128_bn128_dqatomic': ('flash_bwd_wgmma.cu', 'cf::flash_bwd_wgmma<cf::bf16_t, 64, cf::NoMask, 128, 128, cf::DqAdd::atomic>', 256, 134144, '90a'),
    'flash_bwd_wgmma_bf16_hdim64_full_bm128_bn128_dqnone': ('flash_bwd_wgmma.cu', 'cf::flash_bwd_wgmma<cf::bf16_t, 64, cf::NoMask, 128, 128, cf::DqAdd::none>', 256, 134144, '90a'),
    'flash_bwd_wgmma_bf16_hdim64_local_bm128_bn128_dqatomic': ('flash_bwd_wgmma.cu', 'cf::flash_bwd_wgmma<cf::bf16_t, 64, cf::Local, 128, 128, cf::DqAdd::atomic>', 256, 134144, '90a'),
    'flash_bwd_wgmma_bf16_hdim64_local_bm128_bn128_dqnone': ('flash_bwd_wgmma.cu', 'cf::flash_bwd_wgmma<cf::bf16_t, 64, cf::Local, 128, 128, cf::DqAdd::none>', 256, 134144, '90a'),
    'flash_bwd_wgmma_dsplit_bf16_hdim256_causal_bm64_bn64_dqnone': ('flash_bwd_wgmma_dsplit.cu', 'cf::flash_bwd_wgmma_dsplit<cf::bf16_t, 256, cf::Causal, 64, 64, cf::DqAdd::none>', 256, 215040, '90a'),
    'flash_bwd_wgmma_dsplit_bf16_hdim256_full_bm64_bn64_dqnone': ('flash_bwd_wgmma_dsplit.cu', 'cf::flash_bwd_wgmma_dsplit<cf::bf16_t, 256, cf::NoMask, 64, 64, cf::DqAdd::none>', 256, 215040, '90a'),
    'flash_bwd_wgmma_dsplit_bf16_hdim256_local_bm64_bn64_dqnone': ('flash_bwd_wgmma_dsplit.cu', 'cf::flash_bwd_wgmma_dsplit<cf::bf16_t, 256, cf::Local, 64, 64, cf::DqAdd::none>', 256, 215040, '90a'),
    'flash_bwd_wgmma_dsplit_fp16_hdim256_causal_bm64_bn64_dqnone': ('flash_bwd_wgmma_dsplit.cu', 'cf::flash_bwd_wgmma_dsplit<cf::half_t, 256, cf::Causal, 64, 64, cf::DqAdd::none>', 256, 215040, '90a'),
    'flash_bwd_wgmma_dsplit_fp16_hdim256_full_bm64_bn64_dqnone': ('flash_bwd_wgmma_dsplit.cu', 'cf::flash_bwd_wgmma_dsplit<cf::half_t, 256, cf::NoMask, 64, 64, cf::DqAdd::none>', 256, 215040, '90a'),
    'flash_bwd_wgmma_dsplit_fp16_hdim256_local_bm64_bn64_dqnone': ('flash_bwd_wgmma_dsplit.cu', 'cf::flash_bwd_wgmma_dsplit<cf::half_t, 256, cf::Local, 64, 64, cf::DqAdd::none>', 256, 215040, '90a'),
    'flash_bwd_wgmma_fp16_hdim128_causal_bm64_bn128_dqatomic': ('flash_bwd_wgmma.cu', 'cf::flash_bwd_wgmma<cf::half_t, 128, cf::Causal, 64, 128, cf::DqAdd::atomic>', 256, 149504, '90a'),
    'flash_bwd_wgmma_fp16_hdim128_causal_bm64_bn128_dqnone': ('flash_bwd_wgmma.cu', 'cf::flash_bwd_wgmma<cf::half_t, 128, cf::Causal, 64, 128, cf::DqAdd::none>', 256, 149504, '90a'),
    'flash_bwd_wgmma_fp16_hdim128_full_bm64_bn128_dqatomic': ('flash_bwd_wgmma.cu', 'cf::flash_bwd_wgmma<cf::half_t, 128, cf::NoMask, 64, 128, cf::DqAdd::atomic>', 256, 149504, '90a'),
    'flash_bwd_wgmma_fp16_hdim128_full_bm64_bn128_dqnone': ('flash_bwd_wgmma.cu', 'cf::flash_bwd_wgmma<cf::half_t, 128, cf::NoMask, 64, 128, cf::DqAdd::none>', 256, 149504, '90a'),
    'flash_bwd_wgmma_fp16_hdim128_local_bm64_bn128_dqatomic': ('flash_bwd_wgmma.cu', 'cf::flash_bwd_wgmma<cf::half_t, 128, cf::Local, 64, 128, cf::DqAdd::atomic>', 256, 149504, '90a'),
    'flash_bwd_wgmma_fp16_hdim128_local_bm64_bn128_dqnone': ('flash_bwd_wgmma.cu', 'cf::flash_bwd_wgmma<cf::half_t, 128, cf::Local, 64, 128, cf::DqAdd::none>', 256, 149504, '90a'),
    'flash_bwd_wgmma_fp16_hdim64_causal_bm128_bn128_dqatomic': ('flash_bwd_wgmma.cu', 'cf::flash_bwd_wgmma<cf::half_t, 64, cf::Causal, 128, 128, cf::DqAdd::atomic>', 256, 134144, '90a'),
    'flash_bwd_wgmma_fp16_hdim64_causal_bm128_bn128_dqnone': ('flash_bwd_wgmma.cu', 'cf::flash_bwd_wgmma<cf::half_t, 64, cf::Causal, 128, 128, cf::DqAdd::none>', 256, 134144, '90a'),
    'flash_bwd_wgmma_fp16_hdim64_full_bm128_bn128_dqatomic': ('flash_bwd_wgmma.cu', 'cf::flash_bwd_wgmma<cf::half_t, 64, cf::NoMask, 128, 128, cf::DqAdd::atomic>', 256, 134144, '90a'),
    'flash_bwd_wgmma_fp16_hdim64_full_bm128_bn128_dqnone': ('flash_bwd_wgmma.cu', 'cf::flash_bwd_wgmma<cf::half_t, 64, cf::NoMask, 128, 128, cf::DqAdd::none>', 256, 134144, '90a'),
    'flash_bwd_wgmma_fp16_hdim64_local_bm128_bn128_dqatomic': ('flash_bwd_wgmma.cu', 'cf::flash_bwd_wgmma<cf::half_t, 64, cf::Local, 128, 128, cf::DqAdd::atomic>', 256, 134144, '90a'),
    'flash_bwd_wgmma_fp16_hdim64_local_bm128_bn128_dqnone': ('flash_bwd_wgmma.cu', 'cf::flash_bwd_wgmma<cf::half_t, 64, cf::Local, 128, 128, cf::DqAdd::none>', 256, 134144, '90a'),
}

OLD_CHOICES = (
    ('float16', 'full', True, (('80', 166912), ('80', 232448), ('80', 101376), ('86', 166912), ('86', 232448), ('86', 101376), ('89', 166912), ('89', 232448), ('89', 101376)), (
        (64, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_v2_fp16_hdim64_full_bm64_ms32_bn128_w4_rg2', 'flash_bwd_dq_mma_v2_fp16_hdim64_full_bm128_bn32_w4_rg2')),
        (128, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_split_fp16_hdim128_full_bm64_ms32_bn128_w8_rg2', 'flash_bwd_dq_mma_v2_fp16_hdim128_full_bm128_bn32_w4_rg2')),
        (256, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_split_fp16_hdim256_full_bm32_ms32_bn64_w8_rg1', 'flash_bwd_dq_mma_fp16_hdim256_full_bm64_bn32_w4')),
    )),
    ('float16', 'full', True, (('90', 166912), ('90', 232448), ('90', 101376)), (
        (64, ('flash_bwd_preprocess_fp16', 'flash_bwd_wgmma_fp16_hdim64_full_bm128_bn128_dqnone', 'flash_bwd_dq_wgmma_fp16_hdim64_full_bm128_bn128_k2')),
        (128, ('flash_bwd_preprocess_fp16', 'flash_bwd_wgmma_fp16_hdim128_full_bm64_bn128_dqnone', 'flash_bwd_dq_wgmma_fp16_hdim128_full_bm128_bn64_k2')),
        (256, ('flash_bwd_preprocess_fp16', 'flash_bwd_wgmma_dsplit_fp16_hdim256_full_bm64_bn64_dqnone', 'flash_bwd_dq_wgmma_fp16_hdim256_full_bm128_bn32_k2')),
    )),
    ('float16', 'full', False, (('80', 166912), ('86', 166912), ('89', 166912)), (
        (64, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_v2_fp16_hdim64_full_bm64_ms32_bn128_w4_rg2_dqatomic', 'flash_bwd_dq_convert_fp16')),
        (128, ('flash_bwd_preprocess_fp16', 'flash_bwd_fused_mma_fp16_hdim128_full_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16', 'flash_bwd_dq_convert_fp16')),
        (256, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_fp16_hdim256_full_bm32_ms16_bn64_w8_wd2_dqatomic', 'flash_bwd_dq_convert_fp16')),
    )),
    ('float16', 'full', False, (('80', 232448), ('86', 232448), ('89', 232448)), (
        (64, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_v2_fp16_hdim64_full_bm64_ms32_bn128_w4_rg2_dqatomic', 'flash_bwd_dq_convert_fp16')),
        (128, ('flash_bwd_preprocess_fp16', 'flash_bwd_fused_mma_fp16_hdim128_full_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16', 'flash_bwd_dq_convert_fp16')),
        (256, ('flash_bwd_preprocess_fp16', 'flash_bwd_fused_mma_fp16_hdim256_full_bm64_bn64_wn2_wd4_dqm2_u16_dqatomic', 'flash_bwd_dq_convert_fp16')),
    )),
    ('float16', 'full', False, (('80', 101376), ('86', 101376), ('89', 101376)), (
        (64, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_v2_fp16_hdim64_full_bm64_ms32_bn128_w4_rg2_dqatomic', 'flash_bwd_dq_convert_fp16')),
        (128, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_fp16_hdim128_full_bm64_ms32_bn128_w8_wd1_dqatomic', 'flash_bwd_dq_convert_fp16')),
        (256, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_fp16_hdim256_full_bm32_ms16_bn64_w8_wd2_dqatomic', 'flash_bwd_dq_convert_fp16')),
    )),
    ('float16', 'full', False, (('90', 166912), ('90', 232448), ('90', 101376)), (
        (64, ('flash_bwd_preprocess_fp16', 'flash_bwd_wgmma_fp16_hdim64_full_bm128_bn128_dqatomic', 'flash_bwd_dq_convert_fp16')),
        (128, ('flash_bwd_preprocess_fp16', 'flash_bwd_wgmma_fp16_hdim128_full_bm64_bn128_dqatomic', 'flash_bwd_dq_convert_fp16')),
        (256, ('flash_bwd_preprocess_fp16', 'flash_bwd_wgmma_dsplit_fp16_hdim256_full_bm64_bn64_dqnone', 'flash_bwd_dq_wgmma_fp16_hdim256_full_bm128_bn32_k2')),
    )),
    ('float16', 'causal', True, (('80', 166912), ('80', 232448), ('80', 101376), ('86', 166912), ('86', 232448), ('86', 101376), ('89', 166912), ('89', 232448), ('89', 101376)), (
        (64, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_v2_fp16_hdim64_causal_bm64_ms32_bn128_w4_rg2', 'flash_bwd_dq_mma_v2_fp16_hdim64_causal_bm128_bn32_w4_rg2')),
        (128, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_split_fp16_hdim128_causal_bm64_ms32_bn128_w8_rg2', 'flash_bwd_dq_mma_v2_fp16_hdim128_causal_bm128_bn32_w4_rg2')),
        (256, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_split_fp16_hdim256_causal_bm32_ms32_bn64_w8_rg1', 'flash_bwd_dq_mma_fp16_hdim256_causal_bm64_bn32_w4')),
    )),
    ('float16', 'causal', True, (('90', 166912), ('90', 232448), ('90', 101376)), (
        (64, ('flash_bwd_preprocess_fp16', 'flash_bwd_wgmma_fp16_hdim64_causal_bm128_bn128_dqnone', 'flash_bwd_dq_wgmma_fp16_hdim64_causal_bm128_bn128_k2')),
        (128, ('flash_bwd_preprocess_fp16', 'flash_bwd_wgmma_fp16_hdim128_causal_bm64_bn128_dqnone', 'flash_bwd_dq_wgmma_fp16_hdim128_causal_bm128_bn64_k2')),
        (256, ('flash_bwd_preprocess_fp16', 'flash_bwd_wgmma_dsplit_fp16_hdim256_causal_bm64_bn64_dqnone', 'flash_bwd_dq_wgmma_fp16_hdim256_causal_bm128_bn32_k2')),
    )),
    ('float16', 'causal', False, (('80', 166912), ('86', 166912), ('89', 166912)), (
        (64, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_v2_fp16_hdim64_causal_bm64_ms32_bn128_w4_rg2_dqatomic', 'flash_bwd_dq_convert_fp16')),
        (128, ('flash_bwd_preprocess_fp16', 'flash_bwd_fused_mma_fp16_hdim128_causal_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16', 'flash_bwd_dq_convert_fp16')),
        (256, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_fp16_hdim256_causal_bm32_ms16_bn64_w8_wd2_dqatomic', 'flash_bwd_dq_convert_fp16')),
    )),
    ('float16', 'causal', False, (('80', 232448), ('86', 232448), ('89', 232448)), (
        (64, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_v2_fp16_hdim64_causal_bm64_ms32_bn128_w4_rg2_dqatomic', 'flash_bwd_dq_convert_fp16')),
        (128, ('flash_bwd_preprocess_fp16', 'flash_bwd_fused_mma_fp16_hdim128_causal_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16', 'flash_bwd_dq_convert_fp16')),
        (256, ('flash_bwd_preprocess_fp16', 'flash_bwd_fused_mma_fp16_hdim256_causal_bm64_bn64_wn2_wd4_dqm2_u16_dqatomic', 'flash_bwd_dq_convert_fp16')),
    )),
    ('float16', 'causal', False, (('80', 101376), ('86', 101376), ('89', 101376)), (
        (64, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_v2_fp16_hdim64_causal_bm64_ms32_bn128_w4_rg2_dqatomic', 'flash_bwd_dq_convert_fp16')),
        (128, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_fp16_hdim128_causal_bm64_ms32_bn128_w8_wd1_dqatomic', 'flash_bwd_dq_convert_fp16')),
        (256, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_fp16_hdim256_causal_bm32_ms16_bn64_w8_wd2_dqatomic', 'flash_bwd_dq_convert_fp16')),
    )),
    ('float16', 'causal', False, (('90', 166912), ('90', 232448), ('90', 101376)), (
        (64, ('flash_bwd_preprocess_fp16', 'flash_bwd_wgmma_fp16_hdim64_causal_bm128_bn128_dqatomic', 'flash_bwd_dq_convert_fp16')),
        (128, ('flash_bwd_preprocess_fp16', 'flash_bwd_wgmma_fp16_hdim128_causal_bm64_bn128_dqatomic', 'flash_bwd_dq_convert_fp16')),
        (256, ('flash_bwd_preprocess_fp16', 'flash_bwd_wgmma_dsplit_fp16_hdim256_causal_bm64_bn64_dqnone', 'flash_bwd_dq_wgmma_fp16_hdim256_causal_bm128_bn32_k2')),
    )),
    ('float16', 'local', True, (('80', 166912), ('80', 232448), ('80', 101376), ('86', 166912), ('86', 232448), ('86', 101376), ('89', 166912), ('89', 232448), ('89', 101376)), (
        (64, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_v2_fp16_hdim64_local_bm64_ms32_bn128_w4_rg2', 'flash_bwd_dq_mma_v2_fp16_hdim64_local_bm128_bn32_w4_rg2')),
        (128, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_split_fp16_hdim128_local_bm64_ms32_bn128_w8_rg2', 'flash_bwd_dq_mma_v2_fp16_hdim128_local_bm128_bn32_w4_rg2')),
        (256, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_split_fp16_hdim256_local_bm32_ms32_bn64_w8_rg1', 'flash_bwd_dq_mma_fp16_hdim256_local_bm64_bn32_w4')),
    )),
    ('float16', 'local', True, (('90', 166912), ('90', 232448), ('90', 101376)), (
        (64, ('flash_bwd_preprocess_fp16', 'flash_bwd_wgmma_fp16_hdim64_local_bm128_bn128_dqnone', 'flash_bwd_dq_wgmma_fp16_hdim64_local_bm128_bn128_k2')),
        (128, ('flash_bwd_preprocess_fp16', 'flash_bwd_wgmma_fp16_hdim128_local_bm64_bn128_dqnone', 'flash_bwd_dq_wgmma_fp16_hdim128_local_bm128_bn64_k2')),
        (256, ('flash_bwd_preprocess_fp16', 'flash_bwd_wgmma_dsplit_fp16_hdim256_local_bm64_bn64_dqnone', 'flash_bwd_dq_wgmma_fp16_hdim256_local_bm128_bn32_k2')),
    )),
    ('float16', 'local', False, (('80', 166912), ('86', 166912), ('89', 166912)), (
        (64, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_fp16_hdim64_local_bm64_ms64_bn128_w8_wd1_dqatomic', 'flash_bwd_dq_convert_fp16')),
        (128, ('flash_bwd_preprocess_fp16', 'flash_bwd_fused_mma_fp16_hdim128_local_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16', 'flash_bwd_dq_convert_fp16')),
        (256, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_fp16_hdim256_local_bm32_ms16_bn64_w8_wd2_dqatomic', 'flash_bwd_dq_convert_fp16')),
    )),
    ('float16', 'local', False, (('80', 232448), ('86', 232448), ('89', 232448)), (
        (64, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_fp16_hdim64_local_bm64_ms64_bn128_w8_wd1_dqatomic', 'flash_bwd_dq_convert_fp16')),
        (128, ('flash_bwd_preprocess_fp16', 'flash_bwd_fused_mma_fp16_hdim128_local_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16', 'flash_bwd_dq_convert_fp16')),
        (256, ('flash_bwd_preprocess_fp16', 'flash_bwd_fused_mma_fp16_hdim256_local_bm64_bn64_wn2_wd4_dqm2_u16_dqatomic', 'flash_bwd_dq_convert_fp16')),
    )),
    ('float16', 'local', False, (('80', 101376), ('86', 101376), ('89', 101376)), (
        (64, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_fp16_hdim64_local_bm64_ms64_bn128_w8_wd1_dqatomic', 'flash_bwd_dq_convert_fp16')),
        (128, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_fp16_hdim128_local_bm64_ms32_bn128_w8_wd1_dqatomic', 'flash_bwd_dq_convert_fp16')),
        (256, ('flash_bwd_preprocess_fp16', 'flash_bwd_dkdv_mma_fp16_hdim256_local_bm32_ms16_bn64_w8_wd2_dqatomic', 'flash_bwd_dq_convert_fp16')),
    )),
    ('float16', 'local', False, (('90', 166912), ('90', 232448), ('90', 101376)), (
        (64, ('flash_bwd_preprocess_fp16', 'flash_bwd_wgmma_fp16_hdim64_local_bm128_bn128_dqatomic', 'flash_bwd_dq_convert_fp16')),
        (128, ('flash_bwd_preprocess_fp16', 'flash_bwd_wgmma_fp16_hdim128_local_bm64_bn128_dqatomic', 'flash_bwd_dq_convert_fp16')),
        (256, ('flash_bwd_preprocess_fp16', 'flash_bwd_wgmma_dsplit_fp16_hdim256_local_bm64_bn64_dqnone', 'flash_bwd_dq_wgmma_fp16_hdim256_local_bm128_bn32_k2')),
    )),
    ('bfloat16', 'full', True, (('80', 166912), ('80', 232448), ('80', 101376), ('86', 166912), ('86', 232448), ('86', 101376), ('89', 166912), ('89', 232448), ('89', 101376)), (
        (64, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_v2_bf16_hdim64_full_bm64_ms32_bn128_w4_rg2', 'flash_bwd_dq_mma_v2_bf16_hdim64_full_bm128_bn32_w4_rg2')),
        (128, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_split_bf16_hdim128_full_bm64_ms32_bn128_w8_rg2', 'flash_bwd_dq_mma_v2_bf16_hdim128_full_bm128_bn32_w4_rg2')),
        (256, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_split_bf16_hdim256_full_bm32_ms32_bn64_w8_rg1', 'flash_bwd_dq_mma_bf16_hdim256_full_bm64_bn32_w4')),
    )),
    ('bfloat16', 'full', True, (('90', 166912), ('90', 232448), ('90', 101376)), (
        (64, ('flash_bwd_preprocess_bf16', 'flash_bwd_wgmma_bf16_hdim64_full_bm128_bn128_dqnone', 'flash_bwd_dq_wgmma_bf16_hdim64_full_bm128_bn128_k2')),
        (128, ('flash_bwd_preprocess_bf16', 'flash_bwd_wgmma_bf16_hdim128_full_bm64_bn128_dqnone', 'flash_bwd_dq_wgmma_bf16_hdim128_full_bm128_bn64_k2')),
        (256, ('flash_bwd_preprocess_bf16', 'flash_bwd_wgmma_dsplit_bf16_hdim256_full_bm64_bn64_dqnone', 'flash_bwd_dq_wgmma_bf16_hdim256_full_bm128_bn32_k2')),
    )),
    ('bfloat16', 'full', False, (('80', 166912), ('86', 166912), ('89', 166912)), (
        (64, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_v2_bf16_hdim64_full_bm64_ms32_bn128_w4_rg2_dqatomic', 'flash_bwd_dq_convert_bf16')),
        (128, ('flash_bwd_preprocess_bf16', 'flash_bwd_fused_mma_bf16_hdim128_full_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16', 'flash_bwd_dq_convert_bf16')),
        (256, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_bf16_hdim256_full_bm32_ms16_bn64_w8_wd2_dqatomic', 'flash_bwd_dq_convert_bf16')),
    )),
    ('bfloat16', 'full', False, (('80', 232448), ('86', 232448), ('89', 232448)), (
        (64, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_v2_bf16_hdim64_full_bm64_ms32_bn128_w4_rg2_dqatomic', 'flash_bwd_dq_convert_bf16')),
        (128, ('flash_bwd_preprocess_bf16', 'flash_bwd_fused_mma_bf16_hdim128_full_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16', 'flash_bwd_dq_convert_bf16')),
        (256, ('flash_bwd_preprocess_bf16', 'flash_bwd_fused_mma_bf16_hdim256_full_bm64_bn64_wn2_wd4_dqm2_u16_dqatomic', 'flash_bwd_dq_convert_bf16')),
    )),
    ('bfloat16', 'full', False, (('80', 101376), ('86', 101376), ('89', 101376)), (
        (64, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_v2_bf16_hdim64_full_bm64_ms32_bn128_w4_rg2_dqatomic', 'flash_bwd_dq_convert_bf16')),
        (128, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_bf16_hdim128_full_bm64_ms32_bn128_w8_wd1_dqatomic', 'flash_bwd_dq_convert_bf16')),
        (256, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_bf16_hdim256_full_bm32_ms16_bn64_w8_wd2_dqatomic', 'flash_bwd_dq_convert_bf16')),
    )),
    ('bfloat16', 'full', False, (('90', 166912), ('90', 232448), ('90', 101376)), (
        (64, ('flash_bwd_preprocess_bf16', 'flash_bwd_wgmma_bf16_hdim64_full_bm128_bn128_dqatomic', 'flash_bwd_dq_convert_bf16')),
        (128, ('flash_bwd_preprocess_bf16', 'flash_bwd_wgmma_bf16_hdim128_full_bm64_bn128_dqatomic', 'flash_bwd_dq_convert_bf16')),
        (256, ('flash_bwd_preprocess_bf16', 'flash_bwd_wgmma_dsplit_bf16_hdim256_full_bm64_bn64_dqnone', 'flash_bwd_dq_wgmma_bf16_hdim256_full_bm128_bn32_k2')),
    )),
    ('bfloat16', 'causal', True, (('80', 166912), ('80', 232448), ('80', 101376), ('86', 166912), ('86', 232448), ('86', 101376), ('89', 166912), ('89', 232448), ('89', 101376)), (
        (64, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_v2_bf16_hdim64_causal_bm64_ms32_bn128_w4_rg2', 'flash_bwd_dq_mma_v2_bf16_hdim64_causal_bm128_bn32_w4_rg2')),
        (128, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_split_bf16_hdim128_causal_bm64_ms32_bn128_w8_rg2', 'flash_bwd_dq_mma_v2_bf16_hdim128_causal_bm128_bn32_w4_rg2')),
        (256, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_split_bf16_hdim256_causal_bm32_ms32_bn64_w8_rg1', 'flash_bwd_dq_mma_bf16_hdim256_causal_bm64_bn32_w4')),
    )),
    ('bfloat16', 'causal', True, (('90', 166912), ('90', 232448), ('90', 101376)), (
        (64, ('flash_bwd_preprocess_bf16', 'flash_bwd_wgmma_bf16_hdim64_causal_bm128_bn128_dqnone', 'flash_bwd_dq_wgmma_bf16_hdim64_causal_bm128_bn128_k2')),
        (128, ('flash_bwd_preprocess_bf16', 'flash_bwd_wgmma_bf16_hdim128_causal_bm64_bn128_dqnone', 'flash_bwd_dq_wgmma_bf16_hdim128_causal_bm128_bn64_k2')),
        (256, ('flash_bwd_preprocess_bf16', 'flash_bwd_wgmma_dsplit_bf16_hdim256_causal_bm64_bn64_dqnone', 'flash_bwd_dq_wgmma_bf16_hdim256_causal_bm128_bn32_k2')),
    )),
    ('bfloat16', 'causal', False, (('80', 166912), ('86', 166912), ('89', 166912)), (
        (64, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_v2_bf16_hdim64_causal_bm64_ms32_bn128_w4_rg2_dqatomic', 'flash_bwd_dq_convert_bf16')),
        (128, ('flash_bwd_preprocess_bf16', 'flash_bwd_fused_mma_bf16_hdim128_causal_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16', 'flash_bwd_dq_convert_bf16')),
        (256, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_bf16_hdim256_causal_bm32_ms16_bn64_w8_wd2_dqatomic', 'flash_bwd_dq_convert_bf16')),
    )),
    ('bfloat16', 'causal', False, (('80', 232448), ('86', 232448), ('89', 232448)), (
        (64, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_v2_bf16_hdim64_causal_bm64_ms32_bn128_w4_rg2_dqatomic', 'flash_bwd_dq_convert_bf16')),
        (128, ('flash_bwd_preprocess_bf16', 'flash_bwd_fused_mma_bf16_hdim128_causal_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16', 'flash_bwd_dq_convert_bf16')),
        (256, ('flash_bwd_preprocess_bf16', 'flash_bwd_fused_mma_bf16_hdim256_causal_bm64_bn64_wn2_wd4_dqm2_u16_dqatomic', 'flash_bwd_dq_convert_bf16')),
    )),
    ('bfloat16', 'causal', False, (('80', 101376), ('86', 101376), ('89', 101376)), (
        (64, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_v2_bf16_hdim64_causal_bm64_ms32_bn128_w4_rg2_dqatomic', 'flash_bwd_dq_convert_bf16')),
        (128, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_bf16_hdim128_causal_bm64_ms32_bn128_w8_wd1_dqatomic', 'flash_bwd_dq_convert_bf16')),
        (256, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_bf16_hdim256_causal_bm32_ms16_bn64_w8_wd2_dqatomic', 'flash_bwd_dq_convert_bf16')),
    )),
    ('bfloat16', 'causal', False, (('90', 166912), ('90', 232448), ('90', 101376)), (
        (64, ('flash_bwd_preprocess_bf16', 'flash_bwd_wgmma_bf16_hdim64_causal_bm128_bn128_dqatomic', 'flash_bwd_dq_convert_bf16')),
        (128, ('flash_bwd_preprocess_bf16', 'flash_bwd_wgmma_bf16_hdim128_causal_bm64_bn128_dqatomic', 'flash_bwd_dq_convert_bf16')),
        (256, ('flash_bwd_preprocess_bf16', 'flash_bwd_wgmma_dsplit_bf16_hdim256_causal_bm64_bn64_dqnone', 'flash_bwd_dq_wgmma_bf16_hdim256_causal_bm128_bn32_k2')),
    )),
    ('bfloat16', 'local', True, (('80', 166912), ('80', 232448), ('80', 101376), ('86', 166912), ('86', 232448), ('86', 101376), ('89', 166912), ('89', 232448), ('89', 101376)), (
        (64, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_v2_bf16_hdim64_local_bm64_ms32_bn128_w4_rg2', 'flash_bwd_dq_mma_v2_bf16_hdim64_local_bm128_bn32_w4_rg2')),
        (128, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_split_bf16_hdim128_local_bm64_ms32_bn128_w8_rg2', 'flash_bwd_dq_mma_v2_bf16_hdim128_local_bm128_bn32_w4_rg2')),
        (256, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_split_bf16_hdim256_local_bm32_ms32_bn64_w8_rg1', 'flash_bwd_dq_mma_bf16_hdim256_local_bm64_bn32_w4')),
    )),
    ('bfloat16', 'local', True, (('90', 166912), ('90', 232448), ('90', 101376)), (
        (64, ('flash_bwd_preprocess_bf16', 'flash_bwd_wgmma_bf16_hdim64_local_bm128_bn128_dqnone', 'flash_bwd_dq_wgmma_bf16_hdim64_local_bm128_bn128_k2')),
        (128, ('flash_bwd_preprocess_bf16', 'flash_bwd_wgmma_bf16_hdim128_local_bm64_bn128_dqnone', 'flash_bwd_dq_wgmma_bf16_hdim128_local_bm128_bn64_k2')),
        (256, ('flash_bwd_preprocess_bf16', 'flash_bwd_wgmma_dsplit_bf16_hdim256_local_bm64_bn64_dqnone', 'flash_bwd_dq_wgmma_bf16_hdim256_local_bm128_bn32_k2')),
    )),
    ('bfloat16', 'local', False, (('80', 166912), ('86', 166912), ('89', 166912)), (
        (64, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_bf16_hdim64_local_bm64_ms64_bn128_w8_wd1_dqatomic', 'flash_bwd_dq_convert_bf16')),
        (128, ('flash_bwd_preprocess_bf16', 'flash_bwd_fused_mma_bf16_hdim128_local_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16', 'flash_bwd_dq_convert_bf16')),
        (256, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_bf16_hdim256_local_bm32_ms16_bn64_w8_wd2_dqatomic', 'flash_bwd_dq_convert_bf16')),
    )),
    ('bfloat16', 'local', False, (('80', 232448), ('86', 232448), ('89', 232448)), (
        (64, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_bf16_hdim64_local_bm64_ms64_bn128_w8_wd1_dqatomic', 'flash_bwd_dq_convert_bf16')),
        (128, ('flash_bwd_preprocess_bf16', 'flash_bwd_fused_mma_bf16_hdim128_local_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16', 'flash_bwd_dq_convert_bf16')),
        (256, ('flash_bwd_preprocess_bf16', 'flash_bwd_fused_mma_bf16_hdim256_local_bm64_bn64_wn2_wd4_dqm2_u16_dqatomic', 'flash_bwd_dq_convert_bf16')),
    )),
    ('bfloat16', 'local', False, (('80', 101376), ('86', 101376), ('89', 101376)), (
        (64, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_bf16_hdim64_local_bm64_ms64_bn128_w8_wd1_dqatomic', 'flash_bwd_dq_convert_bf16')),
        (128, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_bf16_hdim128_local_bm64_ms32_bn128_w8_wd1_dqatomic', 'flash_bwd_dq_convert_bf16')),
        (256, ('flash_bwd_preprocess_bf16', 'flash_bwd_dkdv_mma_bf16_hdim256_local_bm32_ms16_bn64_w8_wd2_dqatomic', 'flash_bwd_dq_convert_bf16')),
    )),
    ('bfloat16', 'local', False, (('90', 166912), ('90', 232448), ('90', 101376)), (
        (64, ('flash_bwd_preprocess_bf16', 'flash_bwd_wgmma_bf16_hdim64_local_bm128_bn128_dqatomic', 'flash_bwd_dq_convert_bf16')),
        (128, ('flash_bwd_preprocess_bf16', 'flash_bwd_wgmma_bf16_hdim128_local_bm64_bn128_dqatomic', 'flash_bwd_dq_convert_bf16')),
        (256, ('flash_bwd_preprocess_bf16', 'flash_bwd_wgmma_dsplit_bf16_hdim256_local_bm64_bn64_dqnone', 'flash_bwd_dq_wgmma_bf16_hdim256_local_bm128_bn32_k2')),
    )),
    ('float32', 'full', True, (('80', 166912), ('80', 232448), ('80', 101376), ('86', 166912), ('86', 232448), ('86', 101376), ('89', 166912), ('89', 232448), ('89', 101376), ('90', 166912), ('90', 232448), ('90', 101376)), (
        (16, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim16_full_bm64_bn64_tpr4', 'flash_bwd_dq_simt_fp32_hdim16_full_bm64_bn64_tpr4')),
        (32, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim32_full_bm64_bn64_tpr4', 'flash_bwd_dq_simt_fp32_hdim32_full_bm64_bn64_tpr4')),
        (64, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim64_full_bm64_bn64_tpr4', 'flash_bwd_dq_simt_fp32_hdim64_full_bm64_bn64_tpr4')),
        (128, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim128_full_bm32_bn32_tpr8', 'flash_bwd_dq_simt_fp32_hdim128_full_bm32_bn32_tpr8')),
        (256, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim256_full_bm32_bn32_tpr8', 'flash_bwd_dq_simt_fp32_hdim256_full_bm32_bn32_tpr8')),
    )),
    ('float32', 'full', False, (('80', 166912), ('80', 232448), ('80', 101376), ('86', 166912), ('86', 232448), ('86', 101376), ('89', 166912), ('89', 232448), ('89', 101376), ('90', 166912), ('90', 232448), ('90', 101376)), (
        (16, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim16_full_bm64_bn64_tpr4', 'flash_bwd_dq_simt_fp32_hdim16_full_bm64_bn64_tpr4')),
        (32, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim32_full_bm64_bn64_tpr4', 'flash_bwd_dq_simt_fp32_hdim32_full_bm64_bn64_tpr4')),
        (64, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim64_full_bm64_bn64_tpr4', 'flash_bwd_dq_simt_fp32_hdim64_full_bm64_bn64_tpr4')),
        (128, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim128_full_bm32_bn32_tpr8', 'flash_bwd_dq_simt_fp32_hdim128_full_bm32_bn32_tpr8')),
        (256, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim256_full_bm32_bn32_tpr8', 'flash_bwd_dq_simt_fp32_hdim256_full_bm32_bn32_tpr8')),
    )),
    ('float32', 'causal', True, (('80', 166912), ('80', 232448), ('80', 101376), ('86', 166912), ('86', 232448), ('86', 101376), ('89', 166912), ('89', 232448), ('89', 101376), ('90', 166912), ('90', 232448), ('90', 101376)), (
        (16, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim16_causal_bm64_bn64_tpr4', 'flash_bwd_dq_simt_fp32_hdim16_causal_bm64_bn64_tpr4')),
        (32, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim32_causal_bm64_bn64_tpr4', 'flash_bwd_dq_simt_fp32_hdim32_causal_bm64_bn64_tpr4')),
        (64, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim64_causal_bm64_bn64_tpr4', 'flash_bwd_dq_simt_fp32_hdim64_causal_bm64_bn64_tpr4')),
        (128, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim128_causal_bm32_bn32_tpr8', 'flash_bwd_dq_simt_fp32_hdim128_causal_bm32_bn32_tpr8')),
        (256, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim256_causal_bm32_bn32_tpr8', 'flash_bwd_dq_simt_fp32_hdim256_causal_bm32_bn32_tpr8')),
    )),
    ('float32', 'causal', False, (('80', 166912), ('80', 232448), ('80', 101376), ('86', 166912), ('86', 232448), ('86', 101376), ('89', 166912), ('89', 232448), ('89', 101376), ('90', 166912), ('90', 232448), ('90', 101376)), (
        (16, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim16_causal_bm64_bn64_tpr4', 'flash_bwd_dq_simt_fp32_hdim16_causal_bm64_bn64_tpr4')),
        (32, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim32_causal_bm64_bn64_tpr4', 'flash_bwd_dq_simt_fp32_hdim32_causal_bm64_bn64_tpr4')),
        (64, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim64_causal_bm64_bn64_tpr4', 'flash_bwd_dq_simt_fp32_hdim64_causal_bm64_bn64_tpr4')),
        (128, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim128_causal_bm32_bn32_tpr8', 'flash_bwd_dq_simt_fp32_hdim128_causal_bm32_bn32_tpr8')),
        (256, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim256_causal_bm32_bn32_tpr8', 'flash_bwd_dq_simt_fp32_hdim256_causal_bm32_bn32_tpr8')),
    )),
    ('float32', 'local', True, (('80', 166912), ('80', 232448), ('80', 101376), ('86', 166912), ('86', 232448), ('86', 101376), ('89', 166912), ('89', 232448), ('89', 101376), ('90', 166912), ('90', 232448), ('90', 101376)), (
        (16, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim16_local_bm64_bn64_tpr4', 'flash_bwd_dq_simt_fp32_hdim16_local_bm64_bn64_tpr4')),
        (32, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim32_local_bm64_bn64_tpr4', 'flash_bwd_dq_simt_fp32_hdim32_local_bm64_bn64_tpr4')),
        (64, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim64_local_bm64_bn64_tpr4', 'flash_bwd_dq_simt_fp32_hdim64_local_bm64_bn64_tpr4')),
        (128, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim128_local_bm32_bn32_tpr8', 'flash_bwd_dq_simt_fp32_hdim128_local_bm32_bn32_tpr8')),
        (256, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim256_local_bm32_bn32_tpr8', 'flash_bwd_dq_simt_fp32_hdim256_local_bm32_bn32_tpr8')),
    )),
    ('float32', 'local', False, (('80', 166912), ('80', 232448), ('80', 101376), ('86', 166912), ('86', 232448), ('86', 101376), ('89', 166912), ('89', 232448), ('89', 101376), ('90', 166912), ('90', 232448), ('90', 101376)), (
        (16, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim16_local_bm64_bn64_tpr4', 'flash_bwd_dq_simt_fp32_hdim16_local_bm64_bn64_tpr4')),
        (32, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim32_local_bm64_bn64_tpr4', 'flash_bwd_dq_simt_fp32_hdim32_local_bm64_bn64_tpr4')),
        (64, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim64_local_bm64_bn64_tpr4', 'flash_bwd_dq_simt_fp32_hdim64_local_bm64_bn64_tpr4')),
        (128, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim128_local_bm32_bn32_tpr8', 'flash_bwd_dq_simt_fp32_hdim128_local_bm32_bn32_tpr8')),
        (256, ('flash_bwd_preprocess_fp32', 'flash_bwd_dkdv_simt_fp32_hdim256_local_bm32_bn32_tpr8', 'flash_bwd_dq_simt_fp32_hdim256_local_bm32_bn32_tpr8')),
    )),
    ('float64', 'full', True, (('80', 166912), ('80', 232448), ('80', 101376), ('86', 166912), ('86', 232448), ('86', 101376), ('89', 166912), ('89', 232448), ('89', 101376), ('90', 166912), ('90', 232448), ('90', 101376)), (
        (16, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim16_full_bm32_bn32_tpr4', 'flash_bwd_dq_simt_fp64_hdim16_full_bm32_bn32_tpr4')),
        (32, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim32_full_bm32_bn32_tpr4', 'flash_bwd_dq_simt_fp64_hdim32_full_bm32_bn32_tpr4')),
        (64, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim64_full_bm32_bn32_tpr4', 'flash_bwd_dq_simt_fp64_hdim64_full_bm32_bn32_tpr4')),
        (128, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim128_full_bm16_bn16_tpr8', 'flash_bwd_dq_simt_fp64_hdim128_full_bm16_bn16_tpr8')),
        (256, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim256_full_bm16_bn16_tpr16', 'flash_bwd_dq_simt_fp64_hdim256_full_bm16_bn16_tpr16')),
    )),
    ('float64', 'full', False, (('80', 166912), ('80', 232448), ('80', 101376), ('86', 166912), ('86', 232448), ('86', 101376), ('89', 166912), ('89', 232448), ('89', 101376), ('90', 166912), ('90', 232448), ('90', 101376)), (
        (16, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim16_full_bm32_bn32_tpr4', 'flash_bwd_dq_simt_fp64_hdim16_full_bm32_bn32_tpr4')),
        (32, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim32_full_bm32_bn32_tpr4', 'flash_bwd_dq_simt_fp64_hdim32_full_bm32_bn32_tpr4')),
        (64, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim64_full_bm32_bn32_tpr4', 'flash_bwd_dq_simt_fp64_hdim64_full_bm32_bn32_tpr4')),
        (128, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim128_full_bm16_bn16_tpr8', 'flash_bwd_dq_simt_fp64_hdim128_full_bm16_bn16_tpr8')),
        (256, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim256_full_bm16_bn16_tpr16', 'flash_bwd_dq_simt_fp64_hdim256_full_bm16_bn16_tpr16')),
    )),
    ('float64', 'causal', True, (('80', 166912), ('80', 232448), ('80', 101376), ('86', 166912), ('86', 232448), ('86', 101376), ('89', 166912), ('89', 232448), ('89', 101376), ('90', 166912), ('90', 232448), ('90', 101376)), (
        (16, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim16_causal_bm32_bn32_tpr4', 'flash_bwd_dq_simt_fp64_hdim16_causal_bm32_bn32_tpr4')),
        (32, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim32_causal_bm32_bn32_tpr4', 'flash_bwd_dq_simt_fp64_hdim32_causal_bm32_bn32_tpr4')),
        (64, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim64_causal_bm32_bn32_tpr4', 'flash_bwd_dq_simt_fp64_hdim64_causal_bm32_bn32_tpr4')),
        (128, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim128_causal_bm16_bn16_tpr8', 'flash_bwd_dq_simt_fp64_hdim128_causal_bm16_bn16_tpr8')),
        (256, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim256_causal_bm16_bn16_tpr16', 'flash_bwd_dq_simt_fp64_hdim256_causal_bm16_bn16_tpr16')),
    )),
    ('float64', 'causal', False, (('80', 166912), ('80', 232448), ('80', 101376), ('86', 166912), ('86', 232448), ('86', 101376), ('89', 166912), ('89', 232448), ('89', 101376), ('90', 166912), ('90', 232448), ('90', 101376)), (
        (16, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim16_causal_bm32_bn32_tpr4', 'flash_bwd_dq_simt_fp64_hdim16_causal_bm32_bn32_tpr4')),
        (32, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim32_causal_bm32_bn32_tpr4', 'flash_bwd_dq_simt_fp64_hdim32_causal_bm32_bn32_tpr4')),
        (64, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim64_causal_bm32_bn32_tpr4', 'flash_bwd_dq_simt_fp64_hdim64_causal_bm32_bn32_tpr4')),
        (128, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim128_causal_bm16_bn16_tpr8', 'flash_bwd_dq_simt_fp64_hdim128_causal_bm16_bn16_tpr8')),
        (256, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim256_causal_bm16_bn16_tpr16', 'flash_bwd_dq_simt_fp64_hdim256_causal_bm16_bn16_tpr16')),
    )),
    ('float64', 'local', True, (('80', 166912), ('80', 232448), ('80', 101376), ('86', 166912), ('86', 232448), ('86', 101376), ('89', 166912), ('89', 232448), ('89', 101376), ('90', 166912), ('90', 232448), ('90', 101376)), (
        (16, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim16_local_bm32_bn32_tpr4', 'flash_bwd_dq_simt_fp64_hdim16_local_bm32_bn32_tpr4')),
        (32, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim32_local_bm32_bn32_tpr4', 'flash_bwd_dq_simt_fp64_hdim32_local_bm32_bn32_tpr4')),
        (64, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim64_local_bm32_bn32_tpr4', 'flash_bwd_dq_simt_fp64_hdim64_local_bm32_bn32_tpr4')),
        (128, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim128_local_bm16_bn16_tpr8', 'flash_bwd_dq_simt_fp64_hdim128_local_bm16_bn16_tpr8')),
        (256, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim256_local_bm16_bn16_tpr16', 'flash_bwd_dq_simt_fp64_hdim256_local_bm16_bn16_tpr16')),
    )),
    ('float64', 'local', False, (('80', 166912), ('80', 232448), ('80', 101376), ('86', 166912), ('86', 232448), ('86', 101376), ('89', 166912), ('89', 232448), ('89', 101376), ('90', 166912), ('90', 232448), ('90', 101376)), (
        (16, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim16_local_bm32_bn32_tpr4', 'flash_bwd_dq_simt_fp64_hdim16_local_bm32_bn32_tpr4')),
        (32, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim32_local_bm32_bn32_tpr4', 'flash_bwd_dq_simt_fp64_hdim32_local_bm32_bn32_tpr4')),
        (64, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim64_local_bm32_bn32_tpr4', 'flash_bwd_dq_simt_fp64_hdim64_local_bm32_bn32_tpr4')),
        (128, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim128_local_bm16_bn16_tpr8', 'flash_bwd_dq_simt_fp64_hdim128_local_bm16_bn16_tpr8')),
        (256, ('flash_bwd_preprocess_fp64', 'flash_bwd_dkdv_simt_fp64_hdim256_local_bm16_bn16_tpr16', 'flash_bwd_dq_simt_fp64_hdim256_local_bm16_bn16_tpr16')),
    )),
)

OLD_GRIDS = {
    'flash_bwd_dkdv_mma_bf16_hdim128_causal_bm64_ms32_bn128_w8_wd1_dqatomic': (3, 2, 2),
    'flash_bwd_dkdv_mma_bf16_hdim128_full_bm64_ms32_bn128_w8_wd1_dqatomic': (3, 2, 2),
    'flash_bwd_dkdv_mma_bf16_hdim128_local_bm64_ms32_bn128_w8_wd1_dqatomic': (3, 2, 2),
    'flash_bwd_dkdv_mma_bf16_hdim256_causal_bm32_ms16_bn64_w8_wd2_dqatomic': (5, 2, 2),
    'flash_bwd_dkdv_mma_bf16_hdim256_full_bm32_ms16_bn64_w8_wd2_dqatomic': (5, 2, 2),
    'flash_bwd_dkdv_mma_bf16_hdim256_local_bm32_ms16_bn64_w8_wd2_dqatomic': (5, 2, 2),
    'flash_bwd_dkdv_mma_bf16_hdim64_local_bm64_ms64_bn128_w8_wd1_dqatomic': (3, 2, 2),
    'flash_bwd_dkdv_mma_fp16_hdim128_causal_bm64_ms32_bn128_w8_wd1_dqatomic': (3, 2, 2),
    'flash_bwd_dkdv_mma_fp16_hdim128_full_bm64_ms32_bn128_w8_wd1_dqatomic': (3, 2, 2),
    'flash_bwd_dkdv_mma_fp16_hdim128_local_bm64_ms32_bn128_w8_wd1_dqatomic': (3, 2, 2),
    'flash_bwd_dkdv_mma_fp16_hdim256_causal_bm32_ms16_bn64_w8_wd2_dqatomic': (5, 2, 2),
    'flash_bwd_dkdv_mma_fp16_hdim256_full_bm32_ms16_bn64_w8_wd2_dqatomic': (5, 2, 2),
    'flash_bwd_dkdv_mma_fp16_hdim256_local_bm32_ms16_bn64_w8_wd2_dqatomic': (5, 2, 2),
    'flash_bwd_dkdv_mma_fp16_hdim64_local_bm64_ms64_bn128_w8_wd1_dqatomic': (3, 2, 2),
    'flash_bwd_dkdv_mma_split_bf16_hdim128_causal_bm64_ms32_bn128_w8_rg2': (3, 2, 2),
    'flash_bwd_dkdv_mma_split_bf16_hdim128_full_bm64_ms32_bn128_w8_rg2': (3, 2, 2),
    'flash_bwd_dkdv_mma_split_bf16_hdim128_local_bm64_ms32_bn128_w8_rg2': (3, 2, 2),
    'flash_bwd_dkdv_mma_split_bf16_hdim256_causal_bm32_ms32_bn64_w8_rg1': (5, 2, 2),
    'flash_bwd_dkdv_mma_split_bf16_hdim256_full_bm32_ms32_bn64_w8_rg1': (5, 2, 2),
    'flash_bwd_dkdv_mma_split_bf16_hdim256_local_bm32_ms32_bn64_w8_rg1': (5, 2, 2),
    'flash_bwd_dkdv_mma_split_fp16_hdim128_causal_bm64_ms32_bn128_w8_rg2': (3, 2, 2),
    'flash_bwd_dkdv_mma_split_fp16_hdim128_full_bm64_ms32_bn128_w8_rg2': (3, 2, 2),
    'flash_bwd_dkdv_mma_split_fp16_hdim128_local_bm64_ms32_bn128_w8_rg2': (3, 2, 2),
    'flash_bwd_dkdv_mma_split_fp16_hdim256_causal_bm32_ms32_bn64_w8_rg1': (5, 2, 2),
    'flash_bwd_dkdv_mma_split_fp16_hdim256_full_bm32_ms32_bn64_w8_rg1': (5, 2, 2),
    'flash_bwd_dkdv_mma_split_fp16_hdim256_local_bm32_ms32_bn64_w8_rg1': (5, 2, 2),
    'flash_bwd_dkdv_mma_v2_bf16_hdim64_causal_bm64_ms32_bn128_w4_rg2': (3, 2, 2),
    'flash_bwd_dkdv_mma_v2_bf16_hdim64_causal_bm64_ms32_bn128_w4_rg2_dqatomic': (3, 2, 2),
    'flash_bwd_dkdv_mma_v2_bf16_hdim64_full_bm64_ms32_bn128_w4_rg2': (3, 2, 2),
    'flash_bwd_dkdv_mma_v2_bf16_hdim64_full_bm64_ms32_bn128_w4_rg2_dqatomic': (3, 2, 2),
    'flash_bwd_dkdv_mma_v2_bf16_hdim64_local_bm64_ms32_bn128_w4_rg2': (3, 2, 2),
    'flash_bwd_dkdv_mma_v2_fp16_hdim64_causal_bm64_ms32_bn128_w4_rg2': (3, 2, 2),
    'flash_bwd_dkdv_mma_v2_fp16_hdim64_causal_bm64_ms32_bn128_w4_rg2_dqatomic': (3, 2, 2),
    'flash_bwd_dkdv_mma_v2_fp16_hdim64_full_bm64_ms32_bn128_w4_rg2': (3, 2, 2),
    'flash_bwd_dkdv_mma_v2_fp16_hdim64_full_bm64_ms32_bn128_w4_rg2_dqatomic': (3, 2, 2),
    'flash_bwd_dkdv_mma_v2_fp16_hdim64_local_bm64_ms32_bn128_w4_rg2': (3, 2, 2),
    'flash_bwd_dkdv_simt_fp32_hdim128_causal_bm32_bn32_tpr8': (10, 2, 2),
    'flash_bwd_dkdv_simt_fp32_hdim128_full_bm32_bn32_tpr8': (10, 2, 2),
    'flash_bwd_dkdv_simt_fp32_hdim128_local_bm32_bn32_tpr8': (10, 2, 2),
    'flash_bwd_dkdv_simt_fp32_hdim16_causal_bm64_bn64_tpr4': (5, 2, 2),
    'flash_bwd_dkdv_simt_fp32_hdim16_full_bm64_bn64_tpr4': (5, 2, 2),
    'flash_bwd_dkdv_simt_fp32_hdim16_local_bm64_bn64_tpr4': (5, 2, 2),
    'flash_bwd_dkdv_simt_fp32_hdim256_causal_bm32_bn32_tpr8': (10, 2, 2),
    'flash_bwd_dkdv_simt_fp32_hdim256_full_bm32_bn32_tpr8': (10, 2, 2),
    'flash_bwd_dkdv_simt_fp32_hdim256_local_bm32_bn32_tpr8': (10, 2, 2),
    'flash_bwd_dkdv_simt_fp32_hdim32_causal_bm64_bn64_tpr4': (5, 2, 2),
    'flash_bwd_dkdv_simt_fp32_hdim32_full_bm64_bn64_tpr4': (5, 2, 2),
    'flash_bwd_dkdv_simt_fp32_hdim32_local_bm64_bn64_tpr4': (5, 2, 2),
    'flash_bwd_dkdv_simt_fp32_hdim64_causal_bm64_bn64_tpr4': (5, 2, 2),
    'flash_bwd_dkdv_simt_fp32_hdim64_full_bm64_bn64_tpr4': (5, 2, 2),
    'flash_bwd_dkdv_simt_fp32_hdim64_local_bm64_bn64_tpr4': (5, 2, 2),
    'flash_bwd_dkdv_simt_fp64_hdim128_causal_bm16_bn16_tpr8': (19, 2, 2),
    'flash_bwd_dkdv_simt_fp64_hdim128_full_bm16_bn16_tpr8': (19, 2, 2),
    'flash_bwd_dkdv_simt_fp64_hdim128_local_bm16_bn16_tpr8': (19, 2, 2),
    'flash_bwd_dkdv_simt_fp64_hdim16_causal_bm32_bn32_tpr4': (10, 2, 2),
    'flash_bwd_dkdv_simt_fp64_hdim16_full_bm32_bn32_tpr4': (10, 2, 2),
    'flash_bwd_dkdv_simt_fp64_hdim16_local_bm32_bn32_tpr4': (10, 2, 2),
    'flash_bwd_dkdv_simt_fp64_hdim256_causal_bm16_bn16_tpr16': (19, 2, 2),
    'flash_bwd_dkdv_simt_fp64_hdim256_full_bm16_bn16_tpr16': (19, 2, 2),
    'flash_bwd_dkdv_simt_fp64_hdim256_local_bm16_bn16_tpr16': (19, 2, 2),
    'flash_bwd_dkdv_simt_fp64_hdim32_causal_bm32_bn32_tpr4': (10, 2, 2),
    'flash_bwd_dkdv_simt_fp64_hdim32_full_bm32_bn32_tpr4': (10, 2, 2),
    'flash_bwd_dkdv_simt_fp64_hdim32_local_bm32_bn32_tpr4': (10, 2, 2),
    'flash_bwd_dkdv_simt_fp64_hdim64_causal_bm32_bn32_tpr4': (10, 2, 2),
    'flash_bwd_dkdv_simt_fp64_hdim64_full_bm32_bn32_tpr4': (10, 2, 2),
    'flash_bwd_dkdv_simt_fp64_hdim64_local_bm32_bn32_tpr4': (10, 2, 2),
    'flash_bwd_dq_mma_bf16_hdim256_causal_bm64_bn32_w4': (6, 4, 2),
    'flash_bwd_dq_mma_bf16_hdim256_full_bm64_bn32_w4': (6, 4, 2),
    'flash_bwd_dq_mma_bf16_hdim256_local_bm64_bn32_w4': (6, 4, 2),
    'flash_bwd_dq_mma_fp16_hdim256_causal_bm64_bn32_w4': (6, 4, 2),
    'flash_bwd_dq_mma_fp16_hdim256_full_bm64_bn32_w4': (6, 4, 2),
    'flash_bwd_dq_mma_fp16_hdim256_local_bm64_bn32_w4': (6, 4, 2),
    'flash_bwd_dq_mma_v2_bf16_hdim128_causal_bm128_bn32_w4_rg2': (3, 4, 2),
    'flash_bwd_dq_mma_v2_bf16_hdim128_full_bm128_bn32_w4_rg2': (3, 4, 2),
    'flash_bwd_dq_mma_v2_bf16_hdim128_local_bm128_bn32_w4_rg2': (3, 4, 2),
    'flash_bwd_dq_mma_v2_bf16_hdim64_causal_bm128_bn32_w4_rg2': (3, 4, 2),
    'flash_bwd_dq_mma_v2_bf16_hdim64_full_bm128_bn32_w4_rg2': (3, 4, 2),
    'flash_bwd_dq_mma_v2_bf16_hdim64_local_bm128_bn32_w4_rg2': (3, 4, 2),
    'flash_bwd_dq_mma_v2_fp16_hdim128_causal_bm128_bn32_w4_rg2': (3, 4, 2),
    'flash_bwd_dq_mma_v2_fp16_hdim128_full_bm128_bn32_w4_rg2': (3, 4, 2),
    'flash_bwd_dq_mma_v2_fp16_hdim128_local_bm128_bn32_w4_rg2': (3, 4, 2),
    'flash_bwd_dq_mma_v2_fp16_hdim64_causal_bm128_bn32_w4_rg2': (3, 4, 2),
    'flash_bwd_dq_mma_v2_fp16_hdim64_full_bm128_bn32_w4_rg2': (3, 4, 2),
    'flash_bwd_dq_mma_v2_fp16_hdim64_local_bm128_bn32_w4_rg2': (3, 4, 2),
    'flash_bwd_dq_simt_fp32_hdim128_causal_bm32_bn32_tpr8': (11, 4, 2),
    'flash_bwd_dq_simt_fp32_hdim128_full_bm32_bn32_tpr8': (11, 4, 2),
    'flash_bwd_dq_simt_fp32_hdim128_local_bm32_bn32_tpr8': (11, 4, 2),
    'flash_bwd_dq_simt_fp32_hdim16_causal_bm64_bn64_tpr4': (6, 4, 2),
    'flash_bwd_dq_simt_fp32_hdim16_full_bm64_bn64_tpr4': (6, 4, 2),
    'flash_bwd_dq_simt_fp32_hdim16_local_bm64_bn64_tpr4': (6, 4, 2),
    'flash_bwd_dq_simt_fp32_hdim256_causal_bm32_bn32_tpr8': (11, 4, 2),
    'flash_bwd_dq_simt_fp32_hdim256_full_bm32_bn32_tpr8': (11, 4, 2),
    'flash_bwd_dq_simt_fp32_hdim256_local_bm32_bn32_tpr8': (11, 4, 2),
    'flash_bwd_dq_simt_fp32_hdim32_causal_bm64_bn64_tpr4': (6, 4, 2),
    'flash_bwd_dq_simt_fp32_hdim32_full_bm64_bn64_tpr4': (6, 4, 2),
    'flash_bwd_dq_simt_fp32_hdim32_local_bm64_bn64_tpr4': (6, 4, 2),
    'flash_bwd_dq_simt_fp32_hdim64_causal_bm64_bn64_tpr4': (6, 4, 2),
    'flash_bwd_dq_simt_fp32_hdim64_full_bm64_bn64_tpr4': (6, 4, 2),
    'flash_bwd_dq_simt_fp32_hdim64_local_bm64_bn64_tpr4': (6, 4, 2),
    'flash_bwd_dq_simt_fp64_hdim128_causal_bm16_bn16_tpr8': (21, 4, 2),
    'flash_bwd_dq_simt_fp64_hdim128_full_bm16_bn16_tpr8': (21, 4, 2),
    'flash_bwd_dq_simt_fp64_hdim128_local_bm16_bn16_tpr8': (21, 4, 2),
    'flash_bwd_dq_simt_fp64_hdim16_causal_bm32_bn32_tpr4': (11, 4, 2),
    'flash_bwd_dq_simt_fp64_hdim16_full_bm32_bn32_tpr4': (11, 4, 2),
    'flash_bwd_dq_simt_fp64_hdim16_local_bm32_bn32_tpr4': (11, 4, 2),
    'flash_bwd_dq_simt_fp64_hdim256_causal_bm16_bn16_tpr16': (21, 4, 2),
    'flash_bwd_dq_simt_fp64_hdim256_full_bm16_bn16_tpr16': (21, 4, 2),
    'flash_bwd_dq_simt_fp64_hdim256_local_bm16_bn16_tpr16': (21, 4, 2),
    'flash_bwd_dq_simt_fp64_hdim32_causal_bm32_bn32_tpr4': (11, 4, 2),
    'flash_bwd_dq_simt_fp64_hdim32_full_bm32_bn32_tpr4': (11, 4, 2),
    'flash_bwd_dq_simt_fp64_hdim32_local_bm32_bn32_tpr4': (11, 4, 2),
    'flash_bwd_dq_simt_fp64_hdim64_causal_bm32_bn32_tpr4': (11, 4, 2),
    'flash_bwd_dq_simt_fp64_hdim64_full_bm32_bn32_tpr4': (11, 4, 2),
    'flash_bwd_dq_simt_fp64_hdim64_local_bm32_bn32_tpr4': (11, 4, 2),
    'flash_bwd_dq_wgmma_bf16_hdim128_causal_bm128_bn64_k2': (3, 4, 2),
    'flash_bwd_dq_wgmma_bf16_hdim128_full_bm128_bn64_k2': (3, 4, 2),
    'flash_bwd_dq_wgmma_bf16_hdim128_local_bm128_bn64_k2': (3, 4, 2),
    'flash_bwd_dq_wgmma_bf16_hdim256_causal_bm128_bn32_k2': (3, 4, 2),
    'flash_bwd_dq_wgmma_bf16_hdim256_full_bm128_bn32_k2': (3, 4, 2),
    'flash_bwd_dq_wgmma_bf16_hdim256_local_bm128_bn32_k2': (3, 4, 2),
    'flash_bwd_dq_wgmma_bf16_hdim64_causal_bm128_bn128_k2': (3, 4, 2),
    'flash_bwd_dq_wgmma_bf16_hdim64_full_bm128_bn128_k2': (3, 4, 2),
    'flash_bwd_dq_wgmma_bf16_hdim64_local_bm128_bn128_k2': (3, 4, 2),
    'flash_bwd_dq_wgmma_fp16_hdim128_causal_bm128_bn64_k2': (3, 4, 2),
    'flash_bwd_dq_wgmma_fp16_hdim128_full_bm128_bn64_k2': (3, 4, 2),
    'flash_bwd_dq_wgmma_fp16_hdim128_local_bm128_bn64_k2': (3, 4, 2),
    'flash_bwd_dq_wgmma_fp16_hdim256_causal_bm128_bn32_k2': (3, 4, 2),
    'flash_bwd_dq_wgmma_fp16_hdim256_full_bm128_bn32_k2': (3, 4, 2),
    'flash_bwd_dq_wgmma_fp16_hdim256_local_bm128_bn32_k2': (3, 4, 2),
    'flash_bwd_dq_wgmma_fp16_hdim64_causal_bm128_bn128_k2': (3, 4, 2),
    'flash_bwd_dq_wgmma_fp16_hdim64_full_bm128_bn128_k2': (3, 4, 2),
    'flash_bwd_dq_wgmma_fp16_hdim64_local_bm128_bn128_k2': (3, 4, 2),
    'flash_bwd_fused_mma_bf16_hdim128_causal_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16': (3, 2, 2),
    'flash_bwd_fused_mma_bf16_hdim128_full_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16': (3, 2, 2),
    'flash_bwd_fused_mma_bf16_hdim128_local_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16': (3, 2, 2),
    'flash_bwd_fused_mma_bf16_hdim256_causal_bm64_bn64_wn2_wd4_dqm2_u16_dqatomic': (5, 2, 2),
    'flash_bwd_fused_mma_bf16_hdim256_full_bm64_bn64_wn2_wd4_dqm2_u16_dqatomic': (5, 2, 2),
    'flash_bwd_fused_mma_bf16_hdim256_local_bm64_bn64_wn2_wd4_dqm2_u16_dqatomic': (5, 2, 2),
    'flash_bwd_fused_mma_fp16_hdim128_causal_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16': (3, 2, 2),
    'flash_bwd_fused_mma_fp16_hdim128_full_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16': (3, 2, 2),
    'flash_bwd_fused_mma_fp16_hdim128_local_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16': (3, 2, 2),
    'flash_bwd_fused_mma_fp16_hdim256_causal_bm64_bn64_wn2_wd4_dqm2_u16_dqatomic': (5, 2, 2),
    'flash_bwd_fused_mma_fp16_hdim256_full_bm64_bn64_wn2_wd4_dqm2_u16_dqatomic': (5, 2, 2),
    'flash_bwd_fused_mma_fp16_hdim256_local_bm64_bn64_wn2_wd4_dqm2_u16_dqatomic': (5, 2, 2),
    'flash_bwd_preprocess_bf16': (666, 1, 1),
    'flash_bwd_preprocess_fp16': (666, 1, 1),
    'flash_bwd_preprocess_fp32': (666, 1, 1),
    'flash_bwd_preprocess_fp64': (666, 1, 1),
    'flash_bwd_wgmma_bf16_hdim128_causal_bm64_bn128_dqatomic': (3, 2, 2),
    'flash_bwd_wgmma_bf16_hdim128_causal_bm64_bn128_dqnone': (3, 2, 2),
    'flash_bwd_wgmma_bf16_hdim128_full_bm64_bn128_dqatomic': (3, 2, 2),
    'flash_bwd_wgmma_bf16_hdim128_full_bm64_bn128_dqnone': (3, 2, 2),
    'flash_bwd_wgmma_bf16_hdim128_local_bm64_bn128_dqatomic': (3, 2, 2),
    'flash_bwd_wgmma_bf16_hdim128_local_bm64_bn128_dqnone': (3, 2, 2),
    'flash_bwd_wgmma_bf16_hdim64_causal_bm128_bn128_dqatomic': (3, 2, 2),
    'flash_bwd_wgmma_bf16_hdim64_causal_bm128_bn128_dqnone': (3, 2, 2),
    'flash_bwd_wgmma_bf16_hdim64_full_bm128_bn128_dqatomic': (3, 2, 2),
    'flash_bwd_wgmma_bf16_hdim64_full_bm128_bn128_dqnone': (3, 2, 2),
    'flash_bwd_wgmma_bf16_hdim64_local_bm128_bn128_dqatomic': (3, 2, 2),
    'flash_bwd_wgmma_bf16_hdim64_local_bm128_bn128_dqnone': (3, 2, 2),
    'flash_bwd_wgmma_dsplit_bf16_hdim256_causal_bm64_bn64_dqnone': (5, 2, 2),
    'flash_bwd_wgmma_dsplit_bf16_hdim256_full_bm64_bn64_dqnone': (5, 2, 2),
    'flash_bwd_wgmma_dsplit_bf16_hdim256_local_bm64_bn64_dqnone': (5, 2, 2),
    'flash_bwd_wgmma_dsplit_fp16_hdim256_causal_bm64_bn64_dqnone': (5, 2, 2),
    'flash_bwd_wgmma_dsplit_fp16_hdim256_full_bm64_bn64_dqnone': (5, 2, 2),
    'flash_bwd_wgmma_dsplit_fp16_hdim256_local_bm64_bn64_dqnone': (5, 2, 2),
    'flash_bwd_wgmma_fp16_hdim128_causal_bm64_bn128_dqatomic': (3, 2, 2),
    'flash_bwd_wgmma_fp16_hdim128_causal_bm64_bn128_dqnone': (3, 2, 2),
    'flash_bwd_wgmma_fp16_hdim128_full_bm64_bn128_dqatomic': (3, 2, 2),
    'flash_bwd_wgmma_fp16_hdim128_full_bm64_bn128_dqnone': (3, 2, 2),
    'flash_bwd_wgmma_fp16_hdim128_local_bm64_bn128_dqatomic': (3, 2, 2),
    'flash_bwd_wgmma_fp16_hdim128_local_bm64_bn128_dqnone': (3, 2, 2),
    'flash_bwd_wgmma_fp16_hdim64_causal_bm128_bn128_dqatomic': (3, 2, 2),
    'flash_bwd_wgmma_fp16_hdim64_causal_bm128_bn128_dqnone': (3, 2, 2),
    'flash_bwd_wgmma_fp16_hdim64_full_bm128_bn128_dqatomic': (3, 2, 2),
    'flash_bwd_wgmma_fp16_hdim64_full_bm128_bn128_dqnone': (3, 2, 2),
    'flash_bwd_wgmma_fp16_hdim64_local_bm128_bn128_dqatomic': (3, 2, 2),
    'flash_bwd_wgmma_fp16_hdim64_local_bm128_bn128_dqnone': (3, 2, 2),
    ('flash_bwd_dq_convert_bf16', 128): (167, 1, 1),
    ('flash_bwd_dq_convert_bf16', 256): (333, 1, 1),
    ('flash_bwd_dq_convert_bf16', 64): (84, 1, 1),
    ('flash_bwd_dq_convert_fp16', 128): (167, 1, 1),
    ('flash_bwd_dq_convert_fp16', 256): (333, 1, 1),
    ('flash_bwd_dq_convert_fp16', 64): (84, 1, 1),
}

# mma_bwd.specializations() of that tree, by name.
OLD_COMPILE_CHECK = (
    'flash_bwd_dkdv_mma_bf16_hdim128_causal_bm64_ms32_bn128_w8_wd1',
    'flash_bwd_dkdv_mma_bf16_hdim128_causal_bm64_ms32_bn128_w8_wd1_dqatomic',
    'flash_bwd_dkdv_mma_bf16_hdim128_full_bm64_ms32_bn128_w8_wd1',
    'flash_bwd_dkdv_mma_bf16_hdim128_full_bm64_ms32_bn128_w8_wd1_dqatomic',
    'flash_bwd_dkdv_mma_bf16_hdim128_local_bm64_ms32_bn128_w8_wd1_dqatomic',
    'flash_bwd_dkdv_mma_bf16_hdim256_causal_bm32_ms16_bn64_w8_wd2',
    'flash_bwd_dkdv_mma_bf16_hdim256_causal_bm32_ms16_bn64_w8_wd2_dqatomic',
    'flash_bwd_dkdv_mma_bf16_hdim256_full_bm32_ms16_bn64_w8_wd2',
    'flash_bwd_dkdv_mma_bf16_hdim256_full_bm32_ms16_bn64_w8_wd2_dqatomic',
    'flash_bwd_dkdv_mma_bf16_hdim256_local_bm32_ms16_bn64_w8_wd2_dqatomic',
    'flash_bwd_dkdv_mma_bf16_hdim64_causal_bm64_ms64_bn128_w8_wd1',
    'flash_bwd_dkdv_mma_bf16_hdim64_causal_bm64_ms64_bn128_w8_wd1_dqatomic',
    'flash_bwd_dkdv_mma_bf16_hdim64_full_bm64_ms64_bn128_w8_wd1',
    'flash_bwd_dkdv_mma_bf16_hdim64_full_bm64_ms64_bn128_w8_wd1_dqatomic',
    'flash_bwd_dkdv_mma_bf16_hdim64_local_bm64_ms64_bn128_w8_wd1_dqatomic',
    'flash_bwd_dkdv_mma_fp16_hdim128_causal_bm64_ms32_bn128_w8_wd1',
    'flash_bwd_dkdv_mma_fp16_hdim128_causal_bm64_ms32_bn128_w8_wd1_dqatomic',
    'flash_bwd_dkdv_mma_fp16_hdim128_full_bm64_ms32_bn128_w8_wd1',
    'flash_bwd_dkdv_mma_fp16_hdim128_full_bm64_ms32_bn128_w8_wd1_dqatomic',
    'flash_bwd_dkdv_mma_fp16_hdim128_local_bm64_ms32_bn128_w8_wd1_dqatomic',
    'flash_bwd_dkdv_mma_fp16_hdim256_causal_bm32_ms16_bn64_w8_wd2',
    'flash_bwd_dkdv_mma_fp16_hdim256_causal_bm32_ms16_bn64_w8_wd2_dqatomic',
    'flash_bwd_dkdv_mma_fp16_hdim256_full_bm32_ms16_bn64_w8_wd2',
    'flash_bwd_dkdv_mma_fp16_hdim256_full_bm32_ms16_bn64_w8_wd2_dqatomic',
    'flash_bwd_dkdv_mma_fp16_hdim256_local_bm32_ms16_bn64_w8_wd2_dqatomic',
    'flash_bwd_dkdv_mma_fp16_hdim64_causal_bm64_ms64_bn128_w8_wd1',
    'flash_bwd_dkdv_mma_fp16_hdim64_causal_bm64_ms64_bn128_w8_wd1_dqatomic',
    'flash_bwd_dkdv_mma_fp16_hdim64_full_bm64_ms64_bn128_w8_wd1',
    'flash_bwd_dkdv_mma_fp16_hdim64_full_bm64_ms64_bn128_w8_wd1_dqatomic',
    'flash_bwd_dkdv_mma_fp16_hdim64_local_bm64_ms64_bn128_w8_wd1_dqatomic',
    'flash_bwd_dkdv_mma_split_bf16_hdim128_causal_bm64_ms32_bn128_w8_rg2',
    'flash_bwd_dkdv_mma_split_bf16_hdim128_full_bm64_ms32_bn128_w8_rg2',
    'flash_bwd_dkdv_mma_split_bf16_hdim128_local_bm64_ms32_bn128_w8_rg2',
    'flash_bwd_dkdv_mma_split_bf16_hdim256_causal_bm32_ms32_bn64_w8_rg1',
    'flash_bwd_dkdv_mma_split_bf16_hdim256_full_bm32_ms32_bn64_w8_rg1',
    'flash_bwd_dkdv_mma_split_bf16_hdim256_local_bm32_ms32_bn64_w8_rg1',
    'flash_bwd_dkdv_mma_split_fp16_hdim128_causal_bm64_ms32_bn128_w8_rg2',
    'flash_bwd_dkdv_mma_split_fp16_hdim128_full_bm64_ms32_bn128_w8_rg2',
    'flash_bwd_dkdv_mma_split_fp16_hdim128_local_bm64_ms32_bn128_w8_rg2',
    'flash_bwd_dkdv_mma_split_fp16_hdim256_causal_bm32_ms32_bn64_w8_rg1',
    'flash_bwd_dkdv_mma_split_fp16_hdim256_full_bm32_ms32_bn64_w8_rg1',
    'flash_bwd_dkdv_mma_split_fp16_hdim256_local_bm32_ms32_bn64_w8_rg1',
    'flash_bwd_dkdv_mma_v2_bf16_hdim64_causal_bm64_ms32_bn128_w4_rg2',
    'flash_bwd_dkdv_mma_v2_bf16_hdim64_causal_bm64_ms32_bn128_w4_rg2_dqatomic',
    'flash_bwd_dkdv_mma_v2_bf16_hdim64_full_bm64_ms32_bn128_w4_rg2',
    'flash_bwd_dkdv_mma_v2_bf16_hdim64_full_bm64_ms32_bn128_w4_rg2_dqatomic',
    'flash_bwd_dkdv_mma_v2_bf16_hdim64_local_bm64_ms32_bn128_w4_rg2',
    'flash_bwd_dkdv_mma_v2_fp16_hdim64_causal_bm64_ms32_bn128_w4_rg2',
    'flash_bwd_dkdv_mma_v2_fp16_hdim64_causal_bm64_ms32_bn128_w4_rg2_dqatomic',
    'flash_bwd_dkdv_mma_v2_fp16_hdim64_full_bm64_ms32_bn128_w4_rg2',
    'flash_bwd_dkdv_mma_v2_fp16_hdim64_full_bm64_ms32_bn128_w4_rg2_dqatomic',
    'flash_bwd_dkdv_mma_v2_fp16_hdim64_local_bm64_ms32_bn128_w4_rg2',
    'flash_bwd_dq_convert_bf16',
    'flash_bwd_dq_convert_fixed_bf16',
    'flash_bwd_dq_convert_fixed_fp16',
    'flash_bwd_dq_convert_fp16',
    'flash_bwd_dq_mma_bf16_hdim128_causal_bm128_bn64_w8',
    'flash_bwd_dq_mma_bf16_hdim128_full_bm128_bn64_w8',
    'flash_bwd_dq_mma_bf16_hdim256_causal_bm64_bn32_w4',
    'flash_bwd_dq_mma_bf16_hdim256_full_bm64_bn32_w4',
    'flash_bwd_dq_mma_bf16_hdim256_local_bm64_bn32_w4',
    'flash_bwd_dq_mma_bf16_hdim64_causal_bm64_bn64_w4',
    'flash_bwd_dq_mma_bf16_hdim64_full_bm64_bn64_w4',
    'flash_bwd_dq_mma_fp16_hdim128_causal_bm128_bn64_w8',
    'flash_bwd_dq_mma_fp16_hdim128_full_bm128_bn64_w8',
    'flash_bwd_dq_mma_fp16_hdim256_causal_bm64_bn32_w4',
    'flash_bwd_dq_mma_fp16_hdim256_full_bm64_bn32_w4',
    'flash_bwd_dq_mma_fp16_hdim256_local_bm64_bn32_w4',
    'flash_bwd_dq_mma_fp16_hdim64_causal_bm64_bn64_w4',
    'flash_bwd_dq_mma_fp16_hdim64_full_bm64_bn64_w4',
    'flash_bwd_dq_mma_v2_bf16_hdim128_causal_bm128_bn32_w4_rg2',
    'flash_bwd_dq_mma_v2_bf16_hdim128_full_bm128_bn32_w4_rg2',
    'flash_bwd_dq_mma_v2_bf16_hdim128_local_bm128_bn32_w4_rg2',
    'flash_bwd_dq_mma_v2_bf16_hdim64_causal_bm128_bn32_w4_rg2',
    'flash_bwd_dq_mma_v2_bf16_hdim64_full_bm128_bn32_w4_rg2',
    'flash_bwd_dq_mma_v2_bf16_hdim64_local_bm128_bn32_w4_rg2',
    'flash_bwd_dq_mma_v2_fp16_hdim128_causal_bm128_bn32_w4_rg2',
    'flash_bwd_dq_mma_v2_fp16_hdim128_full_bm128_bn32_w4_rg2',
    'flash_bwd_dq_mma_v2_fp16_hdim128_local_bm128_bn32_w4_rg2',
    'flash_bwd_dq_mma_v2_fp16_hdim64_causal_bm128_bn32_w4_rg2',
    'flash_bwd_dq_mma_v2_fp16_hdim64_full_bm128_bn32_w4_rg2',
    'flash_bwd_dq_mma_v2_fp16_hdim64_local_bm128_bn32_w4_rg2',
    'flash_bwd_dq_wgmma_bf16_hdim128_causal_bm128_bn64_k2',
    'flash_bwd_dq_wgmma_bf16_hdim128_full_bm128_bn64_k2',
    'flash_bwd_dq_wgmma_bf16_hdim128_local_bm128_bn64_k2',
    'flash_bwd_dq_wgmma_bf16_hdim256_causal_bm128_bn32_k2',
    'flash_bwd_dq_wgmma_bf16_hdim256_full_bm128_bn32_k2',
    'flash_bwd_dq_wgmma_bf16_hdim256_local_bm128_bn32_k2',
    'flash_bwd_dq_wgmma_bf16_hdim64_causal_bm128_bn128_k2',
    'flash_bwd_dq_wgmma_bf16_hdim64_full_bm128_bn128_k2',
    'flash_bwd_dq_wgmma_bf16_hdim64_local_bm128_bn128_k2',
    'flash_bwd_dq_wgmma_fp16_hdim128_causal_bm128_bn64_k2',
    'flash_bwd_dq_wgmma_fp16_hdim128_full_bm128_bn64_k2',
    'flash_bwd_dq_wgmma_fp16_hdim128_local_bm128_bn64_k2',
    'flash_bwd_dq_wgmma_fp16_hdim256_causal_bm128_bn32_k2',
    'flash_bwd_dq_wgmma_fp16_hdim256_full_bm128_bn32_k2',
    'flash_bwd_dq_wgmma_fp16_hdim256_local_bm128_bn32_k2',
    'flash_bwd_dq_wgmma_fp16_hdim64_causal_bm128_bn128_k2',
    'flash_bwd_dq_wgmma_fp16_hdim64_full_bm128_bn128_k2',
    'flash_bwd_dq_wgmma_fp16_hdim64_local_bm128_bn128_k2',
    'flash_bwd_fused_mma_bf16_hdim128_causal_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16',
    'flash_bwd_fused_mma_bf16_hdim128_causal_bm64_bn128_wn4_wd2_dqm2_u2_dqordered_p16',
    'flash_bwd_fused_mma_bf16_hdim128_full_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16',
    'flash_bwd_fused_mma_bf16_hdim128_full_bm64_bn128_wn4_wd2_dqm2_u2_dqordered_p16',
    'flash_bwd_fused_mma_bf16_hdim128_local_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16',
    'flash_bwd_fused_mma_bf16_hdim256_causal_bm64_bn64_wn2_wd4_dqm2_u16_dqatomic',
    'flash_bwd_fused_mma_bf16_hdim256_causal_bm64_bn64_wn2_wd4_dqm2_u16_dqordered',
    'flash_bwd_fused_mma_bf16_hdim256_full_bm64_bn64_wn2_wd4_dqm2_u16_dqatomic',
    'flash_bwd_fused_mma_bf16_hdim256_full_bm64_bn64_wn2_wd4_dqm2_u16_dqordered',
    'flash_bwd_fused_mma_bf16_hdim256_local_bm64_bn64_wn2_wd4_dqm2_u16_dqatomic',
    'flash_bwd_fused_mma_fp16_hdim128_causal_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16',
    'flash_bwd_fused_mma_fp16_hdim128_causal_bm64_bn128_wn4_wd2_dqm2_u2_dqordered_p16',
    'flash_bwd_fused_mma_fp16_hdim128_full_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16',
    'flash_bwd_fused_mma_fp16_hdim128_full_bm64_bn128_wn4_wd2_dqm2_u2_dqordered_p16',
    'flash_bwd_fused_mma_fp16_hdim128_local_bm64_bn128_wn4_wd2_dqm2_u2_dqatomic_p16',
    'flash_bwd_fused_mma_fp16_hdim256_causal_bm64_bn64_wn2_wd4_dqm2_u16_dqatomic',
    'flash_bwd_fused_mma_fp16_hdim256_causal_bm64_bn64_wn2_wd4_dqm2_u16_dqordered',
    'flash_bwd_fused_mma_fp16_hdim256_full_bm64_bn64_wn2_wd4_dqm2_u16_dqatomic',
    'flash_bwd_fused_mma_fp16_hdim256_full_bm64_bn64_wn2_wd4_dqm2_u16_dqordered',
    'flash_bwd_fused_mma_fp16_hdim256_local_bm64_bn64_wn2_wd4_dqm2_u16_dqatomic',
    'flash_bwd_kv_bounds_bf16_hdim128',
    'flash_bwd_kv_bounds_bf16_hdim256',
    'flash_bwd_kv_bounds_bf16_hdim64',
    'flash_bwd_kv_bounds_fp16_hdim128',
    'flash_bwd_kv_bounds_fp16_hdim256',
    'flash_bwd_kv_bounds_fp16_hdim64',
    'flash_bwd_preprocess_fixed_bf16_hdim128',
    'flash_bwd_preprocess_fixed_bf16_hdim256',
    'flash_bwd_preprocess_fixed_bf16_hdim64',
    'flash_bwd_preprocess_fixed_fp16_hdim128',
    'flash_bwd_preprocess_fixed_fp16_hdim256',
    'flash_bwd_preprocess_fixed_fp16_hdim64',
    'flash_bwd_wgmma_bf16_hdim128_causal_bm64_bn128_dqatomic',
    'flash_bwd_wgmma_bf16_hdim128_causal_bm64_bn128_dqfixed',
    'flash_bwd_wgmma_bf16_hdim128_causal_bm64_bn128_dqfixed_panels',
    'flash_bwd_wgmma_bf16_hdim128_causal_bm64_bn128_dqnone',
    'flash_bwd_wgmma_bf16_hdim128_causal_bm64_bn128_dqordered',
    'flash_bwd_wgmma_bf16_hdim128_full_bm64_bn128_dqatomic',
    'flash_bwd_wgmma_bf16_hdim128_full_bm64_bn128_dqfixed',
    'flash_bwd_wgmma_bf16_hdim128_full_bm64_bn128_dqfixed_panels',
    'flash_bwd_wgmma_bf16_hdim128_full_bm64_bn128_dqnone',
    'flash_bwd_wgmma_bf16_hdim128_full_bm64_bn128_dqordered',
    'flash_bwd_wgmma_bf16_hdim128_local_bm64_bn128_dqatomic',
    'flash_bwd_wgmma_bf16_hdim128_local_bm64_bn128_dqnone',
    'flash_bwd_wgmma_bf16_hdim64_causal_bm128_bn128_dqatomic',
    'flash_bwd_wgmma_bf16_hdim64_causal_bm128_bn128_dqfixed',
    'flash_bwd_wgmma_bf16_hdim64_causal_bm128_bn128_dqfixed_panels',
    'flash_bwd_wgmma_bf16_hdim64_causal_bm128_bn128_dqnone',
    'flash_bwd_wgmma_bf16_hdim64_causal_bm128_bn128_dqordered',
    'flash_bwd_wgmma_bf16_hdim64_full_bm128_bn128_dqatomic',
    'flash_bwd_wgmma_bf16_hdim64_full_bm128_bn128_dqfixed',
    'flash_bwd_wgmma_bf16_hdim64_full_bm128_bn128_dqfixed_panels',
    'flash_bwd_wgmma_bf16_hdim64_full_bm128_bn128_dqnone',
    'flash_bwd_wgmma_bf16_hdim64_full_bm128_bn128_dqordered',
    'flash_bwd_wgmma_bf16_hdim64_local_bm128_bn128_dqatomic',
    'flash_bwd_wgmma_bf16_hdim64_local_bm128_bn128_dqnone',
    'flash_bwd_wgmma_dsplit_bf16_hdim256_causal_bm64_bn64_dqatomic',
    'flash_bwd_wgmma_dsplit_bf16_hdim256_causal_bm64_bn64_dqnone',
    'flash_bwd_wgmma_dsplit_bf16_hdim256_causal_bm64_bn64_dqordered',
    'flash_bwd_wgmma_dsplit_bf16_hdim256_full_bm64_bn64_dqatomic',
    'flash_bwd_wgmma_dsplit_bf16_hdim256_full_bm64_bn64_dqnone',
    'flash_bwd_wgmma_dsplit_bf16_hdim256_full_bm64_bn64_dqordered',
    'flash_bwd_wgmma_dsplit_bf16_hdim256_local_bm64_bn64_dqnone',
    'flash_bwd_wgmma_dsplit_fp16_hdim256_causal_bm64_bn64_dqatomic',
    'flash_bwd_wgmma_dsplit_fp16_hdim256_causal_bm64_bn64_dqnone',
    'flash_bwd_wgmma_dsplit_fp16_hdim256_causal_bm64_bn64_dqordered',
    'flash_bwd_wgmma_dsplit_fp16_hdim256_full_bm64_bn64_dqatomic',
    'flash_bwd_wgmma_dsplit_fp16_hdim256_full_bm64_bn64_dqnone',
    'flash_bwd_wgmma_dsplit_fp16_hdim256_full_bm64_bn64_dqordered',
    'flash_bwd_wgmma_dsplit_fp16_hdim256_local_bm64_bn64_dqnone',
    'flash_bwd_wgmma_fp16_hdim128_causal_bm64_bn128_dqatomic',
    'flash_bwd_wgmma_fp16_hdim128_causal_bm64_bn128_dqfixed',
    'flash_bwd_wgmma_fp16_hdim128_causal_bm64_bn128_dqfixed_panels',
    'flash_bwd_wgmma_fp16_hdim128_causal_bm64_bn128_dqnone',
    'flash_bwd_wgmma_fp16_hdim128_causal_bm64_bn128_dqordered',
    'flash_bwd_wgmma_fp16_hdim128_full_bm64_bn128_dqatomic',
    'flash_bwd_wgmma_fp16_hdim128_full_bm64_bn128_dqfixed',
    'flash_bwd_wgmma_fp16_hdim128_full_bm64_bn128_dqfixed_panels',
    'flash_bwd_wgmma_fp16_hdim128_full_bm64_bn128_dqnone',
    'flash_bwd_wgmma_fp16_hdim128_full_bm64_bn128_dqordered',
    'flash_bwd_wgmma_fp16_hdim128_local_bm64_bn128_dqatomic',
    'flash_bwd_wgmma_fp16_hdim128_local_bm64_bn128_dqnone',
    'flash_bwd_wgmma_fp16_hdim64_causal_bm128_bn128_dqatomic',
    'flash_bwd_wgmma_fp16_hdim64_causal_bm128_bn128_dqfixed',
    'flash_bwd_wgmma_fp16_hdim64_causal_bm128_bn128_dqfixed_panels',
    'flash_bwd_wgmma_fp16_hdim64_causal_bm128_bn128_dqnone',
    'flash_bwd_wgmma_fp16_hdim64_causal_bm128_bn128_dqordered',
    'flash_bwd_wgmma_fp16_hdim64_full_bm128_bn128_dqatomic',
    'flash_bwd_wgmma_fp16_hdim64_full_bm128_bn128_dqfixed',
    'flash_bwd_wgmma_fp16_hdim64_full_bm128_bn128_dqfixed_panels',
    'flash_bwd_wgmma_fp16_hdim64_full_bm128_bn128_dqnone',
    'flash_bwd_wgmma_fp16_hdim64_full_bm128_bn128_dqordered',
    'flash_bwd_wgmma_fp16_hdim64_local_bm128_bn128_dqatomic',
    'flash_bwd_wgmma_fp16_hdim64_local_bm128_bn128_dqnone',
)


# v10's deterministic sm_90 rows at d64 and d128, before v13's producer rows took their place.
V10_ROWS = {64: backward_plans.BackwardKernels("wgmma", (128, 128), "none", "dq_wgmma", (128, 128, 2),
                                               backward_plans._V10),
            128: backward_plans.BackwardKernels("wgmma", (64, 128), "none", "dq_wgmma", (128, 64, 2),
                                                backward_plans._V10)}
# v10's rows without determinism (dQ by float32 atomic adds), before the producer pair took them.
V10_ATOMIC = {64: backward_plans.BackwardKernels("wgmma", (128, 128), "atomic", perf_log=backward_plans._V10),
              128: backward_plans.BackwardKernels("wgmma", (64, 128), "atomic", perf_log=backward_plans._V10)}


def set_aside_the_producer_rows(monkeypatch) -> None:
    """v13's producer rows (flash_bwd_wgmma_ws, flash_bwd_dq_wgmma_ws at sm_90 d64 / d128 with
    determinism or without; test_the_producer_rows_run_v10s_work_split) back to v10's, which the
    old choice records."""
    for dt, row in V10_ROWS.items():
        monkeypatch.setitem(BACKWARD_KERNELS, (SM90, dt, True), (row,))
        monkeypatch.setitem(BACKWARD_KERNELS, (SM90, dt, False), (V10_ATOMIC[dt],))


def old_names(dtype: str, mask: str, deterministic: bool, arch: str, smem: int, headdim: int) -> tuple:
    [rows] = [rows for name, m, det, devices, rows in OLD_CHOICES
              if (name, m, det) == (dtype, mask, deterministic) and (arch, smem) in devices]
    return next(names for bound, names in rows if headdim <= bound)


# Files of the old tree that held several kernels: kernels_cu/<kernel>.cu each now.
SPLIT_SOURCES = ("flash_bwd_mma.cu", "flash_bwd_simt.cu")


def old_spec(name: str) -> tuple:
    """(source, expression, threads, shared memory bytes, arch) of the old table, the dQ mode in
    the DqAdd spelling: the dK/dV kernels' last template argument ATOMIC_DQ true / false is
    DqAdd::atomic / none, the fused kernel's tenth, DQ_ORDERED true / false, DqAdd::ordered /
    atomic (the names say which: _dqatomic, _dqordered); a source of SPLIT_SOURCES is the kernel's
    own file."""
    source, expression, *rest = OLD_SPECS[name]
    if source in SPLIT_SOURCES:
        source = expression.removeprefix("cf::").split("<", 1)[0] + ".cu"
    if name.startswith("flash_bwd_dkdv_mma"):
        dq_add = "atomic" if name.endswith("_dqatomic") else "none"
        flag = re.search(r", (true|false)>$", expression)
        assert flag and (flag.group(1) == "true") == (dq_add == "atomic"), name
        expression = f"{expression[:flag.start()]}, cf::DqAdd::{dq_add}>"
    elif name.startswith("flash_bwd_fused_mma"):
        head, args = expression[:-1].split("<", 1)
        args = args.split(", ")
        assert args[9] == ("true" if "_dqordered" in name else "false"), name
        args[9] = "cf::DqAdd::" + ("ordered" if "_dqordered" in name else "atomic")
        expression = f"{head}<{', '.join(args)}>"
    elif name.startswith("flash_bwd_dkdv_simt"):
        # Since the recomputed statistics the SIMT dK/dV kernel stages four values per query row
        # (top, weight, dP reference, D), not two (lse, D): softmax_bwd.cuh's RowStats.
        threads, smem, arch = rest
        block_m = int(re.search(r"_bm(\d+)_", name).group(1))
        rest = [threads, smem + 2 * block_m * (8 if "_fp64_" in name else 4), arch]
    return (source, expression, *rest)


def old_launch(name: str, headdim: int) -> tuple:
    """(name, source, expression, threads, shared memory bytes, arch, grid) of the old table."""
    grid = OLD_GRIDS[(name, headdim) if "_convert" in name else name]
    return (name, *old_spec(name), grid)


def planned(plan) -> tuple:
    """The plan's launches on the recorder's SHAPE, in OLD_* terms."""
    batch, seqlen_q, seqlen_k, nheads, nheads_kv = RECORDER.SHAPE
    return tuple((s.name, s.source_file, s.expression, s.threads, s.smem_bytes, s.arch, grid)
                 for s, grid in plan.grids(batch, seqlen_q, seqlen_k, nheads, nheads_kv))


def test_old_tables_cover_every_device_once():
    for dtype, mask, deterministic in itertools.product(SUPPORTED, MASKS, (True, False)):
        devices = [d for name, m, det, ds, _ in OLD_CHOICES if (name, m, det) == (dtype, mask, deterministic)
                   for d in ds]
        assert sorted(devices) == sorted(itertools.product(ARCHS, SMEM_OPTINS))
    assert all(rows[-1][0] == 256 for *_, rows in OLD_CHOICES)


@pytest.mark.parametrize("dtype", list(SUPPORTED))
def test_the_plan_is_the_old_dispatch_choice(dtype, monkeypatch):
    """Every (arch, opt-in shared memory, head dim 1..256, mask, deterministic): the plan's kernels in
    launch order are the old choice, with the old specializations, and at each head-dim tile the
    old grids. The tensor-core plans see the head dim padded to a multiple of 8, as the dispatcher
    pads it; the SIMT plans do not depend on the device, so every head dim is checked on one. A
    window's own rows (LOCAL_BACKWARD_KERNELS, test_a_window_has_its_own_backward_row) and the producer
    rows set aside."""
    monkeypatch.setattr(backward_plans, "LOCAL_BACKWARD_KERNELS", {})
    set_aside_the_producer_rows(monkeypatch)
    compared = 0
    tensor_cores = SUPPORTED[dtype].itemsize == 2
    for arch, smem in itertools.product(ARCHS, SMEM_OPTINS):
        head_dims = range(1, 257) if tensor_cores or (arch, smem) == (ARCHS[0], SMEM_OPTINS[0]) else \
            RECORDER.grid_head_dims(SUPPORTED[dtype])
        for headdim, (mask, policy), deterministic in itertools.product(head_dims, MASKS.items(), (True, False)):
            # float64 and float32 run the DMMA kernels up to d128 now (tests/kernels/
            # test_flash_bwd_dmma.py); their SIMT plans, the old choice everywhere, stay what they were
            plan = plan_backward(arch, SUPPORTED[dtype], headdim, policy, smem, deterministic,
                                 family="simt" if dtype in ("float32", "float64") else None)
            seen = plans.mma_headdim(headdim) if tensor_cores else headdim
            names = old_names(dtype, mask, deterministic, arch, smem, seen)
            assert tuple(launch.spec.name for launch in plan.launches) == names, (arch, smem, headdim, mask)
            assert all((s.source_file, s.expression, s.threads, s.smem_bytes, s.arch) == old_spec(s.name)
                       for s in (launch.spec for launch in plan.launches))
            if seen in RECORDER.grid_head_dims(SUPPORTED[dtype]):
                assert planned(plan) == tuple(old_launch(name, seen) for name in names)
            assert plan.deterministic or not deterministic
            compared += 1
    assert compared >= 3 * 2 * 256 * (len(ARCHS) * len(SMEM_OPTINS) if tensor_cores else 1)


@pytest.mark.parametrize("dtype", list(SUPPORTED))
def test_the_launchers_launch_their_plan(dtype, monkeypatch):
    """mma_bwd.backward and simt.backward (stand-in arrays, launches recorded) launch the old
    kernels with the old grids, in the old order, at each head-dim tile and at two head dims
    between tiles, on every device (a window's own rows and the producer rows set aside, as in the
    test above)."""
    monkeypatch.setattr(backward_plans, "LOCAL_BACKWARD_KERNELS", {})
    set_aside_the_producer_rows(monkeypatch)
    for arch, smem in itertools.product(ARCHS, SMEM_OPTINS):
        for headdim, mask, deterministic in itertools.product(
                (*RECORDER.grid_head_dims(SUPPORTED[dtype]), 40, 200), MASKS, (True, False)):
            launched = RECORDER.launches(arch, smem, SUPPORTED[dtype], headdim, mask, deterministic)
            names = old_names(dtype, mask, deterministic, arch, smem, headdim)
            assert tuple(name for name, *_ in launched) == names, (arch, smem, headdim, mask, deterministic)
            if headdim in RECORDER.grid_head_dims(SUPPORTED[dtype]):
                assert launched == tuple(old_launch(name, headdim) for name in names)
            # simt.backward asks for the SIMT plan (float32's and float64's defaults run the DMMA
            # kernels up to d128)
            plan = plan_backward(arch, SUPPORTED[dtype], headdim, MASKS[mask], smem, deterministic,
                                 family="simt" if dtype in ("float32", "float64") else None)
            assert launched == planned(plan)


def test_one_row_answers_what_runs():
    """What runs on sm_90 at d128 with deterministic=True is one row of BACKWARD_KERNELS."""
    plan = plan_backward("90", SUPPORTED["bfloat16"], 128, Causal(), 227 * 1024, True)
    assert plan.kernels is BACKWARD_KERNELS[(SM90, 128, True)][0]
    assert (plan.device_class, plan.d_tile, plan.dq_add) == (SM90, 128, "none")
    assert [launch.spec.name for launch in plan.launches] == [
        "flash_bwd_preprocess_bf16", "flash_bwd_wgmma_ws_bf16_hdim128_causal_bm64_bn128_s3_pingpong",
        "flash_bwd_dq_wgmma_ws_bf16_hdim128_causal_bm128_bn64_s3_pingpong"]
    # the fused kernel does not fit 163 KiB at d256: the row's second entry
    assert plan_backward("80", SUPPORTED["float16"], 256, NoMask(), 163 * 1024, False).kernels is \
        BACKWARD_KERNELS[(MMA_SYNC, 256, False)][1]
    assert plan_backward(None, SUPPORTED["float16"], 256, NoMask(), None, False).kernels is \
        BACKWARD_KERNELS[(MMA_SYNC, 256, False)][0]
    anchors = _perf_log_anchors()
    for (where, dt, deterministic), rows in BACKWARD_KERNELS.items():
        assert where in (SM90, MMA_SYNC) and dt in backward_plans.D_TILES and rows
        for row in rows:
            assert row.perf_log in anchors
            assert row.dq_add != "atomic" or not deterministic
            assert backward_plans.backward_plan(SUPPORTED["bfloat16"], dt, Causal(), row).kernels == row


def test_the_producer_rows_run_v10s_work_split():
    """v13 (perf log wgmma-bwd-ws-route): sm_90 d64 / d128 with determinism runs the producer
    kernels for no mask, causal, the score variants and (d64) a window or a packed causal batch; at
    d64 softcap, dropout and user modifiers on 64-query dK/dV blocks (a user modifier's row before
    the compile check's choice, without_spills); a window at d128 v11's 64 x 64 rows, a packed
    causal batch there the pair (v16); without determinism the pair too (faster than the atomic
    rows, perf log wgmma-bwd-ws-nondet and wgmma-bwd-ws-nondet-d64)."""
    from cupyflash.modifiers import example_modifiers

    def kernels(dt, mask, deterministic=True):
        planned = plan_backward("90", SUPPORTED["bfloat16"], dt, mask, 227 * 1024, deterministic)
        return planned.kernels.dkdv, planned.kernels.dkdv_tiles, planned.kernels.dq

    user = Score(user=example_modifiers())
    for dt in (64, 128):
        route = BACKWARD_KERNELS[(SM90, dt, True)][0]
        for score in (Score(), Score(alibi=True), Score(sink=True).backward(), Score(softcap=True),
                      Score(dropout=True)):
            tiles = backward_plans.WGMMA_WS_VARIANT_D64 if dt == 64 and (score.softcap or score.dropout) \
                else route.dkdv_tiles
            assert kernels(dt, Causal(score=score)) == ("wgmma_ws", tiles, "dq_wgmma_ws"), (dt, score)
        row = backward_plans._without_spills(route, Causal(score=user), dt)
        assert (row.dkdv, row.dq) == ("wgmma_ws", "dq_wgmma_ws")
        assert kernels(dt, Causal(), False) == kernels(dt, Causal())
    assert kernels(64, Local(100, 3))[::2] == kernels(64, Causal(packed=True))[::2] == ("wgmma_ws", "dq_wgmma_ws")
    assert kernels(128, Local(100, 3)) == ("wgmma", (64, 64), "dq_wgmma")
    for score in (Score(), Score(alibi=True), Score(softcap=True), Score(dropout=True)):
        for deterministic in (True, False):
            assert (kernels(128, Causal(score=score, packed=True), deterministic)
                    == kernels(128, Causal(score=score), deterministic)), (score, deterministic)
            assert kernels(128, Causal(score=score, packed=True), deterministic)[::2] == ("wgmma_ws", "dq_wgmma_ws")


def _perf_log_anchors():
    sys.path.insert(0, str(REPO / "tests"))
    from test_docs import heading_anchors

    return heading_anchors(REPO / "docs" / "perf-log.md")


def test_deterministic_has_one_encoding():
    """The plan's dq_add says how dQ is formed; the plan is deterministic where it is not "atomic"
    (a row may be deterministic where determinism is not asked for, never the reverse), and every
    launch of a plan follows from it: a dQ kernel exactly where the dK/dV kernel adds none,
    a convert kernel exactly where it adds."""
    for (where, dt, deterministic), rows in BACKWARD_KERNELS.items():
        for row in rows:
            plan = backward_plans.backward_plan(SUPPORTED["float16"], dt, NoMask(), row)
            roles = [launch.role for launch in plan.launches]
            assert plan.deterministic or not deterministic  # sm_90 d256 runs its deterministic kernels
            assert ("dq" in roles) == (plan.dq_add == "none") != ("convert" in roles)
            name = plan.spec("dkdv").name
            if row.dkdv == "wgmma":
                assert name.endswith(f"_dq{plan.dq_add}")
            else:
                assert ("_dqatomic" in name) == (plan.dq_add == "atomic")
    with pytest.raises(ValueError, match="unknown dQ add mode"):
        backward_plans.backward_plan(SUPPORTED["float16"], 64, NoMask(),
                                     backward_plans.BackwardKernels("wgmma", (128, 128), "sorted"))
    with pytest.raises(ValueError, match="exactly where"):
        backward_plans.backward_plan(SUPPORTED["float16"], 64, NoMask(),
                                     backward_plans.BackwardKernels("wgmma", (128, 128), "none"))


def test_plans_refuse_what_no_kernel_runs():
    with pytest.raises(ValueError, match="unknown backward family"):
        plan_backward("90", SUPPORTED["bfloat16"], 64, NoMask(), None, True, family="wgmma")
    with pytest.raises(ValueError, match="does not support dtype float32"):
        backward_plans.backward_plan(SUPPORTED["float32"], 64, NoMask(), BACKWARD_KERNELS[(SM90, 64, True)][0])
    with pytest.raises(ValueError, match="headdim 257"):
        plan_backward("80", SUPPORTED["float32"], 257, NoMask(), None, True)


def test_the_compile_check_sees_the_same_specializations():
    """The plain kernels the old compile check built, and with the score variants of
    masks.VARIANT_KINDS and the packed batches of masks.PACKED_KINDS exactly the kernels the plans
    launch for them."""
    names = [s.name for s in mma_bwd.specializations()]
    scored = [n for n in names if any(f"_{part}_" in n for part in ("softcap", "alibi", "sink", "packed", "dropout"))
              or "_mod_" in n]
    plain = [n for n in names if n not in scored]
    # a window's own rows (LOCAL_BACKWARD_KERNELS) in place of the old choice's local kernels there,
    # and the producer rows' kernels (v13) beside v10's, which stay for the variants and dev/; with a
    # window at d64 the producer kernels in place of v10's pair and atomic row (v15)
    own = {launch.spec.name for dtype in ("float16", "bfloat16") for det in (True, False)
           for launch in plan_backward("90", SUPPORTED[dtype], 128, Local(), None, det).launches
           if launch.role in ("dkdv", "dq")}
    own |= {launch.spec.name for dtype in ("float16", "bfloat16") for dt in (64, 128)
            for mask in (NoMask(), Causal(), Local())
            for launch in plan_backward("90", SUPPORTED[dtype], dt, mask, None, True).launches
            if launch.role in ("dkdv", "dq")}
    old = {n for n in OLD_COMPILE_CHECK if "_local_" in n and "wgmma" in n
           and ("_hdim128_" in n or "_hdim64_" in n)}
    assert len(names) == len(set(names)) and sorted(plain) == sorted(set(OLD_COMPILE_CHECK) - old | own)
    launched = {launch.spec.name for mask in masks.VARIANT_KINDS + masks.PACKED_KINDS
                for dtype in ("float16", "bfloat16")
                for dt in (64, 128, 256) for arch, smem in (("80", None), ("90", None), ("80", 0))
                for det in (True, False)
                for launch in plan_backward(arch, SUPPORTED[dtype], dt, mask.backward(), smem, det).launches
                if launch.role in ("dkdv", "dq")}
    assert set(scored) == launched
    shipped = {s for s, *_ in OLD_SPECS.items() if s.startswith("flash_bwd_") and "simt" not in s
               and "preprocess" not in s}
    assert shipped - old <= set(names)


@pytest.mark.gpu
def test_the_plan_of_this_device_fits_it():
    """The launcher's plan is plan_backward's for the device's numbers, for its arch, and fits its
    shared memory where the old dispatch's did (sm_86 / sm_89 refuse d128 and d256 as before)."""
    import cupy

    from cupyflash.kernels import mma_fwd
    from cupyflash.kernels._module import _max_smem_optin, device_arch, runs_on_device

    arch, smem = device_arch(), _max_smem_optin(cupy.cuda.Device().id)
    for dtype, headdim, (mask, policy), deterministic in itertools.product(
            ("float16", "bfloat16"), (24, 64, 96, 128, 256), MASKS.items(), (True, False)):
        plan = plan_backward(arch, SUPPORTED[dtype], headdim, policy, smem, deterministic)
        assert plan == mma_bwd.plan(SUPPORTED[dtype], plan.headdim, policy, deterministic)
        assert (plan.device_class == SM90) == (arch == "90") == (mma_fwd.current_arch() == "90")
        for launch in plan.launches:
            assert runs_on_device(launch.spec)
            assert launch.spec.smem_bytes <= smem or (smem < 160 * 1024 and plan.d_tile > 64), launch.spec.name


def test_a_packed_causal_batch_takes_the_dense_rows():
    """A packed causal batch plans as the dense causal batch of its shape (v16, perf log
    varlen-bwd-pair): at sm_90 d128 the producer pair, not v12's 64 x 64 row (measured 1.10x
    slower than the pair on the varlen bench), whatever the score and determinism, and at d64 too.
    (mma.sync devices give packed batches their deterministic rows: test_packed_launches.)"""
    assert not hasattr(backward_plans, "PACKED_CAUSAL_BACKWARD_KERNELS")
    for score in (Score(), Score(alibi=True), Score(sink=True), Score(dropout=True), Score(softcap=True)):
        for deterministic in (True, False):
            for arch, smem, dtype, headdim in (("90", 227 * 1024, "bfloat16", 128), ("90", 227 * 1024, "float16", 96),
                                               ("90", 227 * 1024, "bfloat16", 64)):
                packed = plan_backward(arch, SUPPORTED[dtype], headdim, Causal(score=score, packed=True), smem,
                                       deterministic)
                dense = plan_backward(arch, SUPPORTED[dtype], headdim, Causal(score=score), smem, deterministic)
                assert packed.kernels.dkdv == dense.kernels.dkdv, (arch, headdim, score, deterministic)
                assert packed.kernels.dkdv_tiles == dense.kernels.dkdv_tiles, (arch, headdim, score)
                assert packed.kernels.dq == dense.kernels.dq, (arch, headdim, score, deterministic)
                if headdim > 64:
                    names = [launch.spec.name for launch in packed.launches]
                    assert any("flash_bwd_wgmma_ws_" in n for n in names), names
                    assert any("flash_bwd_dq_wgmma_ws_" in n for n in names), names


def test_a_window_has_its_own_backward_row():
    """A sliding window (Local, any window, score and packing) at sm_90 d128 runs
    LOCAL_BACKWARD_KERNELS' row whether deterministic or not: dK/dV on 64 x 64 blocks without dQ
    adds, dQ by flash_bwd_dq_wgmma on 64 x 64; the causal band, other head dims and mma.sync
    devices keep BACKWARD_KERNELS' rows."""
    row = backward_plans.LOCAL_BACKWARD_KERNELS[(SM90, 128)]
    assert (row.dkdv, row.dkdv_tiles, row.dq_add, row.dq, row.dq_tiles) == ("wgmma", (64, 64), "none", "dq_wgmma",
                                                                           (64, 64, 2))
    for mask in (Local(1024, 0), Local(512, 512), Local(-1, 7), Local(score=Score(alibi=True)), Local(3, 3).as_packed()):
        for deterministic in (True, False):
            for dtype, headdim in (("bfloat16", 128), ("float16", 96)):
                plan = plan_backward("90", SUPPORTED[dtype], headdim, mask, 227 * 1024, deterministic)
                names = [launch.spec.name for launch in plan.launches]
                assert any("flash_bwd_wgmma_" in n and n.endswith("_bm64_bn64_dqnone") for n in names), names
                assert any("flash_bwd_dq_wgmma_" in n and n.endswith("_bm64_bn64_k2") for n in names), names
            band = Causal(score=mask.score, packed=mask.packed)
            for arch, smem, headdim in (("90", 227 * 1024, 64), ("90", 227 * 1024, 256), ("80", 163 * 1024, 128)):
                ours = [launch.spec.name.replace("_local_", "_") for launch in
                        plan_backward(arch, SUPPORTED["bfloat16"], headdim, mask, smem, deterministic).launches]
                causal = [launch.spec.name.replace("_causal_", "_") for launch in
                          plan_backward(arch, SUPPORTED["bfloat16"], headdim, band, smem, deterministic).launches]
                assert ours == causal, (arch, headdim, mask)

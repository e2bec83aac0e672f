"""kernels_cu/wgmma.cuh holds exactly the wrappers cupyflash/kernels/wgmma_wrappers.py writes."""
from __future__ import annotations

import re

from cupyflash.kernels import wgmma_wrappers


def test_header_holds_the_generated_wrappers():
    text = wgmma_wrappers.header_path().read_text()
    assert wgmma_wrappers.generated_block(text) == wgmma_wrappers.wrappers(), (
        "kernels_cu/wgmma.cuh is out of date: python -m cupyflash.kernels.wgmma_wrappers")


def test_operand_numbering_matches_the_constraint_lists():
    # In each asm statement the highest %N must be the last operand: accumulators, then the
    # descriptors / A registers, the accumulate flag and the immediates.
    for n in wgmma_wrappers.WIDTHS:
        block = wgmma_wrappers._specialization("bf16_t", "bf16", n)
        for asm in re.findall(r"asm volatile\((.*?)\);", block, re.S):
            used = max(int(i) for i in re.findall(r"%(\d+)", asm))
            constraints = len(re.findall(r'"[+=]?[flrn]"\(', asm))
            assert used == constraints - 1, (n, used, constraints)


def test_tf32_header_holds_the_generated_wrappers():
    text = wgmma_wrappers.header_path("wgmma_tf32.cuh").read_text()
    assert wgmma_wrappers.generated_block(text) == wgmma_wrappers.tf32_wrappers(), (
        "kernels_cu/wgmma_tf32.cuh is out of date: python -m cupyflash.kernels.wgmma_wrappers")


def test_tf32_operand_numbering_matches_the_constraint_lists():
    for n in wgmma_wrappers.WIDTHS:
        block = wgmma_wrappers._tf32_specialization(n)
        for asm in re.findall(r"asm volatile\((.*?)\);", block, re.S):
            used = max(int(i) for i in re.findall(r"%(\d+)", asm))
            constraints = len(re.findall(r'"[+=]?[flrn]"\(', asm))
            assert used == constraints - 1, (n, used, constraints)

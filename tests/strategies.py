"""The shipped Hypothesis strategies (cupyflash.testing.strategies) under the names the tests use:
cupyflash fuzzes itself with what it ships."""
from __future__ import annotations

from cupyflash.testing.problem import DTYPES
from cupyflash.testing.problem import AttentionProblem as AttentionCase
from cupyflash.testing.strategies import (
    CPU_MAX_COST,
    HEADDIMS,
    MAX_LOGIT_STD,
    MAX_SEQLEN,
    SEQLENS,
    attention_problems,
)

__all__ = ["AttentionCase", "CPU_MAX_COST", "DTYPES", "HEADDIMS", "MAX_LOGIT_STD", "MAX_SEQLEN",
           "SEQLENS", "attention_case", "make_inputs"]


def attention_case(*, dtypes=DTYPES, max_cost=CPU_MAX_COST, max_seqlen=MAX_SEQLEN, max_headdim=256):
    """attention_problems with the project's defaults: every dtype, causal or not, GQA groups up to
    3, seqlens 1..max_seqlen, the CPU cost bound."""
    return attention_problems(dtypes=dtypes, max_cost=max_cost, max_seqlen=max_seqlen,
                              max_headdim=max_headdim)


def make_inputs(case: AttentionCase):
    """(q, k, v, do): NumPy arrays of case.dtype, standard normal times case.magnitude."""
    return case.arrays()

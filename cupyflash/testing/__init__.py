"""The oracle cupyflash tests itself with, for testing attention code of your own.

- ``AttentionProblem``: shapes, GQA grouping, dtype, causal mask, softmax scale, input magnitude
  and the seed of the inputs; ``problem.arrays()`` gives (q, k, v, do).
- ``assert_attention_close(problem, o, lse=None, grads=None)``: compares with the float64
  reference (``cupyflash.reference``) under flash-attn's tolerance rule (``tolerance``), and
  raises one readable AssertionError naming every output that fails.
- ``strategies.attention_problems(...)``: Hypothesis strategies of AttentionProblems with keyword
  bounds (needs Hypothesis; importing this package does not import it).
- ``poisoned_outputs()`` makes every GPU output buffer cupyflash allocates start as NaN instead of
  uninitialised memory, so an element a kernel forgets to write fails a comparison instead of
  passing by luck.

See docs/testing.md for a worked example.
"""
from __future__ import annotations

import contextlib
import threading

from .problem import AttentionProblem, as_numpy
from .tolerance import assert_attention_close, assert_close

__all__ = [
    "AttentionProblem",
    "as_numpy",
    "assert_attention_close",
    "assert_close",
    "attention_problems",
    "poison_enabled",
    "poisoned_outputs",
]

_state = threading.local()


def poison_enabled() -> bool:
    return getattr(_state, "poison", False)


@contextlib.contextmanager
def poisoned_outputs(enabled: bool = True):
    previous = poison_enabled()
    _state.poison = enabled
    try:
        yield
    finally:
        _state.poison = previous


def __getattr__(name):
    # attention_problems lives with Hypothesis, which is imported only when it is asked for.
    if name == "attention_problems":
        from .strategies import attention_problems

        return attention_problems
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

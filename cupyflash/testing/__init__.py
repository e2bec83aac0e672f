"""The oracle cupyflash tests itself with, for testing attention code of your own.

- ``AttentionProblem``: shapes, GQA grouping, dtype, causal mask, softmax scale, input magnitude
  and the seed of the inputs; ``problem.arrays()`` gives (q, k, v, do).
- ``assert_attention_close(problem, o, lse=None, grads=None)``: compares with the float64
  reference (``cupyflash.reference``) under flash-attn's tolerance rule (``tolerance``), and
  raises one readable AssertionError naming every output that fails.
- ``strategies.attention_problems(...)``: Hypothesis strategies of AttentionProblems with keyword
  bounds (needs Hypothesis; importing this package does not import it).
- ``VarlenProblem`` / ``KVCacheProblem`` (``testing.packed``): packed variable-length batches
  and KV-cache decoding steps; ``assert_varlen_close`` / ``assert_kvcache_close`` apply the same
  rule to them, and ``strategies.varlen_problems`` / ``strategies.kvcache_problems`` draw them.
- ``poisoned_outputs()`` makes every GPU output buffer cupyflash allocates start as NaN instead of
  uninitialised memory, so an element a kernel forgets to write fails a comparison instead of
  passing by luck.

See docs/testing.md for a worked example.
"""
from __future__ import annotations

import contextlib
import threading

from .packed import KVCacheProblem, VarlenProblem
from .problem import AttentionProblem, as_numpy
from .tolerance import assert_attention_close, assert_close, assert_kvcache_close, assert_varlen_close

__all__ = [
    "AttentionProblem",
    "KVCacheProblem",
    "VarlenProblem",
    "as_numpy",
    "assert_attention_close",
    "assert_close",
    "assert_kvcache_close",
    "assert_varlen_close",
    "attention_problems",
    "kvcache_problems",
    "poison_enabled",
    "poisoned_outputs",
    "varlen_problems",
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
    # The strategies live with Hypothesis, which is imported only when one is asked for.
    if name in ("attention_problems", "varlen_problems", "kvcache_problems"):
        from . import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

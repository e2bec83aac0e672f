"""Fuzz a user's score / mask modifier against the float64 reference, before timing it.

    import cupyflash as cf
    from cupyflash.testing.modifiers import fuzz_modifier

    def rel_bias(score, b, h, q_idx, kv_idx, table):
        return score + table[h, q_idx - kv_idx + 511]

    def make_score_mod(problem):                 # tensors sized for each drawn problem
        table = np.random.default_rng(0).standard_normal((problem.nheads, 1024)).astype(np.float32)
        return cf.ScoreMod(rel_bias, table=table)

    fuzz_modifier(score_mod=make_score_mod, max_seqlen=512, max_examples=50)

Each example draws an attention problem (dtype, shapes, GQA, causal, scale, inputs: the
strategies of cupyflash's own tests), runs ``flash_attn_func`` and ``flash_attn_backward`` with
the modifiers (on the GPU where there is one, else the NumPy twin: ``backend``), and checks o, lse
and the gradients against ``cupyflash.reference`` in float64 under the tolerance rule
(``assert_attention_close``); Hypothesis shrinks a failure to a small problem. The reference
calls the modifier's own Python function on NumPy arrays, so a tracer or kernel error shows, not
only a numerical one. A modifier or a factory ``f(problem) -> modifier`` (one parameter) may be
given for each of score_mod and mask_mod; a mask factory may return a BlockMask. Needs Hypothesis.
"""
from __future__ import annotations

import inspect
from dataclasses import replace

try:
    from hypothesis import given, settings
    from hypothesis import seed as hypothesis_seed
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("cupyflash.testing.modifiers needs Hypothesis: pip install hypothesis") from exc

from .strategies import attention_problems
from .tolerance import assert_attention_close

__all__ = ["fuzz_modifier", "check_modifier"]


def _is_factory(x) -> bool:
    if x is None or not callable(x) or not inspect.isfunction(x) and not inspect.ismethod(x):
        return False
    return len(inspect.signature(x).parameters) == 1


def check_modifier(problem, score_mod=None, mask_mod=None, *, backend: str = "auto", deterministic: bool = True):
    """One problem: cupyflash with the modifiers (mask_mod may be a BlockMask) against the float64
    reference, forward (o, lse) and backward (dq, dk, dv); an AssertionError says what failed."""
    import cupyflash as cf
    from ..modifiers import BlockMask

    q, k, v, do = problem.arrays()
    mods = {"score_mod": score_mod}
    mods["block_mask" if isinstance(mask_mod, BlockMask) else "mask_mod"] = mask_mod
    o, lse = cf.flash_attn_func(q, k, v, **problem.kwargs, **mods, return_lse=True, backend=backend)
    grads = cf.flash_attn_backward(do, q, k, v, o, lse, **problem.kwargs, **mods, backend=backend,
                                   deterministic=deterministic)
    mask_for_reference = mask_mod.mask_mod if isinstance(mask_mod, BlockMask) else mask_mod
    assert_attention_close(problem, o, lse, grads, variant={"score_mod": score_mod, "mask_mod": mask_for_reference})


def fuzz_modifier(score_mod=None, mask_mod=None, *, dtypes=("float16", "bfloat16", "float32"), causal=None,
                  windows: bool = False, max_seqlen: int = 130, seqlen: int | None = None, batch: int | None = None,
                  nheads: int | None = None, headdims=None, max_examples: int = 30, backend: str = "auto",
                  deterministic: bool = True, seed: int | None = None) -> None:
    """Run ``check_modifier`` on ``max_examples`` drawn problems. ``seqlen`` / ``batch`` /
    ``nheads`` pin those sizes (for modifiers whose tensors have fixed shapes; nheads pins the
    query heads, without GQA); ``dtypes``, ``causal``, ``windows``, ``headdims``: as
    cupyflash.testing.strategies.attention_problems; ``seed``: a reproducible run."""
    if score_mod is None and mask_mod is None:
        raise ValueError("fuzz_modifier needs a score_mod or a mask_mod (or a factory of one)")
    problems = attention_problems(dtypes=dtypes, causal=causal, windows=windows,
                                  min_seqlen=seqlen if seqlen is not None else 1,
                                  max_seqlen=seqlen if seqlen is not None else max_seqlen,
                                  same_seqlens=seqlen is not None, headdims=headdims,
                                  max_batch=batch or 3, max_heads_kv=nheads or 3, max_group=1 if nheads else 3)

    def pinned(problem):
        if batch is not None:
            problem = replace(problem, batch=batch)
        if nheads is not None:
            problem = replace(problem, nheads_kv=nheads, group=1)
        return problem

    @settings(max_examples=max_examples, deadline=None, database=None)
    @given(problems.map(pinned))
    def run(problem):
        made_score = score_mod(problem) if _is_factory(score_mod) else score_mod
        made_mask = mask_mod(problem) if _is_factory(mask_mod) else mask_mod
        check_modifier(problem, made_score, made_mask, backend=backend, deterministic=deterministic)

    if seed is not None:
        run = hypothesis_seed(seed)(run)
    run()

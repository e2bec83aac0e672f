"""cupyflash as a timed region.

A runner is a context manager that prepares one (implementation, case) pair and yields
``run(i)``, which enqueues one timed region on the current stream using input set i. What the
region contains, per mode:

* fwd: ``flash_attn_func`` (o only, as in inference);
* bwd: ``flash_attn_backward`` alone, with o and lse of every input set computed beforehand;
* fwd+bwd: both, back to back.

Preparing calls the region once: an unsupported case is raised as ``Rejected`` before any
timing, and that first call also absorbs compilation.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager

from .impls import TF32, Rejected
from .shapes import Case

# What the public API raises for a combination it does not support (dtype, headdim, backend).
REJECTIONS = (ValueError, NotImplementedError, TypeError)


def api(backend: str, case: Case, *, softmax_scale=None, deterministic=True):
    """(forward, backward) of the public API with this case's options bound; the pseudo-backend
    "tf32" is backend "auto" with precision="tf32" (cupyflash.precision)."""
    import cupyflash

    backend, precision = ("auto", "tf32") if backend == TF32 else (backend, None)
    fwd = functools.partial(cupyflash.flash_attn_func, softmax_scale=softmax_scale,
                            causal=case.causal, backend=backend, precision=precision)
    bwd = functools.partial(cupyflash.flash_attn_backward, softmax_scale=softmax_scale,
                            causal=case.causal, backend=backend, deterministic=deterministic, precision=precision)
    return fwd, bwd


@contextmanager
def cupyflash_runner(backend: str, case: Case, inputs, *, softmax_scale=None,
                     deterministic=True):
    fwd, bwd = api(backend, case, softmax_scale=softmax_scale, deterministic=deterministic)
    try:
        if case.mode == "fwd":
            def run(i):
                s = inputs[i]
                fwd(s.q, s.k, s.v)
        elif case.mode == "bwd":
            saved = [fwd(s.q, s.k, s.v, return_lse=True) for s in inputs]

            def run(i):
                s = inputs[i]
                o, lse = saved[i]
                bwd(s.do, s.q, s.k, s.v, o, lse)
        else:
            def run(i):
                s = inputs[i]
                o, lse = fwd(s.q, s.k, s.v, return_lse=True)
                bwd(s.do, s.q, s.k, s.v, o, lse)
        run(0)
    except REJECTIONS as exc:
        raise Rejected(f"{type(exc).__name__}: {exc}") from exc
    yield run


def cupyflash_outputs(backend: str, case: Case, inputs, *, softmax_scale=None,
                      deterministic=True) -> dict:
    """o and lse, plus dq, dk, dv unless the case is forward-only, for one input set."""
    fwd, bwd = api(backend, case, softmax_scale=softmax_scale, deterministic=deterministic)
    o, lse = fwd(inputs.q, inputs.k, inputs.v, return_lse=True)
    outputs = {"o": o, "lse": lse}
    if case.mode != "fwd":
        outputs.update(zip(("dq", "dk", "dv"),
                           bwd(inputs.do, inputs.q, inputs.k, inputs.v, o, lse)))
    return outputs

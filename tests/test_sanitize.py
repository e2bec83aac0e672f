"""cupyflash.sanitize's workload on CPU: the variants' calls (issue 16: the sanitizer with variant
cases in its workload) are valid calls of the public API, run here on the NumPy twin with the
arguments the GPU workload passes, so a bad argument is found before a sanitizer run."""
from __future__ import annotations

import numpy as np
import pytest

from cupyflash import api, sanitize, varlen


def test_the_variant_calls_name_every_variant():
    """VARIANT_CALLS holds softcap, ALiBi (with a window), a sink, dropout and both user modifiers."""
    keys = set().union(*(spec for _, spec in sanitize.VARIANT_CALLS))
    assert {"softcap", "alibi", "sink", "dropout_p", "score_mod", "mask_mod", "window_size"} <= keys


@pytest.mark.parametrize("family", ["simt", "mma"])
@pytest.mark.parametrize("quick", [False, True])
def test_the_variants_workload_runs_on_the_numpy_twin(family, quick, monkeypatch):
    """Each of the workload's calls, forward and backward, on backend="numpy": no NaN out, a
    dsink where a sink is passed; the mma family adds v's own head dim and a packed batch."""
    seen = []

    def recording(function):
        def call(*args, **kwargs):
            assert kwargs["backend"] == "numpy"
            out = function(*args, **kwargs)
            for x in out if isinstance(out, tuple) else (out,):  # (lse is -inf on a row without keys)
                assert not np.isnan(np.asarray(x, np.float64)).any()
            seen.append((function.__name__, kwargs.get("sink") is not None, len(out) if isinstance(out, tuple) else 1))
            return out
        return call

    for module, name in ((api, "flash_attn_func"), (api, "flash_attn_backward"),
                         (varlen, "flash_attn_varlen_func"), (varlen, "flash_attn_varlen_backward")):
        monkeypatch.setattr(module, name, recording(getattr(module, name)))
    calls = sanitize._variants_workload(np.random.default_rng(0), family, quick, backend="numpy",
                                        to_device=np.asarray)
    shapes = len(sanitize.VARIANT_CALLS) * (1 if quick else 2)
    assert calls == shapes + (2 if family == "mma" else 0)
    names = [name for name, _, _ in seen]
    assert names.count("flash_attn_func") == names.count("flash_attn_backward") == shapes + (family == "mma")
    assert names.count("flash_attn_varlen_func") == names.count("flash_attn_varlen_backward") == (family == "mma")
    # with a sink the backward returns dsink too
    assert {n for name, sink, n in seen if name == "flash_attn_backward" and sink} == {4}
    assert {n for name, sink, n in seen if name == "flash_attn_backward" and not sink} == {3}


def test_every_name_the_gpu_workload_reads_exists():
    """The workload's GPU-only functions (the KV-cache calls, the tools' loop) cannot run here, so a
    name one of them reads that is neither a module global, a builtin nor its own local is found
    by reading their code: every global each function and its nested functions load resolves."""
    import builtins
    import dis
    import types

    def loaded_globals(code):
        names = {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                names |= loaded_globals(const)
        return names

    functions = [f for f in vars(sanitize).values()
                 if isinstance(f, types.FunctionType) and f.__module__ == sanitize.__name__]
    assert {"workload", "_kvcache_workload", "_variants_workload", "run"} <= {f.__name__ for f in functions}
    for f in functions:
        missing = {n for n in loaded_globals(f.__code__) if n not in vars(sanitize) and not hasattr(builtins, n)}
        assert not missing, (f.__name__, missing)

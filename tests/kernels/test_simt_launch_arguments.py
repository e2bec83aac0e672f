"""The SIMT family's launch arguments against its kernels' C++ parameter lists, without a GPU:
forward, backward preprocess, dK/dV and dQ run on stand-in arrays with ``launch`` recorded, and
every argument must match its parameter in count and type (pointer, int32, int64, and the
accumulator type for scalars declared ``typename acc_of<T>::type``)."""
import re
import sys
import types

import ml_dtypes
import numpy as np
import pytest

from cupyflash.kernels import _module, simt


class _FakeArray:
    """Shape, dtype and C-order strides of a CuPy array; nothing else is touched."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.strides = tuple(int(np.prod(self.shape[i + 1:])) * self.itemsize for i in range(len(shape)))


def _parameter_types(spec) -> list[str]:
    source = _module.kernel_source(spec.source_file)
    kernel = re.match(r"cf::(\w+)<", spec.expression).group(1)
    params = re.search(r"\b" + kernel + r"\(([^)]*)\)\s*\{", source).group(1)
    return [p.strip().rsplit(" ", 1)[0].replace("__restrict__", "").replace("const", "").strip()
            for p in params.split(",")]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ml_dtypes.bfloat16, np.float16], ids=str)
@pytest.mark.parametrize("deterministic", [True, False])
def test_simt_launch_arguments_match_kernel_signatures(dtype, deterministic, monkeypatch):
    launches = []
    monkeypatch.setattr(simt, "launch", lambda spec, grid, args: launches.append((spec, grid, args)))
    fake_cupy = types.SimpleNamespace(empty=lambda shape, dtype=None: _FakeArray(shape, dtype),
                                      zeros=lambda shape, dtype=None: _FakeArray(shape, dtype),
                                      ascontiguousarray=lambda a, dtype=None: a)
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)

    b, sq, sk, h, hkv, d = 2, 100, 70, 4, 2, 40
    acc = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    q, o, do = (_FakeArray((b, sq, h, d), dtype) for _ in range(3))
    k, v = _FakeArray((b, sk, hkv, d), dtype), _FakeArray((b, sk, hkv, d), dtype)
    lse = _FakeArray((b, h, sq), acc)
    simt.forward(q, k, v, o, lse, softmax_scale=0.1, causal=True)
    simt.backward(do, q, k, v, o, lse, _FakeArray(q.shape, dtype), _FakeArray(k.shape, dtype),
                  _FakeArray(k.shape, dtype), softmax_scale=0.1, causal=True, deterministic=deterministic)

    assert [s.name.split("_")[1:3] for s, _, _ in launches] == [["fwd", "simt"], ["bwd", "preprocess"],
                                                                 ["bwd", "dkdv"], ["bwd", "dq"]]
    kinds = {"int": np.int32, "i64": np.int64, "typename acc_of<T>::type": acc}
    for spec, grid, args in launches:
        types_ = _parameter_types(spec)
        assert len(types_) == len(args), spec.name
        for t, a in zip(types_, args):
            if t.endswith("*"):
                assert isinstance(a, _FakeArray), (spec.name, t, a)
            else:
                assert type(a) is kinds[t], (spec.name, t, type(a))
        assert all(0 < g < 65536 for g in grid)

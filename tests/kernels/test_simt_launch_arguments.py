"""The SIMT family's launch arguments against its kernels' C++ parameter lists, without a GPU:
forward, backward preprocess, dK/dV and dQ run on stand-in arrays with ``launch`` recorded, and
every argument must match its parameter in count and type (pointer, int32, int64, and the
accumulator type for scalars declared ``typename acc_of<T>::type``)."""
import sys
import types

import ml_dtypes
import numpy as np
import pytest

from cupyflash.kernels import simt
from launch_fakes import FakeArray, kernel_parameter_types


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ml_dtypes.bfloat16, np.float16], ids=str)
@pytest.mark.parametrize("deterministic", [True, False])
def test_simt_launch_arguments_match_kernel_signatures(dtype, deterministic, monkeypatch):
    launches = []
    monkeypatch.setattr(simt, "launch", lambda spec, grid, args: launches.append((spec, grid, args)))
    fake_cupy = types.SimpleNamespace(empty=lambda shape, dtype=None: FakeArray(shape, dtype),
                                      zeros=lambda shape, dtype=None: FakeArray(shape, dtype),
                                      ascontiguousarray=lambda a, dtype=None: a)
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)

    b, sq, sk, h, hkv, d = 2, 100, 70, 4, 2, 40
    acc = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    q, o, do = (FakeArray((b, sq, h, d), dtype) for _ in range(3))
    k, v = FakeArray((b, sk, hkv, d), dtype), FakeArray((b, sk, hkv, d), dtype)
    lse = FakeArray((b, h, sq), acc)
    simt.forward(q, k, v, o, lse, softmax_scale=0.1, causal=True)
    simt.backward(do, q, k, v, o, lse, FakeArray(q.shape, dtype), FakeArray(k.shape, dtype),
                  FakeArray(k.shape, dtype), softmax_scale=0.1, causal=True, deterministic=deterministic)

    assert [s.name.split("_")[1:3] for s, _, _ in launches] == [["fwd", "simt"], ["bwd", "preprocess"],
                                                                 ["bwd", "dkdv"], ["bwd", "dq"]]
    kinds = {"int": np.int32, "i64": np.int64, "typename acc_of<T>::type": acc}
    for spec, grid, args in launches:
        types_ = kernel_parameter_types(spec)
        assert len(types_) == len(args), spec.name
        for t, a in zip(types_, args):
            if t.endswith("*"):
                assert isinstance(a, FakeArray), (spec.name, t, a)
            else:
                assert type(a) is kinds[t], (spec.name, t, type(a))
        assert all(0 < g < 65536 for g in grid)

"""Stand-ins for the launch-argument and layout tests, which run without a GPU: an array that has
only a CuPy array's shape, dtype and C-order strides, and a kernel's C++ parameter types read from
its source."""
from __future__ import annotations

import re

import numpy as np


class FakeArray:
    """Shape, dtype and C-order strides of a CuPy array; nothing else is touched."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.strides = tuple(int(np.prod(self.shape[i + 1:])) * self.itemsize for i in range(len(shape)))

    def fill(self, value):
        raise AssertionError("no zero-length input here")


def kernel_parameter_types(spec) -> list[str]:
    """The C++ types of the parameters of ``spec``'s kernel ("T*", "int", "i64", "float", ...)."""
    from cupyflash.kernels import _module

    source = _module.kernel_source(spec.source_file)
    kernel = re.match(r"cf::(\w+)<", spec.expression).group(1)
    params = re.search(r"\b" + kernel + r"\(([^)]*)\)\s*\{", source).group(1)
    return [p.strip().rsplit(" ", 1)[0].replace("__restrict__", "").replace("const", "").strip()
            for p in params.split(",")]

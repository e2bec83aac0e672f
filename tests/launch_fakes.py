"""Stand-ins for the launch tests, which run without a GPU, and the checks of what a launch passes.

Every kernel takes one argument, its direction's params struct (kernels_cu/params.cuh): the
launchers pass a size-1 NumPy array of ``params.FWD_PARAMS`` or ``params.BWD_PARAMS``. Here

* ``FakeArray`` has a CuPy array's shape, dtype, C-order strides, flags and a fake device address
  (``.data.ptr``, distinct per array), nothing else;
* ``LaunchRecorder`` replaces ``launch`` in the launcher modules and CuPy's allocations: it keeps
  every launch (specialization, grid, and a copy of the struct as it was at the launch, as CuPy
  copies the bytes then) and every array allocated;
* ``assert_forward_launch`` / ``assert_backward_launches`` check one call's launches: one argument,
  the right struct for the direction (and the kernel's only parameter is that struct, read from
  its source by name), pointer fields the call's arrays, strides, lengths, window and scales the
  call's, the buffers the plan needs allocated and the others null, one struct for the call.
"""
from __future__ import annotations

import itertools
import math
import re
import sys
import types
from typing import NamedTuple

import numpy as np

from cupyflash.kernels import params as kparams
from cupyflash.kernels.constants import LOG2E
from models.mirrors import kernel_parameters

_ADDRESSES = itertools.count(1)


def fake_address() -> int:
    """A distinct, nonzero, 256-byte aligned device address."""
    return next(_ADDRESSES) << 24


class FakeArray:
    """Shape, dtype, C-order strides and a fake device address of a CuPy array."""

    def __init__(self, shape, dtype, ptr: int | None = None):
        self.shape, self.dtype = tuple(int(s) for s in shape), np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.strides = tuple(int(np.prod(self.shape[i + 1:])) * self.itemsize for i in range(len(shape)))
        self.size = int(np.prod(self.shape))
        self.data = types.SimpleNamespace(ptr=fake_address() if ptr is None else ptr)
        self.flags = types.SimpleNamespace(c_contiguous=True)
        self.zeroed = False

    def fill(self, value):
        raise AssertionError("no zero-length input here")

    def __repr__(self):
        return f"FakeArray({self.shape}, {self.dtype}, ptr={self.data.ptr:#x})"


class Launch(NamedTuple):
    spec: object
    grid: tuple
    args: tuple

    @property
    def params(self) -> np.void:
        return self.args[0][0]


class LaunchRecorder:
    """``launch`` of the launcher modules recorded, CuPy's empty / zeros / ascontiguousarray
    replaced by FakeArray (zeros marks its arrays ``zeroed``)."""

    def __init__(self, monkeypatch, modules=None):
        from cupyflash.kernels import dq_fixed, mma_bwd, mma_fwd, simt

        self.launches: list[Launch] = []
        self.allocations: list[FakeArray] = []
        for module in modules or (mma_fwd, mma_bwd, dq_fixed, simt):
            monkeypatch.setattr(module, "launch", self._record)
        try:
            import cupy
        except ImportError:
            cupy = types.ModuleType("cupy")
            monkeypatch.setitem(sys.modules, "cupy", cupy)
        monkeypatch.setattr(cupy, "empty", self._empty, raising=False)
        monkeypatch.setattr(cupy, "zeros", self._zeros, raising=False)
        monkeypatch.setattr(cupy, "ascontiguousarray", self._ascontiguousarray, raising=False)

    def _record(self, spec, grid, args):
        # the bytes as they are now (CuPy copies them at the launch; ndarray.copy of an aligned
        # struct leaves its padding undefined, hence through bytes)
        copied = tuple(np.frombuffer(bytearray(a.tobytes()), a.dtype).reshape(a.shape) if isinstance(a, np.ndarray)
                       else a for a in args)
        self.launches.append(Launch(spec, tuple(int(g) for g in grid), copied))

    def _empty(self, shape, dtype=np.float32):
        a = FakeArray(shape, dtype)
        self.allocations.append(a)
        return a

    def _zeros(self, shape, dtype=np.float32):
        a = self._empty(shape, dtype)
        a.zeroed = True
        return a

    @staticmethod
    def _ascontiguousarray(a, dtype=None):
        assert dtype is None or np.dtype(dtype) == a.dtype, (a, dtype)
        return a

    def take(self) -> list[Launch]:
        """The launches so far (and forget them and the allocations)."""
        launches, self.launches, self.allocations = self.launches, [], []
        return launches

    def allocation(self, ptr: int) -> FakeArray:
        """The array allocated at address ``ptr`` (it must be one of the call's allocations)."""
        found = [a for a in self.allocations if a.data.ptr == ptr]
        assert len(found) == 1, (f"{ptr:#x} is no allocation of the call", self.allocations)
        return found[0]


# --- the struct of a launch ---------------------------------------------------------------------

STRUCTS = {"fwd": kparams.FWD_PARAMS, "bwd": kparams.BWD_PARAMS}
_CPP = {"fwd": "FwdParams", "bwd": "BwdParams"}


def kernel_name(spec) -> str:
    return re.match(r"cf::(\w+)", spec.expression).group(1)


def assert_one_struct(launch: Launch, direction: str) -> np.void:
    """The launch passes one argument, a (1,) array of its direction's struct dtype; the kernel
    (found by name in kernels_cu/) takes exactly that struct, and the source the spec compiles
    defines it; the grid is launchable. Returns the struct."""
    from cupyflash.kernels._module import kernel_source

    spec, grid, args = launch
    assert len(args) == 1, (spec.name, len(args))
    [p] = args
    assert isinstance(p, np.ndarray) and p.shape == (1,) and p.dtype == STRUCTS[direction], \
        (spec.name, type(p), getattr(p, "dtype", None))
    name = kernel_name(spec)
    assert kernel_parameters(name) == f"const __grid_constant__ {_CPP[direction]} p", (spec.name, direction)
    assert re.search(r"__global__[^;{]*?\b" + name + r"\s*\(\s*const\s+__grid_constant__\s+" + _CPP[direction],
                     kernel_source(spec.source_file)), (spec.name, spec.source_file)
    assert all(0 < g < 2**31 for g in grid) and grid[1] < 65536 and grid[2] < 65536, (spec.name, grid)
    return p[0]


def rows_of(p, name: str) -> tuple:
    """(address, batch, row, head strides) of TensorRows field ``name``."""
    f = p[name]
    return int(f["data"]), int(f["batch_stride"]), int(f["row_stride"]), int(f["head_stride"])


def rows_want(a, strides: tuple | None = None) -> tuple:
    """What a TensorRows field of the (B, S, H, D) array ``a`` holds (``strides``: given ones)."""
    strides = strides if strides is not None else tuple(s // a.itemsize for s in a.strides[:3])
    return (a.data.ptr, *(int(s) for s in strides))


def _window(mask) -> tuple:
    return tuple(int(x) for x in mask.window_args())


def _assert_shape(p, q, k, mask, softmax_scale) -> None:
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    got = tuple(int(p[f]) for f in ("batch", "seqlen_q", "seqlen_k", "nheads", "nheads_kv", "group", "headdim"))
    assert got == (batch, seqlen_q, seqlen_k, nheads, nheads_kv, nheads // nheads_kv, headdim)
    assert (int(p["window_left"]), int(p["window_right"])) == _window(mask)
    assert p["scale_log2_f64"] == np.float64(softmax_scale) * LOG2E
    assert p["scale_log2"] == np.float32(np.float64(softmax_scale) * LOG2E)  # rounded once, to nearest


def assert_forward_launch(launch: Launch, q, k, v, o, lse, *, softmax_scale: float, mask) -> None:
    """One forward launch: FwdParams holding the call's arrays, shape, window and scale."""
    p = assert_one_struct(launch, "fwd")
    for name, a in (("q", q), ("k", k), ("v", v), ("o", o)):
        assert rows_of(p, name) == rows_want(a), (launch.spec.name, name)
    assert int(p["lse"]) == lse.data.ptr
    _assert_shape(p, q, k, mask, softmax_scale)


# BwdParams' buffers beyond the call's arrays, by the plans that need them.
_LATE = ("dq_accum", "dq_accum_panel_stride", "dq_semaphore")  # allocated after the preprocess
_PREPROCESS_ROLES = ("preprocess", "kv_bounds", "preprocess_fixed")


def _leaves(p, prefix=""):
    for name in p.dtype.names:
        if p.dtype.fields[name][0].names:
            yield from _leaves(p[name], f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", p[name]


def assert_one_struct_per_call(launches: list[Launch], roles: list[str]) -> None:
    """Every backward launch of one call gets the same BwdParams: the launches after the
    preprocess every field alike, and the preprocess launches (``roles``) the same values except the
    buffers the launcher allocates after them (dq_accum, its panel stride, dq_semaphore), which
    are null there (the preprocess kernels read none of them)."""
    final = launches[-1].params
    for launch, role in zip(launches, roles):
        p = launch.params
        for (path, got), (_, want) in zip(_leaves(p), _leaves(final)):
            late = role in _PREPROCESS_ROLES and path.split(".")[0] in _LATE
            # array fields (a modifier's tensor addresses and strides) compare element by element
            assert np.array_equal(got, want) or (late and not np.any(got)), (launch.spec.name, path, got, want)


def assert_backward_launches(recorder: LaunchRecorder, launches: list[Launch], plan, do, q, k, v, o, lse, dq, dk,
                             dv, *, softmax_scale: float, mask) -> np.void:
    """One backward call: the plan's specializations and grids in the plan's order, each with one
    BwdParams, one struct for the call holding the call's arrays, shape, window and scales; delta
    always, dq_accum for every dq_add but "none", dq_semaphore for "ordered" only, dq_row_scale
    and kv_bound for the fixed-point adds only, each an allocation of the call with the layout its
    kernels index (the others null). Returns the call's struct."""
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    assert [(launch.spec, launch.grid) for launch in launches] == plan.grids(batch, seqlen_q, seqlen_k, nheads,
                                                                             nheads_kv)
    for launch in launches:
        assert_one_struct(launch, "bwd")
    assert_one_struct_per_call(launches, [launch.role for launch in plan.launches])
    p = launches[-1].params
    for name, a in (("q", q), ("k", k), ("v", v), ("o", o), ("dout", do), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert rows_of(p, name) == rows_want(a), name
    assert int(p["lse"]) == lse.data.ptr
    _assert_shape(p, q, k, mask, softmax_scale)
    assert p["scale_f64"] == np.float64(softmax_scale) and p["scale"] == np.float32(softmax_scale)

    acc = np.float64 if q.dtype == np.float64 else np.float32
    delta = recorder.allocation(int(p["delta"]))
    assert delta.shape == (batch, nheads, seqlen_q) and delta.dtype == acc
    dq_add, dt = plan.dq_add, plan.d_tile
    if dq_add == "none":
        assert rows_of(p, "dq_accum") == (0, 0, 0, 0) and p["dq_accum_panel_stride"] == 0
    else:
        accum = recorder.allocation(int(p["dq_accum"]["data"]))
        assert accum.zeroed, "dQ is added into dq_accum: it starts at zero"
        assert accum.dtype == (np.int64 if dq_add in ("fixed", "fixed_panels") else np.float32)
        if dq_add == "fixed_panels":  # (batch, head x panel, rows in whole query blocks, 64)
            rows = math.ceil(seqlen_q / plan.kernels.dkdv_tiles[0]) * plan.kernels.dkdv_tiles[0]
            assert accum.shape == (batch, nheads * dt // 64, rows, 64)
            # a head is dt / 64 consecutive panels; column c of a row at (c / 64) panels + c % 64
            assert rows_of(p, "dq_accum")[1:] == (nheads * dt // 64 * rows * 64, 64, dt // 64 * rows * 64)
            assert p["dq_accum_panel_stride"] == rows * 64
        else:
            assert accum.shape == (batch, seqlen_q, nheads, dt)
            assert rows_of(p, "dq_accum")[1:] == (seqlen_q * nheads * dt, nheads * dt, dt)
            assert p["dq_accum_panel_stride"] == 64
    if dq_add == "ordered":
        semaphore = recorder.allocation(int(p["dq_semaphore"]))
        block_m = plan.kernels.dkdv_tiles[0]
        assert semaphore.zeroed and semaphore.dtype == np.int32
        assert semaphore.shape == (batch, nheads, math.ceil(seqlen_q / block_m))
    else:
        assert p["dq_semaphore"] == 0
    if dq_add in ("fixed", "fixed_panels"):
        scale = recorder.allocation(int(p["dq_row_scale"]))
        assert scale.shape == (batch, nheads, seqlen_q) and scale.dtype == np.float32
        bound = recorder.allocation(int(p["kv_bound"]))
        assert bound.zeroed and bound.shape == (batch, nheads_kv, 2) and bound.dtype == np.uint32
    else:
        assert p["dq_row_scale"] == 0 and p["kv_bound"] == 0
    return p

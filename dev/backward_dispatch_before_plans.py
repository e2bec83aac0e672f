"""Print, as the table ``tests/test_plans_bwd.py`` keeps, the kernels that the backward dispatch of
a tree from before backward plans (commit 5e4395f: ``mma_bwd.backward`` walking ``VERSIONS`` to
v10, ``simt.backward``) launched, in order, for every device class, dtype, head dimension, mask and
``deterministic``, on one odd GQA shape (``SHAPE``). Nothing runs on a GPU: CuPy's allocations and
the launch are replaced by stand-ins that record (specialization, grid).

    git archive 5e4395f | tar -x -C OLD && PYTHONPATH=OLD python dev/backward_dispatch_before_plans.py

The same ``launches`` runs against the current tree in the test, so the tables pin both the plans
and the launchers: the specializations by name; which of them each call launches, in order (rows
group the (arch, opt-in shared memory) pairs that launched alike, and a row's head dims are those up
to its bound and above the previous row's; the tensor-core rows step by 8, as the dispatcher pads a
head dim to a multiple of 8 before the backward sees it); and the grids at each head-dim tile.
"""
from __future__ import annotations

import contextlib
import itertools

import numpy as np

ARCHS = ("80", "86", "89", "90")
SMEM_OPTINS = (163 * 1024, 227 * 1024, 99 * 1024)  # A100, H100/H200, sm_86/sm_89 opt-in per block
SHAPE = (2, 333, 301, 4, 2)  # batch, seqlen_q, seqlen_k, nheads, nheads_kv
WINDOWS = {"full": (False, (-1, -1)), "causal": (True, (-1, -1)), "local": (False, (100, 3))}


class _Array:
    """Shape, dtype and C-order strides of a CuPy array (all a launcher reads before launching)."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.strides = tuple(int(np.prod(self.shape[i + 1:])) * self.itemsize for i in range(len(shape)))
        self.data = type("Pointer", (), {"ptr": 0})()


@contextlib.contextmanager
def _recording(arch: str | None, smem_optin: int | None, launched: list):
    """The current device is (arch, smem_optin); every launch appends (spec, grid) to ``launched``."""
    import cupy

    from cupyflash.kernels import dq_fixed, mma_bwd, mma_fwd, simt

    def record(spec, grid, args):
        launched.append((spec, tuple(int(g) for g in grid)))

    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    for module in (mma_bwd, dq_fixed, simt):
        patch(module, "launch", record)
    patch(mma_fwd, "current_arch", lambda: arch)
    patch(mma_fwd, "current_smem_optin", lambda: smem_optin)
    patch(cupy, "zeros", lambda shape, dtype=np.float32: _Array(shape, dtype))
    patch(cupy, "empty", lambda shape, dtype=np.float32: _Array(shape, dtype))
    patch(cupy, "ascontiguousarray", lambda a, dtype=None: a)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def launches(arch: str | None, smem_optin: int | None, dtype, headdim: int, mask: str,
             deterministic: bool, **options) -> tuple:
    """((name, source, expression, threads, smem_bytes, arch, grid), ...) that the tree's backward
    launches, in order, for one call on ``SHAPE`` (the tensor-core family for 16-bit dtypes, the
    SIMT family otherwise; ``options``: mma_bwd.backward's keywords, e.g. version=)."""
    from cupyflash.kernels import mma_bwd, simt

    batch, seqlen_q, seqlen_k, nheads, nheads_kv = SHAPE
    q, do, o, dq = (_Array((batch, seqlen_q, nheads, headdim), dtype) for _ in range(4))
    k, v, dk, dv = (_Array((batch, seqlen_k, nheads_kv, headdim), dtype) for _ in range(4))
    lse = _Array((batch, nheads, seqlen_q), np.float32)
    causal, window = WINDOWS[mask]
    family = mma_bwd if np.dtype(dtype).itemsize == 2 else simt
    launched: list = []
    with _recording(arch, smem_optin, launched):
        family.backward(do, q, k, v, o, lse, dq, dk, dv, softmax_scale=0.125, causal=causal,
                        deterministic=deterministic, window_size=window, **options)
    return tuple((s.name, s.source_file, s.expression, s.threads, s.smem_bytes, s.arch, grid)
                 for s, grid in launched)


def head_dims(dtype) -> range:
    return range(8, 257, 8) if np.dtype(dtype).itemsize == 2 else range(1, 257)


def grid_head_dims(dtype) -> tuple:
    """The head dims whose grids the table keeps: each head-dim tile."""
    return (64, 128, 256) if np.dtype(dtype).itemsize == 2 else (16, 32, 64, 128, 256)


def tables() -> tuple[dict, list, dict]:
    """(specs, choices, grids): {name: (source, expression, threads, smem_bytes, arch)}; rows
    (dtype, mask, deterministic, devices, ((head-dim bound, names in launch order), ...)); and
    {name: grid} on SHAPE (a name spells the kernel's tiles, so its grid is one; the dQ convert
    kernels' count elements: {(name, head dim): grid})."""
    from cupyflash._dtypes import SUPPORTED

    specs, choices, grids = {}, [], {}
    for (dtype_name, dtype), mask, deterministic in itertools.product(SUPPORTED.items(), WINDOWS, (True, False)):
        groups: dict = {}
        for arch, smem in itertools.product(ARCHS, SMEM_OPTINS):
            rows = []
            for headdim in head_dims(dtype):
                launched = launches(arch, smem, dtype, headdim, mask, deterministic)
                for name, *spec, grid in launched:
                    specs[name] = tuple(spec)
                if headdim in grid_head_dims(dtype):
                    for name, *_, grid in launched:
                        key = (name, headdim) if "_convert" in name else name
                        assert grids.setdefault(key, grid) == grid, (key, grid)
                names = tuple(name for name, *_ in launched)
                if rows and rows[-1][1] == names:
                    rows[-1] = (headdim, names)
                else:
                    rows.append((headdim, names))
            groups.setdefault(tuple(rows), []).append((arch, smem))
        choices += [(dtype_name, mask, deterministic, tuple(devices), rows) for rows, devices in groups.items()]
    return specs, choices, grids


def main() -> None:
    specs, choices, grids = tables()
    print("OLD_SPECS = {")
    for name, spec in sorted(specs.items()):
        print(f"    {name!r}: {spec!r},")
    print("}\n\nOLD_CHOICES = (")
    for dtype_name, mask, deterministic, devices, rows in choices:
        print(f"    ({dtype_name!r}, {mask!r}, {deterministic!r}, {devices!r}, (")
        for bound, names in rows:
            print(f"        ({bound}, {names!r}),")
        print("    )),")
    print(")\n\nOLD_GRIDS = {")
    for key, value in sorted(grids.items(), key=str):
        print(f"    {key!r}: {value!r},")
    print("}")


if __name__ == "__main__":
    np.seterr(all="raise")
    main()

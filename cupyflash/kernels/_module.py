"""From `kernels_cu/` source text to a launched specialization.

A *specialization* is one template instantiation of one kernel, with a deterministic readable
name (``flash_fwd_simt_bf16_hdim64_causal_bm64_bn64_tpr4``) that is also its cache key. Its
module is compiled lazily by CuPy's ``RawModule`` (NVRTC) on first launch; CuPy's own disk
cache makes later processes skip the compile. Headers are inlined into the source text so that
CuPy's cache key (a hash of the text) changes whenever any included file changes.
"""
from __future__ import annotations

import functools
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

NVRTC_OPTIONS = ("-std=c++17",)

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


@dataclass(frozen=True)
class Specialization:
    """One compiled kernel: what to compile and how to launch it."""

    name: str  # deterministic, readable; the cache key
    source_file: str  # file in kernels_cu/
    expression: str  # C++ template instantiation, e.g. "cf::flash_fwd_simt<float, 64, ...>"
    threads: int  # threads per block
    smem_bytes: int  # dynamic shared memory per block
    arch: str = ""  # target it needs beyond the device's default, e.g. "90a" (wgmma); "" for any


def device_arch() -> str:
    """Compute capability of the current device as NVRTC spells it ("80", "90")."""
    import cupy

    return str(cupy.cuda.Device().compute_capability)


def runs_on_device(spec: Specialization) -> bool:
    """Whether ``spec`` can run on the current device (an arch-specific one only on its own arch)."""
    return not spec.arch or spec.arch.rstrip("a") == device_arch()


def kernels_dir() -> Path:
    """Folder holding the .cu/.cuh sources: the source checkout this package was imported from, else
    the installed package data. The checkout comes first because an editable install maps
    ``cupyflash.kernels_cu`` to the checkout it was installed from: a second tree imported through
    PYTHONPATH (an experiment's copy) would otherwise compile the first tree's kernels."""
    path = Path(__file__).resolve().parents[2] / "kernels_cu"
    if (path / "common.cuh").is_file():
        return path
    try:
        from importlib.resources import files

        path = Path(str(files("cupyflash.kernels_cu")))
        if (path / "common.cuh").is_file():
            return path
    except (ModuleNotFoundError, TypeError):
        pass
    raise FileNotFoundError("cupyflash: kernel sources (kernels_cu/) not found")


@functools.lru_cache(maxsize=None)
def kernel_source(filename: str) -> str:
    """The text of ``kernels_cu/<filename>`` with its local includes inlined (each once)."""
    root = kernels_dir()
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (root / name).read_text()
        text = text.replace("#pragma once", "")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return f"// cupyflash: {filename}\n" + expand(filename)


def module_source(source_file: str, expressions) -> str:
    """The text NVRTC compiles for these template expressions: the kernel's file (kernel_source),
    then the user modifier structs they name (cupyflash.modifiers: generated per call's
    modifiers, so a kernel without them compiles its file alone)."""
    from ..modifiers import source_for

    return kernel_source(source_file) + source_for(" ".join(expressions))


_lock = threading.Lock()
_functions: dict = {}


def get_function(spec: Specialization):
    """The CuPy function of ``spec`` on the current device, compiled once per process.

    A lock makes concurrent first calls from several threads compile each module once.
    """
    import cupy

    device = cupy.cuda.Device().id
    key = (spec.name, device)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    if not runs_on_device(spec):
        raise ValueError(f"cupyflash: kernel {spec.name} needs sm_{spec.arch}; device {device} is "
                         f"sm_{device_arch()}")
    with _lock:
        fn = _functions.get(key)
        if fn is None:
            # An explicit -arch comes before the one CuPy appends for the device; NVRTC compiles
            # for the first (sm_90a adds wgmma to sm_90).
            module = cupy.RawModule(
                code=module_source(spec.source_file, (spec.expression,)),
                options=NVRTC_OPTIONS + ((f"-arch=sm_{spec.arch}",) if spec.arch else ()),
                name_expressions=(spec.expression,),
            )
            try:
                fn = module.get_function(spec.expression)
            except cupy.cuda.compiler.CompileException as exc:
                if "cfu::" not in spec.expression:
                    raise
                from ..modifiers import ModifierError

                raise ModifierError(f"cupyflash: kernel {spec.name} with a user modifier did not compile; NVRTC's "
                                    f"log names the modifier's lines by its Python file and line:\n{exc}") from exc
            limit = _max_smem_optin(device)
            if spec.smem_bytes > limit:
                raise ValueError(
                    f"cupyflash: kernel {spec.name} needs {spec.smem_bytes} bytes of shared memory; "
                    f"device {device} allows {limit}"
                )
            if spec.smem_bytes > 48 * 1024:
                fn.max_dynamic_shared_size_bytes = spec.smem_bytes
            _functions[key] = fn
    return fn


@functools.lru_cache(maxsize=None)
def _max_smem_optin(device: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device).attributes["MaxSharedMemoryPerBlockOptin"])


def launch(spec: Specialization, grid: tuple, args: tuple) -> None:
    """Launch ``spec`` on the current stream. Scalars in ``args`` must be NumPy scalars of the
    kernel's exact parameter types (np.int32, np.int64, np.float32, np.float64)."""
    fn = get_function(spec)
    for g in grid:
        if not 0 < g < 2**31:
            raise ValueError(f"cupyflash: grid {grid} out of range for {spec.name}")
    if grid[1] > 65535 or grid[2] > 65535:
        raise ValueError(f"cupyflash: grid {grid} exceeds 65535 in y or z for {spec.name}")
    fn(tuple(int(g) for g in grid), (spec.threads, 1, 1), tuple(_as_raw_bytes(a) for a in args),
       shared_mem=spec.smem_bytes)


def _as_raw_bytes(arg):
    """A Params struct (a one-element NumPy structured array) as one element of raw bytes. CuPy
    passes a NumPy argument by the data pointer of its __array_interface__, and building that
    interface walks a structured dtype field by field: 60-70 us per launch of the KV-cache
    kernel's Params on the H200's host, a tenth of a decode call; the bytes are the same."""
    if isinstance(arg, np.ndarray) and arg.dtype.names is not None:
        return arg.view(_raw_dtype(arg.dtype.itemsize))
    return arg


@functools.lru_cache(maxsize=None)
def _raw_dtype(itemsize: int):
    return np.dtype((np.void, itemsize))


def row_strides(a) -> tuple:
    """(batch, seq, head) strides of a (B, S, H, D) array in elements, as int64 kernel arguments."""
    import numpy as np

    item = a.itemsize
    return tuple(np.int64(s // item) for s in a.strides[:3])


def backward_is_empty(q, k, dq, dk, dv) -> bool:
    """Whether a backward on (B, S, H, D) arrays q, k has nothing to launch; zero-length sequences
    then get zero gradients here (the API does the same before calling a family; this covers
    direct calls, e.g. from the tuner)."""
    batch, seqlen_q, nheads = q.shape[:3]
    if batch == 0 or nheads == 0:
        return True
    if seqlen_q == 0 or k.shape[1] == 0:
        for g in (dq, dk, dv):
            g.fill(0)
        return True
    return False

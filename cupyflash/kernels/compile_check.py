"""Compile every specialization with NVRTC for a given architecture, without a GPU.

Used by the CPU test suite and by ``python -m cupyflash compile-check``: catches compile errors,
register spills (local memory) and missing tensor-core instructions before any device time is spent.
Specializations of one source file are compiled together in one NVRTC program.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from ._module import NVRTC_OPTIONS, Specialization, kernel_source


@dataclass
class Resources:
    name: str  # specialization name
    mangled: str
    registers: int
    shared_static: int
    stack_bytes: int  # stack frame (local memory)
    spill_bytes: int  # spill stores + spill loads reported by ptxas
    sass: str = ""
    wgmma_serialized: bool = False  # ptxas C7515: its wgmma wait after every instruction


def all_specializations() -> list[Specialization]:
    from . import simt

    specs = list(simt.specializations())
    for module_name in ("mma_fwd", "mma_bwd"):
        try:
            module = __import__(f"cupyflash.kernels.{module_name}", fromlist=["specializations"])
        except ImportError:
            continue
        specs.extend(module.specializations())
    return specs


def _nvrtc():
    """libnvrtc through ctypes: the pip wheel (cuda-toolkit[nvrtc]) first, then the system's."""
    import ctypes
    import ctypes.util

    candidates = []
    try:
        import nvidia

        for root in getattr(nvidia, "__path__", []):
            candidates += sorted(Path(root).glob("cu*/lib/libnvrtc.so*"), reverse=True)
    except ImportError:
        pass
    system = ctypes.util.find_library("nvrtc")
    if system:
        candidates.append(system)
    for candidate in candidates:
        try:
            return ctypes.CDLL(str(candidate))
        except OSError:
            continue
    raise FileNotFoundError("libnvrtc not found (pip install 'cuda-toolkit[nvrtc]')")


def compile_cubin(source_file: str, expressions: list[str], arch: str) -> tuple[bytes, dict, str]:
    """(cubin, {expression: mangled name}, ptxas log) for the given template instantiations."""
    import ctypes

    lib = _nvrtc()

    def check_call(status, what):
        if status != 0:
            raise RuntimeError(f"NVRTC {what} failed with status {status}")

    program = ctypes.c_void_p()
    source = kernel_source(source_file).encode()
    check_call(lib.nvrtcCreateProgram(ctypes.byref(program), source, source_file.encode(), 0, None, None),
               "create")
    try:
        for expr in expressions:
            check_call(lib.nvrtcAddNameExpression(program, expr.encode()), "add name expression")
        options = [o.encode() for o in (*NVRTC_OPTIONS, f"-arch=sm_{arch}", "--ptxas-options=-v")]
        option_array = (ctypes.c_char_p * len(options))(*options)
        status = lib.nvrtcCompileProgram(program, len(options), option_array)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log_buffer = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(program, log_buffer)
        log = log_buffer.value.decode(errors="replace")
        if status != 0:
            raise RuntimeError(f"{source_file} for sm_{arch}:\n{log}")
        mangled = {}
        for expr in expressions:
            name = ctypes.c_char_p()
            check_call(lib.nvrtcGetLoweredName(program, expr.encode(), ctypes.byref(name)), "lowered name")
            mangled[expr] = name.value.decode()
        size = ctypes.c_size_t()
        check_call(lib.nvrtcGetCUBINSize(program, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        check_call(lib.nvrtcGetCUBIN(program, cubin), "cubin")
        return cubin.raw, mangled, log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


def find_cuobjdump() -> str | None:
    exe = shutil.which("cuobjdump")
    if exe:
        return exe
    try:
        import nvidia

        for root in getattr(nvidia, "__path__", []):
            for candidate in Path(root).glob("cu*/bin/cuobjdump"):
                if os.access(candidate, os.X_OK):
                    return str(candidate)
    except ImportError:
        pass
    return None


_PTXAS_ENTRY = re.compile(
    r"Compiling entry function '(\S+)'.*?(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
    re.DOTALL)


def spills_from_log(log: str) -> dict[str, tuple[int, int, int]]:
    """{mangled: (stack frame, spill stores, spill loads)} from a ``ptxas -v`` log."""
    out = {}
    for chunk in log.split("Compiling entry function")[1:]:
        m = _PTXAS_ENTRY.search("Compiling entry function" + chunk)
        if m:
            out[m.group(1)] = (int(m.group(2)), int(m.group(3)), int(m.group(4)))
    return out


# ptxas info (C7515) "Potential Performance Loss: wgmma.mma_async instructions are serialized due
# to ..." names the function: ptxas then waits for each wgmma before the next instruction, which
# removes all overlap of the tensor cores with the rest of the warpgroup's work.
_WGMMA_SERIALIZED = re.compile(r"\(C7515\).*?in the function '(\S+)'")


def wgmma_serialized_from_log(log: str) -> set[str]:
    """Mangled names of the kernels whose wgmma ptxas serialized (C7515)."""
    return set(_WGMMA_SERIALIZED.findall(log))


_RES = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def resource_usage(cubin: bytes, with_sass: bool = False) -> dict[str, dict]:
    """{mangled: {registers, stack, shared, local, sass}} read by cuobjdump from a cubin."""
    exe = find_cuobjdump()
    if exe is None:
        raise FileNotFoundError("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([exe, "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
        usage = {m.group(1): {"registers": int(m.group(2)), "stack": int(m.group(3)),
                              "shared": int(m.group(4)), "local": int(m.group(5)), "sass": ""}
                 for m in _RES.finditer(out)}
        if with_sass:
            sass = subprocess.run([exe, "-sass", str(path)], capture_output=True, text=True, check=True).stdout
            for block in re.split(r"\n\s*Function : ", sass)[1:]:
                mangled = block.split("\n", 1)[0].strip()
                if mangled in usage:
                    usage[mangled]["sass"] = block
    return usage


def _check_group(source_file: str, group: list[Specialization], arch: str, with_sass: bool) -> list[Resources]:
    expressions = sorted({s.expression for s in group})
    cubin, mangled, log = compile_cubin(source_file, expressions, arch)
    usage = resource_usage(cubin, with_sass)
    spills = spills_from_log(log)
    serialized = wgmma_serialized_from_log(log)
    results = []
    for spec in group:
        u = usage.get(mangled[spec.expression])
        if u is None:
            raise RuntimeError(f"{spec.name}: no resource line for {mangled[spec.expression]}")
        stack, stores, loads = spills.get(mangled[spec.expression], (0, 0, 0))
        results.append(Resources(spec.name, mangled[spec.expression], u["registers"],
                                 u["shared"], stack, stores + loads, u["sass"],
                                 mangled[spec.expression] in serialized))
    return results


ARCHS = ("80", "90", "90a")  # sm_90a: the wgmma kernels only


def compiled_for(spec: Specialization, arch: str) -> bool:
    """Whether the check compiles ``spec`` for ``sm_<arch>``: an arch-specific specialization
    (wgmma: "90a") for its own arch only, the portable ones for the portable archs ("80", "90")."""
    return spec.arch == arch or (not spec.arch and not arch.endswith("a"))


def check_archs(archs, specs: list[Specialization] | None = None,
                with_sass: bool = False) -> dict[str, list[Resources]]:
    """{arch: resources} for ``specs`` (default: all) compiled for each ``sm_<arch>``.

    One NVRTC program per (source file, arch), compiled on a thread each: ctypes releases the GIL
    during the call, so the programs build in parallel on every core.
    """
    from concurrent.futures import ThreadPoolExecutor

    specs = all_specializations() if specs is None else specs
    jobs = []
    for arch in archs:
        by_file: dict[str, list[Specialization]] = defaultdict(list)
        for spec in specs:
            if compiled_for(spec, arch):
                by_file[spec.source_file].append(spec)
        jobs.extend((arch, f, group) for f, group in by_file.items())
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        futures = [(arch, pool.submit(_check_group, f, group, arch, with_sass)) for arch, f, group in jobs]
        results: dict[str, list[Resources]] = {arch: [] for arch in archs}
        for arch, future in futures:
            results[arch].extend(future.result())
    return results


def check(arch: str, specs: list[Specialization] | None = None, with_sass: bool = False) -> list[Resources]:
    """Compile ``specs`` (default: all) for ``sm_<arch>``; resources per specialization."""
    return check_archs([arch], specs, with_sass)[arch]


DESCRIPTION = """\
Compile every kernel specialization with NVRTC for sm_80 and sm_90 (the wgmma kernels for
sm_90a) without a GPU, and read each kernel's registers, stack and spills from ptxas and
cuobjdump. A compile error, a register spill or a serialized wgmma (ptxas C7515) fails the check.
Exit status: 0 every kernel clean, 1 some kernel failed or spilled, 2 bad arguments, 3 NVRTC or
cuobjdump not installed."""


def configure(parser) -> None:
    parser.add_argument("--arch", action="append", choices=ARCHS,
                        help="80, 90 or 90a, repeatable (default: all three)")
    parser.add_argument("--kernel", action="append", metavar="TEXT",
                        help="only the specializations whose name contains TEXT (repeatable)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="one line per kernel: registers, stack, spills")
    parser.add_argument("--quiet", action="store_true", help="no progress line")


def _kernel_line(arch: str, r: Resources) -> str:
    flags = " ".join(f for f, bad in (("SPILL", r.spill_bytes),
                                      ("WGMMA-SERIALIZED", r.wgmma_serialized)) if bad)
    return (f"sm_{arch:4} {r.name:70} regs {r.registers:4} stack {r.stack_bytes:5} "
            f"spill {r.spill_bytes:5} {flags}").rstrip()


def run(args) -> int:
    """Compiles one NVRTC program per (arch, source file) on a thread each, as check_archs does,
    so that each finished program moves the progress line and a compile error fails only its
    own kernels."""
    import sys
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from .. import cli
    from ..bench.progress import Progress

    archs = list(dict.fromkeys(args.arch or ARCHS))
    specs = [s for s in all_specializations()
             if not args.kernel or any(text in s.name for text in args.kernel)]
    groups = []
    for arch in archs:
        by_file: dict[str, list[Specialization]] = defaultdict(list)
        for spec in specs:
            if compiled_for(spec, arch):
                by_file[spec.source_file].append(spec)
        groups += [(arch, source_file, group) for source_file, group in by_file.items()]
    if not groups:
        raise cli.UsageError(f"no specialization for sm_{', sm_'.join(archs)} matches "
                             f"--kernel {' '.join(args.kernel or [])}")
    try:
        _nvrtc()
        if find_cuobjdump() is None:
            raise FileNotFoundError("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    except (FileNotFoundError, OSError) as exc:
        cli.summary("compile-check", f"cannot run: {exc}", file=sys.stderr)
        return cli.EXIT_UNAVAILABLE

    total = sum(len(group) for _, _, group in groups)
    results: dict[tuple, list[Resources]] = {}
    errors: dict[tuple, str] = {}
    progress = Progress(len(groups), enabled=not args.quiet)
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        futures = {pool.submit(check, arch, group): (arch, source_file)
                   for arch, source_file, group in groups}
        for future in as_completed(futures):
            key = futures[future]
            try:
                results[key] = future.result()
                spilled = sum(bool(r.spill_bytes) for r in results[key])
                verdict = f"{len(results[key])} compiled" + (f", {spilled} with spills"
                                                             if spilled else "")
            except Exception as exc:  # a compile error: the log names the kernel and the line
                errors[key] = f"{type(exc).__name__}: {exc}"
                verdict = "FAILED"
            progress.step(f"sm_{key[0]} {key[1]}: {verdict}")
    progress.close()

    failed = spills = 0
    for arch, source_file, group in groups:
        key = (arch, source_file)
        if key in errors:
            failed += len(group)
            print(f"sm_{arch} {source_file}: {errors[key]}", file=sys.stderr)
            continue
        for r in results[key]:
            failed += r.wgmma_serialized
            spills += bool(r.spill_bytes) and not r.wgmma_serialized
            if args.verbose or r.spill_bytes or r.wgmma_serialized:
                print(_kernel_line(arch, r))
    text = (f"{total} kernels compiled for sm_{', sm_'.join(archs)}: {total - spills - failed} ok, "
            f"{spills} with spills, {failed} failed")
    cli.summary("compile-check", text)
    return cli.EXIT_FAILED if spills or failed else cli.EXIT_OK


def main(argv=None) -> int:
    from .. import cli

    return cli.alias("compile-check", argv)

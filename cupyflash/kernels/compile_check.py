"""Compile every specialization with NVRTC for a given architecture, without a GPU.

Used by the CPU test suite and by ``python -m cupyflash compile-check``: catches compile errors,
register spills (local memory) and missing tensor-core instructions before any device time is spent.
Specializations of one source file are compiled together in one NVRTC program, with the libnvrtc
and the include paths that CuPy's ``RawModule`` uses, so a toolchain that passes here also compiles
at run time. Registers, stack and spills come from ptxas's report; the SASS (through cuobjdump) is
read only when asked for.

Each program's results are cached on disk (``$CUPYFLASH_CACHE_DIR``, default
``~/.cache/cupyflash``), keyed by a hash of the source text with its headers inlined, the
instantiations, the options, the NVRTC build, the architecture and this file's own text.

``representative()`` picks, per kernel, one dtype/mask combination of every tile configuration
(rotating the combinations so that each dtype and each mask still compiles): the CPU suite checks
that set, ``-m compile_full`` every specialization.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ._module import NVRTC_OPTIONS, Specialization, module_source


@dataclass
class Resources:
    name: str  # specialization name
    mangled: str
    registers: int
    shared_static: int
    stack_bytes: int  # stack frame (local memory)
    spill_bytes: int  # spill stores + spill loads reported by ptxas
    sass_opcodes: frozenset = field(default_factory=frozenset)  # "HMMA", "HGMMA", ...; with_sass only
    wgmma_serialized: bool = False  # ptxas C7515: its wgmma wait after every instruction


def all_specializations() -> list[Specialization]:
    from . import simt

    specs = list(simt.specializations())
    for module_name in ("mma_fwd", "mma_bwd", "dmma", "merge", "kvcache_mma", "kvcache_append", "rotary"):
        try:
            module = __import__(f"cupyflash.kernels.{module_name}", fromlist=["specializations"])
        except ImportError:
            continue
        specs.extend(module.specializations())
    from .. import modifiers

    specs.extend(modifiers.specializations())
    return specs


def _name_tokens() -> tuple[frozenset, frozenset]:
    """The dtype tokens ("fp16", ...) and mask tokens ("full", "causal", ...) of specialization names."""
    from .. import masks
    from .._dtypes import SHORT_NAMES

    kinds = masks.VARIANT_KINDS + masks.PACKED_KINDS
    variants = {m.name for m in kinds} | {m.backward().name for m in kinds}
    return frozenset(SHORT_NAMES.values()), frozenset({m.name for m in masks.KINDS} | variants)


def _variant(spec: Specialization) -> tuple[str, tuple[str, ...], tuple[str, str]]:
    """(kernel, tile configuration, (dtype, mask)) read from the specialization's name: the kernel
    is what precedes the dtype token, the configuration is every other token. A mask with a score
    spans several tokens ("causal_softcap_alibi"): the longest mask name in the name is taken."""
    dtypes, masks = _name_tokens()
    tokens = spec.name.split("_")
    dtype = next((t for t in tokens if t in dtypes), "")
    mask, span = "", ()
    for start in range(len(tokens)):
        for end in range(len(tokens), start, -1):
            candidate = "_".join(tokens[start:end])
            if candidate in masks and end - start > len(span):
                mask, span = candidate, tuple(range(start, end))
    kernel = "_".join(tokens[:tokens.index(dtype)]) if dtype else spec.name
    config = tuple(t for i, t in enumerate(tokens) if t != dtype and i not in span)
    return f"{spec.source_file}:{kernel}", config, (dtype, mask)


def representative(specs: list[Specialization]) -> list[Specialization]:
    """Every tile configuration of every kernel once, in one (dtype, mask) combination each.

    Combinations rotate over a kernel's configurations (the least used so far first), and a dtype
    or mask that the rotation missed is added once, so every dtype and mask of a kernel compiles.
    A name without dtype or mask tokens is its own configuration and always kept.
    """
    kernels: dict[str, dict[tuple, dict[tuple, Specialization]]] = defaultdict(lambda: defaultdict(dict))
    for spec in specs:
        kernel, config, combination = _variant(spec)
        kernels[kernel][(spec.arch, config)].setdefault(combination, spec)
    chosen: list[Specialization] = []
    for configs in kernels.values():
        used: Counter = Counter()
        for config in sorted(configs):
            members = configs[config]
            combination = min(members, key=lambda c: (used[c], c))
            used[combination] += 1
            chosen.append(members[combination])
        for axis in (0, 1):
            covered = {c[axis] for c in used}
            for config in sorted(configs):
                for combination, spec in sorted(configs[config].items()):
                    if combination[axis] not in covered:
                        covered.add(combination[axis])
                        used[combination] += 1
                        chosen.append(spec)
    order = {spec.name: i for i, spec in enumerate(specs)}
    return sorted(dict.fromkeys(chosen), key=lambda s: order[s.name])


_INSTALL_HINT = "pip install 'cupyflash[cuda13]' (or [cuda12]), which brings NVRTC and the CUDA headers"


@functools.lru_cache(maxsize=None)
def nvrtc_path() -> str:
    """The libnvrtc that CuPy compiles with: cuda.pathfinder's choice (CuPy's own discovery: the
    pip wheels, then conda, then the system's), else the dynamic loader's."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError:
        import ctypes.util

        path = ctypes.util.find_library("nvrtc")
        if path is None:
            raise FileNotFoundError(f"libnvrtc not found: {_INSTALL_HINT}") from None
        return path
    try:
        return load_nvidia_dynamic_lib("nvrtc").abs_path
    except Exception as exc:  # DynamicLibNotFoundError, a RuntimeError
        raise FileNotFoundError(f"libnvrtc not found ({exc}): {_INSTALL_HINT}") from exc


@functools.lru_cache(maxsize=None)
def _nvrtc():
    """libnvrtc through ctypes (which releases the GIL during a compile)."""
    import ctypes

    return ctypes.CDLL(nvrtc_path())


def nvrtc_version() -> tuple[int, int]:
    import ctypes

    major, minor = ctypes.c_int(), ctypes.c_int()
    _nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def compile_options(arch: str) -> tuple[str, ...]:
    """The NVRTC options of ``RawModule`` for cupyflash's kernels on ``sm_<arch>``, CuPy's include
    paths among them, with ptxas's resource report. CuPy raises here, as it would at run time,
    when it finds no CUDA headers. CuPy also adds -ftz=true, which changes the code (registers
    included) of every kernel, and --device-as-default-execution-space."""
    options = NVRTC_OPTIONS
    try:
        from cupy._core.core import assemble_cupy_compiler_options
    except ImportError:  # no CuPy, or one without this helper: the kernels include no CUDA header
        pass
    else:
        options = tuple(assemble_cupy_compiler_options(options))
    return options + (f"-arch=sm_{arch}", "-ftz=true", "--device-as-default-execution-space",
                      "--ptxas-options=-v")


def compile_cubin(source_file: str, expressions: list[str], arch: str) -> tuple[bytes, dict, str]:
    """(cubin, {expression: mangled name}, ptxas log) for the given template instantiations."""
    return compile_text(module_source(source_file, expressions), source_file, expressions, arch)


def compile_text(text: str, source_file: str, expressions: list[str], arch: str) -> tuple[bytes, dict, str]:
    """compile_cubin for source text (its local includes already inlined: kernel_source)."""
    import ctypes

    lib = _nvrtc()

    def check_call(status, what):
        if status != 0:
            raise RuntimeError(f"NVRTC {what} failed with status {status}")

    program = ctypes.c_void_p()
    source = text.encode()
    check_call(lib.nvrtcCreateProgram(ctypes.byref(program), source, source_file.encode(), 0, None, None),
               "create")
    try:
        for expr in expressions:
            check_call(lib.nvrtcAddNameExpression(program, expr.encode()), "add name expression")
        options = [o.encode() for o in compile_options(arch)]
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


_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
_PTXAS_SHARED = re.compile(r"(\d+) bytes smem")


def ptxas_report(log: str) -> dict[str, dict[str, int]]:
    """{mangled: {registers, shared, stack, spill_stores, spill_loads}} from a ``ptxas -v`` log."""
    out = {}
    for chunk in log.split("Compiling entry function '")[1:]:
        mangled, text = chunk.split("'", 1)
        spills = _PTXAS_SPILLS.search(text)
        registers = _PTXAS_REGISTERS.search(text)
        shared = _PTXAS_SHARED.search(text.split("Compile time", 1)[0])
        if registers is None:
            raise RuntimeError(f"no register count in ptxas's report of {mangled}")
        stack, stores, loads = (int(g) for g in spills.groups()) if spills else (0, 0, 0)
        out[mangled] = {"registers": int(registers.group(1)), "shared": int(shared.group(1)) if shared else 0,
                        "stack": stack, "spill_stores": stores, "spill_loads": loads}
    return out


def spills_from_log(log: str) -> dict[str, tuple[int, int, int]]:
    """{mangled: (stack frame, spill stores, spill loads)} from a ``ptxas -v`` log."""
    return {m: (r["stack"], r["spill_stores"], r["spill_loads"]) for m, r in ptxas_report(log).items()}


# ptxas info (C7515) "Potential Performance Loss: wgmma.mma_async instructions are serialized due
# to ..." names the function: ptxas then waits for each wgmma before the next instruction, which
# removes all overlap of the tensor cores with the rest of the warpgroup's work.
_WGMMA_SERIALIZED = re.compile(r"\(C7515\).*?in the function '(\S+)'")


def wgmma_serialized_from_log(log: str) -> set[str]:
    """Mangled names of the kernels whose wgmma ptxas serialized (C7515)."""
    return set(_WGMMA_SERIALIZED.findall(log))


_RES = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
# An instruction line of ``cuobjdump -sass``: its address, an optional predicate, the opcode.
_SASS_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def sass_opcodes(sass: str) -> frozenset:
    """The opcodes, without modifiers (``HMMA.16816.F32`` -> ``HMMA``), of a function's SASS."""
    return frozenset(_SASS_OPCODE.findall(sass))


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


def cache_dir() -> Path:
    root = os.environ.get("CUPYFLASH_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cupyflash"
    return Path(root) / "compile-check"


@functools.lru_cache(maxsize=None)
def _toolchain_fingerprint() -> str:
    """NVRTC's version and library file, and this file's text (a change of the parsing above must
    not reuse results read by the old one)."""
    parts = [str(nvrtc_version()), Path(__file__).read_text()]
    library = Path(nvrtc_path()).resolve()
    if library.is_file():  # a bare name from find_library has no stat to add
        stat = library.stat()
        parts.append(f"{library} {stat.st_size} {stat.st_mtime_ns}")
    return "\n".join(parts)


def _cache_key(source_file: str, expressions: list[str], arch: str, with_sass: bool) -> str:
    cuobjdump = find_cuobjdump() if with_sass else None
    text = json.dumps([module_source(source_file, expressions), expressions, compile_options(arch), arch,
                       with_sass, cuobjdump, _toolchain_fingerprint()])
    return hashlib.sha256(text.encode()).hexdigest()


def _compile_group(source_file: str, expressions: list[str], arch: str, with_sass: bool) -> dict[str, dict]:
    """{expression: resources as plain data} for one NVRTC program."""
    cubin, mangled, log = compile_cubin(source_file, expressions, arch)
    report = ptxas_report(log)
    serialized = wgmma_serialized_from_log(log)
    usage = resource_usage(cubin, with_sass=True) if with_sass else {}
    out = {}
    for expr in expressions:
        name = mangled[expr]
        if name not in report:
            raise RuntimeError(f"{source_file} for sm_{arch}: no ptxas report for {name}")
        r = report[name]
        if with_sass and usage.get(name, {}).get("registers") != r["registers"]:
            raise RuntimeError(f"{name}: ptxas reports {r['registers']} registers, cuobjdump "
                               f"{usage.get(name, {}).get('registers')}")
        out[expr] = {"mangled": name, "registers": r["registers"], "shared_static": r["shared"],
                     "stack_bytes": r["stack"], "spill_bytes": r["spill_stores"] + r["spill_loads"],
                     "sass_opcodes": sorted(sass_opcodes(usage[name]["sass"])) if with_sass else [],
                     "wgmma_serialized": name in serialized}
    return out


def _check_group(source_file: str, group: list[Specialization], arch: str, with_sass: bool,
                 cache: bool = True) -> list[Resources]:
    expressions = sorted({s.expression for s in group})
    data = None
    path = cache_dir() / f"{_cache_key(source_file, expressions, arch, with_sass)}.json" if cache else None
    if path is not None and path.is_file():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):  # a torn or foreign file: compile again
            data = None
    if data is None or set(data) != set(expressions):
        data = _compile_group(source_file, expressions, arch, with_sass)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                partial = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
                partial.write_text(json.dumps(data))
                os.replace(partial, path)  # readers see the old file or the whole new one
            except OSError:
                pass  # a read-only home: the check still runs, uncached
    results = []
    for spec in group:
        d = dict(data[spec.expression])
        d["sass_opcodes"] = frozenset(d["sass_opcodes"])
        results.append(Resources(name=spec.name, **d))
    return results


ARCHS = ("80", "90", "90a")  # sm_90a: the wgmma kernels only


def compiled_for(spec: Specialization, arch: str) -> bool:
    """Whether the check compiles ``spec`` for ``sm_<arch>``: an arch-specific specialization
    (wgmma: "90a") for its own arch only, the portable ones for the portable archs ("80", "90")."""
    return spec.arch == arch or (not spec.arch and not arch.endswith("a"))


def compile_groups(archs, specs) -> list[tuple[str, str, list[Specialization]]]:
    """(arch, source file, its specializations built for that arch): one NVRTC program each."""
    groups = []
    for arch in archs:
        by_file: dict[str, list[Specialization]] = defaultdict(list)
        for spec in specs:
            if compiled_for(spec, arch):
                by_file[spec.source_file].append(spec)
        groups += [(arch, source_file, group) for source_file, group in by_file.items()]
    return groups


def check_archs(archs, specs: list[Specialization] | None = None,
                with_sass: bool = False, cache: bool = True) -> dict[str, list[Resources]]:
    """{arch: resources} for ``specs`` (default: all) compiled for each ``sm_<arch>``.

    One NVRTC program per (source file, arch), compiled on a thread each: NVRTC releases the GIL
    during the compile, so the programs build in parallel on every core. ``cache``: reuse and
    store results in ``cache_dir()``.
    """
    from concurrent.futures import ThreadPoolExecutor

    specs = all_specializations() if specs is None else specs
    jobs = compile_groups(archs, specs)
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        futures = [(arch, pool.submit(_check_group, f, group, arch, with_sass, cache))
                   for arch, f, group in jobs]
        results: dict[str, list[Resources]] = {arch: [] for arch in archs}
        for arch, future in futures:
            results[arch].extend(future.result())
    return results


def check(arch: str, specs: list[Specialization] | None = None, with_sass: bool = False,
          cache: bool = True) -> list[Resources]:
    """Compile ``specs`` (default: all) for ``sm_<arch>``; resources per specialization."""
    return check_archs([arch], specs, with_sass, cache)[arch]


DESCRIPTION = """\
Compile every kernel specialization with NVRTC for sm_80 and sm_90 (the wgmma kernels for
sm_90a) without a GPU, and read each kernel's registers, stack and spills from ptxas. A compile
error, a register spill or a serialized wgmma (ptxas C7515) fails the check. Results are cached
in $CUPYFLASH_CACHE_DIR (default ~/.cache/cupyflash), keyed by the sources and the toolchain.
Exit status: 0 every kernel clean, 1 some kernel failed or spilled, 2 bad arguments, 3 NVRTC or
the CUDA headers not installed."""


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
    groups = compile_groups(archs, specs)
    if not groups:
        raise cli.UsageError(f"no specialization for sm_{', sm_'.join(archs)} matches "
                             f"--kernel {' '.join(args.kernel or [])}")
    try:
        _nvrtc()
        compile_options(archs[0])  # CuPy's include paths: it raises when it finds no CUDA headers
    except (OSError, RuntimeError) as exc:
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

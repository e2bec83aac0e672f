"""The registry of mirrored C++ statements and the checks that keep them the kernels' code.

A model names the statements it copies with @mirrors(source, *statements): ``source`` is a kernel
by name (``"flash_bwd_dkdv_mma"``), found wherever kernels_cu/ defines it, or a header of shared
helpers by file (``"mask.cuh"``). A kernel's text is the file that defines it, less the bodies of
the other kernels there, with its local includes inlined: a kernel moved to a file of its own, or
a helper moved to a header it includes, keeps its mirrors. missing_statements finds the statements
no longer in their source (whitespace aside); unmirrored_statements finds the layout statements of
a source (its own file, no includes) that no model names. An edit of the kernels' arithmetic then
fails until its mirror follows.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import NamedTuple

KERNELS_CU = Path(__file__).resolve().parents[2] / "kernels_cu"


class Mirror(NamedTuple):
    source: str  # a kernel's name, or a header file in kernels_cu
    statement: str  # the C++ statement, as written there
    name: str  # the Python mirror's name


MIRRORED: list[Mirror] = []


def mirrors(source: str, *statements: str):
    def register(obj):
        MIRRORED.extend(Mirror(source, s, obj.__name__) for s in statements)
        return obj
    return register


# Statements that compute a shared-memory address, a tile or descriptor offset, or issue a wgmma
# or a fragment store: every one of them in the wgmma kernels must have a mirror.
WGMMA_LAYOUT_STATEMENT = re.compile(
    r"\b(?:return static_cast|static constexpr \w+ \w+|constexpr int \w+|const u32 \w+|"
    r"const int (?:row0|rows_left|key_row|qp|m_lo|chunk|col)\b|Wgmma<T|st_shared_b32\(|cp_async_16\(|"
    r"cp_async_panels<|return tile)")

# A kernel definition: __global__ void [__launch_bounds__(...)] name(parameters)
_KERNEL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)\s*)?(\w+)\s*\(")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


def is_file(source: str) -> bool:
    return source.endswith((".cu", ".cuh"))


def _files() -> list[Path]:
    return sorted([*KERNELS_CU.glob("*.cu"), *KERNELS_CU.glob("*.cuh")])


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", text)


def kernel_definitions(text: str) -> list[tuple[str, int, int, str]]:
    """(name, start, end, parameter list) of every kernel defined in ``text`` (comments
    stripped): start is the ``__global__``, end just past the body's closing brace."""
    found = []
    for m in _KERNEL.finditer(text):
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        parameters = text[m.end(): i - 1]
        depth, j = 0, text.index("{", i)
        while True:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
            if depth == 0:
                break
        found.append((m.group(1), m.start(), j, " ".join(parameters.split())))
    return found


@functools.lru_cache(maxsize=None)
def _definitions() -> dict[str, list[tuple[Path, int, int, str]]]:
    table: dict = {}
    for path in _files():
        for name, start, end, parameters in kernel_definitions(_strip_comments(path.read_text())):
            table.setdefault(name, []).append((path, start, end, parameters))
    return table


def kernel_names() -> list[str]:
    return sorted(_definitions())


def kernel_file(name: str) -> Path:
    """The one file of kernels_cu/ (.cu or .cuh) that defines kernel ``name``."""
    where = _definitions().get(name, [])
    assert len(where) == 1, f"kernel {name} is defined {len(where)} times in kernels_cu/: {[p.name for p, *_ in where]}"
    return where[0][0]


def kernel_parameters(name: str) -> str:
    """The parameter list of kernel ``name`` (whitespace squashed to single spaces)."""
    kernel_file(name)
    return _definitions()[name][0][3]


def _inline(text: str, seen: set) -> str:
    def expand(m):
        header = m.group(1)
        if header in seen or not (KERNELS_CU / header).is_file():
            return ""
        seen.add(header)
        return _inline(_strip_comments((KERNELS_CU / header).read_text()), seen)
    return _INCLUDE.sub(expand, text)


def code(source: str, includes: bool = False) -> str:
    """The text of ``source`` without its line comments: a header's file, or a kernel's file less
    the other kernels defined there; ``includes``: with the local headers it includes inlined."""
    path = KERNELS_CU / source if is_file(source) else kernel_file(source)
    text = _strip_comments(path.read_text())
    if not is_file(source):
        for name, start, end, _ in reversed(kernel_definitions(text)):
            if name != source:
                text = text[:start] + text[end:]
    return _inline(text, {path.name}) if includes else text


def squash(text: str) -> str:
    return "".join(text.split())


def layout_statements(text: str, pattern: re.Pattern = WGMMA_LAYOUT_STATEMENT) -> list[str]:
    """Every statement of `text` that `pattern` starts (from its first token to its semicolon)."""
    found, pos = [], 0
    while (m := pattern.search(text, pos)) is not None:
        end = text.index(";", m.start()) + 1
        found.append(text[m.start(): end])
        pos = end
    return found


@functools.cache
def _register_every_model() -> None:
    """Import every model module: a source's mirrors may live in several models (a shared header's
    in each kernel's), and a test file run alone imports only some of them."""
    import importlib
    import pkgutil
    for module in pkgutil.iter_modules([str(Path(__file__).parent)]):
        importlib.import_module(f"{__package__}.{module.name}")


def sources() -> list[str]:
    """Every source some mirror names."""
    _register_every_model()
    return sorted({m.source for m in MIRRORED})


def missing_statements(source: str) -> list[tuple[str, str]]:
    """(statement, mirror) for each registered statement of `source` that the source no longer holds."""
    text = squash(code(source, includes=True))
    return [(m.statement, m.name) for m in MIRRORED if m.source == source and squash(m.statement) not in text]


def unmirrored_statements(source: str, text: str | None = None,
                          pattern: re.Pattern = WGMMA_LAYOUT_STATEMENT) -> list[str]:
    """The layout statements (those `pattern` starts) of `text` (default: all of `source`'s own
    text) that no mirror of `source` names."""
    _register_every_model()
    named = {squash(m.statement) for m in MIRRORED if m.source == source}
    return [s for s in layout_statements(code(source) if text is None else text, pattern) if squash(s) not in named]

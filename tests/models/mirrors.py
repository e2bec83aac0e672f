"""The registry of mirrored C++ statements and the checks that keep them the kernels' code.

A model names the statements it copies with @mirrors(source, *statements). missing_statements
finds those no longer in their source (whitespace aside); unmirrored_statements finds the layout
statements of a source that no model names. An edit of the kernels' arithmetic then fails until
its mirror follows.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

KERNELS_CU = Path(__file__).resolve().parents[2] / "kernels_cu"


class Mirror(NamedTuple):
    source: str  # file in kernels_cu
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


def code(source: str) -> str:
    """The source without its line comments."""
    return re.sub(r"//[^\n]*", "", (KERNELS_CU / source).read_text())


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


def missing_statements(source: str) -> list[tuple[str, str]]:
    """(statement, mirror) for each registered statement of `source` that the source no longer holds."""
    text = squash(code(source))
    return [(m.statement, m.name) for m in MIRRORED if m.source == source and squash(m.statement) not in text]


def unmirrored_statements(source: str, text: str | None = None) -> list[str]:
    """The layout statements of `text` (default: all of `source`) that no mirror of `source` names."""
    named = {squash(m.statement) for m in MIRRORED if m.source == source}
    return [s for s in layout_statements(code(source) if text is None else text) if squash(s) not in named]

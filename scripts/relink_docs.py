"""Move the docs' line links into the sources (kernels_cu/, cupyflash/, ...) along with an edit.

    python scripts/relink_docs.py [--base REV] [--check]

docs/*.md and README.md link code by line range (``../kernels_cu/flash_bwd_wgmma.cu#L130-L150``,
``../cupyflash/plans.py#L484-L486``), and tests/test_docs.py fails when the name a link shows is no
longer inside its range. For every file that differs from ``--base`` (default HEAD), this maps each
line of the base's text to the working tree's (difflib's matching blocks; a line that was removed
maps to the nearest kept line before it) and rewrites the ranges of the links whose name (the
first `code` of the link text) is no longer inside them, so a second run changes nothing.
``--check`` prints the rewrites and changes nothing.
"""
from __future__ import annotations

import argparse
import difflib
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[([^\]]*)\]\((\.\./)?([\w./-]+\.(?:cu|cuh|py))#L(\d+)(?:-L(\d+))?\)")
NAME = re.compile(r"`([^`]+)`")


def line_map(old: list[str], new: list[str]) -> dict[int, int]:
    """1-based old line -> new line: equal lines by difflib's blocks, others to the nearest before."""
    mapping: dict[int, int] = {}
    for a, b, size in difflib.SequenceMatcher(None, old, new, autojunk=False).get_matching_blocks():
        for k in range(size):
            mapping[a + k + 1] = b + k + 1
    last = 1
    for line in range(1, len(old) + 1):
        last = mapping.setdefault(line, last)
    return mapping


def changed_maps(base: str) -> dict[str, dict[int, int]]:
    names = subprocess.run(["git", "diff", "--name-only", base], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    maps = {}
    for name in names:
        path = ROOT / name
        if not path.is_file():
            continue
        old = subprocess.run(["git", "show", f"{base}:{name}"], cwd=ROOT, capture_output=True, text=True)
        if old.returncode != 0:  # new in the working tree: nothing links it yet
            continue
        maps[name] = line_map(old.stdout.splitlines(), path.read_text().splitlines())
    return maps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    maps = changed_maps(args.base)
    for doc in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        text = doc.read_text()

        def move(match: re.Match) -> str:
            text_, up, path, a, b = match.groups()
            lines = maps.get(path)
            name = NAME.search(text_)
            if lines is None or name is None:
                return match.group(0)
            start, end = int(a), int(b or a)
            source = (ROOT / path).read_text().splitlines()
            if any(name.group(1).split("(")[0] in line for line in source[start - 1:end]):
                return match.group(0)  # still where it names: moved already, or never moved
            new_start, new_end = lines.get(start, start), lines.get(end, end)
            rng = f"L{new_start}" + (f"-L{new_end}" if b else "")
            moved = f"[{text_}]({up or ''}{path}#{rng})"
            print(f"{doc.relative_to(ROOT)}: {match.group(0)} -> {moved}")
            return moved

        moved = LINK.sub(move, text)
        if moved != text and not args.check:
            doc.write_text(moved)


if __name__ == "__main__":
    main()

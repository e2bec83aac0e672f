"""Compare the machine code of two trees' kernels, on CPU: registers, spills, instruction counts and
opcodes of every specialization both trees name the same, compiled by this machine's NVRTC.

    git archive <rev> | tar -x -C .before          # the tree to compare against
    python dev/compare_sass.py --before .before [--match REGEX] [--arch 80 90 90a] [--identical]
                               [--opcodes 'MMA|MUFU|^[DF](ADD|MUL|FMA)']   # the math a refactor must keep

A refactor that should not change the code (run-time arguments moved into a struct, a template
argument renamed) shows up here before any GPU run: same registers, no spills, and instruction
counts within a few (parameter loads) of before. Memory opcodes keep all their modifiers
(LDG.E.U16.CONSTANT vs LDG.E.U16), so a lost read-only path is visible. ``--identical`` exits 1 unless
every compared kernel has the same opcode histogram and register count.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cupyflash.kernels import compile_check  # noqa: E402

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)
_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")
_MEMORY = ("LDG", "STG", "LDS", "STS", "LDGSTS", "LDC", "ULDC", "RED", "ATOMG")


def source_text(root: Path, filename: str) -> str:
    """kernels_cu/<filename> of the tree at ``root`` with its includes inlined (as _module.kernel_source)."""
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        return _INCLUDE.sub(lambda m: expand(m.group(1)), (root / "kernels_cu" / name).read_text()
                            .replace("#pragma once", ""))

    return f"// cupyflash: {filename}\n" + expand(filename)


_LIST_SPECS = """
import json, sys
sys.path.insert(0, sys.argv[1])
from cupyflash.kernels import compile_check
print(json.dumps([(s.name, s.source_file, s.expression, s.arch) for s in compile_check.all_specializations()]))
"""


def specs_of(root: Path) -> list[tuple[str, str, str, str]]:
    """(name, source file, expression, arch) of every specialization the tree at ``root`` compiles."""
    out = subprocess.run([sys.executable, "-c", _LIST_SPECS, str(root)], capture_output=True, text=True,
                         check=True, cwd=root).stdout
    return [tuple(s) for s in json.loads(out)]


def opcode(line_opcode: str) -> str:
    """Memory opcodes with all their modifiers (LDG.E.U16.CONSTANT is not LDG.E.U16), others bare."""
    return line_opcode if line_opcode.split(".")[0] in _MEMORY else line_opcode.split(".")[0]


def compile_tree(root: Path, specs, archs) -> dict:
    """{(arch, name): {registers, spill, instructions, histogram}}."""
    jobs = []
    for arch in archs:
        by_file: dict[str, list] = {}
        for name, source_file, expression, spec_arch in specs:
            if spec_arch == arch or (not spec_arch and not arch.endswith("a")):
                by_file.setdefault(source_file, []).append((name, expression))
        jobs += [(arch, f, group) for f, group in by_file.items()]

    def build(job):
        arch, source_file, group = job
        expressions = sorted({e for _, e in group})
        cubin, mangled, log = compile_check.compile_text(source_text(root, source_file), source_file,
                                                         expressions, arch)
        report = compile_check.ptxas_report(log)
        usage = compile_check.resource_usage(cubin, with_sass=True)
        out = {}
        for name, expression in group:
            m = mangled[expression]
            histogram = Counter(opcode(op) for op in _LINE.findall(usage[m]["sass"]))
            out[(arch, name)] = {"registers": report[m]["registers"],
                                 "spill": report[m]["spill_stores"] + report[m]["spill_loads"],
                                 "instructions": sum(histogram.values()), "histogram": histogram}
        return out

    results = {}
    with ThreadPoolExecutor(max_workers=4) as pool:
        for part in pool.map(build, jobs):
            results.update(part)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="an exported tree to compare against")
    parser.add_argument("--match", default="", help="regex on specialization names")
    parser.add_argument("--arch", nargs="+", default=["80", "90", "90a"])
    parser.add_argument("--identical", action="store_true", help="exit 1 unless histograms and registers match")
    parser.add_argument("--opcodes", default=None,
                        help="regex: the opcodes a change must leave alone (a refactor: 'MMA|MUFU|^[DF](ADD|MUL|FMA)'); "
                             "their every count change is listed after the table, and exit 1 if any")
    args = parser.parse_args(argv)
    watched = re.compile(args.opcodes) if args.opcodes else None
    watched_changes = []
    pattern = re.compile(args.match)
    before_specs = [s for s in specs_of(args.before.resolve()) if pattern.search(s[0])]
    after_specs = [s for s in specs_of(ROOT) if pattern.search(s[0])]
    # A user modifier's kernels (cfu:: structs generated per call) are not compared: their code
    # comes from cupyflash/modifiers.py, not from the kernels' files alone.
    before_specs = [s for s in before_specs if "cfu::" not in s[2]]
    after_specs = [s for s in after_specs if "cfu::" not in s[2]]
    common = sorted({s[0] for s in before_specs} & {s[0] for s in after_specs})
    only = sorted({s[0] for s in before_specs} ^ {s[0] for s in after_specs})
    before = compile_tree(args.before.resolve(), [s for s in before_specs if s[0] in common], args.arch)
    after = compile_tree(ROOT, [s for s in after_specs if s[0] in common], args.arch)
    differs = 0
    print(f"{'arch':5} {'specialization':70} {'regs':>9} {'spill':>7} {'instr':>11}  opcode changes")
    for key in sorted(before):
        if key not in after:
            continue
        b, a = before[key], after[key]
        delta = {op: a["histogram"][op] - b["histogram"][op]
                 for op in set(a["histogram"]) | set(b["histogram"]) if a["histogram"][op] != b["histogram"][op]}
        same = not delta and a["registers"] == b["registers"]
        differs += not same
        changes = " ".join(f"{op}{n:+d}" for op, n in sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:8])
        if watched is not None:
            watched_changes += [(key, op, n) for op, n in sorted(delta.items()) if watched.search(op)]
        print(f"sm{key[0]:3} {key[1]:70} {b['registers']:>4}>{a['registers']:<4} {b['spill']:>3}>{a['spill']:<3} "
              f"{b['instructions']:>5}>{a['instructions']:<5}  {changes or 'same'}")
    print(f"{len(before)} kernels compared, {differs} differ; names in one tree only: {len(only)}"
          + (f" ({', '.join(only[:6])}{', ...' if len(only) > 6 else ''})" if only else ""))
    if watched is not None:
        for (arch, name), op, n in watched_changes:
            print(f"watched: sm{arch} {name} {op}{n:+d}")
        print(f"watched opcodes ({args.opcodes}): {len(watched_changes)} count changes")
    return 1 if (args.identical and differs) or watched_changes else 0


if __name__ == "__main__":
    sys.exit(main())

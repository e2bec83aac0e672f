"""The loops of a kernel's machine code, on the CPU: each backward branch's body (from its target to
the branch) with its instruction count and opcode mix, so that a warp's issue slots per loop
iteration can be counted against the time a step takes (a warp issues at most one instruction a
clock on its scheduler; the four schedulers of an SM each hold warps of every role).

    python dev/sass_loops.py --kernel flash_bwd_dkdv_tf32_wgmma_ws_fp32_hdim64_full_bm32_bn64_s2_r1_apart [--arch 90a]

Only the compile check's specializations (and the bench's float32 candidates) are known by name.
Loops nest: an outer loop's count includes its inner loops' bodies once.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# "/*0a30*/   @!P0 BRA `(.L_x_12) ;" or "BRA 0xa30": an instruction's address, predicate, opcode, rest
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\S*)\s*([^;]*);")
_TARGET = re.compile(r"0x([0-9a-f]+)")
_LABEL = re.compile(r"^\s*\.L_x_(\d+):", re.MULTILINE)


def parse(sass: str) -> tuple[list, dict]:
    """([(address, opcode, operands)], {label: address}) of one function's cuobjdump -sass text."""
    instructions, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = re.match(r"^\s*\.L_x_(\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        m = _LINE.search(line)
        if m:
            address = int(m.group(1), 16)
            for name in pending:
                labels[name] = address
            pending = []
            instructions.append((address, m.group(2), m.group(4)))
    return instructions, labels


def loops(instructions: list, labels: dict) -> list:
    """(start, end, body) of every backward branch: start its target, end the branch's address."""
    found = []
    for address, opcode, operands in instructions:
        if opcode not in ("BRA", "JMP"):
            continue
        label = re.search(r"\.L_x_(\d+)", operands)
        target = labels.get(label.group(1)) if label else None
        if target is None:
            hexes = _TARGET.findall(operands)
            target = int(hexes[-1], 16) if hexes else None
        if target is not None and target <= address:
            body = [i for i in instructions if target <= i[0] <= address]
            found.append((target, address, body))
    return sorted(found)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", required=True, help="a specialization's name (or a unique substring)")
    parser.add_argument("--arch", default="90a")
    parser.add_argument("--top", type=int, default=10, help="opcodes listed a loop")
    args = parser.parse_args(argv)

    from cupyflash.kernels import compile_check

    specs = {s.name: s for s in compile_check.all_specializations()}
    try:
        from bench_dmma_bwd import WGMMA_CANDIDATES, WGMMA_D128_CANDIDATES

        from cupyflash.backward_plans import tf32_wgmma_backward_plan

        for headdim, table in ((64, WGMMA_CANDIDATES), (128, WGMMA_D128_CANDIDATES)):
            for config in table.values():
                for causal in (False, True):
                    for launch in tf32_wgmma_backward_plan(headdim, causal, config).launches:
                        specs.setdefault(launch.spec.name, launch.spec)
    except ImportError:
        pass
    matches = [s for name, s in specs.items() if args.kernel in name]
    exact = [s for s in matches if s.name == args.kernel]
    if len(exact) == 1:
        matches = exact
    if len(matches) != 1:
        print(f"{len(matches)} specializations match {args.kernel!r}: "
              f"{', '.join(sorted(s.name for s in matches)[:8])}", file=sys.stderr)
        return 2
    spec = matches[0]
    cubin, mangled, _ = compile_check.compile_cubin(spec.source_file, [spec.expression], spec.arch or args.arch)
    info = compile_check.resource_usage(cubin, with_sass=True)[mangled[spec.expression]]
    instructions, labels = parse(info["sass"])
    print(f"{spec.name} (sm_{spec.arch or args.arch}): {info['registers']} registers, {len(instructions)} instructions")
    for start, end, body in loops(instructions, labels):
        mix = collections.Counter(opcode for _, opcode, _ in body)
        top = ", ".join(f"{op} {n}" for op, n in mix.most_common(args.top))
        print(f"  loop 0x{start:05x}-0x{end:05x}: {len(body):5d} instructions  ({top})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

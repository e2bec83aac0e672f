"""``python -m cupyflash plan``: which kernels a call launches, with which tiles, on which GPU —
the plans' answer (cupyflash.plans.plan_forward, cupyflash.backward_plans.plan_backward) printed
for one problem, without a GPU. For a kernel engineer about to read or change a kernel: the
specialization name printed is the one the compile check, the tuner, the sanitizer and the
profiles use, and its template instantiation says which source file and which template arguments.
"""
from __future__ import annotations

import argparse

from ._dtypes import SUPPORTED, dtype_argument
from .cli import EXIT_OK, EXIT_USAGE, integer, summary

DESCRIPTION = """\
Which kernels a call launches, with which tiles, on a given GPU: the plans' answer for one problem
(no GPU needed). The forward, then the backward's launches in order, each with its specialization
name (the compile check's, the tuner's and the profiles'), its C++ instantiation, threads and
dynamic shared memory."""

EPILOG = """\
GPUs by compute capability: 80 (A100: 163 KiB of shared memory a block may opt in to), 86 and 89
(99 KiB), 90 (H100 / H200: 227 KiB, the wgmma kernels). --smem overrides the opt-in bytes.

  python -m cupyflash plan --arch 90 --dtype bf16 --headdim 128 --causal
  python -m cupyflash plan --arch 80 --dtype fp32 --headdim 64 --window 256 0 --atomic

Exit status: 0 a plan printed, 2 bad arguments or a problem no plan takes."""

# Opt-in shared memory per block of the devices each compute capability names here.
SMEM_OPTIN = {"80": 163 * 1024, "86": 99 * 1024, "89": 99 * 1024, "90": 227 * 1024}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", choices=sorted(SMEM_OPTIN), default="90", help="compute capability (default 90)")
    parser.add_argument("--smem", type=integer(0), metavar="BYTES",
                        help="opt-in shared memory per block (default: the arch's, see below)")
    parser.add_argument("--dtype", type=dtype_argument(), default="bfloat16", help="default bf16")
    parser.add_argument("--headdim", type=integer(1, 256), default=128, help="of q and k (default 128)")
    parser.add_argument("--headdim-v", type=integer(1, 256), metavar="D", help="of v, when its own")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--window", type=int, nargs=2, default=(-1, -1), metavar=("LEFT", "RIGHT"),
                        help="flash-attn's window_size (-1: unbounded)")
    parser.add_argument("--atomic", action="store_true",
                        help="deterministic=False: the backward may add dQ with atomics")
    parser.add_argument("--precision", choices=("ieee", "tf32"), default="ieee", help="float32's products")
    parser.add_argument("--statistics", choices=("saved", "recomputed"), default="saved",
                        help="the backward's row statistics: flash_attn_backward's default (saved), or "
                             "recomputed, what flash_attn_vjp and the torch autograd use for fp32 / fp64")


def describe(arch: str, smem: int, dtype: str, headdim: int, headdim_v: int | None, causal: bool, window,
             deterministic: bool, precision: str = "ieee", statistics: str = "saved") -> tuple[list[str], int]:
    """(the lines ``plan`` prints: the forward plan, then the backward's launches; how many kernels)."""
    from .backward_plans import plan_backward
    from .masks import mask_for
    from .plans import plan_forward

    mask = mask_for(causal, tuple(window))
    widest = max(headdim, headdim_v or headdim)
    forward = plan_forward(arch, SUPPORTED[dtype], widest, mask, smem, headdim_v=headdim_v, precision=precision)
    lines = [f"forward: {forward.family} family, {forward.kernel}, device class {forward.device_class}, "
             f"head dim {forward.headdim} (tile {forward.d_tile}), tiles {forward.tiles}",
             _spec_line(forward.spec)]
    backward = plan_backward(arch, SUPPORTED[dtype], widest, mask, smem, deterministic, statistics=statistics)
    lines.append(f"backward: {backward.family} family, device class {backward.device_class}, dQ formed "
                 f"{backward.dq_add!r} ({'deterministic' if backward.deterministic else 'atomic adds'}), "
                 f"{len(backward.launches)} launches")
    for launch in backward.launches:
        lines.append(f"  {launch.role}:")
        lines.append("  " + _spec_line(launch.spec))
    return lines, 1 + len(backward.launches)


def _spec_line(spec) -> str:
    arch = f", compiled for sm_{spec.arch}" if spec.arch else ""
    return (f"  {spec.name}\n    {spec.expression} in kernels_cu/{spec.source_file}, {spec.threads} threads, "
            f"{spec.smem_bytes} bytes of dynamic shared memory{arch}")


def run(args) -> int:
    smem = SMEM_OPTIN[args.arch] if args.smem is None else args.smem
    try:
        lines, kernels = describe(args.arch, smem, args.dtype, args.headdim, args.headdim_v, args.causal,
                                  args.window, not args.atomic, args.precision, args.statistics)
    except ValueError as error:
        summary("plan", f"no plan: {str(error).removeprefix('cupyflash: ')}")
        return EXIT_USAGE
    print("\n".join(lines))
    summary("plan", f"sm_{args.arch} ({smem // 1024} KiB), {args.dtype}, head dim {args.headdim}: {kernels} kernels")
    return EXIT_OK


def main(argv=None) -> int:
    from .cli import main as cli_main

    return cli_main(["plan", *(argv or [])])

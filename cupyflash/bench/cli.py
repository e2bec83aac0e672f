"""``python -m cupyflash bench``: time cupyflash against PyTorch SDPA on the papers' shapes."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .. import cli as cupyflash_cli
from .._dtypes import SHORT_NAMES, parse_dtype_name
from . import shapes
from .impls import Impl, cupyflash_impls, torch_anchors
from .timing import FULL_POLICY, QUICK_POLICY, RepeatPolicy

EXIT_OK = cupyflash_cli.EXIT_OK
EXIT_FAILED = cupyflash_cli.EXIT_FAILED  # a cupyflash result failed validation or errored
EXIT_USAGE = cupyflash_cli.EXIT_USAGE
EXIT_NO_GPU = cupyflash_cli.EXIT_UNAVAILABLE

MEMORY_SEQLENS = (1024, 2048, 4096, 8192, 16384)
MEMORY_SEQLENS_QUICK = (1024, 4096)

DESCRIPTION = """\
Time cupyflash against PyTorch SDPA (FlashAttention-2, cuDNN, memory-efficient) on the
FlashAttention papers' shapes, each cupyflash result checked against float64 first."""

EPILOG = """\
examples:
  python -m cupyflash bench --quick
  python -m cupyflash bench --json bench.json --markdown docs/benchmarks.md --plot bench.png
  python -m cupyflash bench --dtype bf16 --headdim 128 --seqlen 4k 16k --mode fwd+bwd
  python -m cupyflash bench --backends simt,mma --no-torch --causal yes
  python -m cupyflash bench --skip-throughput --memory --decode
  python -m cupyflash bench --list            # the planned cases; needs no GPU
  python -m cupyflash bench --from-json bench.json --markdown docs/benchmarks.md --plot bench.png
                                              # re-render a saved report; needs no GPU or torch

Shapes follow the FlashAttention papers: batch*seqlen = --tokens, nheads*headdim = --model-dim.
TFLOP/s = 4*B*H*Sq*Sk*D / time, x0.5 causal, x2.5 bwd, x3.5 fwd+bwd. Exit status: 0 done,
1 a cupyflash result failed validation or errored, 2 bad arguments, 3 no usable GPU.
"""


def _split(convert):
    """One command-line word of comma-separated values, each converted."""
    def parse(text: str):
        try:
            return [convert(item) for item in text.split(",") if item.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


class _Collect(argparse.Action):
    """Values given space- or comma-separated, over repeated options, without duplicates."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = list(getattr(namespace, self.dest) or [])
        for word in values:
            items += [v for v in word if v not in items]
        setattr(namespace, self.dest, items)


def _dtype(text: str) -> str:
    """The short name (shapes.DTYPES' key) of a dtype spelled either way: bf16 or bfloat16."""
    return SHORT_NAMES[parse_dtype_name(text, allowed=tuple(shapes.DTYPES.values()))]


def _mode(text: str) -> str:
    if text.strip() not in shapes.MODES:
        raise ValueError(f"unknown mode {text!r} (choose from {', '.join(shapes.MODES)})")
    return text.strip()


_positive = cupyflash_cli.integer(1)


def build_parser() -> argparse.ArgumentParser:
    return cupyflash_cli.command_parser("bench")


def configure(p: argparse.ArgumentParser) -> None:
    what = p.add_argument_group("what to sweep (explicit values replace the preset's)")
    what.add_argument("--quick", action="store_true",
                      help="small sweep: bf16, d128, seqlen 1k and 4k, fewer repeats")
    what.add_argument("--dtype", action=_Collect, nargs="+", type=_split(_dtype),
                      help="bf16, fp16, fp32 or bfloat16, float16, float32 (default: bf16 "
                           "d64/128/256, fp16 d128, "
                           "fp32 d64/128 at 1k/4k/8k)")
    what.add_argument("--headdim", action=_Collect, nargs="+", type=_split(_positive))
    what.add_argument("--seqlen", action=_Collect, nargs="+", type=_split(shapes.parse_size),
                      help="e.g. 512 1k 16k (default 512..16k)")
    what.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    what.add_argument("--mode", action=_Collect, nargs="+", type=_split(_mode),
                      help="fwd, bwd, fwd+bwd (default: fwd bwd)")
    what.add_argument("--tokens", type=_positive, default=shapes.PAPER_TOKENS,
                      help="batch*seqlen (default %(default)s)")
    what.add_argument("--model-dim", type=_positive, default=shapes.PAPER_MODEL_DIM,
                      help="nheads*headdim (default %(default)s)")
    what.add_argument("--batch", type=_positive, help="fixed batch instead of tokens/seqlen")
    what.add_argument("--nheads", type=_positive, help="fixed query heads instead of "
                      "model-dim/headdim")
    what.add_argument("--nheads-kv", type=_positive, help="kv heads (GQA); default nheads")
    who = p.add_argument_group("what to compare")
    who.add_argument("--backends", action=_Collect, nargs="+", type=_split(str),
                     help="cupyflash backends, side by side (default: auto)")
    who.add_argument("--anchors", action=_Collect, nargs="+", type=_split(str),
                     help="torch SDPA anchors among FA2, cuDNN, mem-eff (default: all)")
    who.add_argument("--no-torch", action="store_true", help="cupyflash alone")
    extra = p.add_argument_group("extra sections")
    extra.add_argument("--memory", action="store_true",
                       help="extra peak memory of fwd+bwd vs seqlen, cupyflash vs standard "
                            "attention (batch 1, causal)")
    extra.add_argument("--decode", action="store_true",
                       help="seqlen_q = 1 against a long KV cache, K+V read TB/s")
    extra.add_argument("--skip-throughput", action="store_true",
                       help="run only the extra sections")
    how = p.add_argument_group("measurement")
    how.add_argument("--repeats", type=_positive, help="fixed repeat count (default: adaptive)")
    how.add_argument("--warmup", type=_positive,
                     help="warm-up calls after the compiling one (default 1)")
    how.add_argument("--seed", type=int, default=0)
    how.add_argument("--nondeterministic", action="store_true",
                     help="cupyflash backward with deterministic=False (dq by atomics, as "
                          "FlashAttention-2 does)")
    how.add_argument("--no-validate", action="store_true",
                     help="skip the float64 check of each cupyflash result")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="every figure, with environment")
    out.add_argument("--markdown", metavar="PATH",
                     help="fill the marked sections of PATH (e.g. docs/benchmarks.md), or "
                          "write a new document")
    out.add_argument("--plot", metavar="PATH", help="PNG (needs matplotlib); with --memory "
                     "also PATH-memory.png")
    out.add_argument("--from-json", metavar="PATH",
                     help="measure nothing: write --markdown, --plot and/or --json from the "
                          "report a --json run saved at PATH (needs no GPU, CuPy or torch); "
                          "the options that choose what to run, and how, are ignored")
    out.add_argument("--list", action="store_true", help="print the planned cases and exit")
    out.add_argument("--quiet", action="store_true", help="no progress line")


@dataclass
class Plan:
    throughput: list
    memory: list
    decode: list
    cupyflash: list
    anchors: list
    policy: RepeatPolicy

    def impls(self) -> list[Impl]:
        return self.cupyflash + self.anchors

    def steps(self) -> int:
        n = len(self.impls())
        return (len(self.throughput) * n + len(self.decode) * n + (1 if self.decode else 0)
                + len(self.memory) * (n + 1))


def make_plan(args) -> Plan:
    """Merge the presets with explicit options; raises ValueError on inconsistent ones."""
    causal = {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]
    throughput = []
    if not args.skip_throughput:
        spec = shapes.make_sweep(
            quick=args.quick, dtypes=args.dtype, headdims=args.headdim, seqlens=args.seqlen,
            causal=causal, modes=args.mode or ("fwd", "bwd"), tokens=args.tokens,
            model_dim=args.model_dim, batch=args.batch, nheads=args.nheads,
            nheads_kv=args.nheads_kv)
        throughput = shapes.expand(spec)
    dtype = args.dtype[0] if args.dtype else "bf16"
    headdim = args.headdim[0] if args.headdim else 128
    memory = []
    if args.memory:
        seqlens = args.seqlen or (MEMORY_SEQLENS_QUICK if args.quick else MEMORY_SEQLENS)
        memory = shapes.memory_cases(seqlens, dtype=dtype, headdim=headdim,
                                     model_dim=args.model_dim)
    decode = shapes.decode_cases(dtype, headdim) if args.decode else []
    if not (throughput or memory or decode):
        raise ValueError("nothing to run: --skip-throughput needs --memory or --decode")
    policy = QUICK_POLICY if args.quick else FULL_POLICY
    if args.repeats:
        policy = replace(policy, min_repeats=args.repeats, max_repeats=args.repeats)
    if args.warmup:
        policy = replace(policy, warmup=args.warmup)
    anchors = [] if args.no_torch else torch_anchors(args.anchors)
    return Plan(throughput, memory, decode, cupyflash_impls(args.backends or ("auto",)),
                anchors, policy)


def plan_text(plan: Plan) -> str:
    lines = []
    for title, cases in (("throughput", plan.throughput), ("decode", plan.decode),
                         ("memory", plan.memory)):
        if cases:
            lines.append(f"{title}: {len(cases)} cases")
            lines += [f"  {c.label():<44} {c.flops / 1e9:>12,.1f} GFLOP" for c in cases]
    lines.append("implementations: " + ", ".join(i.label for i in plan.impls()))
    lines.append(f"measurements: {plan.steps()}; repeats {plan.policy.min_repeats}.."
                 f"{plan.policy.max_repeats} after 1 compiling + {plan.policy.warmup} warm-up "
                 "calls")
    return "\n".join(lines)


def _config(args, plan: Plan) -> dict:
    return {
        "options": vars(args),
        "policy": asdict(plan.policy),
        "implementations": [asdict(i) for i in plan.impls()],
        "timing": "CUDA events per repeat, median; spin kernel holds the stream while repeats "
                  "are enqueued; input sets rotated against L2",
        "torch_backward": "out.backward(do, retain_graph=True), grads of q, k, v set to None "
                          "(untimed, host-side) before each backward",
        "cupyflash_backward": "flash_attn_backward alone, o and lse precomputed, "
                              f"deterministic={not args.nondeterministic}",
    }


def run_plan(plan: Plan, args, *, err=sys.stderr):
    """Measure everything in ``plan``; returns the Report."""
    from .environment import collect
    from .harness import Harness
    from .progress import Progress
    from .results import Report

    notes, torch = [], None
    if args.no_torch:
        notes.append("PyTorch anchors disabled (--no-torch): cupyflash alone.")
    elif plan.anchors:
        from .torch_sdpa import TorchBridge, load_torch

        torch, reason = load_torch()
        if torch is None:
            notes.append(f"PyTorch anchors omitted: {reason}. cupyflash alone.")
            plan.anchors = []
    harness = Harness(impls=plan.impls(), policy=plan.policy, validate=not args.no_validate,
                      seed=args.seed, deterministic=not args.nondeterministic)
    if plan.anchors:
        harness.bridge = TorchBridge(torch, harness.stream)
    report = Report(environment=collect(torch), config=_config(args, plan), notes=notes)
    progress = Progress(plan.steps(), stream=err, enabled=not args.quiet)
    try:
        if plan.throughput:
            report.throughput = harness.run_cases(plan.throughput, progress)
        if plan.decode:
            from .decode import measure_decode

            report.decode, report.copy, decode_notes = measure_decode(harness, plan.decode,
                                                                      progress)
            report.notes += decode_notes
        if plan.memory:
            from .memory import measure_memory

            report.memory = measure_memory(harness, plan.memory, plan.impls(), progress)
    finally:
        progress.close()
    return report


def load_report(path: Path):
    """The Report a --json run wrote; raises ValueError when PATH holds no such report."""
    from .results import Report

    try:
        return Report.from_json(json.loads(path.read_text()))
    except (KeyError, TypeError) as exc:  # a field missing, or of the wrong kind
        raise ValueError(f"malformed report ({type(exc).__name__}: {exc})") from None


def render_saved(args, *, err=sys.stderr) -> int:
    """--from-json: the outputs of a saved report, so that figures measured on a GPU machine
    can be rendered into the docs on one without a GPU. Imports neither CuPy nor torch."""
    if not (args.markdown or args.plot or args.json):
        raise cupyflash_cli.UsageError("--from-json needs --markdown, --plot or --json to write")
    try:
        report = load_report(Path(args.from_json))
    except (OSError, ValueError) as exc:
        raise cupyflash_cli.UsageError(f"cannot read {args.from_json}: {exc}") from None
    write_outputs(report, args, err=err)
    written = [path for path in (args.json, args.markdown, args.plot) if path]
    cupyflash_cli.summary("bench", f"rendered {', '.join(written)} from {args.from_json} "
                                   "(nothing measured)")
    return EXIT_OK


def write_outputs(report, args, *, err=sys.stderr) -> None:
    from .table import markdown_sections

    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=1, allow_nan=False)
                                   + "\n")
        print(f"cupyflash bench: wrote {args.json}", file=err)
    if args.markdown:
        write_markdown(Path(args.markdown), markdown_sections(report), err=err)
    if args.plot:
        from .plot import memory_plot_path, plot_memory, plot_throughput

        targets = []
        if report.throughput:
            targets.append((plot_throughput, report.throughput, Path(args.plot)))
        if report.memory:
            path = memory_plot_path(args.plot) if report.throughput else Path(args.plot)
            targets.append((plot_memory, report.memory, path))
        for draw, data, path in targets:
            problem = draw(data, path)
            print(f"cupyflash bench: {problem}" if problem else f"cupyflash bench: wrote {path}",
                  file=err)


def write_markdown(path: Path, sections: dict, *, err=sys.stderr) -> None:
    """Refill the marked sections of an existing document, or write a new one."""
    from .table import fill_markdown, markers, standalone_markdown

    if not path.exists():
        path.write_text(standalone_markdown(sections))
    else:
        text, missing = fill_markdown(path.read_text(), sections)
        for name in missing:
            begin, end = markers(name)
            text = text.rstrip("\n") + f"\n\n{begin}\n{sections[name].rstrip()}\n{end}\n"
            print(f"cupyflash bench: {path} had no '{name}' markers; appended the section",
                  file=err)
        path.write_text(text)
    print(f"cupyflash bench: wrote {path}", file=err)


def run(args) -> int:
    if args.from_json:
        return render_saved(args, err=sys.stderr)  # the stderr of now, not of import time
    try:
        plan = make_plan(args)
    except ValueError as exc:
        raise cupyflash_cli.UsageError(str(exc)) from None
    if args.list:
        print(plan_text(plan))
        cupyflash_cli.summary("bench", f"{plan.steps()} measurements planned (--list: none run)")
        return EXIT_OK

    from .harness import gpu_unavailable_reason

    reason = gpu_unavailable_reason()
    if reason is not None:
        cupyflash_cli.summary(
            "bench", f"no usable CUDA device ({reason}). The benchmark times GPU kernels, so "
                     "nothing was measured; --list shows the planned cases.", file=sys.stderr)
        return EXIT_NO_GPU

    from .table import text_report

    report = run_plan(plan, args)
    print(text_report(report))
    write_outputs(report, args)
    failures = report.validation_failures
    measured = report.throughput + report.decode
    errors = [m for m in measured if m.impl.family == "cupyflash" and m.status == "error"]
    for m in failures:
        print(f"cupyflash bench: FAILED validation: {m.case.label()} · {m.impl.label}: "
              f"{m.validation['errors']}", file=sys.stderr)
    for m in errors:
        print(f"cupyflash bench: error: {m.case.label()} · {m.impl.label}: {m.reason}",
              file=sys.stderr)
    timed = sum(m.ok for m in measured)
    text = (f"{timed} of {len(measured)} timings done, {len(failures)} failed validation, "
            f"{len(errors)} cupyflash errors" + (f", {len(report.memory)} memory figures"
                                                 if report.memory else ""))
    cupyflash_cli.summary("bench", ("FAIL: " if failures or errors else "") + text)
    return EXIT_FAILED if failures or errors else EXIT_OK


def main(argv=None) -> int:
    return cupyflash_cli.alias("bench", argv)

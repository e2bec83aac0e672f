"""``python -m cupyflash <command>``: the demo and the tools behind one command line.

Each command is a module that defines ``DESCRIPTION`` (its ``--help`` text), optionally
``EPILOG``, ``configure(parser)`` (its options) and ``run(args)`` (returns the exit status). The
module's own ``main(argv)`` is this command line with the command's name in front, so that
``python -m cupyflash.sanitize`` and friends keep working.

Every command ends with one line ``cupyflash <command>: <verdict>`` (``summary``) and exits with
EXIT_OK, EXIT_FAILED (a check failed), EXIT_USAGE (bad arguments) or EXIT_UNAVAILABLE (this
machine lacks what the command needs: a GPU, NVRTC, ncu, compute-sanitizer).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3


@dataclass(frozen=True)
class Command:
    name: str
    module: str
    summary: str  # its line in the top-level --help


COMMANDS = (
    Command("demo", "cupyflash.demo",
            "forward and backward on random data, PASS or FAIL against the float64 reference "
            "(GPU, else the NumPy backend)"),
    Command("bench", "cupyflash.bench.cli",
            "TFLOP/s, memory and decode bandwidth against PyTorch SDPA on the FlashAttention "
            "papers' shapes (GPU; --list and --from-json without)"),
    Command("compile-check", "cupyflash.kernels.compile_check",
            "compile every kernel specialization with NVRTC: registers, spills, wgmma "
            "serialization (no GPU needed)"),
    Command("sanitize", "cupyflash.sanitize",
            "every kernel family under compute-sanitizer's memcheck, racecheck, initcheck and "
            "synccheck (GPU)"),
    Command("io-complexity", "cupyflash.bench.io_complexity",
            "HBM traffic: the FlashAttention IO model against Nsight Compute's counters "
            "(GPU and ncu; --model-only without)"),
    Command("tune", "cupyflash.bench.tune",
            "time every candidate tile configuration of the tensor-core kernels (GPU)"),
    Command("plan", "cupyflash.plan_cli",
            "which kernels a call launches, with which tiles, on a given GPU (no GPU needed)"),
)

DESCRIPTION = """\
cupyflash: exact FlashAttention (forward and backward) as CuPy raw kernels compiled by NVRTC."""

EPILOG = """\
'{prog} help <command>' or '{prog} <command> --help' describes one command.
dtypes are spelled bf16, fp16, fp32, fp64 or bfloat16, float16, float32, float64 everywhere.

exit status: 0 done, every check passed; 1 a check failed; 2 bad arguments; 3 this machine lacks
what the command needs (a GPU, NVRTC, ncu or compute-sanitizer)."""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written; the list of commands without argparse's header
    line (the subparsers' metavar) above it."""

    def _format_action(self, action):
        text = super()._format_action(action)
        if isinstance(action, argparse._SubParsersAction):
            text = text.split("\n", 1)[1]
        return text


def integer(low: int = 1, high: int | None = None):
    """An argparse ``type=``: an integer in [low, high] (argparse names the option on error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f"at least {low}" if high is None else f"between {low} and {high}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


class UsageError(Exception):
    """Raised by a command's run() for arguments that parse but do not make sense together."""


def prog_name() -> str:
    """How the user called us: the console script, or ``python -m cupyflash``."""
    return "cupyflash" if Path(sys.argv[0]).name == "cupyflash" else "python -m cupyflash"


def summary(command: str, text: str, *, file=None) -> None:
    """The last line of every command: ``cupyflash <command>: <text>``."""
    print(f"cupyflash {command}: {text}", file=sys.stdout if file is None else file, flush=True)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and {command: its parser}."""
    prog = prog_name()
    parser = argparse.ArgumentParser(
        prog=prog, description=DESCRIPTION, epilog=EPILOG.format(prog=prog),
        formatter_class=_Formatter)
    from . import __version__

    parser.add_argument("--version", action="version", version=f"cupyflash {__version__}",
                        help="print 'cupyflash <version>' and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="command", required=True,
                                       title="commands")
    parsers = {}
    for command in COMMANDS:
        module = importlib.import_module(command.module)
        sub = subparsers.add_parser(
            command.name, help=command.summary, description=module.DESCRIPTION,
            epilog=getattr(module, "EPILOG", None),
            formatter_class=argparse.RawDescriptionHelpFormatter)
        module.configure(sub)
        parsers[command.name] = sub
    helper = subparsers.add_parser("help", help="this help, or one command's",
                                   description="The help of cupyflash, or of one command.")
    helper.add_argument("topic", nargs="?", choices=list(parsers), metavar="command",
                        help=", ".join(parsers))
    parsers["help"] = helper
    return parser, parsers


def command_parser(name: str) -> argparse.ArgumentParser:
    """The parser of one command, as ``python -m cupyflash <name>`` uses it."""
    return build_parser()[1][name]


def _exit_status(code) -> int:
    """The status a SystemExit from argparse carries: None after --help, 2 after an error."""
    if code is None:
        return EXIT_OK
    return code if isinstance(code, int) else EXIT_USAGE


def main(argv=None) -> int:
    parser, parsers = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exc:  # --help, --version, or a usage error argparse has printed
        return _exit_status(exc.code)
    name = vars(args).pop("command")
    if name == "help":
        (parsers[args.topic] if args.topic else parser).print_help()
        return EXIT_OK
    module = importlib.import_module(next(c.module for c in COMMANDS if c.name == name))
    try:
        return module.run(args)
    except UsageError as exc:  # reported as argparse reports its own: usage, then the error
        try:
            parsers[name].error(str(exc))
        except SystemExit as stop:
            return _exit_status(stop.code)
    except KeyboardInterrupt:
        summary(name, "interrupted", file=sys.stderr)
        return 130


def alias(name: str, argv=None) -> int:
    """``python -m <module of name> ARGS``: the same as ``python -m cupyflash <name> ARGS``."""
    return main([name, *(sys.argv[1:] if argv is None else argv)])

"""python -m cupyflash {demo, bench, compile-check} [options]"""
import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("demo", "bench", "compile-check")
    if not argv or argv[0] not in commands:
        print(f"usage: python -m cupyflash {{{','.join(commands)}}} [options]  (--help after a command)")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from .demo import main as run
    elif command == "bench":
        from .bench.cli import main as run
    else:
        from .kernels.compile_check import main as run
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())

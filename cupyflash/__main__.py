"""``python -m cupyflash <command>``: the command line of cupyflash/cli.py."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())

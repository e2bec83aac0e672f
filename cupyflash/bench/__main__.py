"""``python -m cupyflash.bench`` (the same as ``python -m cupyflash bench``)."""
import sys

from .cli import main

sys.exit(main())

"""The varlen bench's causal rows alone (issue 17's packed causal bar), for a before / after of two
source trees on one machine: ``PYTHONPATH=<tree> python dev/varlen_causal_ab.py [d ...]`` prints
cupyflash.bench.varlen's table for those head dims (default 128), causal only."""
import sys

from cupyflash.bench.varlen import measure, table

headdims = tuple(int(a) for a in sys.argv[1:]) or (128,)
print(table(measure(headdims=headdims, causal_modes=(True,))))

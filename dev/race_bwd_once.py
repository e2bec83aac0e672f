"""One bfloat16 forward and backward on the mma backend at head dim D, for compute-sanitizer's
racecheck on the default backward kernels alone (perf log wgmma-bwd-ws-route: the producer
kernels' epilogue):

    compute-sanitizer --tool racecheck --racecheck-report all --print-limit 40 \\
        python dev/race_bwd_once.py D causal|none [dropout]

q (1, 77, 4, D), k and v (1, 130, 2, D): GQA, a partial last block of queries and of keys, the
sanitize workload's odd shape (cupyflash/sanitize.py). "dropout": both passes with dropout_p 0.2
(the producer backward kernels' keep records, perf log dropout-bwd-producer-records)."""
import sys

import cupy
import numpy as np

from cupyflash import api
from cupyflash._dtypes import SUPPORTED


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    headdim, causal = int(argv[0]), argv[1] == "causal"
    dropout = dict(dropout_p=0.2, seed=7) if "dropout" in argv[2:] else {}
    rng = np.random.default_rng(0)
    dtype = SUPPORTED["bfloat16"]
    q, do = (cupy.asarray(rng.standard_normal((1, 77, 4, headdim)).astype(dtype)) for _ in range(2))
    k, v = (cupy.asarray(rng.standard_normal((1, 130, 2, headdim)).astype(dtype)) for _ in range(2))
    o, lse = api.flash_attn_func(q, k, v, causal=causal, return_lse=True, backend="mma", **dropout)
    api.flash_attn_backward(do, q, k, v, o, lse, causal=causal, backend="mma", **dropout)
    cupy.cuda.runtime.deviceSynchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())

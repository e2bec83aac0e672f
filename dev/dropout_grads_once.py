"""One bfloat16 forward and backward with dropout through the default plan, saved for a bitwise
comparison between two source trees (perf log dropout-bwd-producer-records: the producer backward
kernels' keep records must give exactly the bits the consumers' own generator gave):

    PYTHONPATH=TREE python dev/dropout_grads_once.py OUT.npz

Head dims 64 and 128 (the two producer tiles), causal and not, GQA, odd lengths (a partial last
block of queries and of keys), dropout_p 0.17, fresh normal inputs from a fixed seed."""
import sys

import cupy
import numpy as np

from cupyflash import api
from cupyflash._dtypes import SUPPORTED


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rng = np.random.default_rng(2026)
    dtype = SUPPORTED["bfloat16"]
    out = {}
    for headdim in (64, 128):
        for causal in (False, True):
            q, do = (cupy.asarray(rng.standard_normal((2, 1000, 8, headdim)).astype(dtype)) for _ in range(2))
            k, v = (cupy.asarray(rng.standard_normal((2, 1203, 4, headdim)).astype(dtype)) for _ in range(2))
            kw = dict(causal=causal, dropout_p=0.17, seed=11, offset=3)
            o, lse = api.flash_attn_func(q, k, v, return_lse=True, **kw)
            dq, dk, dv = api.flash_attn_backward(do, q, k, v, o, lse, **kw)
            for name, x in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
                out[f"d{headdim}_{'causal' if causal else 'full'}_{name}"] = cupy.asnumpy(x).view(np.uint16)
    np.savez(argv[0], **out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

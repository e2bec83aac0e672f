"""One forward and one backward (deterministic and atomic dq) of the tensor-core kernels, for
Nsight Compute: ``ncu --clock-control none -k regex:flash python scripts/ncu_workload.py 128 16384``."""
import sys

import cupy
import numpy as np

import cupyflash
from cupyflash._dtypes import SUPPORTED

headdim, seqlen = int(sys.argv[1]), int(sys.argv[2])
causal = len(sys.argv) > 3 and sys.argv[3] == "causal"
batch, nheads = 16384 // seqlen, 2048 // headdim
rng = np.random.default_rng(0)
q, k, v, do = (cupy.asarray(rng.standard_normal((batch, seqlen, nheads, headdim)).astype(SUPPORTED["bfloat16"]))
               for _ in range(4))
o, lse = cupyflash.flash_attn_func(q, k, v, causal=causal, return_lse=True, backend="mma")
cupyflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal, backend="mma")
cupyflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal, backend="mma", deterministic=False)
cupy.cuda.runtime.deviceSynchronize()

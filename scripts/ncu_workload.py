"""One forward and one backward of the tensor-core kernels, for Nsight Compute:

    ncu --clock-control none -k regex:flash python scripts/ncu_workload.py 128 16384 [causal] [fwd|bwd|all] [softcap=C]
        [dtype=float32]

``all`` (the default) runs the forward and the backward both deterministic and with atomic dQ;
``fwd`` and ``bwd`` run the forward alone or the default (deterministic) backward alone, so two
source trees can be profiled kernel by kernel (``PYTHONPATH=<tree>``). The shape is the bench's
(batch * seqlen = 16384 tokens, nheads * headdim = 2048), on fresh normal bfloat16 inputs;
``softcap=C`` runs every pass with that softcap (a variant's kernels against the plain ones'
in one tree: issue 16's softcap bar); ``dtype=float32`` (or float16) runs that dtype instead of
bfloat16 (float32's backward at d64 on sm_90: the tf32 wgmma route, issue 18)."""
import sys

import cupy
import numpy as np

import cupyflash
from cupyflash._dtypes import SUPPORTED

headdim, seqlen = int(sys.argv[1]), int(sys.argv[2])
causal = "causal" in sys.argv[3:]
passes = next((a for a in sys.argv[3:] if a in ("fwd", "bwd", "all")), "all")
softcap = float(next((a.split("=", 1)[1] for a in sys.argv[3:] if a.startswith("softcap=")), 0.0))
dtype = next((a.split("=", 1)[1] for a in sys.argv[3:] if a.startswith("dtype=")), "bfloat16")
batch, nheads = 16384 // seqlen, 2048 // headdim
rng = np.random.default_rng(0)
q, k, v, do = (cupy.asarray(rng.standard_normal((batch, seqlen, nheads, headdim)).astype(SUPPORTED[dtype]))
               for _ in range(4))
o, lse = cupyflash.flash_attn_func(q, k, v, causal=causal, softcap=softcap, return_lse=True, backend="mma")
if passes in ("bwd", "all"):
    cupyflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal, softcap=softcap, backend="mma")
if passes == "all":
    cupyflash.flash_attn_backward(do, q, k, v, o, lse, causal=causal, softcap=softcap, backend="mma",
                                  deterministic=False)
cupy.cuda.runtime.deviceSynchronize()

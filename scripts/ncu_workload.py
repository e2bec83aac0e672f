"""One forward and one backward of the tensor-core kernels, for Nsight Compute:

    ncu --clock-control none -k regex:flash python scripts/ncu_workload.py 128 16384 [causal] [fwd|bwd|all] [softcap=C]
        [dtype=float32] [documents=N] [dropout=P]

``all`` (the default) runs the forward and the backward both deterministic and with atomic dQ;
``fwd`` and ``bwd`` run the forward alone or the default (deterministic) backward alone, so two
source trees can be profiled kernel by kernel (``PYTHONPATH=<tree>``). The shape is the bench's
(batch * seqlen = 16384 tokens, nheads * headdim = 2048), on fresh normal bfloat16 inputs;
``softcap=C`` runs every pass with that softcap (a variant's kernels against the plain ones'
in one tree: issue 16's softcap bar); ``dtype=float32`` (or float16) runs that dtype instead of
bfloat16 (float32's backward at d64 on sm_90: the tf32 wgmma route, issue 18); ``documents=N`` a
mask_mod of documents of N tokens packed into each sequence, its block map made before the passes
(the variants bench's "documents N": issue 16's document mask against no mask in one tree);
``dropout=P`` every pass with dropout_p P (seed 1234: the variants bench's "dropout" rows against
the plain ones in one tree)."""
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
documents = int(next((a.split("=", 1)[1] for a in sys.argv[3:] if a.startswith("documents=")), 0))
dropout = float(next((a.split("=", 1)[1] for a in sys.argv[3:] if a.startswith("dropout=")), 0.0))
batch, nheads = 16384 // seqlen, 2048 // headdim
rng = np.random.default_rng(0)
q, k, v, do = (cupy.asarray(rng.standard_normal((batch, seqlen, nheads, headdim)).astype(SUPPORTED[dtype]))
               for _ in range(4))
options = dict(causal=causal, softcap=softcap, backend="mma")
if dropout:
    options.update(dropout_p=dropout, seed=1234)
if documents:
    from cupyflash.bench.variants import document_ids

    doc = cupy.asarray(document_ids(seqlen, documents))
    mask = cupyflash.MaskMod(lambda b, h, q_idx, kv_idx, doc: doc[0, q_idx] == doc[0, kv_idx], doc=doc)
    options["block_mask"] = cupyflash.create_block_mask(mask, None, None, seqlen, seqlen)
o, lse = cupyflash.flash_attn_func(q, k, v, return_lse=True, **options)
if passes in ("bwd", "all"):
    cupyflash.flash_attn_backward(do, q, k, v, o, lse, **options)
if passes == "all":
    cupyflash.flash_attn_backward(do, q, k, v, o, lse, deterministic=False, **options)
cupy.cuda.runtime.deviceSynchronize()

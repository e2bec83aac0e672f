"""One 16-bit forward of a dev/mma_fwd.py version's d128 tiles with one score variant, for Nsight
Compute (one launch, after a warm-up launch that ``--launch-skip 1`` passes over):

    ncu --clock-control none -k regex:flash_fwd --launch-skip 1 --launch-count 1 \\
        python dev/ncu_forward_config.py v7 [plain|softcap|alibi|dropout|window] [SEQLEN]

8k causal d128 bf16, 2 x 16 heads by default (issue 16's variant shape), fresh normal inputs.
"window": plain with a causal window of 1024 keys (issue 15's); version "local": the window row
of plans.LOCAL_FORWARD_TILES instead of a dev version."""
import sys
from pathlib import Path

import cupy
import numpy as np

from cupyflash._dtypes import SUPPORTED
from cupyflash.bench import tune
from cupyflash.dropout import Dropout
from cupyflash.kernels import mma_fwd
from cupyflash.scores import Variant

version = sys.argv[1]
variant_name = sys.argv[2] if len(sys.argv) > 2 else "plain"
seqlen = int(sys.argv[3]) if len(sys.argv) > 3 else 8192
dev = tune.load_dev_forward(Path(__file__).resolve().parent)
if version == "local":
    from cupyflash import plans
    config = plans.LOCAL_FORWARD_TILES[("mma", plans.SM90, 128)]
elif version.startswith("ws") and version[2:].isdigit():  # a producer candidate, WS_CANDIDATES[128][N]
    config = dev.WS_CANDIDATES[128][int(version[2:])]
else:
    config = next(v for v in dev.VERSIONS if v.name == version).tiles[128]
batch, nheads, d = 16384 // seqlen, 16, 128
rng = np.random.default_rng(0)
q, k, v = (cupy.asarray(rng.standard_normal((batch, seqlen, nheads, d)).astype(SUPPORTED["bfloat16"]))
           for _ in range(3))
o, lse = cupy.empty_like(q), cupy.empty((batch, nheads, seqlen), np.float32)
slopes = cupy.asarray(np.linspace(0.05, 0.5, nheads).astype(np.float32))
variant = {"plain": None, "softcap": Variant(softcap=30.0), "alibi": Variant(alibi_slopes=slopes),
           "dropout": Variant(dropout=Dropout(0.1, 1234, 0)), "window": None}[variant_name]
window = (1024, 0) if variant_name == "window" else (-1, -1)
for _ in range(2):
    mma_fwd.forward(q, k, v, o, lse, softmax_scale=d ** -0.5, causal=True, window_size=window, config=config,
                     variant=variant)
cupy.cuda.runtime.deviceSynchronize()

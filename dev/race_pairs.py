"""racecheck probe: the float64 dK/dV kernels at d128 alone (sm_90's plan row: the warp pairs; the
mma.sync row's kernel), causal, saved statistics."""
import cupy
import numpy as np

import cupyflash
from cupyflash.backward_plans import DMMA_BACKWARD_TILES, MMA_SYNC
from cupyflash.kernels import dmma
from cupyflash.scores import Variant

rng = np.random.default_rng(0)
for config in (None, DMMA_BACKWARD_TILES[(MMA_SYNC, dmma.d_tile(128))]):
    q, do = (cupy.asarray(rng.standard_normal((1, 77, 4, 128))) for _ in range(2))
    k, v = (cupy.asarray(rng.standard_normal((1, 130, 2, 128))) for _ in range(2))
    o, lse = cupyflash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    grads = [cupy.empty_like(x) for x in (q, k, v)]
    dmma.backward(do, q, k, v, o, lse, *grads, softmax_scale=128 ** -0.5, causal=True, window_size=(-1, -1),
                  variant=Variant(statistics="saved"), config=config)
    cupy.cuda.runtime.deviceSynchronize()
    print("config", config, "done")

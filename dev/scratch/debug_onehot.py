import sys; sys.path.insert(0, "tests")
import numpy as np, cupy, cupyflash, saturation
from cupyflash.kernels import simt
from cupyflash import numpy_backend as NB
kept = {}
orig = simt.backward_statistics
def keep(params, plan, grid, o):
    s = orig(params, plan, grid, o); kept["s"] = s; return s
simt.backward_statistics = keep
orig_tw = NB._recomputed_statistics
def keep_tw(*a, **k):
    r = orig_tw(*a, **k); kept["t"] = r; return r
NB._recomputed_statistics = keep_tw
case = saturation.Case(np.dtype(np.float32), 96, 80, 2, 64, False, 1e4, 1.0, 20261203)
q, k, v, do = case.arrays()
opts = dict(softmax_scale=case.softmax_scale)
o, lse = cupyflash.flash_attn_func(q, k, v, return_lse=True, backend="numpy", **opts)
g_gpu = [g.get() for g in cupyflash.flash_attn_backward(*(cupy.asarray(x) for x in (do, q, k, v, o, lse)), statistics="recomputed", **opts)]
g_tw = cupyflash.flash_attn_backward(do, q, k, v, o, lse, statistics="recomputed", backend="numpy", **opts)
s = kept["s"].get(); t = kept["t"]
for i, name in enumerate(("D'", "top", "w", "ref")):
    tw = t[(3, 0, 1, 2)[i]]
    bad = np.argwhere(s[i] != tw)
    print(name, "mismatches", len(bad), bad[:3].tolist(), [(float(s[i][tuple(b)]), float(tw[tuple(b)])) for b in bad[:3]])
for n, a, b in zip("qkv", g_gpu, g_tw):
    print("d" + n, "gpu max", float(abs(a).max()), "twin max", float(abs(b).max()), "argmax gpu", np.unravel_index(np.argmax(abs(a)), a.shape))

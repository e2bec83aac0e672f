import numpy as np, cupy, cupyflash
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
rng = np.random.default_rng(1)
for sink in (None, np.array([0.5], np.float32)):
    q, k, v, do = (rng.standard_normal((1, 8, 1, 16)).astype(np.float32) for _ in range(4))
    opts = dict(softmax_scale=1e4 if sink is None else 0.3, sink=sink)
    o, lse = cupyflash.flash_attn_func(q, k, v, return_lse=True, backend="numpy", **opts)
    g_gpu = cupyflash.flash_attn_backward(*(cupy.asarray(x) for x in (do, q, k, v, o, lse)), statistics="recomputed", **opts)
    g_tw = cupyflash.flash_attn_backward(do, q, k, v, o, lse, statistics="recomputed", backend="numpy", **opts)
    s = kept["s"].get()
    print("sink", sink)
    print("gpu  D'", s[0].ravel()); print("twin D'", kept["t"][3].ravel())
    print("gpu  top", s[1].ravel()); print("twin top", kept["t"][0].ravel())
    print("gpu  w", s[2].ravel()); print("twin w", kept["t"][1].ravel())
    print("gpu  ref", s[3].ravel()); print("twin ref", kept["t"][2].ravel())
    print("dq gpu", float(abs(g_gpu[0].get()).max()), "twin", float(abs(g_tw[0]).max()), "diff", float(abs(g_gpu[0].get() - g_tw[0]).max()))

import sys; sys.path.insert(0, "tests")
import numpy as np, cupy, cupyflash, saturation
case = saturation.Case(np.dtype(np.float32), 1, 15, 1, 40, False, 10.0, 1.0, 0)
q, k, v, do = case.arrays()
opts = dict(softmax_scale=case.softmax_scale)
truth, sizes = saturation.extended_gradients(do, q, k, v, softmax_scale=case.softmax_scale, causal=False)
o, lse = cupyflash.flash_attn_func(q, k, v, return_lse=True, backend="numpy", **opts)
for name, g in (("gpu", [x.get() for x in cupyflash.flash_attn_vjp(*(cupy.asarray(x) for x in (q, k, v)), **opts)[1](cupy.asarray(do))]),
                ("twin", cupyflash.flash_attn_vjp(q, k, v, backend="numpy", **opts)[1](do))):
    dv = g[2][0, :, 0, 7]
    print(name, "dv[:,7]", dv)
print("true dv[:,7]", truth[2][0, :, 0, 7].astype(np.float64))
s = (q[0, 0, 0].astype(np.float64) @ k[0, :, 0].T.astype(np.float64)) * 10
print("s - max (log2)", (s - s.max()) * 1.4427)

"""The GPU case where v6's ordered-dQ wgmma backward missed the tolerance (fp16, d1, 129 queries
over 3 keys, causal): its dq error against float64, and the same case's on the default kernels
and at other head dims, each next to what the test allows.

    python dev/repro_ordered_dq.py
"""
import dataclasses
import sys

sys.path.insert(0, "tests")

from cupyflash.testing.problem import AttentionProblem  # noqa: E402

import test_api_gpu as t  # noqa: E402

base = AttentionProblem(batch=3, seqlen_q=129, seqlen_k=3, nheads_kv=1, group=2, headdim=1, causal=True,
                        softmax_scale=None, magnitude=2.436591738390176, dtype="float16", seed=59)


def run(label, case, version=None, every_d=False):
    from cupyflash.bench import tune
    from cupyflash.kernels import mma_bwd

    dev = tune.load_dev_backward()
    saved = dev.WGMMA_ORDERED_D_TILES
    if every_d:
        dev.WGMMA_ORDERED_D_TILES = mma_bwd.D_TILES
    try:
        if version:
            with t._backward_version(version):
                t._check_backward(case, "mma", deterministic=True)
        else:
            t._check_backward(case, "mma", deterministic=True)
        print(label, "ok")
    except AssertionError as exc:
        print(label, str(exc).splitlines()[0][:220])
    finally:
        dev.WGMMA_ORDERED_D_TILES = saved


for d in (1, 8, 64, 128):
    case = dataclasses.replace(base, headdim=d)
    run(f"d{d} default          ", case)
    run(f"d{d} v6 every d-tile  ", case, "v6", every_d=True)
for sk in (3, 64, 200):
    case = dataclasses.replace(base, seqlen_k=sk)
    run(f"d1 sk{sk} v6          ", case, "v6", every_d=True)
case = dataclasses.replace(base, causal=False)
run("d1 non-causal v6     ", case, "v6", every_d=True)

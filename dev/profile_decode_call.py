"""Where the host time of one flash_attn_with_kvcache decode call goes (cProfile, top entries).

    python dev/profile_decode_call.py [--checked] [--paged]
"""
import argparse
import cProfile
import pstats

import cupy
import ml_dtypes
import numpy as np

import cupyflash

parser = argparse.ArgumentParser()
parser.add_argument("--checked", action="store_true")
parser.add_argument("--paged", action="store_true")
args = parser.parse_args()
bf16 = ml_dtypes.bfloat16
batch, capacity = 8, 8192
rng = np.random.default_rng(0)
if args.paged:
    shape, table = (batch * capacity // 16, 16, 8, 128), cupy.asarray(
        rng.permutation(batch * capacity // 16).reshape(batch, -1).astype(np.int32))
else:
    shape, table = (batch, capacity, 8, 128), None
kc, vc = cupy.zeros(shape, bf16), cupy.zeros(shape, bf16)
q = cupy.asarray(rng.standard_normal((batch, 1, 32, 128)).astype(bf16))
k = cupy.asarray(rng.standard_normal((batch, 1, 8, 128)).astype(bf16))
seqlens = cupy.full(batch, 4096, np.int32)


def call():
    return cupyflash.flash_attn_with_kvcache(q, kc, vc, k, k, cache_seqlens=seqlens, block_table=table, causal=True)


call()
mode = cupyflash.no_host_sync if not args.checked else __import__("contextlib").nullcontext
with mode():
    for _ in range(20):
        call()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        call()
    prof.disable()
cupy.cuda.get_current_stream().synchronize()
stats = pstats.Stats(prof)
stats.sort_stats("tottime").print_stats(28)

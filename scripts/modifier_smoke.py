"""A first look at user modifiers on a GPU, before the property suite: each of a few modifier pairs
through the default kernels (the tensor cores at head dims 64, 128, 256; the float32 and float64
SIMT kernels), forward and backward against the float64 reference under the tolerance rule, the GPU block
map against the host's, and causal by mask_mod against causal=True bit for bit. One line per case;
exit status 1 if any case fails. Run from the tree (PYTHONPATH=<tree>):

    python scripts/modifier_smoke.py [--seqlen 200]
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, default=200)
    parser.add_argument("--only", default="", help="the cases whose label holds this text")
    args = parser.parse_args(argv)
    import cupy

    import cupyflash as cf
    import modifier_zoo as zoo
    from cupyflash import modifiers as M

    failures = 0

    def case(label, fn):
        nonlocal failures
        if args.only not in label:
            return
        t0 = time.time()
        try:
            fn()
            print(f"ok    {label} ({time.time() - t0:.1f} s)", flush=True)
        except Exception:  # every case runs; the first lines say what failed
            failures += 1
            print(f"FAIL  {label} ({time.time() - t0:.1f} s)\n" + traceback.format_exc(limit=3)[-3000:], flush=True)

    base = cf.testing.AttentionProblem(batch=2, seqlen_q=args.seqlen, seqlen_k=args.seqlen, nheads_kv=2, group=2,
                                       headdim=64, causal=True, softmax_scale=None, magnitude=1.0,
                                       dtype=np.float16, seed=1)

    def attention(problem, score, mask):
        def run():
            score_mod = None if score is None else zoo.make_score_mod(score, problem, 3)
            mask_mod = None if mask is None else zoo.make_mask_mod(mask, problem, 4)
            cf.testing.modifiers.check_modifier(problem, score_mod, mask_mod, backend="cuda")
        return run

    import cupyflash.testing.modifiers  # noqa: F401

    for dtype, headdim in (("bfloat16", 64), ("bfloat16", 128), ("float16", 256), ("float32", 64), ("float64", 32)):
        if True:
            for score, mask in zoo.GPU_COMBOS:
                problem = replace(base, dtype=cf.testing.problem.as_dtype(dtype), headdim=headdim)
                case(f"{dtype} d{headdim} causal {score} + {mask}", attention(problem, score, mask))
    case("bfloat16 d128 window (17, 5) relative_bias + documents",
         attention(replace(base, dtype=cf.testing.problem.as_dtype("bfloat16"), headdim=128, causal=False,
                           window_size=(17, 5)), "relative_bias", "documents"))

    def aligned_documents(causal):
        def run():
            # documents of 512 tokens: most visited blocks are whole
            problem = replace(base, batch=1, seqlen_q=2048, seqlen_k=2048, nheads_kv=2, group=1, headdim=128,
                              dtype=cf.testing.problem.as_dtype("bfloat16"), causal=causal)
            doc = (np.arange(2048, dtype=np.int32) // 512)[None]
            mask_mod = cf.MaskMod(zoo.documents, doc_q=doc, doc_k=doc)
            cf.testing.modifiers.check_modifier(problem, None, mask_mod, backend="cuda")
        return run
    case("bfloat16 d128 2048 documents of 512", aligned_documents(False))
    case("bfloat16 d128 2048 causal documents of 512", aligned_documents(True))

    def block_map():
        for mask in zoo.MASKS:
            problem = replace(base, seqlen_q=333, seqlen_k=517, nheads_kv=3, group=1)
            mask_mod = zoo.make_mask_mod(mask, problem, 5)
            gpu = M.BlockMask(mask_mod, 2, 3, 333, 517, device="cuda")
            host = M.BlockMask(mask_mod, 2, 3, 333, 517, device="cpu")
            assert np.array_equal(gpu.key_ranges, host.key_ranges), mask
            assert np.array_equal(gpu.query_ranges, host.query_ranges), mask
            assert np.array_equal(gpu.key_runs, host.key_runs), mask
            assert np.array_equal(gpu.query_runs, host.query_runs), mask
    case("block map on the GPU = the host's", block_map)

    def causal_bitwise():
        for dtype in ("float16", "bfloat16", "float32"):
            problem = replace(base, dtype=cf.testing.problem.as_dtype(dtype), seqlen_q=1000, seqlen_k=1000)
            q, k, v, do = (cupy.asarray(x) for x in problem.arrays())
            flag = cf.flash_attn_func(q, k, v, causal=True, return_lse=True)
            mask = cf.flash_attn_func(q, k, v, mask_mod=zoo.causal, return_lse=True)
            grads_flag = cf.flash_attn_backward(do, q, k, v, *flag, causal=True)
            grads_mask = cf.flash_attn_backward(do, q, k, v, *mask, mask_mod=zoo.causal)
            for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), (*flag, *grads_flag), (*mask, *grads_mask)):
                same = (a.view(cupy.uint16) == b.view(cupy.uint16)) if a.itemsize == 2 else (a == b)
                assert bool(same.all()), f"{dtype} {name}: {int((~same).sum())} entries differ"
    case("causal by mask_mod = causal=True, bit for bit", causal_bitwise)
    print(f"modifier smoke: {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

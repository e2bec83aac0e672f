"""The GPU property test_sums_apart_within_twice_standard_float32 (tests/test_tf32_wgmma_gpu.py) run
on the CPU against dev/emulate_split_tf32.py's emulation of the apart kernel instead of the kernel:
the same problem strategy (float32, windows, up to 300 keys, the wgmma head dims), the same plain
and ALiBi variants (softcap and sink are not emulated), the same bound (2x standard float32's
error + 2^-21 max(1, max|ref|), on o and on lse). Hypothesis generates without shrinking and every
draw is recorded, so the output is a failure rate and the worst ratios, per candidate arithmetic:
a fix is tried here on hundreds of draws before it costs device time.

    python dev/fuzz_split_tf32.py --examples 300 --candidates kernel hh1 s_lolo hh1_s_lolo
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import emulate_split_tf32 as emu  # noqa: E402

from cupyflash.testing import attention_problems  # noqa: E402

HEADDIMS = (8, 16, 40, 64, 72, 96, 128)  # TENSOR_CORE_HEADDIMS of the GPU test
CANDIDATES = {
    "kernel": {},                                        # the shipped apart arithmetic (hi hi chains of 2)
    "hh1": dict(s_hihi_chunk=1),                         # hi hi fresh every k-step
    "hh4": dict(s_hihi_chunk=4),
    "s_lolo": dict(qk_lolo=False),                       # S's 4th product lo lo
    "hh1_s_lolo": dict(s_hihi_chunk=1, qk_lolo=False),
    "rn": dict(qk_acc="rn", pv_acc="rn"),                # what a rounding tensor core would give
    "rn_s_lolo": dict(qk_acc="rn", pv_acc="rn", qk_lolo=False),
    "exact_s": dict(qk_acc="exact", qk_lolo=False, qk_lo_round=False),  # S exact: the softmax's own share
    # each k-step's hi hi fresh, the k-steps' sums and the small products' added exactly (TwoSum),
    # S rounded once: what compensated FADDs would give on the tensor core's truncating k-step sums
    "hh1_twosum": dict(s_hihi_chunk=1, s_fadd_exact=True),
    "hh2_twosum": dict(s_hihi_chunk=2, s_fadd_exact=True),
    "hh1_twosum_lolo": dict(s_hihi_chunk=1, s_fadd_exact=True, qk_lolo=False),
    "step_sums": dict(s_step_sums=True),  # each k-step's 3 products fresh, FADD: the shipped mma.sync rows' S
    "standard_reordered": None,  # standard float32 attention with Q K^T summed in another order
}


def _standard_reordered(case):
    """Standard float32 attention itself, with Q K^T summed in another order (the head dim
    reversed): its ratio to the bound made from standard float32 attention in the usual order. Two
    float32-accurate computations of the same thing: how often one exceeds twice the other's
    error is the floor of any float32 kernel's failure rate under this property."""
    from cupyflash import reference

    options = {} if case.alibi_slopes is None else {"alibi_slopes": case.alibi_slopes}
    o, lse = reference.standard_attention(case.q[..., ::-1], case.k[..., ::-1], case.v, dtype=np.float32,
                                          **case.problem.kwargs, **options)
    return max(case.err(o) / case.bound, case.lse_err(lse) / case.lse_bound)


def _variant(name, nheads, seed):
    rng = np.random.default_rng(seed)  # the GPU test's draw of the slopes
    return rng.uniform(0.01, 0.5, nheads).astype(np.float32) if name == "alibi" else None


def fuzz(candidates, examples, seed, ex2_draws, orders=1):
    records = []

    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              phases=(Phase.generate,), suppress_health_check=list(HealthCheck))
    @given(problem=attention_problems(dtypes=("float32",), windows=True, max_seqlen=300, headdims=HEADDIMS),
           variant=st.sampled_from(("plain", "alibi")))
    @hypothesis_seed(seed)
    def one(problem, variant):
        case = emu.Case("draw", problem, alibi_slopes=_variant(variant, problem.nheads, problem.seed),
                        check_lse=True, orders=orders)
        ratios = {}
        for name in candidates:
            if name == "standard_reordered":
                ratios[name] = _standard_reordered(case)
                continue
            ar = replace(emu.KERNEL, **{"s_hihi_chunk": 2, **CANDIDATES[name]})
            ratios[name] = float(case.run(ar, range(ex2_draws)).max())
        records.append((problem, variant, ratios))

    t0 = time.time()
    one()
    print(f"{len(records)} draws in {time.time() - t0:.0f} s (hypothesis seed {seed}, {ex2_draws} ex2 draws each, "
          f"standard's error over {orders} summation order{'s' if orders > 1 else ''})")
    for name in candidates:
        r = np.array([rec[2][name] for rec in records])
        worst = int(np.argmax(r))
        print(f"  {name:12s} fail {np.mean(r > 1):6.1%} ({int(np.sum(r > 1))})  median {np.median(r):.2f}  "
              f"p99 {np.quantile(r, 0.99):.2f}  max {r.max():.2f}")
        if r.max() > 1:
            problem, variant, _ = records[worst]
            print(f"      worst: {problem!r}, variant={variant!r}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0, help="Hypothesis' seed")
    parser.add_argument("--ex2-draws", type=int, default=2, help="ex2.approx perturbation draws per problem")
    parser.add_argument("--orders", type=int, default=1, choices=(1, 2), help="standard float32's error: one "
                        "summation order of Q K^T (the test's), or the worse of two (the head dim reversed too)")
    parser.add_argument("--candidates", nargs="+", default=["kernel", "hh1", "s_lolo", "hh1_s_lolo"],
                        choices=sorted(CANDIDATES))
    args = parser.parse_args(argv)
    fuzz(args.candidates, args.examples, args.seed, args.ex2_draws, args.orders)


if __name__ == "__main__":
    main()

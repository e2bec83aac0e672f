"""Where the float32 tensor-core forward's error comes from, on a GPU (issue 18).

The CPU model (dev/tf32_split_study.py: exact tf32 products, float32 sums rounded to nearest)
puts three tf32 products at 0.45-1.9x float32's error; the first GPU run of flash_fwd_tf32 measured
about 10x. This probe separates the suspects on the device:

1. Dot products of length K (16 x 8 blocks of A (16 x K) B (K x 8), one warp per block, many
   blocks) through mma.sync m16n8k8 .tf32 in five ways, each block's max error against float64
   relative to max |a b| sums: ``chain`` (three products into one accumulator, as the kernel),
   ``apart`` (the two small products in an accumulator of their own, added once at the end),
   ``fresh`` (each k-step's three products into a zeroed accumulator, added to the running sum by
   one FADD, rounded to nearest), ``one`` (one tf32 product), and ``fma`` (float32 FMA on CUDA
   cores, the SIMT kernels' arithmetic). Inputs signed (S = Q K^T) or A >= 0 (O = P V).
2. Attention itself, one case per head dim: standard float32 (NumPy), the SIMT kernel and the
   tf32 kernel in both precisions, max error against float64.
3. The candidates against the shipped row (PRESPLIT since tf32-fwd-v2), error and time: FRESH_O
   (each key block's P V in accumulators of its own, merged into O by FFMA:
   Tf32FwdConfig(fresh_o=True)) and STEP_SUMS (the "fresh" mode above in the kernel:
   step_sums=True; for S, and for O where FRESH_O is off), with PRESPLIT and without.

    python dev/tf32_accumulation_probe.py [--candidates]
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SOURCE = r"""
__device__ __forceinline__ unsigned rnd(float x) { return __float_as_uint(x) + 0x1000u; }
__device__ __forceinline__ void split(float x, unsigned& hi, unsigned& lo) {
    hi = rnd(x) & 0xffffe000u;
    lo = rnd(x - __uint_as_float(hi));
}
__device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// A: blocks x 16 x K row-major; B: blocks x K x 8 (k-major); C: blocks x 16 x 8.
extern "C" __global__ void probe(const float* A, const float* B, float* C, int K, int mode) {
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    const float* a = A + (long long)blockIdx.x * 16 * K;
    const float* b = B + (long long)blockIdx.x * K * 8;
    float acc[4] = {0, 0, 0, 0}, small[4] = {0, 0, 0, 0};
    if (mode == 4) {  // float32 FMA
        for (int e = 0; e < 4; ++e) {
            const int row = g + 8 * (e / 2), col = 2 * t + e % 2;
            float s = 0.f;
            for (int k = 0; k < K; ++k) s = fmaf(a[row * K + k], b[k * 8 + col], s);
            acc[e] = s;
        }
    } else {
        for (int k0 = 0; k0 < K; k0 += 8) {
            const float av[4] = {a[g * K + k0 + t], a[(g + 8) * K + k0 + t], a[g * K + k0 + t + 4],
                                 a[(g + 8) * K + k0 + t + 4]};
            const float bv[2] = {b[(k0 + t) * 8 + g], b[(k0 + t + 4) * 8 + g]};
            unsigned ah[4], al[4], bh[2], bl[2];
            for (int e = 0; e < 4; ++e) split(av[e], ah[e], al[e]);
            for (int e = 0; e < 2; ++e) split(bv[e], bh[e], bl[e]);
            if (mode == 3) {
                unsigned ar[4] = {rnd(av[0]), rnd(av[1]), rnd(av[2]), rnd(av[3])};
                mma(acc, ar, rnd(bv[0]), rnd(bv[1]));
            } else if (mode == 0) {
                mma(acc, al, bh[0], bh[1]); mma(acc, ah, bl[0], bl[1]); mma(acc, ah, bh[0], bh[1]);
            } else if (mode == 1) {
                mma(small, al, bh[0], bh[1]); mma(small, ah, bl[0], bl[1]); mma(acc, ah, bh[0], bh[1]);
            } else {
                float step[4] = {0, 0, 0, 0};
                mma(step, al, bh[0], bh[1]); mma(step, ah, bl[0], bl[1]); mma(step, ah, bh[0], bh[1]);
                for (int e = 0; e < 4; ++e) acc[e] = __fadd_rn(acc[e], step[e]);
            }
        }
        for (int e = 0; e < 4; ++e) acc[e] = __fadd_rn(acc[e], small[e]);
    }
    float* c = C + (long long)blockIdx.x * 128;
    c[g * 8 + 2 * t] = acc[0]; c[g * 8 + 2 * t + 1] = acc[1];
    c[(g + 8) * 8 + 2 * t] = acc[2]; c[(g + 8) * 8 + 2 * t + 1] = acc[3];
}
"""

MODES = ("chain", "apart", "fresh", "one", "fma")


def dot_products(blocks: int = 512) -> None:
    import cupy

    kernel = cupy.RawKernel(SOURCE, "probe", options=("-std=c++17",))
    print("| K | A | " + " | ".join(MODES) + " |  (max error / max sum |a b|, worst of the blocks)")
    print("|---:|---|" + "---:|" * len(MODES))
    rng = np.random.default_rng(0)
    for K in (128, 1024, 8192):
        for kind in ("signed", "a>=0"):
            a = rng.standard_normal((blocks, 16, K)).astype(np.float32)
            if kind == "a>=0":
                a = np.abs(a) / K ** 0.5
            b = rng.standard_normal((blocks, K, 8)).astype(np.float32)
            exact = np.einsum("bik,bkn->bin", a.astype(np.float64), b.astype(np.float64))
            scale = np.einsum("bik,bkn->bin", np.abs(a).astype(np.float64), np.abs(b).astype(np.float64)).max()
            ad, bd = cupy.asarray(a), cupy.asarray(b)
            row = []
            for mode in range(len(MODES)):
                c = cupy.full((blocks, 16, 8), np.nan, np.float32)
                kernel((blocks,), (32,), (ad, bd, c, np.int32(K), np.int32(mode)))
                err = np.abs(cupy.asnumpy(c).astype(np.float64) - exact).max() / scale
                row.append(f"{err:.2e}")
            print(f"| {K} | {kind} | " + " | ".join(row) + " |")


def attention_errors() -> None:
    import cupy

    import cupyflash
    from cupyflash import reference

    print("\n| case | standard fp32 | SIMT | tf32 kernel ieee | tf32 kernel tf32 |  (max |o - o64|)")
    print("|---|---:|---:|---:|---:|")
    rng = np.random.default_rng(1)
    for sq, d, causal in ((1024, 64, False), (1024, 128, False), (1024, 128, True), (4096, 128, False),
                          (700, 256, False)):
        q, k, v = (rng.standard_normal((1, sq, 2, d)).astype(np.float32) for _ in range(3))
        o_ref, _ = reference.attention(q, k, v, causal=causal)
        o_std, _ = reference.standard_attention(q, k, v, dtype=np.float32, causal=causal)
        qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
        got = [cupyflash.flash_attn_func(qd, kd, vd, causal=causal, backend="simt"),
               cupyflash.flash_attn_func(qd, kd, vd, causal=causal),
               cupyflash.flash_attn_func(qd, kd, vd, causal=causal, precision="tf32")]
        errs = [np.abs(o_std.astype(np.float64) - o_ref).max()] + \
               [np.abs(cupy.asnumpy(o).astype(np.float64) - o_ref).max() for o in got]
        print(f"| {sq} d{d} {'causal' if causal else 'full'} | " + " | ".join(f"{e:.2e}" for e in errs) + " |")


# The candidates against the shipped row, per head-dim tile (d256 spills with FRESH_O and with
# STEP_SUMS): FRESH_O (each key block's P V in accumulators of its own, merged by FFMA) on PRESPLIT
# (K and V split once per tile in shared memory; shipped since tf32-fwd-v2), and STEP_SUMS (each
# k-step's three products summed apart, added by FADD: the probe's "fresh" mode in the kernel) for
# S and O (O's spill 24-116 bytes, so that time is not its best), or for S with FRESH_O's O
# (spill-free); (block_m, block_n, warps) as the compile check found them.
def candidates(d: int):
    from cupyflash.plans import Tf32FwdConfig

    bn_presplit = 64 if d == 64 else 32  # the lo tiles double K/V's shared memory
    return {"fresh_o+presplit": Tf32FwdConfig(128, bn_presplit, 8, fresh_o=True, presplit=True),
            "step_sums+presplit": Tf32FwdConfig(128, bn_presplit, 8, presplit=True, step_sums=True),
            "step_sums+fresh_o+presplit": Tf32FwdConfig(128, bn_presplit, 8, fresh_o=True, presplit=True,
                                                        step_sums=True),
            "step_sums+fresh_o": Tf32FwdConfig(128, 64, 8, fresh_o=True, step_sums=True)}


def _forward_with(tiles, q, k, v, causal, o, lse):
    from cupyflash.kernels import mma_fwd
    from cupyflash.scores import Variant

    o.fill(np.nan)
    mma_fwd.forward(q, k, v, o, lse, softmax_scale=q.shape[3] ** -0.5, causal=causal, config=tiles,
                    variant=Variant(precision="ieee"))
    return o


def _ms(tiles, q, k, v, causal, o, lse) -> float:
    import cupy

    for _ in range(3):
        _forward_with(tiles, q, k, v, causal, o, lse)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(10):
        _forward_with(tiles, q, k, v, causal, o, lse)
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / 10


def candidates_against_shipped() -> None:
    import cupy

    from cupyflash import reference
    from cupyflash.kernels import mma_fwd

    print("\n| case | kernel | max error (2 heads) | standard fp32 error | ms | TFLOP/s |")
    print("|---|---|---:|---:|---:|---:|")
    rng = np.random.default_rng(2)
    for batch, sq, d, causal in CASES:
        shape = (batch, sq, 32 if d == 64 else 16, d)
        q, k, v = (cupy.asarray(rng.standard_normal(shape).astype(np.float32)) for _ in range(3))
        o = cupy.empty(shape, np.float32)
        lse = cupy.empty((shape[0], shape[2], shape[1]), np.float32)
        flops = 4 * batch * shape[2] * sq * sq * d * (0.5 if causal else 1.0)
        reference_o = std_err = None
        if sq <= 4096:  # the float64 reference on the host: the first two heads
            hq, hk, hv = (cupy.asnumpy(x[:, :, :2]) for x in (q, k, v))
            reference_o, _ = reference.attention(hq, hk, hv, causal=causal)
            o_std, _ = reference.standard_attention(hq, hk, hv, dtype=np.float32, causal=causal)
            std_err = np.abs(o_std.astype(np.float64) - reference_o).max()
        for name, tiles in {"shipped": mma_fwd.plan(np.float32, d, causal).tiles, **candidates(d)}.items():
            err = ""
            if reference_o is not None:
                got = cupy.asnumpy(_forward_with(tiles, q, k, v, causal, o, lse)[:, :, :2]).astype(np.float64)
                err = f"{np.abs(got - reference_o).max():.2e}"
            ms = _ms(tiles, q, k, v, causal, o, lse)
            std = "" if std_err is None else f"{std_err:.2e}"
            print(f"| {batch}x{sq} d{d} {'causal' if causal else 'full'} | {name} | {err} | {std} | {ms:.3f} | "
                  f"{flops / ms / 1e9:.1f} |")


CASES = ((1, 1024, 64, False), (1, 1024, 128, False), (1, 4096, 128, True), (2, 8192, 64, False),
         (2, 8192, 128, False))


def _compile(spec) -> str:
    from cupyflash.kernels import _module

    _module.get_function(spec)
    return spec.name


def warm() -> None:
    """Every kernel the probe launches compiled into CuPy's disk cache on all cores first (NVRTC
    is CPU-bound), so the device's time goes to measuring."""
    import multiprocessing
    import os
    import time
    from concurrent.futures import ProcessPoolExecutor

    from cupyflash import plans
    from cupyflash.kernels import mma_fwd

    specs = {}
    for _, _, d, causal in CASES:
        for tiles in (mma_fwd.plan(np.float32, d, causal).tiles, *candidates(d).values()):
            spec = plans.specialization_for(np.float32, d, causal, tiles, precision="ieee")
            specs[spec.name] = spec
    for d in (64, 128, 256):
        for causal in (False, True):
            for precision in ("ieee", "tf32"):
                spec = mma_fwd.plan(np.float32, d, causal, precision=precision).spec
                specs[spec.name] = spec
            spec = plans.simt_specialization("fwd", np.float32, d, causal)  # attention_errors' SIMT column
            specs[spec.name] = spec
    t0 = time.time()
    with ProcessPoolExecutor(max_workers=os.cpu_count(), mp_context=multiprocessing.get_context("spawn")) as pool:
        names = list(pool.map(_compile, specs.values()))
    print(f"warm: {len(names)} kernels in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    # --candidates: only the warm-up and the candidates' table (the first two parts' numbers do not
    # change with the kernels: docs/results/2026-12-03-tf32-accumulation-probe.txt)
    warm()
    if "--candidates" not in sys.argv[1:]:
        dot_products()
        attention_errors()
    candidates_against_shipped()

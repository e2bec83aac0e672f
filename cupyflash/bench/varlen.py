"""Packed variable-length batches (issue 17's varlen bar), forward and backward, in one run:

    python -m cupyflash.bench.varlen [--json FILE] [--quick]

A batch of sequences with lengths drawn log-uniformly from 128..8k until they fill 16k tokens
(seeded), bf16, causal and not. Timed on the device (CUDA events):
  * cupyflash.flash_attn_varlen_func / flash_attn_varlen_backward (one launch per kernel), with
    cu_seqlens given as NumPy arrays (copied to the device), the same with the sequences issued in
    batch order (the A / B of varlen.issue_order, most pairs first), and as CuPy arrays (read back
    to the host for the checks: a synchronisation, during which the GPU idles; and unread inside
    no_host_sync);
  * PyTorch SDPA's FlashAttention-2 backend on the same sequences as one dense batch padded to the
    longest (what a user without varlen runs; its padding rows are computed and discarded);
  * cupyflash's dense kernels at the same total tokens: one sequence of all of them, and a batch
    of equal sequences with the packed batch's pair-weighted mean length.
TFLOP/s count the pairs each problem really attends (causal: the visible ones), 4 d flops per
pair and head forward, 10 d backward; the padded baseline is credited with the packed batch's
pairs, not its own.
"""
from __future__ import annotations

import argparse
import contextlib
import json

import numpy as np

from .timing import RepeatPolicy, time_region

TOTAL_TOKENS = 16384
LENGTHS = (128, 8192)
NHEADS = 16
POLICY = RepeatPolicy(warmup=3, target_s=0.3, min_repeats=10, max_repeats=50)


def draw_lengths(total: int = TOTAL_TOKENS, bounds=LENGTHS, seed: int = 0) -> list[int]:
    """Log-uniform lengths in ``bounds`` until they fill ``total`` tokens (the last one cut to fit)."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        n = int(np.exp(rng.uniform(np.log(bounds[0]), np.log(bounds[1]))))
        lengths.append(min(n, total - sum(lengths)))
    return lengths


def pairs(lengths, causal: bool) -> int:
    """(query, key) pairs attended over sequences of these lengths (self-attention)."""
    return sum(n * (n + 1) // 2 if causal else n * n for n in lengths)


@contextlib.contextmanager
def _batch_order():
    """Packed calls issued in batch order, as before varlen-v2 (perf log): the same call, the
    sequences in grid slot order, for the issue order's A / B in one run."""
    from cupyflash import varlen

    sorted_order = varlen.issue_order
    varlen.issue_order = lambda sequences: None
    try:
        yield
    finally:
        varlen.issue_order = sorted_order


def measure(headdims=(64, 128), causal_modes=(False, True), quick=False) -> dict:
    import cupy
    import ml_dtypes

    import cupyflash

    policy = RepeatPolicy(warmup=1, target_s=0.1, min_repeats=5, max_repeats=20) if quick else POLICY
    lengths = draw_lengths()
    stream = cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(1)
    dtype = ml_dtypes.bfloat16
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(cu[-1])
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        torch = None
    rows = []
    with stream:
        cu_dev = cupy.asarray(cu)
        for d in headdims:
            q, k, v, do = (cupy.asarray(rng.standard_normal((total, NHEADS, d), np.float32)).astype(dtype)
                           for _ in range(4))
            for causal in causal_modes:
                row = {"headdim": d, "causal": causal, "nheads": NHEADS, "lengths": lengths, "total": total}
                work = pairs(lengths, causal) * NHEADS * d
                # cu_seqlens from the host (as a data loader makes them: no device read-back), the same
                # issued in batch order (varlen.issue_order off: the kernels' order before varlen-v2),
                # on the device (read back for the checks: the GPU idles while the host checks them),
                # and on the device inside no_host_sync() (unread, as flash-attn takes them; batch order)
                for label, cu_arg, mode_of in (("varlen", cu, contextlib.nullcontext),
                                               ("varlen_batch_order", cu, _batch_order),
                                               ("varlen_device_cu", cu_dev, contextlib.nullcontext),
                                               ("varlen_device_cu_unread", cu_dev, cupyflash.no_host_sync)):
                    sequences = (cu_arg, cu_arg, max(lengths), max(lengths))
                    o, lse = cupyflash.flash_attn_varlen_func(q, k, v, *sequences, causal=causal, return_lse=True)

                    def fwd(_):
                        with mode_of():
                            cupyflash.flash_attn_varlen_func(q, k, v, *sequences, causal=causal, return_lse=True)

                    def bwd(_):
                        with mode_of():
                            cupyflash.flash_attn_varlen_backward(do, q, k, v, o, lse, *sequences, causal=causal)

                    for mode, run, flops in (("fwd", fwd, 4 * work), ("bwd", bwd, 10 * work)):
                        row[f"{label}_{mode}_tflops"] = flops / time_region(run, 1, policy=policy,
                                                                            stream=stream).median_ms / 1e9
                # cupyflash dense: all tokens as one sequence, and equal sequences of the mean length
                mean = int(round(pairs(lengths, False) / total))
                for label, batch, length in (("dense_one", 1, total), ("dense_mean", max(1, total // mean), mean)):
                    shape = (batch, length, NHEADS, d)
                    dq, dk, dv, ddo = (x[: batch * length].reshape(shape) for x in (q, k, v, do))
                    do_o, do_lse = cupyflash.flash_attn_func(dq, dk, dv, causal=causal, return_lse=True)
                    dense_work = batch * pairs([length], causal) * NHEADS * d

                    def dfwd(_):
                        cupyflash.flash_attn_func(dq, dk, dv, causal=causal, return_lse=True)

                    def dbwd(_):
                        cupyflash.flash_attn_backward(ddo, dq, dk, dv, do_o, do_lse, causal=causal)

                    row[f"{label}_shape"] = [batch, length]
                    for mode, run, flops in (("fwd", dfwd, 4 * dense_work), ("bwd", dbwd, 10 * dense_work)):
                        row[f"{label}_{mode}_tflops"] = flops / time_region(run, 1, policy=policy,
                                                                             stream=stream).median_ms / 1e9
                if torch is not None:
                    row.update(_fa2_padded(q, k, v, do, cu, lengths, causal, work, stream, policy, torch, F,
                                           SDPBackend, sdpa_kernel))
                rows.append(row)
            del q, k, v, do
            cupy.get_default_memory_pool().free_all_blocks()
    return {"rows": rows}


def _fa2_padded(q, k, v, do, cu, lengths, causal, work, stream, policy, torch, F, SDPBackend, sdpa_kernel) -> dict:
    """SDPA's flash backend on the sequences padded to the longest, one (B, H, L, D) batch."""
    import cupy

    batch, longest = len(lengths), max(lengths)
    out = {}
    padded = []
    for x in (q, k, v, do):
        p = cupy.zeros((batch, longest) + x.shape[1:], x.dtype)
        for b in range(batch):
            p[b, : lengths[b]] = x[int(cu[b]): int(cu[b + 1])]
        padded.append(p)
    ts = torch.cuda.ExternalStream(stream.ptr)
    with torch.cuda.stream(ts):
        tq, tk, tv, tdo = (torch.from_dlpack(x).transpose(1, 2) for x in padded)
        tq, tk, tv = (t.detach().requires_grad_(True) for t in (tq, tk, tv))
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                o = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

                def fwd(_):
                    F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

                def bwd(_):
                    torch.autograd.grad(o, (tq, tk, tv), tdo, retain_graph=True)

                out["fa2_padded_fwd_tflops"] = 4 * work / time_region(fwd, 1, policy=policy,
                                                                      stream=stream).median_ms / 1e9
                out["fa2_padded_bwd_tflops"] = 10 * work / time_region(bwd, 1, policy=policy,
                                                                       stream=stream).median_ms / 1e9
        except Exception as exc:  # a backend that rejects the shape
            out["fa2_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    out["padded_shape"] = [batch, longest]
    return out


def table(result: dict) -> str:
    lines = ["| d | causal | mode | varlen TFLOP/s | batch order | x batch order | device cu_seqlens | "
             "device, no_host_sync | FA2 padded | x FA2 padded | dense 1 x total | x dense | dense B x mean | "
             "x dense mean |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        for mode in ("fwd", "bwd"):
            v, vd = r[f"varlen_{mode}_tflops"], r[f"varlen_device_cu_{mode}_tflops"]
            unread = r.get(f"varlen_device_cu_unread_{mode}_tflops")
            in_batch_order = r.get(f"varlen_batch_order_{mode}_tflops")  # absent in runs before varlen-v2
            fa2 = r.get(f"fa2_padded_{mode}_tflops")
            one, mean = r[f"dense_one_{mode}_tflops"], r[f"dense_mean_{mode}_tflops"]
            fa2_cell = f"{fa2:.1f} | {v / fa2:.2f}" if fa2 else "- | -"
            unread_cell = f"{unread:.1f}" if unread else "-"
            order_cell = f"{in_batch_order:.1f} | {v / in_batch_order:.3f}" if in_batch_order else "- | -"
            lines.append(f"| {r['headdim']} | {r['causal']} | {mode} | {v:.1f} | {order_cell} | {vd:.1f} | "
                         f"{unread_cell} | {fa2_cell} | {one:.1f} | {v / one:.2f} | {mean:.1f} | {v / mean:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupyflash.bench.varlen", description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the measurements here")
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args(argv)
    result = measure(quick=args.quick)
    lengths = result["rows"][0]["lengths"]
    print(f"{len(lengths)} sequences, {sum(lengths)} tokens, lengths {min(lengths)}..{max(lengths)}; "
          f"padded batch {result['rows'][0].get('padded_shape')}")
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

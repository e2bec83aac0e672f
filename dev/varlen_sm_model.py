"""A calibrated model of the causal packed (varlen) gap, forward and backward (CPU only): issue 17's
"varlen within 10% of dense", missed by causal d128 (0.86 / 0.84 fwd / bwd) and the d64 backward
(0.80) on the H100 (perf log varlen, varlen-v2, the eighth session).

dev/varlen_wave_model.py treats every CTA place as a machine of its own. Here an SM holds `slots`
CTAs (the occupancy ptxas and shared memory allow: 1 for every sm_90 bf16 kernel of the bar but the
d64 forward's 2); a CTA spends `overhead` / 2 in a prologue (Q or K/V and the first block's loads,
latency: it uses none of the SM's tensor cores), then its block pairs (the SM's throughput shared
among its CTAs in that phase), then `overhead` / 2 in its epilogue (O or dK/dV out); a CTA past a
packed sequence's end costs `empty`. Each launch is the kernel's own grid and issue order (x
fastest: the forward and dQ kernels' query blocks heaviest first, the dK/dV kernel's key blocks
from 0; then heads; then sequences, most pairs first: varlen.issue_order), one time unit a 128 x
128 x d product. The backward is its dK/dV launch (4 products a block pair) then its dQ launch (3).

`overhead` (and `empty`) are fitted per kernel to the eighth session's eight rates of each head
dim and direction (dense 1 x 16k and 4 x 3650 and the packed batch, causal and not, against dense
1 x 16k), then the model says what each change would give:
  * work list: the grid a list of (sequence, block) items, the heaviest first over the whole batch
    (heads inner), no CTA past a sequence's end (the host knows the lengths);
  * hidden prologue (makespan's ``hidden``, not printed): a persistent CTA whose next tile's loads
    run under the current one's products (d128 forward +2%);
  * the backward on 64 x 64 tiles, two CTAs an SM (varlen-v3's row, shipped at d128 until v16 of
    dev/mma_bwd.py moved a packed causal batch to the producer pair).

    python dev/varlen_sm_model.py
"""
from __future__ import annotations

import heapq
import itertools
import math

# H100, bf16, 16 heads, the eighth session (docs/results/2026-12-06-session8-varlen-h100.txt):
# TFLOP/s of (dense 1 x 16k, dense 4 x 3650, packed most pairs first, packed batch order)
MEASURED = {
    (64, "fwd", False): (399.6, 369.3, 379.0, 375.9),
    (64, "fwd", True): (360.5, 311.6, 342.5, 320.5),
    (64, "bwd", False): (306.5, 268.8, 271.8, 270.3),
    (64, "bwd", True): (301.4, 232.2, 240.9, 225.0),
    (128, "fwd", False): (535.3, 481.0, 521.9, 534.0),
    (128, "fwd", True): (542.5, 469.0, 466.1, 454.2),
    (128, "bwd", False): (350.9, 322.7, 346.8, 348.1),
    (128, "bwd", True): (363.0, 298.7, 305.8, 298.9),
}
SMS = 132
HEADS = 16

# (d, direction) -> launches: (role, query rows a block, keys a block, products a 128 x 128 pair,
# CTAs an SM). The sm_90 bf16 plans (plans.plan_forward / backward_plans.plan_backward, packed,
# deterministic): forward d64 flash_fwd_wgmma 128 x 64 (125 registers x 256 threads: 2 an SM), d128
# flash_fwd_wgmma_ws 128 x 128 (225 KiB); backward flash_bwd_wgmma (dK/dV) + flash_bwd_dq_wgmma,
# d64 128 x 128 both, d128 dK/dV 64 query x 128 keys, dQ 128 x 64 (134-149 KiB, 182-237 registers).
LAUNCHES = {
    (64, "fwd"): (("q", 128, 64, 2, 2),),
    (128, "fwd"): (("q", 128, 128, 2, 1),),
    (64, "bwd"): (("k", 128, 128, 4, 1), ("q", 128, 128, 3, 1)),
    (128, "bwd"): (("k", 64, 128, 4, 1), ("q", 128, 64, 3, 1)),
}


def ctas(lengths, order, causal, role, bm, bn, products, work_list=False, window=None):
    """(grid order) list of CTA costs: block pairs in 128 x 128 products, None for an empty CTA.
    ``window``: a causal band's left width (the dense window study's (1024, 0))."""
    own = bm if role == "q" else bn  # rows a CTA owns
    blocks = math.ceil(max(lengths) / own)
    scale = products * bm * bn / (128 * 128)

    def cost(n, x):
        if role == "q":  # query block x: keys up to its diagonal (causal)
            m0 = x * bm
            if m0 >= n:
                return None
            keys = min(n, m0 + bm) if causal else n
            first = max(0, m0 - window) // bn if window else 0
            return scale * (math.ceil(keys / bn) - first)
        n0 = x * bn  # key block x: queries from its diagonal on (causal)
        if n0 >= n:
            return None
        first = n0 // bm if causal else 0
        end = min(n, n0 + bn + window) if window else n
        return scale * (math.ceil(end / bm) - first)

    if work_list:  # every (sequence, block) once, heaviest first, heads inner
        items = [cost(lengths[z], x) for z in order for x in range(blocks)]
        items = sorted((c for c in items if c is not None), reverse=True)
        return [c for c in items for _ in range(HEADS)]
    out = []
    for z in order:
        for _ in range(HEADS):
            for i in range(blocks):
                x = (blocks - 1 - i) if (role == "q" and causal) else i  # heaviest first
                out.append(cost(lengths[z], x))
    return out


def makespan(costs, slots, overhead, empty, hidden=0.0):
    """Event simulation: SMS SMs of `slots` CTA places, each CTA to the place that frees first;
    a CTA's prologue and epilogue (overhead / 2 each, less `hidden` of the prologue) are latency,
    its products share the SM with the other CTAs in that phase."""
    pro, epi = max(0.0, overhead / 2 - hidden), overhead / 2
    queue = iter(costs)
    # per SM: list of [phase, remaining]; phase 0 prologue, 1 products, 2 epilogue, 3 empty
    sms = [[] for _ in range(SMS)]
    now = [0.0] * SMS
    heap = []
    done = False

    def admit(s):
        nonlocal done
        while len(sms[s]) < slots and not done:
            c = next(queue, StopIteration)
            if c is StopIteration:
                done = True
                break
            sms[s].append([3, empty, 0.0] if c is None else [0, pro, c])

    def next_event(s):
        act = sms[s]
        if not act:
            return None
        sharing = sum(1 for a in act if a[0] == 1)
        return now[s] + min(a[1] * (sharing if a[0] == 1 else 1) for a in act)

    for s in range(SMS):
        admit(s)
        t = next_event(s)
        if t is not None:
            heapq.heappush(heap, (t, s))
    end = 0.0
    while heap:
        t, s = heapq.heappop(heap)
        act = sms[s]
        dt = t - now[s]
        sharing = sum(1 for a in act if a[0] == 1)
        for a in act:
            a[1] -= dt / sharing if a[0] == 1 else dt
        now[s] = t
        keep = []
        for a in act:
            while a[1] <= 1e-12 and a[0] in (0, 1):  # next phase
                a[:2] = [1, a[2]] if a[0] == 0 else [2, epi]
            if a[1] > 1e-12:
                keep.append(a)
        sms[s] = keep
        admit(s)
        end = max(end, t)
        t2 = next_event(s)
        if t2 is not None:
            heapq.heappush(heap, (t2, s))
    return end


def pairs(lengths, causal):
    return sum(n * (n + 1) // 2 if causal else n * n for n in lengths)


def rate(lengths, order, causal, launches, overhead, empty, hidden=0.0, work_list=False):
    """Pairs per time unit of a problem through its launches (role, bm, bn, products, slots[, a
    block pair's cost factor])."""
    t = 0.0
    for role, bm, bn, products, slots, *factor in launches:
        f = factor[0] if factor else 1.0
        costs = [None if c is None else c * f for c in ctas(lengths, order, causal, role, bm, bn, products, work_list)]
        t += makespan(costs, slots, overhead, empty, hidden)
    return pairs(lengths, causal) / t


def problems(lengths):
    """(lengths, issue order) of dense 1 x total, dense B x the pair-weighted mean, the packed batch
    most pairs first and in batch order (the varlen bench's four)."""
    total = sum(lengths)
    mean = round(pairs(lengths, False) / total)
    return {"one": ([total], [0]), "mean": ([mean] * (total // mean), list(range(total // mean))),
            "packed": (lengths, sorted(range(len(lengths)), key=lambda i: -lengths[i])),
            "batch": (lengths, list(range(len(lengths))))}


def ratios(d, direction, causal, lengths, overhead, empty, hidden=0.0, work_list=False, launches=None):
    """Model rates over dense 1 x total (the shipped launches): (dense B x mean, packed most pairs
    first, batch order), the last three through ``launches`` (default the shipped ones)."""
    shipped = LAUNCHES[(d, direction)]
    out = {}
    for name, (ls, order) in problems(lengths).items():
        ours = shipped if name == "one" else (launches or shipped)
        out[name] = rate(ls, order, causal, ours, overhead, empty, hidden, work_list and name in ("packed", "batch"))
    return out["mean"] / out["one"], out["packed"] / out["one"], out["batch"] / out["one"]


def fit(d, direction, lengths):
    """(overhead, empty, rms) minimizing the squared error of the six measured ratios."""
    best = None
    for overhead, empty in itertools.product((0, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 10, 12, 14, 16), (0.25, 0.5, 1.0, 1.5)):
        err = 0.0
        for causal in (False, True):
            one, mean, packed, batch = MEASURED[(d, direction, causal)]
            model = ratios(d, direction, causal, lengths, overhead, empty)
            err += sum((m - r) ** 2 for m, r in zip(model, (mean / one, packed / one, batch / one)))
        if best is None or err < best[2]:
            best = (overhead, empty, err)
    return best[0], best[1], math.sqrt(best[2] / 6)


# The backward on the window rows' tiles (varlen-v3's packed causal row until v16): dK/dV
# and dQ on 64 x 64 blocks, two CTAs an SM (d64's dQ three: 146 registers x 128 threads, 49 KiB).
# A block pair's cost against the shipped tiles': 0.93-0.95 fits the eighth session's window
# (1024, 0) timings at d128 (dK/dV 1.080x, dQ 1.050x, both 1.138x the shipped row at 16k) with the
# overhead fitted here; 1.0 and 1.05 for a margin (d64's 64-row blocks were 5% slower a pair than
# 128-row ones with one CTA an SM: mma-bwd-v10's tuning at 16k).
def two_ctas(d, factor):
    return (("k", 64, 64, 4, 2, factor), ("q", 64, 64, 3, 3 if d == 64 else 2, factor))


def main() -> int:
    from cupyflash.bench.varlen import draw_lengths

    lengths = draw_lengths()
    print(f"lengths {lengths}, {HEADS} heads, {SMS} SMs")
    print("| d | dir | overhead, empty (fitted) | rms | causal | measured mean / packed / batch | model | "
          "no overhead | work list | 64 x 64, 2 CTAs an SM: factor 0.94 / 1.0 / 1.05 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for d, direction in LAUNCHES:
        overhead, empty, rms = fit(d, direction, lengths)
        for causal in (False, True):
            one, mean, packed, batch = MEASURED[(d, direction, causal)]
            model = ratios(d, direction, causal, lengths, overhead, empty)
            bare = ratios(d, direction, causal, lengths, 0.0, 0.0)[1]
            wl = ratios(d, direction, causal, lengths, overhead, empty, work_list=True)[1]
            two = " / ".join(f"{ratios(d, direction, causal, lengths, overhead, empty, launches=two_ctas(d, f))[1]:.2f}"
                             for f in (0.94, 1.0, 1.05)) if direction == "bwd" else "-"
            print(f"| {d} | {direction} | {overhead:g}, {empty:g} | {rms:.3f} | {causal} | "
                  f"{mean / one:.2f} / {packed / one:.2f} / {batch / one:.2f} | "
                  f"{model[0]:.2f} / {model[1]:.2f} / {model[2]:.2f} | {bare:.2f} | {wl:.2f} | {two} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

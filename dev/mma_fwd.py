"""Every tile configuration the tensor-core forward has shipped, v1 to v7, and the candidates that
lost: the history of ``cupyflash/kernels/mma_fwd.py``'s tables. Not part of the library (a wheel
has no dev/); ``python -m cupyflash tune`` from a source checkout times each entry against the
shipped plan (``cupyflash.plans.FORWARD_TILES``), after checking it against the float64 reference.

The kernels are the shipped ones (``kernels_cu/flash_fwd_mma.cu``, ``flash_fwd_wgmma.cu``,
``flash_fwd_wgmma_ws.cu``): a
version here is a set of template arguments, launched by ``mma_fwd.forward(..., config=tiles)``.
A version's tiles are those it ran on an sm_90 device (227 KiB of shared memory per block), one per
head-dim tile. The mma.sync kernel had no row state before v4: v1 and v2 ran what is now
"all_lanes", v3 "one_lane".
"""
from __future__ import annotations

from dataclasses import dataclass

from cupyflash.plans import FwdConfig, WgmmaFwdConfig

PERF_LOG = "docs/perf-log.md"


@dataclass(frozen=True)
class Version:
    name: str
    note: str
    perf_log: str  # the heading anchor of its entry in docs/perf-log.md
    tiles: dict  # {head-dim tile: FwdConfig or WgmmaFwdConfig}
    shipped: str = ""  # the FORWARD_TILES rows that still run it, if any


VERSIONS = (
    Version("v1", "128x32 tiles for d128 (no spills); 128x32, 8 warps for d256", "mma-fwd-v1",
            {64: FwdConfig(128, 64, 4, False, min_blocks=2, row_state="all_lanes"),
             128: FwdConfig(128, 32, 4, False, min_blocks=2, row_state="all_lanes"),
             256: FwdConfig(128, 32, 8, False, row_state="all_lanes")}),
    Version("v2", "v1, but 128x64 tiles, 8 warps for d256 where 193 KiB of shared memory fit (sm_90)",
            "mma-fwd-v1",
            {64: FwdConfig(128, 64, 4, False, min_blocks=2, row_state="all_lanes"),
             128: FwdConfig(128, 32, 4, False, min_blocks=2, row_state="all_lanes"),
             256: FwdConfig(128, 64, 8, False, row_state="all_lanes")}),
    Version("v3", "v2, plus spill-free 128x64 tiles for d128 where 193 KiB fit (sm_90)",
            "mma-fwd-v3-the-default-until-v5",
            {64: FwdConfig(128, 64, 4, False, min_blocks=2), 128: FwdConfig(128, 64, 4, False, min_blocks=2),
             256: FwdConfig(128, 64, 8, False)}),
    Version("v4", "v3, but all-lanes row state for d64",
            "mma-fwd-v4--v5-the-forward-default-until-v6-still-the-default-on-sm_80",
            {64: FwdConfig(128, 64, 4, False, min_blocks=2, row_state="all_lanes"),
             128: FwdConfig(128, 64, 4, False, min_blocks=2), 256: FwdConfig(128, 64, 8, False)}),
    Version("v5", "v4, but Q in registers for d64",
            "mma-fwd-v4--v5-the-forward-default-until-v6-still-the-default-on-sm_80",
            {64: FwdConfig(128, 64, 4, True, min_blocks=2, row_state="all_lanes"),
             128: FwdConfig(128, 64, 4, False, min_blocks=2), 256: FwdConfig(128, 64, 8, False)},
            shipped="large_smem (every head dim), portable (d64)"),
    Version("v6", "warpgroup MMA (wgmma.mma_async) kernel on sm_90: S = Q K^T and O += P V with operands "
            "read from swizzled shared memory (P from registers)",
            "mma-fwd-v6--mma-bwd-v6-hopper-wgmma-the-forward-default-on-sm_90-the-backward-default-until-v7",
            {64: WgmmaFwdConfig(128, 64), 128: WgmmaFwdConfig(128, 128), 256: WgmmaFwdConfig(128, 64)},
            shipped="sm_90 d64 and d256; d128 with dropout or v's own narrower tile"),
    Version("v7", "v6, but d128 on the producer kernel (flash_fwd_wgmma_ws): a warpgroup copies three "
            "stages of K and V, two consumer warpgroups of 64 rows take turns at the tensor cores",
            "wgmma-fwd-ws-route-sm_90s-d128-forward-on-the-producer-kernel",
            {64: WgmmaFwdConfig(128, 64), 128: WgmmaFwdConfig(128, 128, producer=True, stages=3),
             256: WgmmaFwdConfig(128, 64)},
            shipped="sm_90 d128"),
)

# Alternatives worth timing, never a default: FlashAttention-2's 128 x 128 tiles for d64 still
# spill a few registers here (12 to 52 bytes with "one_lane", 160 to 200 with "all_lanes"), the
# 8-warp variants give each warp one 16-row strip; last, the wgmma tiles that lost to v6's.
# wgmma-fwd-ws-v0 (perf log): flash_fwd_wgmma_ws, a producer warpgroup filling K/V stages and two
# consumer warpgroups taking turns at the tensor cores (and one without the turns, to tell the two
# apart). smem: d64 3 stages 113 KiB, d128 2 stages 161 KiB, 3 stages 225 KiB, d256 (64 keys a
# block) 2 stages 193 KiB.
# (d128's three stages with the turns are v7 since wgmma-fwd-ws-route.)
WS_CANDIDATES = {
    64: (WgmmaFwdConfig(128, 128, producer=True, stages=3),),
    128: (WgmmaFwdConfig(128, 128, producer=True, stages=2),
          WgmmaFwdConfig(128, 128, producer=True, stages=3, pingpong=False),
          # For sliding windows (issue 15, perf log window-fwd-budget): 64-key blocks visit 1,088
          # keys a row of a (1024, 0) band where 128-key blocks visit 1,152, at twice the blocks
          # a walk; 129 and 161 KiB. Not yet timed: `tune --headdim 128 --seqlen 8192 16384
          # --window 1024 0 --only default cand` (and causal without --window).
          WgmmaFwdConfig(128, 64, producer=True, stages=3),
          WgmmaFwdConfig(128, 64, producer=True, stages=4)),
    256: (WgmmaFwdConfig(128, 64, producer=True, stages=2),),
}

CANDIDATES = {
    64: (FwdConfig(128, 64, 8, False, min_blocks=2), FwdConfig(128, 128, 4, False),
         FwdConfig(128, 64, 8, False, min_blocks=2, row_state="all_lanes"),
         FwdConfig(128, 128, 4, False, row_state="all_lanes"), WgmmaFwdConfig(128, 128),
         # For sliding windows at d64, d128's routed window tiles (plans.LOCAL_FORWARD_TILES): 64
         # rows, one warpgroup, 49 KiB, 114-127 registers, no spills (sm_90a). Not yet timed:
         # `tune --headdim 64 --seqlen 16384 --window 1024 0 --only default cand`.
         WgmmaFwdConfig(64, 64)),
    128: (FwdConfig(128, 64, 8, False), FwdConfig(128, 32, 4, False, stages=3, min_blocks=2),
          WgmmaFwdConfig(128, 64),
          # For sliding windows: one warpgroup of 64 rows, 99 KiB, two CTAs an SM, and a 64-row
          # block wastes less of the band (1025 / 1088 keys visited against 1025 / 1152). Shipped
          # for the Local policy (plans.LOCAL_FORWARD_TILES: 1.07-1.10x the one-role 128 x 128 at
          # 16k, window 1024), since 2026-12-07 for bands under 1024 keys a row only (wider ones
          # take the producer row, plans.LOCAL_PRODUCER_MIN_KEYS); for NoMask and Causal still a
          # candidate (causal 16k: 0.95x the 128 x 128 tiles).
          WgmmaFwdConfig(64, 64)),
    256: (),
}
CANDIDATES = {dt: configs + WS_CANDIDATES.get(dt, ()) for dt, configs in CANDIDATES.items()}
CANDIDATES_PERF_LOG = "mma-fwd-v4--v5-the-forward-default-until-v6-still-the-default-on-sm_80"


def producer_configs() -> list[tuple[str, int, WgmmaFwdConfig]]:
    """(label, head-dim tile, config) of every flash_fwd_wgmma_ws configuration worth checking: the
    last version's producer rows (shipped), then WS_CANDIDATES."""
    last = VERSIONS[-1]
    shipped = [(f"d{dt}-{last.name}", dt, c) for dt, c in last.tiles.items()
               if getattr(c, "producer", False)]
    return shipped + [(f"d{dt}-{i}", dt, c) for dt, configs in WS_CANDIDATES.items() for i, c in enumerate(configs)]


def entries(dt: int) -> list[tuple[str, object]]:
    """(label, tiles) of every version and candidate at head-dim tile ``dt``, in order."""
    out = [(v.name, v.tiles[dt]) for v in VERSIONS if dt in v.tiles]
    return out + [("cand", tiles) for tiles in CANDIDATES.get(dt, ())]


if __name__ == "__main__":
    for version in VERSIONS:
        shipped = f" [shipped: {version.shipped}]" if version.shipped else ""
        print(f"{version.name}: {version.note}{shipped}\n    {PERF_LOG}#{version.perf_log}")
    print(f"candidates: {sum(map(len, CANDIDATES.values()))}\n    {PERF_LOG}#{CANDIDATES_PERF_LOG}")

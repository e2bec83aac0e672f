"""flash_fwd_dmma's versions and candidates (cupyflash.plans.DmmaFwdConfig) by head-dim tile, for
dev/bench_dmma.py. A version is a set of template arguments of the shipped kernel: v0 (no
cp.async, V rows of D + 4) is a code change and is gone; its numbers are in docs/perf-log.md
(dmma-fwd-v0). v1 is what the plan rows ran when the candidates were added (dmma-fwd-v1); the
candidates are dmma-fwd-v2's: warps of two 8-row m-tiles sharing each K and V fragment, Q's
fragments in registers or shared memory, one or two blocks per SM.

    python dev/dmma_fwd.py      # each entry's specializations compiled for sm_90 (CPU)
"""
from __future__ import annotations

from cupyflash.plans import DmmaFwdConfig

VERSIONS = {
    "v1": {64: DmmaFwdConfig(64, 8), 128: DmmaFwdConfig(32, 8)},
}

CANDIDATES = {
    # two m-tiles as m16n8k8 (sm_90 only): a quarter of the DMMA instructions
    "wide-w4-qsmem-mb2": {64: DmmaFwdConfig(64, 4, 2, False, 2, True), 128: DmmaFwdConfig(16, 4, 2, False, 2, True)},
    "wide-w4-qsmem-mb2-bn32": {64: DmmaFwdConfig(32, 4, 2, False, 2, True)},
    "wide-w8-qsmem": {64: DmmaFwdConfig(64, 8, 2, False, 1, True), 128: DmmaFwdConfig(32, 8, 2, False, 1, True)},
    "wide-w4-qsmem-bn32": {128: DmmaFwdConfig(32, 4, 2, False, 1, True)},
    # two m-tiles per warp, Q from shared memory, two blocks of 4 warps per SM (101 / 98.75 KiB)
    "mt2-w4-qsmem-mb2": {64: DmmaFwdConfig(64, 4, 2, False, 2), 128: DmmaFwdConfig(16, 4, 2, False, 2)},
    # d64 with 32-key blocks: half the S accumulators (64 keys spill 64 bytes at 255 registers)
    "mt2-w4-qsmem-mb2-bn32": {64: DmmaFwdConfig(32, 4, 2, False, 2)},
    "mt2-w8-qsmem-bn32": {64: DmmaFwdConfig(32, 8, 2, False)},
    # the same with Q in registers (d64 only: d128's would take 128 registers alone)
    "mt2-w4-qregs-mb2": {64: DmmaFwdConfig(64, 4, 2, True, 2)},
    # two m-tiles, 8 warps: 128-row blocks, one per SM (135 / 197.5 KiB)
    "mt2-w8-qsmem": {64: DmmaFwdConfig(64, 8, 2, False), 128: DmmaFwdConfig(32, 8, 2, False)},
    # one m-tile, two blocks of 4 warps per SM: v1's loads overlapped by the other block
    "mt1-w4-mb2": {64: DmmaFwdConfig(64, 4, 1, True, 2), 128: DmmaFwdConfig(16, 4, 1, True, 2)},
}


def main() -> None:
    from cupyflash import plans
    from cupyflash.kernels import compile_check
    from cupyflash.masks import as_mask

    entries = [(name, dt, config) for table in (VERSIONS, CANDIDATES) for name, rows in table.items()
               for dt, config in rows.items()]
    specs = [plans.specialization_for("float64", dt, as_mask(causal), config)
             for _, dt, config in entries for causal in (False, True)]
    for arch, results in compile_check.check_archs(["90"], specs).items():
        for r in results:
            print(f"sm_{arch}  {r.name:70} regs {r.registers:3}  spill {r.spill_bytes}")


if __name__ == "__main__":
    main()

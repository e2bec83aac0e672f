"""Print, as the table ``tests/test_plans.py`` keeps, the forward specialization that the dispatch
of a tree from before plans (commit b4b7741: ``dispatch.choose`` and ``mma_fwd.default_config``)
chose for every device class, dtype and head dimension 1..256, and check that the mask changed only
the mask token of a choice.

    git archive b4b7741 | tar -x -C OLD && PYTHONPATH=OLD python dev/forward_dispatch_before_plans.py

Rows group the (arch, opt-in shared memory) pairs that chose alike; a row's head dims are those up
to its bound and above the previous row's.
"""
from __future__ import annotations

import itertools

import numpy as np

from cupyflash import dispatch
from cupyflash._dtypes import SUPPORTED
from cupyflash.kernels import mma_fwd, simt

ARCHS = ("80", "86", "89", "90")
SMEM_OPTINS = (163 * 1024, 227 * 1024, 99 * 1024)  # A100, H100/H200, sm_86/sm_89 opt-in per block


def choice(arch: str, smem_optin: int, dtype, headdim: int, causal: bool) -> tuple:
    """(name, source, expression, threads, smem_bytes, arch, block_m) of the old dispatch."""
    is_mma = (dtype in (SUPPORTED["float16"], SUPPORTED["bfloat16"])
              and mma_fwd.supports(dtype, dispatch.mma_headdim(headdim)))  # choose("auto", ...) on a GPU
    if is_mma:
        dt = mma_fwd.d_tile(dispatch.mma_headdim(headdim))
        config = mma_fwd.default_config(dt, smem_optin, arch)
        spec, block_m = mma_fwd._spec_for(dtype, dt, causal, config), config.block_m
    else:
        spec, block_m = simt._spec("fwd", dtype, headdim, causal), simt.tile_config(dtype, headdim)[0]
    return spec.name, spec.source_file, spec.expression, spec.threads, spec.smem_bytes, spec.arch, block_m


def masked_out(row: tuple, causal: bool) -> tuple:
    """The row with its mask token and template argument replaced by {mask} / {mask_cpp}."""
    name, source, expression, *rest = row
    token, flag = ("causal", "true") if causal else ("full", "false")
    assert f"_{token}_" in name and f", {flag}," in expression, row
    return (name.replace(f"_{token}_", "_{mask}_", 1), source,
            expression.replace(f", {flag},", ", {mask_cpp},", 1), *rest)


def main() -> None:
    for dtype_name, dtype in SUPPORTED.items():
        groups: dict = {}
        for arch, smem in itertools.product(ARCHS, SMEM_OPTINS):
            rows = []
            for headdim in range(1, 257):
                full, causal = (masked_out(choice(arch, smem, dtype, headdim, c), c) for c in (False, True))
                assert full == causal, (arch, smem, dtype_name, headdim)
                if rows and rows[-1][1] == full:
                    rows[-1] = (headdim, full)
                else:
                    rows.append((headdim, full))
            groups.setdefault(tuple(rows), []).append((arch, smem))
        for rows, devices in groups.items():
            print(f"    ({dtype_name!r}, {tuple(devices)!r}, (")
            for bound, row in rows:
                print(f"        ({bound}, {row!r}),")
            print("    )),")


if __name__ == "__main__":
    np.seterr(all="raise")
    main()

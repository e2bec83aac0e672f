"""Compile every specialization this device can run into CuPy's disk cache, on every CPU core.

NVRTC compiles are CPU-bound and a test run or a bench otherwise meets them one at a time on
first use; warmed here in parallel, later processes (pytest groups, the bench) load cubins from
the cache. Run from the tree to warm (PYTHONPATH=<tree>):

    python scripts/warm_kernel_cache.py [--processes N] [--match REGEX] [--zoo]

``--zoo`` adds the kernels of the user modifiers the GPU tests draw (tests/modifier_zoo.py's
GPU_COMBOS) for this device: first the candidates their plans choose among, compiled at once for
ptxas's spill reports (compile_check's disk cache, which the plans then read), then the kernels
the plans choose, into CuPy's cache.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor


def _compile(names: list[str], extra=(), sources=None) -> tuple[int, list[str]]:
    from cupyflash import modifiers
    from cupyflash.kernels import _module, compile_check

    modifiers._SOURCES.update(sources or {})  # a spawned process starts without the parent's modifiers
    by_name = {s.name: s for s in compile_check.all_specializations()}
    by_name.update({s.name: s for s in extra})
    errors = []
    for name in names:
        try:
            _module.get_function(by_name[name])
        except ValueError as exc:  # compiled (and cached), but needs more shared memory than this GPU has
            if "shared memory" not in str(exc):
                errors.append(f"{name}: {exc}")
        except Exception as exc:  # reported, not fatal: the tests will meet it again
            errors.append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return len(names), errors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--match", default="")
    parser.add_argument("--zoo", action="store_true", help="also the GPU tests' user modifiers")
    parser.add_argument("--packed", action="store_true",
                        help="also the packed (varlen) kernels this device's plans launch for every band")
    parser.add_argument("--variants", action="store_true",
                        help="also every band with each score variant the GPU tests combine (softcap, ALiBi, "
                             "a sink, softcap with a sink), every dtype, forward and backward")
    args = parser.parse_args(argv)
    from cupyflash import modifiers
    from cupyflash.kernels import _module, compile_check

    pattern = re.compile(args.match)
    t0 = time.time()
    extra = _zoo_specializations(args.processes) if args.zoo else []
    if args.packed:
        extra += _packed_specializations()
    if args.variants:
        extra += _variant_specializations()
    specs = [s for s in [*compile_check.all_specializations(), *extra]
             if pattern.search(s.name) and _module.runs_on_device(s)]
    names = sorted({s.name for s in specs})
    chunks = [names[i::args.processes * 4] for i in range(args.processes * 4)]
    compiled, errors = 0, []
    sources = dict(modifiers._SOURCES)
    # spawn, not fork: the parent has initialised CUDA (runs_on_device), which a forked child cannot use
    with ProcessPoolExecutor(max_workers=args.processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        for n, errs in pool.map(_compile, [c for c in chunks if c], [extra] * len(chunks), [sources] * len(chunks)):
            compiled += n
            errors += errs
    for line in errors:
        print(line)
    print(f"warm_kernel_cache: {compiled} specializations in {time.time() - t0:.0f} s, {len(errors)} errors")
    return 1 if errors else 0


def _packed_specializations() -> list:
    """The kernels this device's plans launch for packed batches: every band (no mask, causal, a
    window), every dtype and head-dim tile, forward and backward (deterministic or not)."""
    import cupy

    from cupyflash import backward_plans, masks, plans
    from cupyflash.kernels import mma_bwd, mma_fwd
    from cupyflash.kernels._module import _max_smem_optin, device_arch

    arch, smem = device_arch(), _max_smem_optin(cupy.cuda.Device().id)
    out = []
    # a window narrow and wide (plans.band_forms: a wide one can take the causal row's tiles)
    for band in (masks.NoMask(), masks.Causal(), masks.Local(64, 0), masks.Local(2048, 0)):
        mask = band.as_packed()
        for dtype in ("float16", "bfloat16", "float32", "float64"):
            for dt in plans.SIMT_D_TILES:
                out.append(plans.plan_forward(None, dtype, dt, mask, None, family="simt").spec)
                out.extend(launch.spec for launch in backward_plans.plan_backward(
                    None, dtype, dt, mask.backward(), None, True, family="simt").launches)
        for dt in plans.DMMA_D_TILES:  # float64's DMMA kernels up to d128, both statistics
            out.append(plans.plan_forward(arch, "float64", dt, mask, smem).spec)
            for statistics in ("saved", "recomputed"):
                out.extend(launch.spec for launch in backward_plans.plan_backward(
                    arch, "float64", dt, mask.backward(), smem, True, statistics=statistics).launches)
        for dt in (64, 128, 256):  # float32's forward: the tf32 kernel, both precisions
            out += [mma_fwd.plan("float32", dt, mask, precision=precision).spec for precision in ("ieee", "tf32")]
        for dtype in ("float16", "bfloat16"):
            for dt in (64, 128, 256):
                out.append(mma_fwd.plan(dtype, dt, mask).spec)
                for deterministic in (True, False):
                    out.extend(launch.spec for launch in mma_bwd.plan(dtype, dt, mask.backward(), deterministic).launches)
    return list({s.name: s for s in out}.values())


def _variant_specializations() -> list:
    """The kernels this device's plans launch for each band (no mask, causal, a window) with each
    score variant the GPU tests combine with it, head-dim tiles 64 / 128 / 256, forward and backward:
    16-bit (deterministic or not), float32 and float64 (either statistics). The compile check's list has each variant with one band only
    (a representative of each kernel's template arguments), so a test of, say, a window with a
    softcap compiled its kernels in the test: the one-GPU ring's cases took 60-87 s each on
    2026-12-05, its softcap and window cases among them."""
    import cupy

    from cupyflash import backward_plans, plans
    from cupyflash.kernels._module import _max_smem_optin, device_arch
    from cupyflash.masks import Causal, Local, NoMask
    from cupyflash.scores import Score

    arch, smem = device_arch(), _max_smem_optin(cupy.cuda.Device().id)
    scores = (Score(softcap=True), Score(alibi=True), Score(sink=True), Score(softcap=True, sink=True))
    out = []
    for score in scores:
        for band in (NoMask, Causal, lambda score: Local(5, 3, score), lambda score: Local(2048, 0, score)):
            mask = band(score=score)
            for dt in (64, 128, 256):
                for dtype in ("float16", "bfloat16"):
                    out.append(plans.plan_forward(arch, dtype, dt, mask, smem).spec)
                    for deterministic in (True, False):
                        out += [launch.spec for launch in backward_plans.plan_backward(
                            arch, dtype, dt, mask.backward(), smem, deterministic).launches]
                # float32 (the tf32 forward, both precisions) and float64, backward with either statistics
                out += [plans.plan_forward(arch, "float32", dt, mask, smem, precision=precision).spec
                        for precision in ("ieee", "tf32")]
                out.append(plans.plan_forward(arch, "float64", dt, mask, smem).spec)
                for dtype in ("float32", "float64"):
                    for statistics in ("saved", "recomputed"):
                        # layout False: float32's tf32x3 kernels where sm_90's tf32 wgmma route
                        # would run (direct calls on arrays its loaders cannot take)
                        for layout in (True, False):
                            out += [launch.spec for launch in backward_plans.plan_backward(
                                arch, dtype, dt, mask.backward(), smem, True, statistics=statistics,
                                tf32_wgmma_layout=layout).launches]
    return list({s.name: s for s in out}.values())


def _zoo_specializations(processes: int) -> list:
    """The kernels this device's plans launch for GPU_COMBOS (every 16-bit plan and its backward,
    deterministic or not, for each band and head-dim tile; the tf32 forward and the SIMT kernels for
    float32, the DMMA and SIMT kernels for float64; the block map kernels), after compiling every candidate
    the plans choose among for ptxas."""
    from pathlib import Path

    import cupy

    from cupyflash import backward_plans, modifiers, plans
    from cupyflash.kernels import compile_check
    from cupyflash.kernels._module import _max_smem_optin, device_arch
    from cupyflash.masks import Causal, Local, NoMask
    from cupyflash.scores import Score

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import modifier_zoo

    arch, smem = device_arch(), _max_smem_optin(cupy.cuda.Device().id)
    where_fwd = plans.device_class(arch, smem)
    where_bwd = backward_plans.backward_device_class(arch)
    masks = [band(score=Score(user=mods)) for mods in modifier_zoo.gpu_combo_modifiers()
             for band in (NoMask, Causal, lambda score: Local(5, 3, score))]
    # what the plans choose among, compiled for ptxas in parallel threads first
    candidates = []
    for mask in masks:
        for dtype in ("float16", "bfloat16"):
            for dt in (64, 128, 256):
                candidates += [plans.specialization_for(dtype, dt, mask, t)
                               for t in plans.forward_candidates("mma", where_fwd, dt, mask)]
                for deterministic in (True, False):
                    candidates += backward_plans.candidate_specs(where_bwd, dtype, dt, mask, smem, deterministic)
        # float32's backward: the tf32 wgmma route's kernels, which its plan takes unless they spill
        for where, dt in backward_plans.TF32_WGMMA_BACKWARD_ROUTE:
            if where == where_bwd:
                route = backward_plans.tf32_wgmma_route(where, dt, mask)
                candidates += [launch.spec for launch in backward_plans.tf32_wgmma_backward_plan(dt, mask, route).launches
                               if launch.role in ("dkdv", "split_kv", "dq")]
    # One specialization per NVRTC program, every core busy (one program per source file, the
    # compile check's grouping, would compile its dozens of expressions one after another), and
    # each cached under the key plans._spills asks for: the check of that one specialization.
    from concurrent.futures import ThreadPoolExecutor

    chunks = []
    by_arch = {}
    for spec in dict.fromkeys(candidates):
        by_arch.setdefault((spec.arch or arch, spec.source_file), []).append(spec)
    for (target, _), group in by_arch.items():
        chunks += [(target, [spec]) for spec in group]
    with ThreadPoolExecutor(max_workers=processes) as pool:
        list(pool.map(lambda chunk: compile_check.check_archs([chunk[0]], chunk[1]), chunks))
    chosen = []
    for mask in masks:
        for dtype in ("float16", "bfloat16"):
            for dt in (64, 128, 256):
                chosen.append(plans.plan_forward(arch, dtype, dt, mask, smem).spec)
                for deterministic in (True, False):
                    chosen += [launch.spec for launch in
                               backward_plans.plan_backward(arch, dtype, dt, mask, smem, deterministic).launches]
        for dt in (64, 128, 256):  # float32's forward: the tf32 kernel, both precisions
            chosen += [plans.plan_forward(arch, "float32", dt, mask, smem, precision=precision).spec
                       for precision in ("ieee", "tf32")]
        chosen += [plans.plan_forward(arch, "float64", dt, mask, smem).spec  # float64's DMMA forward
                   for dt in plans.DMMA_D_TILES]
        for dtype in ("float32", "float64"):
            for dt in plans.SIMT_D_TILES:
                chosen.append(plans.plan_forward(arch, dtype, dt, mask, smem, family="simt").spec)
                # the default backward (float64: DMMA up to d128; float32: tf32x3, or the tf32 wgmma
                # route) and the SIMT one
                chosen += [launch.spec for family, layout in ((None, True), (None, False), ("simt", True))
                           for launch in backward_plans.plan_backward(arch, dtype, dt, mask, smem, True,
                                                                      family=family,
                                                                      tf32_wgmma_layout=layout).launches]
        if mask.score.user.has_mask:
            mods = mask.score.user
            chosen.append(modifiers.block_map_spec(modifiers.Modifiers(None, modifiers._MaskOnly(mods.mask_mod))))
    print(f"warm_kernel_cache: {len(set(candidates))} candidates checked by ptxas, {len(set(chosen))} zoo kernels",
          flush=True)
    return list(dict.fromkeys(chosen))


if __name__ == "__main__":
    sys.exit(main())

"""Every specialization the dispatcher can launch compiles with NVRTC for sm_80 and sm_90 (no GPU
needed), without register spills; tensor-core kernels contain HMMA (HGMMA for wgmma) instructions.

The CPU suite compiles the representative set (every tile configuration of every kernel, the
dtype/mask combinations rotated over them); ``-m compile_full`` (or CUPYFLASH_COMPILE_FULL=1)
compiles all of them, with the same assertions."""
import functools
import json

import pytest

from cupyflash.kernels import compile_check

pytest.importorskip("cupy")

from nvrtc_check import HAVE_NVRTC, needs_nvrtc  # noqa: E402

needs_cuobjdump = pytest.mark.skipif(not HAVE_NVRTC or compile_check.find_cuobjdump() is None,
                                     reason="NVRTC or cuobjdump not installed (pip install '.[cuda13,test]')")

SETS = ("representative", "full")


def specializations(kind: str):
    specs = compile_check.all_specializations()
    return compile_check.representative(specs) if kind == "representative" else specs


@functools.lru_cache(maxsize=None)
def compiled_set(kind: str):
    """{arch: resources} of one set, every arch compiled at once (the programs build in parallel)."""
    return compile_check.check_archs(list(compile_check.ARCHS), specializations(kind), with_sass=True)


@pytest.fixture(params=[pytest.param((kind, arch), id=f"{kind}-sm{arch}",
                                     marks=[pytest.mark.compile_full] if kind == "full" else [])
                        for kind in SETS for arch in compile_check.ARCHS])
def compiled(request):
    kind, arch = request.param
    return kind, arch, compiled_set(kind)[arch]


@needs_cuobjdump
def test_every_specialization_compiles(compiled):
    kind, arch, results = compiled
    names = {r.name for r in results}
    assert names == {s.name for s in specializations(kind) if compile_check.compiled_for(s, arch)}
    assert len(names) == len(results), "specialization names must be unique"


@needs_cuobjdump
def test_no_register_spills(compiled):
    _, arch, results = compiled
    spilled = [(r.name, r.registers, r.spill_bytes) for r in results if r.spill_bytes]
    assert not spilled, f"sm_{arch}: spills in {spilled}"
    # A stack frame without reported spill bytes is local memory too (an indexed array, say): the
    # tensor-core kernels, which run at the register limit, must have none.
    framed = [(r.name, r.stack_bytes) for r in results
              if ("_mma_" in r.name or "_wgmma_" in r.name or "_dmma_" in r.name) and r.stack_bytes]
    assert not framed, f"sm_{arch}: stack frames in {framed}"


@needs_cuobjdump
def test_no_wgmma_serialized(compiled):
    # ptxas C7515: a wgmma waited for right after issue loses every overlap the kernel is built
    # around (S with dP, the exponentials with dP, products with the next block's).
    _, arch, results = compiled
    serialized = [r.name for r in results if r.wgmma_serialized]
    assert not serialized, f"sm_{arch}: ptxas serialized the wgmma of {serialized}"


@needs_cuobjdump
# The float32 experiment on the DMMA backward's kernels (suffix _tf32x3) runs m16n8k8 .tf32: HMMA.
@pytest.mark.parametrize("family, opcode", [("_mma_", "HMMA"), ("_dmma_", "DMMA"), ("_tf32x3", "HMMA")],
                         ids=["hmma", "dmma", "tf32x3"])
def test_tensor_core_kernels_use_their_mma(compiled, family, opcode):
    _, arch, results = compiled
    ours = [r for r in results if family in r.name and (family == "_tf32x3") == r.name.endswith("_tf32x3")]
    missing = [r.name for r in ours if opcode not in r.sass_opcodes]
    assert not missing, f"sm_{arch}: no {opcode} in {missing}"


@needs_cuobjdump
def test_wgmma_kernels_use_hgmma(compiled):
    _, arch, results = compiled
    wgmma = [r for r in results if "_wgmma_" in r.name]
    assert bool(wgmma) == (arch == "90a"), f"sm_{arch}: wgmma kernels {[r.name for r in wgmma]}"
    missing = [r.name for r in wgmma if "HGMMA" not in r.sass_opcodes]
    assert not missing, f"sm_{arch}: no HGMMA in {missing}"


@needs_cuobjdump
def test_simt_kernels_report_resources(compiled):
    _, arch, results = compiled
    simt = [r for r in results if "_simt_" in r.name]
    assert (bool(simt) or arch in ("90a",)) and all(0 < r.registers <= 255 for r in simt)


def test_wgmma_serialization_is_read_from_the_ptxas_log():
    log = ("ptxas info    : Compiling entry function '_Z1av' for 'sm_90a'\n"
           "ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized "
           "due to non wgmma instructions defining accumulator registers of a wgmma between start and end "
           "of the pipeline stage in the function '_Z1bv' in line 12\n")
    assert compile_check.wgmma_serialized_from_log(log) == {"_Z1bv"}
    assert compile_check.wgmma_serialized_from_log("ptxas info    : Used 40 registers") == set()


def test_resources_are_read_from_the_ptxas_log():
    log = ("ptxas info    : 0 bytes gmem\n"
           "ptxas info    : Compiling entry function '_Z1av' for 'sm_80'\n"
           "ptxas info    : Function properties for _Z1av\n"
           "ptxas         .     24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers, 16384 bytes smem, 400 bytes cmem[0]\n"
           "ptxas info    : Compile time = 5.0 ms\n"
           "ptxas info    : Compiling entry function '_Z1bv' for 'sm_80'\n"
           "ptxas info    : Function properties for _Z1bv\n"
           "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 40 registers, used 0 barriers, 384 bytes cmem[0]\n")
    report = compile_check.ptxas_report(log)
    assert report["_Z1av"] == {"registers": 255, "shared": 16384, "stack": 24, "spill_stores": 8, "spill_loads": 12}
    assert report["_Z1bv"] == {"registers": 40, "shared": 0, "stack": 0, "spill_stores": 0, "spill_loads": 0}
    with pytest.raises(RuntimeError, match="no register count"):
        compile_check.ptxas_report("ptxas info    : Compiling entry function '_Z1cv' for 'sm_80'\n")


def test_sass_opcodes_drop_modifiers_predicates_and_encodings():
    sass = ("        /*0a40*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;   /* 0x0000000c0804723c */\n"
            "        /*0a50*/               @!P0 BRA 0xb00 ;                             /* 0x000000a000008947 */\n"
            "        /*0a60*/              @UP1 HGMMA.64x128x16.F32 gdesc[UR4], RZ, !UPT ; /* 0x00e0000004187df3 */\n")
    assert compile_check.sass_opcodes(sass) == {"HMMA", "BRA", "HGMMA"}


def test_the_representative_set_compiles_every_configuration_dtype_and_mask():
    specs = compile_check.all_specializations()
    chosen = compile_check.representative(specs)
    assert {s.name for s in chosen} <= {s.name for s in specs}
    assert len(chosen) == len({s.name for s in chosen})
    assert len(chosen) < len(specs) / 2, "the representative set is what keeps the CPU suite fast"

    def by_kernel(group):
        out = {}
        for spec in group:
            kernel, config, (dtype, mask) = compile_check._variant(spec)
            entry = out.setdefault(kernel, (set(), set(), set()))
            entry[0].add((spec.arch, config)), entry[1].add(dtype), entry[2].add(mask)
        return out

    assert by_kernel(chosen) == by_kernel(specs)


@needs_nvrtc
def test_results_are_cached_by_source_and_options(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPYFLASH_CACHE_DIR", str(tmp_path))
    spec = next(s for s in compile_check.all_specializations() if s.name == "flash_bwd_preprocess_fp32")
    first = compile_check.check("80", [spec])
    entries = list((tmp_path / "compile-check").glob("*.json"))
    assert len(entries) == 1 and spec.expression in json.loads(entries[0].read_text())

    def no_compile(*args):
        raise AssertionError("compiled although the result is cached")

    monkeypatch.setattr(compile_check, "compile_cubin", no_compile)
    assert compile_check.check("80", [spec]) == first
    with pytest.raises(AssertionError, match="compiled although"):
        compile_check.check("90", [spec])  # another arch is another key
    with pytest.raises(AssertionError, match="compiled although"):
        compile_check.check("80", [spec], cache=False)
    source = compile_check.module_source(spec.source_file, [spec.expression])
    monkeypatch.setattr(compile_check, "module_source", lambda name, expressions: source + "\n// edited\n")
    with pytest.raises(AssertionError, match="compiled although"):
        compile_check.check("80", [spec])  # an edit of the source (or of a header) is another key


@needs_nvrtc
def test_compile_uses_the_libnvrtc_and_headers_cupy_uses():
    cupy_environment = pytest.importorskip("cupy._environment")
    from cuda.pathfinder import load_nvidia_dynamic_lib

    assert compile_check.nvrtc_path() == load_nvidia_dynamic_lib("nvrtc").abs_path
    includes = [o[2:] for o in compile_check.compile_options("90") if o.startswith("-I")]
    cuda_path = cupy_environment.get_cuda_path()
    if cuda_path is not None:
        assert f"{cuda_path}/include" in includes


@pytest.mark.gpu
@needs_nvrtc
def test_the_check_reads_the_registers_of_the_kernels_that_run():
    # RawModule compiles what the check compiled: same libnvrtc, include paths and options, so
    # the registers the check reports are those of the kernels launched on this device.
    from cupyflash.kernels import _module

    device_arch = _module.device_arch()
    chosen = {}
    for spec in compile_check.representative(compile_check.all_specializations()):
        kernel = compile_check._variant(spec)[0]
        if _module.runs_on_device(spec) and kernel not in chosen:
            chosen[kernel] = spec
    names = [spec.name for spec in chosen.values()]
    assert any("_simt_" in name for name in names) and any("_mma_" in name for name in names)
    mismatched = []
    for spec in chosen.values():
        checked = compile_check.check(spec.arch or device_arch, [spec], cache=False)[0]
        launched = _module.get_function(spec).num_regs
        if launched != checked.registers:
            mismatched.append((spec.name, checked.registers, launched))
    assert not mismatched, f"(kernel, registers in the check, registers of the launched kernel): {mismatched}"

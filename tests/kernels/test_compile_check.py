"""Every specialization the dispatcher can launch compiles with NVRTC for sm_80 and sm_90 (no GPU
needed), without register spills; tensor-core kernels contain HMMA instructions."""
import pytest

from cupyflash.kernels import compile_check

pytest.importorskip("cupy")

try:
    compile_check._nvrtc()
    HAVE_NVRTC = True
except (FileNotFoundError, OSError):
    HAVE_NVRTC = False

needs_nvrtc = pytest.mark.skipif(not HAVE_NVRTC or compile_check.find_cuobjdump() is None,
                                 reason="NVRTC or cuobjdump not installed (pip install '.[test]')")


@pytest.fixture(scope="module")
def compiled_all():
    return compile_check.check_archs(list(compile_check.ARCHS), with_sass=True)


@pytest.fixture(params=list(compile_check.ARCHS))
def compiled(request, compiled_all):
    return request.param, compiled_all[request.param]


@needs_nvrtc
def test_every_specialization_compiles(compiled):
    arch, results = compiled
    names = {r.name for r in results}
    assert names == {s.name for s in compile_check.all_specializations() if compile_check.compiled_for(s, arch)}
    assert len(names) == len(results), "specialization names must be unique"


@needs_nvrtc
def test_no_register_spills(compiled):
    arch, results = compiled
    spilled = [(r.name, r.registers, r.spill_bytes) for r in results if r.spill_bytes]
    assert not spilled, f"sm_{arch}: spills in {spilled}"
    # A stack frame without reported spill bytes is local memory too (an indexed array, say): the
    # tensor-core kernels, which run at the register limit, must have none.
    framed = [(r.name, r.stack_bytes) for r in results if ("_mma_" in r.name or "_wgmma_" in r.name) and r.stack_bytes]
    assert not framed, f"sm_{arch}: stack frames in {framed}"


@needs_nvrtc
def test_no_wgmma_serialized(compiled):
    # ptxas C7515: a wgmma waited for right after issue loses every overlap the kernel is built
    # around (S with dP, the exponentials with dP, products with the next block's).
    arch, results = compiled
    serialized = [r.name for r in results if r.wgmma_serialized]
    assert not serialized, f"sm_{arch}: ptxas serialized the wgmma of {serialized}"


def test_wgmma_serialization_is_read_from_the_ptxas_log():
    log = ("ptxas info    : Compiling entry function '_Z1av' for 'sm_90a'\n"
           "ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized "
           "due to non wgmma instructions defining accumulator registers of a wgmma between start and end "
           "of the pipeline stage in the function '_Z1bv' in line 12\n")
    assert compile_check.wgmma_serialized_from_log(log) == {"_Z1bv"}
    assert compile_check.wgmma_serialized_from_log("ptxas info    : Used 40 registers") == set()


@needs_nvrtc
def test_tensor_core_kernels_use_hmma(compiled):
    arch, results = compiled
    mma = [r for r in results if "_mma_" in r.name]
    missing = [r.name for r in mma if "HMMA" not in r.sass]
    assert not missing, f"sm_{arch}: no HMMA in {missing}"


@needs_nvrtc
def test_wgmma_kernels_use_hgmma(compiled):
    arch, results = compiled
    wgmma = [r for r in results if "_wgmma_" in r.name]
    assert bool(wgmma) == (arch == "90a"), f"sm_{arch}: wgmma kernels {[r.name for r in wgmma]}"
    missing = [r.name for r in wgmma if "HGMMA" not in r.sass]
    assert not missing, f"sm_{arch}: no HGMMA in {missing}"


@needs_nvrtc
def test_simt_kernels_report_resources(compiled):
    arch, results = compiled
    simt = [r for r in results if "_simt_" in r.name]
    assert (bool(simt) or arch in ("90a",)) and all(0 < r.registers <= 255 for r in simt)

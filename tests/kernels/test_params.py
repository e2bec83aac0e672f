"""kernels_cu/params.cuh and its NumPy twin (cupyflash/kernels/params.py) have one layout, and every
kernel takes its direction's struct as its only argument, in a file of its own named after it.

The layout check compiles static_asserts of every field's offset and size, the structs' sizes and
alignment, under NVRTC for each target on CPU: a field added, dropped, reordered or retyped on one
side fails to compile."""
import re

import numpy as np
import pytest

from cupyflash.kernels import compile_check, params
from cupyflash.kernels._module import kernels_dir

from nvrtc_check import needs_nvrtc


@needs_nvrtc
@pytest.mark.parametrize("arch", compile_check.ARCHS)
def test_params_layout_matches_numpy(arch):
    compile_check.compile_text(params.layout_asserts(), "params_layout.cu", [], arch)


@needs_nvrtc
def test_params_layout_check_fails_on_a_moved_field():
    """The check can fail: a dtype with two fields swapped gives offsets the compiler rejects."""
    names = list(params.FWD_PARAMS.names)
    i, j = names.index("seqlen_q"), names.index("seqlen_k")
    names[i], names[j] = names[j], names[i]
    swapped = np.dtype([(n, params.FWD_PARAMS.fields[n][0]) for n in names], align=True)
    saved = dict(params._CPP_NAMES)
    try:
        params._CPP_NAMES.clear()
        params._CPP_NAMES[swapped] = "cf::FwdParams"
        text = params.layout_asserts()
    finally:
        params._CPP_NAMES.clear()
        params._CPP_NAMES.update(saved)
    with pytest.raises(RuntimeError, match="seqlen_q: offset"):
        compile_check.compile_text(text, "params_layout.cu", [], compile_check.ARCHS[0])


_KERNEL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)", re.S)


def kernel_signatures():
    """(file, kernel, parameter list) of every kernel in kernels_cu/."""
    for path in sorted(kernels_dir().glob("*.cu")):
        for name, args in _KERNEL.findall(path.read_text()):
            yield path.name, name, " ".join(args.split())


def test_one_kernel_per_file_named_after_it():
    """Every kernels_cu/*.cu defines one kernel and is named after it; every specialization
    compiles its kernel's file."""
    kernels = {}
    for source, name, _ in kernel_signatures():
        kernels.setdefault(source, []).append(name)
    assert set(kernels) == {p.name for p in kernels_dir().glob("*.cu")}
    assert {source: names for source, names in kernels.items() if names != [source.removesuffix(".cu")]} == {}
    for spec in compile_check.all_specializations():
        kernel = spec.expression.removeprefix("cf::").split("<", 1)[0]
        assert spec.source_file == f"{kernel}.cu", spec


# kernel name prefix -> its struct (the first match)
DIRECTIONS = (("flash_fwd_kvcache", "CacheFwd"), ("flash_kvcache_append", "Append"), ("flash_fwd_combine", "Combine"),
              ("flash_fwd", "Fwd"), ("merge_", "Merge"), ("flash_block_map", "BlockMap"), ("flash_rotary", "Rotary"),
              ("", "Bwd"))


def test_every_kernel_takes_one_params_struct():
    signatures = list(kernel_signatures())
    assert len(signatures) >= 15
    for source, name, args in signatures:
        direction = next(d for prefix, d in DIRECTIONS if name.startswith(prefix))
        assert args == f"const __grid_constant__ {direction}Params p", (source, name, args)


def test_forward_params_hold_the_call():
    class Array:  # the attributes forward_params reads, without a GPU
        def __init__(self, shape, ptr, itemsize=2):
            self.shape, self.itemsize = shape, itemsize
            self.strides = tuple(int(np.prod(shape[i + 1:])) * itemsize for i in range(len(shape)))
            self.data = type("Ptr", (), {"ptr": ptr})()

    from cupyflash.masks import mask_for

    q, k = Array((2, 5, 6, 64), 0x1000), Array((2, 7, 3, 64), 0x2000)
    v, o, lse = Array((2, 7, 3, 64), 0x3000), Array((2, 5, 6, 64), 0x4000), Array((2, 6, 5), 0x5000, 4)
    p = params.forward_params(q, k, v, o, lse, softmax_scale=0.125, mask=mask_for(False, (3, 0)))[0]
    assert p["q"]["data"] == 0x1000 and p["lse"] == 0x5000
    assert (p["k"]["batch_stride"], p["k"]["row_stride"], p["k"]["head_stride"]) == (7 * 3 * 64, 3 * 64, 64)
    assert (p["batch"], p["seqlen_q"], p["seqlen_k"], p["nheads"], p["nheads_kv"], p["group"], p["headdim"]) == \
        (2, 5, 7, 6, 3, 2, 64)
    assert (p["window_left"], p["window_right"]) == (3, 0)
    assert p["scale_log2_f64"] == np.float64(0.125) * 1.4426950408889634
    assert p["scale_log2"] == np.float32(np.float64(0.125) * 1.4426950408889634)


def test_a_user_masks_block_map_must_match_the_specialization():
    """A kernel that reads a block map (Score.block_map, UserScore's BLOCK_MAP) refuses a mask_mod
    without one (its tables would be read at address 0), and one that takes none (the KV-cache
    kernel's "nomap") refuses a map; a score_mod alone goes either way."""
    from cupyflash import modifiers as M
    from cupyflash.masks import mask_for
    from cupyflash.scores import Variant

    from dataclasses import replace

    mods = M.example_modifiers()  # its mask comes without a map (_MaskOnly)
    assert mods.has_mask and not mods.has_map
    # a variant's score follows its modifiers: no map, a specialization that reads none
    assert not Variant(mods=mods).score.block_map
    mapped = mask_for(True, score=replace(Variant(mods=mods).score, block_map=True))
    assert mapped.score.block_map
    with pytest.raises(ValueError, match="reads block map"):
        params.check_block_map(mapped, Variant(mods=mods))
    nomap = mapped.with_score(mapped.score.without_block_map)
    params.check_block_map(nomap, Variant(mods=mods))
    with_map = M.Modifiers(mods.score_mod, M.create_block_mask(mods.mask_mod, 1, 1, 16, 16, device="cpu"))
    params.check_block_map(mapped, Variant(mods=with_map))
    with pytest.raises(ValueError, match="takes no block map"):
        params.check_block_map(nomap, Variant(mods=with_map))
    assert "nomap" in mapped.with_score(mapped.score.without_block_map).name and "nomap" not in mapped.name
    score_only = M.Modifiers(mods.score_mod, None)
    assert Variant(mods=score_only).score.without_block_map == Variant(mods=score_only).score
    params.check_block_map(mask_for(True, score=Variant(mods=score_only).score), Variant(mods=score_only))

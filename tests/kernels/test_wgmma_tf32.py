"""kernels_cu/wgmma_tf32.cuh on the CPU: the split-and-transpose loaders of float32 operand
tiles for wgmma's tf32 form (perf log tf32-wgmma-v0; only the candidate flash_fwd_tf32_wgmma uses
them, and nothing here has run on a GPU yet). The model (models/wgmma_tf32.py, mirrored statement by statement) fills
shared memory as the loaders do; what the tensor cores read through the K-major descriptors of
every k-step, written from the PTX ISA, must be exactly hi and lo of the tile (transposed for the
sequence-reduced operands), zero-filled past rows_valid and headdim. The stores must be free of
bank conflicts and the loads use whole 32-byte sectors. Then the header compiles, with the loads
and stores as 16-byte instructions and nothing spilled."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from models.mirrors import missing_statements
from models.wgmma_tf32 import (KERNEL, SOURCE, STEPS, WS_KERNEL, Log, forward_ws_smem, stage_q_rows, staged_q_offsets, cp_async_staged_rows, load_q_fragments, staged_offset, forward_smem, k_major_operand_of, key_pair_order,
                               p_as_a_registers, split_tf32_panels,
                                split_tf32_panels_transposed, tf32_a_fragment_matrix, tf32_k_step_desc, tf32_k_step_desc_after,
                                tf32_operand)
from models.tf32 import tensor_core_reads
from models.wgmma import acc_from_matrix, bank_conflict_free
from nvrtc_check import needs_nvrtc

from cupyflash.plans import WgmmaTf32FwdConfig

# tf32-wgmma-v1's candidates: raw K / V staged by cp.async two blocks ahead, Q in shared memory or
# in registers
V1_CONFIGS = (WgmmaTf32FwdConfig(32, raw_stages=2), WgmmaTf32FwdConfig(32, raw_stages=2, q_registers=True))
# tf32-wgmma-v2's: a producer warpgroup and two consumers (head dims up to 64)
V2_CONFIG = WgmmaTf32FwdConfig(32, raw_stages=2, producer=True, stages=4)

POISON = np.uint32(0xFFFFFFFF)  # a NaN pattern no split produces

# (rows, dim, threads, rows_valid, headdim): the forward's K / V tiles at d64 and d128, a
# producer warpgroup of 128 threads or two, partial tiles (the sequence's last block, a head dim
# padded to the tile)
SHAPES = [(64, 128, 128, 64, 128), (64, 64, 128, 64, 64), (32, 128, 256, 32, 128), (64, 128, 128, 37, 100),
          (128, 64, 128, 1, 60), (32, 32, 64, 20, 32)]


def test_mirrors_are_the_header_and_the_kernel():
    for source in (SOURCE, KERNEL, STEPS, WS_KERNEL):
        assert not (missing := missing_statements(source)), f"mirrored statements no longer in {source}: {missing}"


def _slice(rows, dim, rows_valid, headdim, seed):
    """The global slice (values with all 23 mantissa bits in use) and what the tile must hold."""
    rng = np.random.default_rng(seed)
    gmem = (rng.standard_normal((rows, dim)) * np.exp2(rng.integers(-20, 20, (rows, dim)))).astype(np.float32)
    want = np.zeros((rows, dim), np.float32)
    want[:rows_valid, :headdim] = gmem[:rows_valid, :headdim]
    return gmem, want


def _smem(words):
    return np.full(words, POISON, np.uint32), np.full(words, POISON, np.uint32)


@pytest.mark.parametrize("products", [3, 1])
@pytest.mark.parametrize("rows, dim, nthreads, rows_valid, headdim", SHAPES)
def test_k_major_tile_reads_as_the_split_rows(products, rows, dim, nthreads, rows_valid, headdim):
    """split_tf32_panels: the k-steps of the tile read through tf32_k_step_desc are hi and lo of
    the rows (Q / K for S = Q K^T), 8 columns at a time; every word of the tile written."""
    gmem, want = _slice(rows, dim, rows_valid, headdim, seed=rows + dim)
    tile = rows * dim * 4  # a second tile after the first: the descriptors' addresses are absolute
    hi_smem, lo_smem = _smem(3 * tile // 4)
    split_tf32_panels(products, hi_smem, lo_smem, tile, tile, rows, dim, nthreads, gmem, rows_valid, headdim)
    assert (hi_smem[tile // 4: 2 * tile // 4] != POISON).all() and (hi_smem[: tile // 4] == POISON).all()
    want_hi, want_lo = k_major_operand_of(products, want)
    for step in range(dim // 8):
        desc = tf32_k_step_desc(rows, tile, step)
        assert np.array_equal(tf32_operand(hi_smem, desc, rows), want_hi[:, 8 * step: 8 * step + 8]), step
        assert np.array_equal(tf32_operand(lo_smem, desc, rows), want_lo[:, 8 * step: 8 * step + 8]), step


@pytest.mark.parametrize("rows", [16, 32, 64, 128, 256])
def test_descriptor_advanced_a_k_step_is_the_address_form(rows):
    """tf32_k_step_desc_after: a k-step's descriptor from its tile's equals the one built from the
    k-step's address, for every 1024-byte aligned tile a kernel's 227 KiB can hold and every k-step
    of a 256-column tile (the start field never carries into the next)."""
    for tile in range(0, 227 * 1024, 1024):
        base = tf32_k_step_desc(rows, tile, 0)
        for step in range(32):
            if tile + (step >> 2) * rows * 128 + 32 * (step & 3) >= 227 * 1024:
                break
            assert tf32_k_step_desc_after(rows, base, step) == tf32_k_step_desc(rows, tile, step), (tile, step)


@pytest.mark.parametrize("products", [3, 1])
@pytest.mark.parametrize("rows, dim, nthreads, rows_valid, headdim", SHAPES)
def test_transposed_tile_reads_as_the_split_columns(products, rows, dim, nthreads, rows_valid, headdim):
    """split_tf32_panels_transposed: the tile is dim rows of `rows` sequence values; its k-steps
    (8 sequence positions) read as hi and lo of the slice's transpose (V for O = P V, the B
    operand B[key][d] stored [d][key])."""
    gmem, want = _slice(rows, dim, rows_valid, headdim, seed=3 * rows + dim)
    tile = rows * dim * 4
    hi_smem, lo_smem = _smem(2 * tile // 4)
    split_tf32_panels_transposed(products, hi_smem, lo_smem, 0, tile, rows, dim, nthreads, gmem, rows_valid, headdim)
    assert (hi_smem[: tile // 4] != POISON).all() and (lo_smem[tile // 4:] != POISON).all()
    want_hi, want_lo = k_major_operand_of(products, want.T)
    for step in range(rows // 8):
        assert np.array_equal(tf32_operand(hi_smem, tf32_k_step_desc(dim, 0, step), dim),
                              want_hi[:, 8 * step: 8 * step + 8]), step
        assert np.array_equal(tf32_operand(lo_smem, tf32_k_step_desc(dim, tile, step), dim),
                              want_lo[:, 8 * step: 8 * step + 8]), step


@pytest.mark.parametrize("rows, dim, nthreads, rows_valid, headdim", SHAPES)
def test_key_pairs_tile_reads_as_the_relabelled_columns(rows, dim, nthreads, rows_valid, headdim):
    """KEY_PAIRS: slot s of each 8-position group holds position 0, 2, 4, 6, 1, 3, 5, 7."""
    gmem, want = _slice(rows, dim, rows_valid, headdim, seed=5 * rows + dim)
    tile = rows * dim * 4
    hi_smem, lo_smem = _smem(2 * tile // 4)
    split_tf32_panels_transposed(3, hi_smem, lo_smem, 0, tile, rows, dim, nthreads, gmem, rows_valid, headdim,
                                 key_pairs=True)
    want_hi, want_lo = k_major_operand_of(3, want.T[:, key_pair_order(rows)])
    for step in range(rows // 8):
        assert np.array_equal(tf32_operand(hi_smem, tf32_k_step_desc(dim, 0, step), dim),
                              want_hi[:, 8 * step: 8 * step + 8]), step
        assert np.array_equal(tf32_operand(lo_smem, tf32_k_step_desc(dim, tile, step), dim),
                              want_lo[:, 8 * step: 8 * step + 8]), step


@pytest.mark.parametrize("dim", [64, 128])
def test_p_accumulator_times_key_pairs_tile_is_p_v(dim):
    """O = P V with P an accumulator of the product before (64 rows x 64 keys, the C layout) and
    V a KEY_PAIRS tile: k-step j's A registers are the accumulator's {d0, d2, d1, d3} of column
    block j, read as wgmma's tf32 A fragment, B the tile's k-step j through its descriptor. With
    small integers every product and sum is exact, so the sum of the 8 k-steps must be P V
    exactly: any slip in the relabelling moves a value to another key."""
    rng = np.random.default_rng(dim)
    keys = 64
    p = rng.integers(-8, 9, (64, keys)).astype(np.float32)
    v = rng.integers(-8, 9, (keys, dim)).astype(np.float32)
    tile = keys * dim * 4
    hi_smem, lo_smem = _smem(tile // 4)
    split_tf32_panels_transposed(1, hi_smem, lo_smem, 0, 0, keys, dim, 128, v, keys, dim, key_pairs=True)
    acc = acc_from_matrix(p.astype(np.float64))  # [thread, column block j, e]
    o = np.zeros((64, dim))
    for j in range(keys // 8):
        a = p_as_a_registers(acc[:, j, :])
        b = tensor_core_reads(tf32_operand(hi_smem, tf32_k_step_desc(dim, 0, j), dim)).astype(np.float64)
        o += tf32_a_fragment_matrix(a) @ b.T
    assert np.array_equal(o, p.astype(np.float64) @ v.astype(np.float64))


@pytest.mark.parametrize("d_tile, rows_valid, headdim", [(64, 64, 64), (64, 37, 40), (128, 64, 120)])
def test_q_fragments_are_the_a_operand_of_each_k_step(d_tile, rows_valid, headdim):
    """load_q_fragments (Q_REGS) puts, for every k-step, the A operand the PTX ISA's register
    fragment reads (tf32_a_fragment_matrix): Q's 64 rows x 8 columns of that step, zero-filled."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((64, d_tile)).astype(np.float32)
    a = load_q_fragments(d_tile, q, rows_valid, headdim)
    expected = np.where((np.arange(64)[:, None] < rows_valid) & (np.arange(d_tile)[None, :] < headdim), q, 0)
    for kk in range(d_tile // 8):
        assert np.array_equal(tf32_a_fragment_matrix(a[:, kk, :]), expected[:, 8 * kk: 8 * kk + 8])


def _by_warp(entries: dict):
    """{(instruction, warp): [value of lane 0 .. 31]} of a log's per-thread entries."""
    out: dict = {}
    for (instruction, thread), value in sorted(entries.items(), key=lambda kv: kv[0][1]):
        out.setdefault((instruction, thread // 32), []).append(value)
    return out


def _loader_log(transposed: bool, key_pairs: bool, rows: int, dim: int, nthreads: int, seed: int) -> Log:
    """What one loader did with a whole rows x dim slice (ieee split)."""
    gmem, _ = _slice(rows, dim, rows, dim, seed=seed)
    hi_smem, lo_smem = _smem(2 * rows * dim)
    log = Log()
    if transposed:
        split_tf32_panels_transposed(3, hi_smem, lo_smem, 0, rows * dim * 4, rows, dim, nthreads, gmem, rows, dim,
                                     log=log, key_pairs=key_pairs)
    else:
        split_tf32_panels(3, hi_smem, lo_smem, 0, rows * dim * 4, rows, dim, nthreads, gmem, rows, dim, log=log)
    return log


@pytest.mark.parametrize("transposed, key_pairs", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("rows, dim, nthreads", [(64, 128, 128), (64, 64, 128), (32, 128, 256)])
def test_stores_conflict_free_and_loads_whole_sectors(transposed, key_pairs, rows, dim, nthreads):
    """Each 16-byte store instruction's phases of 8 lanes touch each bank once; each 16-byte load
    instruction of a warp reads whole 32-byte sectors of the slice (row stride: dim floats)."""
    log = _loader_log(transposed, key_pairs, rows, dim, nthreads, seed=1)
    for (instruction, warp), offsets in _by_warp(log.stores).items():
        for phase in range(4):
            assert bank_conflict_free(offsets[8 * phase: 8 * phase + 8], 16), (instruction, warp, phase)
    for (instruction, warp), starts in _by_warp(log.loads).items():
        byte_ranges = [4 * (r * dim + c) for r, c in starts]
        sectors = {b // 32 for b in byte_ranges} | {(b + 15) // 32 for b in byte_ranges}
        assert 32 * len(sectors) == 16 * len(byte_ranges), (instruction, warp)


@pytest.mark.parametrize("transposed, key_pairs", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("rows, dim, nthreads", [(64, 128, 128), (32, 64, 128), (64, 64, 128), (32, 128, 256)])
def test_staged_tiles_read_conflict_free(transposed, key_pairs, rows, dim, nthreads):
    """A loader reading a StagedRows tile (cp.async's raw copy): each 16-byte shared load's phases
    of 8 lanes touch each bank once, staged_offset is a permutation of each row's chunks, and the
    copies cp_async_staged_rows issues cover the valid rows' chunks once each."""
    log = _loader_log(transposed, key_pairs, rows, dim, nthreads, seed=2)
    for (instruction, warp), starts in _by_warp(log.loads).items():
        offsets = [staged_offset(dim, r, c // 4) for r, c in starts]
        for phase in range(4):
            assert bank_conflict_free(offsets[8 * phase: 8 * phase + 8], 16), (instruction, warp, phase)
    for row in range(rows):
        assert sorted(staged_offset(dim, row, c) for c in range(dim // 4)) == \
            [16 * (row * (dim // 4) + c) for c in range(dim // 4)]
    copies = cp_async_staged_rows(rows, dim, nthreads, rows - 3, dim - 8)
    assert sorted((r, c) for r, c, _ in copies.values()) == \
        [(r, c) for r in range(rows - 3) for c in range(dim // 4) if 4 * c < dim - 8]


@needs_nvrtc
@pytest.mark.parametrize("arch", ["90a", "80"])
def test_loaders_compile_to_16_byte_accesses(arch):
    """Both loaders in one kernel (a producer warpgroup filling a d128 K tile and a V^T tile of 64
    keys in KEY_PAIRS order, ieee split): no local memory, and where cuobjdump is installed, 16-byte global loads and
    16-byte shared stores only."""
    from cupyflash.kernels import compile_check
    from cupyflash.kernels._module import kernel_source

    text = kernel_source("wgmma_tf32.cuh") + """
extern "C" __global__ void __launch_bounds__(128) wgmma_tf32_probe(const float* k, const float* v, int rows_valid,
                                                                    int headdim, long long stride, float* out) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const cf::u32 base = cf::smem_u32(smem);
    constexpr cf::u32 TILE = 64 * 128 * 4;
    cf::split_tf32_panels<64, 128, 128, 3>(base, base + TILE, cf::GlobalRows{k, stride}, rows_valid, headdim,
                                           threadIdx.x);
    cf::split_tf32_panels_transposed<64, 128, 128, 3, true>(base + 2 * TILE, base + 3 * TILE,
                                                            cf::GlobalRows{v, stride}, rows_valid, headdim,
                                                            threadIdx.x);
    __syncthreads();
    out[threadIdx.x] = __uint_as_float(cf::ld_shared_b32(base + 4 * threadIdx.x))
                       + (float)cf::tf32_k_step_desc<64>(base, threadIdx.x % 16);
}
"""
    cubin, mangled, log = compile_check.compile_text(text, "wgmma_tf32_probe.cu", [], arch)
    report = compile_check.ptxas_report(log)["wgmma_tf32_probe"]
    assert report["stack"] == 0 and report["spill_stores"] == 0 and report["spill_loads"] == 0, report
    if compile_check.find_cuobjdump() is None:
        pytest.skip("cuobjdump not installed: the instruction widths are not checked")
    sass = compile_check.resource_usage(cubin, with_sass=True)["wgmma_tf32_probe"]["sass"]
    stores = [line for line in sass.splitlines() if " STS" in line]
    loads = [line for line in sass.splitlines() if " LDG" in line]
    # 64 x 128 tile, 128 threads: 16 chunk rows per thread, hi and lo -> 32 stores and 16 loads per
    # loader; the probe's own read is an LDS
    assert len(stores) == 64 and all("STS.128" in s for s in stores), stores
    assert len(loads) == 32 and all(".128" in s for s in loads), loads


@needs_nvrtc
def test_tf32_wgmma_wrappers_compile_without_serialization():
    """WgmmaTf32<N>::ss and ::rs at every width, on descriptors of a loaded tile, for sm_90a: ptxas
    takes them (the forms without transpose arguments) and does not serialize them (C7515)."""
    from cupyflash.kernels import compile_check, wgmma_wrappers
    from cupyflash.kernels._module import kernel_source

    calls = "\n".join(f"""    {{
        float d[{n // 2}];
        for (int i = 0; i < {n // 2}; ++i) d[i] = 0.f;
        cf::wgmma_fence();
        cf::WgmmaTf32<{n}>::ss(d, cf::tf32_k_step_desc<64>(base, 1), cf::tf32_k_step_desc<{n}>(base + 32768, 2), 0);
        cf::WgmmaTf32<{n}>::rs(d, a, cf::tf32_k_step_desc<{n}>(base + 32768, 5), 1);
        cf::wgmma_commit();
        cf::wgmma_wait<0>();
        for (int i = 0; i < {n // 2}; ++i) sum += d[i];
    }}""" for n in wgmma_wrappers.WIDTHS)
    text = kernel_source("wgmma_tf32.cuh") + f"""
extern "C" __global__ void __launch_bounds__(128) wgmma_tf32_wrappers_probe(const float* k, float* out) {{
    extern __shared__ __align__(1024) unsigned char smem[];
    const cf::u32 base = cf::smem_u32(smem);
    cf::split_tf32_panels<64, 64, 128, 3>(base, base + 16384, cf::GlobalRows{{k, 64}}, 64, 64, threadIdx.x);
    __syncthreads();
    cf::fence_proxy_async_shared();
    const cf::u32 a[4] = {{threadIdx.x, threadIdx.x + 1, threadIdx.x + 2, threadIdx.x + 3}};
    float sum = 0.f;
{calls}
    out[threadIdx.x] = sum;
}}
"""
    _, _, log = compile_check.compile_text(text, "wgmma_tf32_wrappers_probe.cu", [], "90a")
    assert "wgmma_tf32_wrappers_probe" in compile_check.ptxas_report(log)
    assert not compile_check.wgmma_serialized_from_log(log), log


def test_candidate_forward_smem_is_the_plan_s():
    """plans.tf32_wgmma_smem_bytes is the kernel's layout plus the 1024-byte alignment slack, and
    fits the H200's 227 KiB at d64 (two CTAs per SM) and d128 (one)."""
    from cupyflash import plans

    for dt, config, per_sm in ((64, plans.WgmmaTf32FwdConfig(64), 2), (128, plans.WgmmaTf32FwdConfig(64), 1),
                               (64, V1_CONFIGS[0], 2), (64, V1_CONFIGS[1], 2), (128, V1_CONFIGS[1], 1)):
        smem = plans.tf32_wgmma_smem_bytes(dt, config)
        assert smem == forward_smem(dt, config.block_n, raw_stages=config.raw_stages,
                                    q_regs=config.q_registers)["BYTES"] + 1024
        assert per_sm * smem <= 227 * 1024 < (per_sm + 1) * smem, (dt, config)
    c = V2_CONFIG
    layout = forward_ws_smem(64, c.block_n, c.stages, c.raw_stages)
    assert plans.tf32_wgmma_smem_bytes(64, c) == layout["BYTES"] + 1024 <= 227 * 1024
    assert layout["FULL"] - layout["RAW"] >= c.block_m * 64 * 4  # O's staging tile in the raw tiles


# tf32-wgmma-d128: Q staged raw in shared memory, split a k-step at a time (the producer kernel up to
# d128, with presplit)
Q_STAGED_CONFIG = WgmmaTf32FwdConfig(32, raw_stages=0, producer=True, stages=2, sums_apart=True, presplit=True,
                                     q_staged=True)


@pytest.mark.parametrize("d_tile", [64, 128])
def test_q_staged_layout_fits_and_stages_o_in_q(d_tile):
    """The Q tile follows the stages (1024-aligned, for nothing but tidiness: its swizzle needs 512),
    holds the CTA's 128 rows, doubles as O's staging tile, and the raw region is the raw stages'
    alone; plans mirrors the bytes, under 227 KiB at d128 (one CTA an SM)."""
    from cupyflash import plans

    c = Q_STAGED_CONFIG
    layout = forward_ws_smem(d_tile, c.block_n, c.stages, c.raw_stages, q_staged=True)
    assert plans.tf32_wgmma_smem_bytes(d_tile, c) == layout["BYTES"] + 1024 <= 227 * 1024
    assert layout["Q"] % 1024 == 0 and layout["O_STAGING"] == layout["Q"]
    assert layout["RAW"] - layout["Q"] == 128 * d_tile * 4 and layout["FULL"] == layout["RAW"]
    assert plans.specialization_for("float32", d_tile, True, c).name.endswith("_qstaged")
    with pytest.raises(ValueError, match="presplit only"):
        plans.specialization_for("float32", 128, True, WgmmaTf32FwdConfig(32, raw_stages=2, producer=True,
                                                                          q_staged=True))
    with pytest.raises(ValueError, match="producer"):
        plans.specialization_for("float32", 128, True, WgmmaTf32FwdConfig(32, q_staged=True))


def test_hh_chain_names_its_kernel_and_takes_the_apart_sums_only():
    """hh_chain 4 (perf log tf32-hh-chain-4): its own name and template argument; the default 2
    leaves every name and expression as it was; refused without the apart sums and on the one-role
    kernels."""
    from cupyflash import plans

    spec = plans.specialization_for("float32", 128, True, replace(Q_STAGED_CONFIG, hh_chain=4))
    assert spec.name.endswith("_apart_presplit_qstaged_hh4") and spec.expression.endswith(", true, 4>")
    default = plans.specialization_for("float32", 128, True, Q_STAGED_CONFIG)
    assert default.name.endswith("_qstaged") and default.expression.endswith(", true, false, true, true>")
    for config, precision in ((replace(Q_STAGED_CONFIG, hh_chain=4, sums_apart=False), "tf32"),
                              (replace(Q_STAGED_CONFIG, hh_chain=3), "ieee")):
        with pytest.raises(ValueError, match="2 or 4 k-steps"):
            plans.specialization_for("float32", 128, True, config, precision=precision)
    with pytest.raises(ValueError, match="hh_chain takes the tf32 wgmma producer kernel"):
        plans.specialization_for("float32", 128, True, WgmmaTf32FwdConfig(32, hh_chain=4))


@needs_nvrtc
@pytest.mark.parametrize("causal", [False, True])
def test_hh_chain_4_compiles_without_spills_at_d128(causal):
    """The staged d128 forward with hi hi chains of 4 k-steps: no local memory, no wgmma
    serialization, the launch's 168 registers (setmaxnreg's budget)."""
    from cupyflash import plans
    from cupyflash.kernels import compile_check
    from cupyflash.masks import mask_for

    spec = plans.specialization_for("float32", 128, mask_for(causal), replace(Q_STAGED_CONFIG, hh_chain=4))
    _, mangled, log = compile_check.compile_cubin(spec.source_file, [spec.expression], "90a")
    report = compile_check.ptxas_report(log)[mangled[spec.expression]]
    assert report["stack"] == 0 and report["spill_stores"] == 0 and report["registers"] == 168, (spec.name, report)
    assert not compile_check.wgmma_serialized_from_log(log), spec.name


@pytest.mark.parametrize("d_tile", [64, 128])
def test_staged_q_reads_load_q_fragments_values_without_conflicts(d_tile):
    """stage_q_rows copies each warp's 16 rows once (16-byte stores, 8 distinct bank groups a
    quarter warp) into swizzled_offset_f32's layout; StagedQ::split's XOR addresses are that
    layout's, so the fragments read back are load_q_fragments' (zeros past the rows and head dim),
    and each of its 32-bit loads hits 32 distinct banks."""
    from models.tf32 import swizzled_offset_f32

    rng = np.random.default_rng(d_tile)
    q = rng.standard_normal((128, d_tile)).astype(np.float32)
    for rows_valid, headdim in ((128, d_tile), (77, d_tile - 24)):
        tile = np.full(128 * d_tile, np.nan, np.float32)
        for strip_row0 in range(0, 128, 16):
            copies = [stage_q_rows(d_tile, strip_row0, lane) for lane in range(32)]
            covered = sorted(rc for lane_copies in copies for rc in lane_copies)
            assert covered == [(strip_row0 + r, c) for r in range(16) for c in range(d_tile // 4)]
            for i in range(len(copies[0])):
                for quarter in range(4):
                    groups = {swizzled_offset_f32(d_tile, *copies[lane][i][:1], 4 * copies[lane][i][1]) // 16 % 8
                              for lane in range(8 * quarter, 8 * quarter + 8)}
                    assert len(groups) == 8
                for lane in range(32):
                    row, chunk = copies[lane][i]
                    for e in range(4):
                        col = 4 * chunk + e
                        value = q[row, col] if row < rows_valid and col < headdim else 0.0
                        tile[swizzled_offset_f32(d_tile, row, col) // 4] = value
        assert not np.isnan(tile).any()
        for wg in range(2):
            want = load_q_fragments(d_tile, q[64 * wg:], rows_valid - 64 * wg, headdim)
            for thread in range(128):
                strip_row0, lane = 64 * wg + 16 * (thread // 32), thread % 32
                for kk in range(d_tile // 8):
                    offsets = staged_q_offsets(d_tile, strip_row0, lane, kk)
                    assert [tile[o // 4] for o in offsets] == list(want[thread, kk])
        for strip_row0 in range(0, 128, 16):
            for kk in range(d_tile // 8):
                for r in range(4):
                    offsets = [staged_q_offsets(d_tile, strip_row0, lane, kk)[r] for lane in range(32)]
                    row0 = strip_row0 + 8 * (r & 1)
                    assert offsets == [swizzled_offset_f32(d_tile, row0 + lane // 4, 8 * kk + lane % 4 + 4 * (r >> 1))
                                       for lane in range(32)]
                    assert len({o // 4 % 32 for o in offsets}) == 32


APART_CONFIGS = (WgmmaTf32FwdConfig(32, raw_stages=2, sums_apart=True),
                 WgmmaTf32FwdConfig(32, raw_stages=2, producer=True, stages=4, sums_apart=True))
PINGPONG_CONFIGS = (WgmmaTf32FwdConfig(32, raw_stages=2, producer=True, stages=4, pingpong=True),
                    WgmmaTf32FwdConfig(32, raw_stages=2, producer=True, stages=4, sums_apart=True, pingpong=True))


@needs_nvrtc
@pytest.mark.parametrize("config", [WgmmaTf32FwdConfig(64), *V1_CONFIGS, V2_CONFIG, *APART_CONFIGS,
                                    *PINGPONG_CONFIGS, Q_STAGED_CONFIG, replace(Q_STAGED_CONFIG, sums_apart=False)],
                         ids=["v0", "v1", "v1-qregs", "v2", "v1-apart", "v2-apart", "v2-pingpong",
                              "v2-pingpong-apart", "v2-qstaged-apart", "v2-qstaged"])
@pytest.mark.parametrize("headdim, causal, precision", [(64, True, "ieee"), (128, False, "tf32")])
def test_candidate_forward_compiles_without_spills(config, headdim, causal, precision):
    """The candidate kernels (flash_fwd_tf32_wgmma, flash_fwd_tf32_wgmma_ws) for sm_90a: no local
    memory, no wgmma serialization (C7515); Q in registers only up to d64 (their plans refuse d128
    with a producer but with Q staged)."""
    if (config.q_registers or config.producer) and headdim > 64 and not config.q_staged:
        pytest.skip("Q in registers: head dims up to 64")
    from cupyflash import plans
    from cupyflash.kernels import compile_check
    from cupyflash.masks import mask_for

    spec = plans.forward_plan("float32", headdim, mask_for(causal), config, None, precision).spec
    _, mangled, log = compile_check.compile_cubin(spec.source_file, [spec.expression], "90a")
    report = compile_check.ptxas_report(log)[mangled[spec.expression]]
    assert report["stack"] == 0 and report["spill_stores"] == 0, (spec.name, report)
    assert not compile_check.wgmma_serialized_from_log(log), spec.name
    if config.producer:
        # setmaxnreg moves registers within the launch allocation: the kernel's static_assert
        # assumes 168 a thread (384 threads), and fewer would leave the consumers' raise waiting
        assert report["registers"] == 168, (spec.name, report)

"""User modifiers (cupyflash.modifiers) on the CPU: the tracer's NumPy form against the user's own
function, its derivative against finite differences, its errors, the generated CUDA compiled by
NVRTC, the hash in the names, the block map against brute force, and the reference and the NumPy
twin with modifiers against each other and against the definitions."""
from __future__ import annotations

import math
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cupyflash as cf
from cupyflash import modifiers as M
from cupyflash import numpy_backend, reference
from cupyflash.modifiers import BlockMask, MaskMod, ModifierError, Modifiers, ScoreMod
from cupyflash.scores import Variant
from cupyflash.testing.modifiers import check_modifier, fuzz_modifier
from cupyflash.testing.strategies import attention_problems
from modifier_zoo import MASKS, make_mask_mod, make_score_mod, modifiers_for
import modifier_zoo as zoo
from nvrtc_check import needs_nvrtc

# --- the tracer ----------------------------------------------------------------------------------

RNG = np.random.default_rng(7)
TABLE = RNG.standard_normal((3, 41)).astype(np.float32)
IDS = RNG.integers(0, 4, (2, 20)).astype(np.int64)


def every_op(score, b, h, q_idx, kv_idx, table, ids):
    """One of each operation the tracer knows, on the score and on the indices."""
    d = q_idx - kv_idx
    x = score * 0.5 + table[h, d + 20] - (q_idx // 3) * 0.25 + (kv_idx % 4) / 3
    y = M.where(d >= 0, M.tanh(x), M.sigmoid(x) - 0.5) + M.exp(-abs(x)) + M.log(1.0 + x * x)
    z = M.sqrt(1.0 + M.maximum(x, 0.0) ** 2) - M.minimum(score, 2.0) + M.floor(score) * 0.0 + x ** 3 * 0.01
    same = ids[b, q_idx] == ids[b, kv_idx]
    return M.where(same & ~(d == 7) | (q_idx < 2), y + z, -score)


def index_grids(batch, nheads, seqlen_q, seqlen_k):
    return (np.arange(batch, dtype=np.int32)[:, None, None, None], np.arange(nheads, dtype=np.int32)[None, :, None, None],
            np.arange(seqlen_q, dtype=np.int32)[None, None, :, None], np.arange(seqlen_k, dtype=np.int32)[None, None, None, :])


def test_numpy_form_is_the_function():
    """The traced graph evaluated in float64 equals the user's function called on NumPy arrays."""
    mod = ScoreMod(every_op, table=TABLE, ids=IDS)
    grids = index_grids(2, 3, 20, 20)
    z = RNG.standard_normal((2, 3, 20, 20)) * 3
    direct = every_op(z, *(g.astype(np.int64) for g in grids), table=TABLE, ids=IDS)
    traced, _ = Modifiers(mod).scores(z, *grids, np.float64)
    np.testing.assert_allclose(traced, direct, rtol=1e-6, atol=1e-6)  # the table is float32 either way


def test_integer_division_is_python_floor_division():
    def mod(b, h, q_idx, kv_idx):
        return ((q_idx - kv_idx) // 3 == -1) | ((q_idx - kv_idx) % 5 == 4)
    grids = index_grids(1, 1, 9, 9)
    traced = Modifiers(None, M._MaskOnly(MaskMod(mod))).visible(*grids)
    q, kv = grids[2].astype(np.int64), grids[3].astype(np.int64)
    np.testing.assert_array_equal(traced, np.broadcast_to(mod(0, 0, q, kv), traced.shape))


def test_derivative_matches_finite_differences():
    mod = ScoreMod(every_op, table=TABLE, ids=IDS)
    grids = index_grids(2, 3, 20, 20)
    z = RNG.standard_normal((2, 3, 20, 20)) * 3
    z = z + 0.5 - np.modf(z)[0] * 0.0  # keep away from floor()'s steps: the graph's slope there is 0
    _, dz = Modifiers(mod).scores(z, *grids, np.float64)
    step = 1e-6
    plus, _ = Modifiers(mod).scores(z + step, *grids, np.float64)
    minus, _ = Modifiers(mod).scores(z - step, *grids, np.float64)
    numeric = (plus - minus) / (2 * step)
    smooth = np.abs(np.floor(z + step) - np.floor(z - step)) == 0  # floor does not jump here
    smooth &= np.abs(z - 2.0) > 2 * step  # nor does minimum(score, 2)
    np.testing.assert_allclose(dz[smooth], numeric[smooth], rtol=1e-5, atol=1e-6)


def test_a_bias_has_no_derivative_to_apply():
    assert not ScoreMod(zoo.relative_bias, table=TABLE).has_grad
    assert not ScoreMod(zoo.alibi, slopes=np.ones(3, np.float32)).has_grad
    assert ScoreMod(zoo.tanh_cap).has_grad


@pytest.mark.parametrize("fn, message", [
    (lambda score, b, h, q_idx, kv_idx: score if q_idx > kv_idx else -score, "where"),
    (lambda score, b, h, q_idx, kv_idx: score * (q_idx > 0 and kv_idx > 0), "&"),
    (lambda score, b, h, q_idx, kv_idx: score * int(q_idx), "index"),
    (lambda score, b, h, q_idx, kv_idx: q_idx > kv_idx, "condition"),
    (lambda score, b, h, q_idx: score, "score, b, h, q_idx, kv_idx"),
    (lambda score, b, h, q_idx, kv_idx: score + np.cumsum(score), "not supported"),
])
def test_tracing_errors_say_what_to_write(fn, message):
    with pytest.raises(ModifierError, match=message):
        ScoreMod(fn)


def test_mask_errors():
    with pytest.raises(ModifierError, match="condition"):
        MaskMod(lambda b, h, q_idx, kv_idx: q_idx - kv_idx)
    with pytest.raises(ModifierError, match="missing"):
        MaskMod(zoo.documents, doc_q=IDS)
    with pytest.raises(ModifierError, match="not parameters"):
        MaskMod(zoo.causal, doc=IDS)
    with pytest.raises(ModifierError, match="2 dimension"):
        MaskMod(lambda b, h, q_idx, kv_idx, ids: ids[q_idx] == 0, ids=IDS)
    with pytest.raises(ModifierError, match="integers"):
        MaskMod(lambda b, h, q_idx, kv_idx, ids: ids[b, q_idx / 2] == 0, ids=IDS)
    with pytest.raises(ModifierError, match="dtype"):
        MaskMod(lambda b, h, q_idx, kv_idx, ids: ids[b, q_idx] == 0, ids=IDS.astype(np.float16))


def test_reads_outside_a_tensor_are_reported_by_the_numpy_form():
    mod = MaskMod(lambda b, h, q_idx, kv_idx, ids: ids[b, q_idx + 5] == 0, ids=IDS)
    with pytest.raises(IndexError, match=r"ids\[2, 20\].*dimension 1"):
        Modifiers(None, M._MaskOnly(mod)).visible(*index_grids(2, 1, 20, 20))


def test_the_hash_names_the_code():
    """Same code, same name (a second process reuses the kernel); new constants or tensor types,
    a new name; new tensor values, the same name (they are run-time arguments)."""
    def bias(c):
        return lambda score, b, h, q_idx, kv_idx, table: score * c + table[h, q_idx]
    name = lambda mod: Modifiers(mod).name  # noqa: E731
    assert name(ScoreMod(bias(2.0), table=TABLE)) == name(ScoreMod(bias(2.0), table=TABLE * 3))
    assert name(ScoreMod(bias(2.0), table=TABLE)) != name(ScoreMod(bias(3.0), table=TABLE))
    assert name(ScoreMod(bias(2.0), table=TABLE)) != name(ScoreMod(bias(2.0), table=TABLE.astype(np.float64)))
    assert Modifiers(ScoreMod(bias(2.0), table=TABLE)).name.startswith("mod_")


# --- the generated CUDA under NVRTC ----------------------------------------------------------------

@needs_nvrtc
@pytest.mark.parametrize("dtype", ["float", "double"])
def test_generated_code_compiles(dtype):
    """Every operation's CUDA text, in a kernel that calls score() and mask() (sm_80)."""
    from cupyflash.kernels import compile_check
    from cupyflash.kernels._module import kernel_source

    mods = Modifiers(ScoreMod(every_op, table=TABLE, ids=IDS), M._MaskOnly(MaskMod(zoo.documents, doc_q=IDS, doc_k=IDS)))
    text = kernel_source("score.cuh") + mods.cuda + f"""
extern "C" __global__ void probe(cf::ModArgs t, {dtype}* out) {{
    {dtype} d;
    out[threadIdx.x] = {mods.cpp}::score<{dtype}>({dtype}(threadIdx.x), 0, 1, threadIdx.x, 3, t, d) + d
                       + {mods.cpp}::mask(0, 1, threadIdx.x, 3, t);
}}
"""
    compile_check.compile_text(text, "probe.cu", [], "80")


# --- the block map --------------------------------------------------------------------------------

def dense_visible(mask_mod, batch, nheads, seqlen_q, seqlen_k):
    """(batch, nheads, seqlen_q, seqlen_k) from the user's function on NumPy arrays."""
    grids = [g.astype(np.int64) for g in index_grids(batch, nheads, seqlen_q, seqlen_k)]
    tensors = {t.name: np.asarray(t.array) for t in mask_mod.tensors}
    return np.broadcast_to(mask_mod.fn(*grids, **tensors), (batch, nheads, seqlen_q, seqlen_k))


def exact_ranges(visible, granule):
    """Per (b, h, query granule): [first, end) key granules holding a visible pair (brute force)."""
    b, h, sq, sk = visible.shape
    out = np.zeros((b, h, -(-sq // granule), 2), np.int64)
    for r in range(out.shape[2]):
        rows = visible[:, :, r * granule:(r + 1) * granule].any(axis=2)  # (b, h, sk)
        for i in np.ndindex(b, h):
            cols = np.flatnonzero(rows[i]) // granule
            out[i + (r,)] = (cols.min(), cols.max() + 1) if cols.size else (-(-sk // granule), 0)
    return out


def host_map_and_visible(sizes, mask, seed):
    """The host-made BlockMask of zoo mask ``mask`` for (batch, nheads, seqlen_q, seqlen_k) and the
    mask's dense (batch, nheads, seqlen_q, seqlen_k) visibility."""
    batch, nheads, seqlen_q, seqlen_k = sizes
    problem = replace(next_problem(), batch=batch, nheads_kv=nheads, group=1, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
    mask_mod = make_mask_mod(mask, problem, seed)
    return (BlockMask(mask_mod, batch, nheads, seqlen_q, seqlen_k, device="cpu"),
            dense_visible(mask_mod, batch, nheads, seqlen_q, seqlen_k))


def assert_both_axes(exact, visible, granule, by_query_granule, by_key_granule):
    """The map's table per query granule equals ``exact`` of the visibility, its table per key
    granule ``exact`` of the transpose; returns both brute-force tables."""
    rows, cols = exact(visible, granule), exact(np.swapaxes(visible, 2, 3), granule)
    np.testing.assert_array_equal(np.broadcast_to(by_query_granule, rows.shape), rows)
    np.testing.assert_array_equal(np.broadcast_to(by_key_granule, cols.shape), cols)
    return rows, cols


problem_sizes = st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(0, 70), st.integers(0, 70))


@given(sizes=problem_sizes, mask=st.sampled_from(MASKS), seed=st.integers(0, 2**32 - 1),
       block=st.sampled_from([16, 32, 48, 64, 128]))
def test_block_map_against_brute_force(sizes, mask, seed, block):
    """The map's ranges are the brute-force ranges of the mask, and the ranges a kernel reads for
    any block (mask.cuh's WithScore: one entry at the block's first granule, one at its last, of
    the folded tables) hold every visible pair of the block: exactly the pairs' own range for
    masks whose keys move forward with the query."""
    batch, nheads, seqlen_q, seqlen_k = sizes
    bm, visible = host_map_and_visible(sizes, mask, seed)
    G = bm.GRANULE
    full, exact_t = assert_both_axes(exact_ranges, visible, G, bm.key_ranges, bm.query_ranges)
    key, query = bm.tables(1, np)
    key, query = np.broadcast_to(key[..., :2], full.shape), np.broadcast_to(query[..., :2], exact_t.shape)
    monotone = mask in ("causal", "sliding_window", "documents", "prefix_lm", "per_head_window")
    for m0 in range(0, seqlen_q, block):
        rows = visible[:, :, m0:m0 + block]
        first, end = key[:, :, m0 // G, 0] * G, key[:, :, (min(m0 + block, seqlen_q) - 1) // G, 1] * G
        for i in np.ndindex(batch, nheads):
            cols = np.flatnonzero(rows[i].any(axis=0))
            if cols.size:
                assert first[i] <= cols.min() and cols.max() < end[i], (i, m0)
                if monotone and mask != "documents" or mask == "documents" and seqlen_q == seqlen_k:
                    assert first[i] == cols.min() // G * G and end[i] == min(-(-(cols.max() + 1) // G) * G,
                                                                                -(-seqlen_k // G) * G)
    for n0 in range(0, seqlen_k, block):
        cols = visible[:, :, :, n0:n0 + block]
        first, end = query[:, :, n0 // G, 0] * G, query[:, :, (min(n0 + block, seqlen_k) - 1) // G, 1] * G
        for i in np.ndindex(batch, nheads):
            qs = np.flatnonzero(cols[i].any(axis=1))
            if qs.size:
                assert first[i] <= qs.min() and qs.max() < end[i], (i, n0)


def exact_runs(visible, granule):
    """Per (b, h, query granule): the longest run [first, end) of key granules whose every pair is
    visible (pairs past the ends count as visible), the first of equal length, [0, 0) for none
    (brute force, a plain loop)."""
    b, h, sq, sk = visible.shape
    rg, cg = -(-sq // granule), -(-sk // granule)
    padded = np.ones((b, h, rg * granule, cg * granule), bool)
    padded[:, :, :sq, :sk] = visible
    out = np.zeros((b, h, rg, 2), np.int64)
    for i in np.ndindex(b, h):
        for r in range(rg):
            best, start = (0, 0), None
            for c in range(cg + 1):
                whole = c < cg and padded[i][r * granule:(r + 1) * granule, c * granule:(c + 1) * granule].all()
                if whole and start is None:
                    start = c
                if not whole and start is not None:
                    if c - start > best[1] - best[0]:
                        best = (start, c)
                    start = None
            out[i + (r,)] = best
    return out


def block_held_whole(table, fixed0, fixed_count, lo, count, granule):
    """mask.cuh's WithScore::map_full on a kernel table (visible range, then a run per level): an
    aligned tile of 2^k granules reads level k's run at its first granule, which must hold
    [lo, lo + count); other tiles are never held whole."""
    level = (fixed_count // granule).bit_length() - 1
    if fixed_count % granule or fixed_count // granule != 1 << level or level >= M.MAP_LEVELS or fixed0 % fixed_count:
        return False
    first, end = table[fixed0 // granule, 2 + 2 * level:4 + 2 * level]
    return lo >= first * granule and lo + count <= end * granule


@given(sizes=problem_sizes, mask=st.sampled_from(MASKS), seed=st.integers(0, 2**32 - 1),
       block=st.sampled_from([16, 32, 64, 128]))
def test_block_map_runs_against_brute_force(sizes, mask, seed, block):
    """The whole runs are the brute-force longest runs, and a kernel block that they hold whole
    (read along either axis, as a query CTA and a key CTA read them) keeps every pair: the kernels
    skip the predicate there, so a wrong run would be a wrong answer."""
    batch, nheads, seqlen_q, seqlen_k = sizes
    bm, visible = host_map_and_visible(sizes, mask, seed)
    G = bm.GRANULE
    runs, runs_t = assert_both_axes(exact_runs, visible, G, bm.key_runs, bm.query_runs)
    key, query = bm.tables(1, np)
    key = np.broadcast_to(key, runs.shape[:3] + key.shape[-1:])
    query = np.broadcast_to(query, runs_t.shape[:3] + query.shape[-1:])
    whole_blocks = 0
    for m0 in range(0, seqlen_q - block + 1, block):  # blocks inside the sequence: the band takes the rest
        for n0 in range(0, seqlen_k - block + 1, block):
            for i in np.ndindex(batch, nheads):
                by_queries = block_held_whole(key[i], m0, block, n0, block, G)
                by_keys = block_held_whole(query[i], n0, block, m0, block, G)
                kept = visible[i][m0:m0 + block, n0:n0 + block].all()
                assert not by_queries or kept, (i, m0, n0)
                assert not by_keys or kept, (i, m0, n0)
                whole_blocks += by_queries
    if mask == "documents" and seqlen_q == seqlen_k and block == 16:
        # granule-sized blocks: every whole one is held (the runs are the documents, one each)
        assert whole_blocks == sum(visible[i][m:m + 16, n:n + 16].all() for i in np.ndindex(batch, nheads)
                                   for m in range(0, seqlen_q - 15, 16) for n in range(0, seqlen_k - 15, 16))


def next_problem():
    return cf.testing.AttentionProblem(batch=1, seqlen_q=1, seqlen_k=1, nheads_kv=1, group=1, headdim=8, causal=False,
                                       softmax_scale=None, magnitude=1.0, dtype=np.float32, seed=0)


def test_block_map_of_a_mask_that_reads_no_batch_or_head_is_one_map():
    bm = BlockMask(zoo.causal, 3, 4, 40, 40, device="cpu")
    assert bm.key_ranges.shape[:2] == (1, 1)
    with pytest.raises(ModifierError, match="reads h"):
        BlockMask(MaskMod(zoo.per_head_window, width=np.ones(4, np.int32)), 3, None, 40, 40, device="cpu")


def test_block_map_query_table_is_a_union_over_each_gqa_group():
    width = np.array([0, 20, 3, 40], np.int32)
    bm = BlockMask(MaskMod(zoo.per_head_window, width=width), 1, 4, 64, 64, device="cpu")
    _, query = bm.tables(2, np)
    _, per_head = bm.tables(1, np)
    assert query.shape[1] == 2
    np.testing.assert_array_equal(query[:, 0, :, 0], per_head[:, :2, :, 0].min(axis=1))
    np.testing.assert_array_equal(query[:, 1, :, 1], per_head[:, 2:, :, 1].max(axis=1))
    # the whole runs: the intersection over the group (a key CTA serves every head of it)
    width = np.array([20, 40, 33, 60], np.int32)
    bm = BlockMask(MaskMod(zoo.per_head_window, width=width), 1, 4, 128, 128, device="cpu")
    _, query = bm.tables(2, np)
    _, per_head = bm.tables(1, np)
    np.testing.assert_array_equal(query[:, 0, :, 2], per_head[:, :2, :, 2].max(axis=1))
    np.testing.assert_array_equal(query[:, 1, :, 3],
                                  np.maximum(per_head[:, 2:, :, 3].min(axis=1), per_head[:, 2:, :, 2].max(axis=1)))
    assert (query[..., 3] > query[..., 2]).any()  # some run survives the intersection
    # level k: the intersection over aligned groups of 2^k granules, at every granule of the group
    for table in (query, per_head):
        for k in range(1, M.MAP_LEVELS):
            for g in range(table.shape[2]):
                group = table[..., g >> k << k:(g >> k << k) + (1 << k), 2:4]
                first = group[..., 0].max(axis=-1)
                np.testing.assert_array_equal(table[..., g, 2 + 2 * k], first)
                np.testing.assert_array_equal(table[..., g, 3 + 2 * k], np.maximum(group[..., 1].min(axis=-1), first))


def test_block_mask_for_another_shape_is_refused():
    bm = cf.create_block_mask(zoo.causal, None, None, 32, 32, device="cpu")
    q = np.ones((1, 33, 1, 8), np.float32)
    with pytest.raises(ValueError, match="block_mask was made for"):
        cf.flash_attn_func(q, q, q, block_mask=bm, backend="numpy")


# --- the reference, the twin and the API ------------------------------------------------------------

twin_problems = attention_problems(dtypes=["float32", "float64", "bfloat16"], max_seqlen=90, max_cost=3e6, windows=True)


def variant_of(score_mod, mask_mod, problem, xp=np):
    mods = M.check_modifiers(score_mod, mask_mod, None, batch=problem.batch, nheads=problem.nheads,
                             seqlen_q=problem.seqlen_q, seqlen_k=problem.seqlen_k, on_gpu=False)
    return Variant(mods=mods).to(xp)


@settings(max_examples=40)
@given(problem=twin_problems, block_m=st.sampled_from([16, 48, 64, 128]), block_n=st.sampled_from([16, 32, 80]),
       data=st.data())
def test_twin_matches_reference(problem, block_m, block_n, data):
    score_mod, mask_mod = data.draw(modifiers_for(problem), label="modifiers")
    variant = variant_of(score_mod, mask_mod, problem)
    q, k, v, do = problem.arrays()
    opts = dict(softmax_scale=problem.scale, causal=problem.causal, window_size=problem.window_size)
    o, lse = numpy_backend.forward(q, k, v, **opts, variant=variant, block_m=block_m, block_n=block_n)
    grads = numpy_backend.backward(do, q, k, v, o, lse, **opts, variant=variant, block_m=block_m, block_n=block_n)
    cf.testing.assert_attention_close(problem, o, lse, grads, variant={"score_mod": score_mod, "mask_mod": mask_mod})


@settings(max_examples=15)
@given(problem=attention_problems(dtypes=["float64"], max_seqlen=6, max_cost=400, max_headdim=4), data=st.data())
def test_reference_backward_matches_finite_differences(problem, data):
    from brute_force import numerical_gradient

    score_mod, mask_mod = data.draw(modifiers_for(problem), label="modifiers")
    q, k, v, do = problem.arrays()
    opts = dict(problem.kwargs, score_mod=score_mod, mask_mod=mask_mod)

    def loss():
        return float(np.sum(do * reference.attention(q, k, v, **opts)[0]))

    for name, x, grad in zip(("dq", "dk", "dv"), (q, k, v), reference.attention_backward(do, q, k, v, **opts)):
        np.testing.assert_allclose(grad, numerical_gradient(loss, x), rtol=1e-5, atol=1e-7, err_msg=name)


@settings(max_examples=20)
@given(problem=attention_problems(dtypes=["float64"], max_seqlen=20, max_cost=20_000, windows=True), data=st.data())
def test_reference_against_its_definition(problem, data):
    """The reference with modifiers equals the softmax written out here, pair by pair."""
    score_mod, mask_mod = data.draw(modifiers_for(problem), label="modifiers")
    q, k, v, _ = problem.arrays()
    o, lse = reference.attention(q, k, v, **problem.kwargs, score_mod=score_mod, mask_mod=mask_mod)
    group = problem.group
    band = reference.visible_keys(problem.seqlen_q, problem.seqlen_k, problem.causal, problem.window_size)
    tensors = lambda mod: {t.name: np.asarray(t.array) for t in mod.tensors}  # noqa: E731
    for b, h, i in (tuple(np.int64(x) for x in idx) for idx in np.ndindex(problem.batch, problem.nheads,
                                                                          problem.seqlen_q)):
        zs, vs = [], []  # int64 indices, as the reference's: float32 tensor values promote to float64
        for j in (np.int64(x) for x in range(problem.seqlen_k)):
            if not band[i, j] or (mask_mod is not None and not mask_mod.fn(b, h, i, j, **tensors(mask_mod))):
                continue
            z = problem.scale * float(q[b, i, h] @ k[b, j, h // group])
            if score_mod is not None:
                z = float(score_mod.fn(np.float64(z), b, h, i, j, **tensors(score_mod)))
            zs.append(z)
            vs.append(v[b, j, h // group])
        if not zs:
            assert lse[b, h, i] == -np.inf and not o[b, i, h].any()
            continue
        top = max(zs)
        weights = np.exp(np.array(zs) - top)
        np.testing.assert_allclose(lse[b, h, i], top + math.log(weights.sum()), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(o[b, i, h], weights @ np.array(vs) / weights.sum(), rtol=1e-10, atol=1e-12)


def test_causal_by_mask_mod_is_causal_bitwise():
    """A mask_mod equal to causal=True gives causal's result bit for bit (the twin: the same
    blocks, the scores untouched where the mask keeps them)."""
    problem = replace(next_problem(), batch=2, nheads_kv=2, group=2, seqlen_q=77, seqlen_k=77, headdim=24, seed=3,
                      dtype=np.dtype(ml_dtypes.bfloat16))
    q, k, v, do = problem.arrays()
    o_c, lse_c = cf.flash_attn_func(q, k, v, causal=True, return_lse=True, backend="numpy")
    o_m, lse_m = cf.flash_attn_func(q, k, v, mask_mod=zoo.causal, return_lse=True, backend="numpy")
    assert np.array_equal(o_c.view(np.uint16), o_m.view(np.uint16)) and np.array_equal(lse_c, lse_m)
    g_c = cf.flash_attn_backward(do, q, k, v, o_c, lse_c, causal=True, backend="numpy")
    g_m = cf.flash_attn_backward(do, q, k, v, o_m, lse_m, mask_mod=zoo.causal, backend="numpy")
    for a, b in zip(g_c, g_m):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_alibi_by_score_mod_is_alibi_slopes():
    problem = replace(next_problem(), batch=2, nheads_kv=3, group=1, seqlen_q=50, seqlen_k=50, headdim=16, seed=4)
    q, k, v, do = problem.arrays()
    slopes = np.array([0.5, 0.25, 0.125], np.float32)
    o_a = cf.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, backend="numpy")
    o_s = cf.flash_attn_func(q, k, v, causal=True, score_mod=cf.ScoreMod(zoo.alibi, slopes=slopes), backend="numpy")
    np.testing.assert_allclose(o_s, o_a, rtol=2e-6, atol=2e-6)


def test_api_refusals():
    q = np.ones((1, 8, 2, 8), np.float32)
    with pytest.raises(ValueError, match="does not combine with softcap"):
        cf.flash_attn_func(q, q, q, softcap=5.0, score_mod=zoo.tanh_cap, backend="numpy")
    with pytest.raises(ModifierError, match="pass it as mask_mod"):
        cf.flash_attn_func(q, q, q, score_mod=cf.MaskMod(zoo.causal), backend="numpy")
    with pytest.raises(ValueError, match="differ"):
        cf.flash_attn_func(q, q, q, mask_mod=zoo.prefix_lm, block_mask=cf.create_block_mask(zoo.causal, 1, 2, 8, 8,
                                                                                              device="cpu"),
                           backend="numpy")


def test_vjp_makes_the_block_map_once():
    problem = replace(next_problem(), batch=1, nheads_kv=2, group=1, seqlen_q=40, seqlen_k=40, headdim=8, seed=5)
    q, k, v, do = problem.arrays()
    o, vjp = cf.flash_attn_vjp(q, k, v, mask_mod=zoo.sliding_window, score_mod=zoo.tanh_cap, backend="numpy")
    grads = vjp(do)
    cf.testing.assert_attention_close(problem, o, None, grads,
                                      variant={"score_mod": zoo.tanh_cap, "mask_mod": zoo.sliding_window})


def test_the_fuzzer_finds_a_wrong_modifier():
    """cupyflash.testing.modifiers: passes on the twin, and fails where the reference and the
    kernels disagree (a mask whose traced form, q_idx >= kv_idx, is not its NumPy form, q_idx > kv_idx)."""
    fuzz_modifier(score_mod=lambda problem: make_score_mod("relative_bias", problem, 0), dtypes=["float32"],
                  max_seqlen=40, max_examples=5, backend="numpy", seed=1)

    def wrong(b, h, q_idx, kv_idx):
        return M.where(q_idx >= kv_idx, True, False) if isinstance(q_idx, M.Expr) else q_idx > kv_idx

    with pytest.raises(AssertionError):
        check_modifier(replace(next_problem(), seqlen_q=20, seqlen_k=20, headdim=8, seed=2), None, wrong, backend="numpy")


# --- cupyflash.torch ---------------------------------------------------------------------------------

def test_torch_passes_the_modifiers_through_with_autograd():
    torch = pytest.importorskip("torch")
    from cupyflash.torch import flash_attn_func as torch_attention

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=generator, dtype=torch.float64).requires_grad_()
               for s in [(2, 30, 4, 8), (2, 30, 2, 8), (2, 30, 2, 8)])
    sink = torch.randn(4, generator=generator, dtype=torch.float64).float().requires_grad_()
    table = torch.randn(4, 2 * zoo.MAX_DISTANCE + 1, generator=generator).float()
    score_mod = cf.ScoreMod(zoo.relative_bias, table=table)
    o = torch_attention(q, k, v, causal=True, score_mod=score_mod, mask_mod=zoo.sliding_window, sink=sink)
    do = torch.randn(o.shape, generator=generator, dtype=torch.float64)
    dq, dk, dv, dsink = torch.autograd.grad(o, (q, k, v, sink), do)
    arrays = [x.detach().numpy() for x in (q, k, v)]
    ref = dict(causal=True, score_mod=cf.ScoreMod(zoo.relative_bias, table=table.numpy()), mask_mod=zoo.sliding_window,
               sink=sink.detach().numpy())
    np.testing.assert_allclose(o.detach().numpy(), reference.attention(*arrays, **ref)[0], rtol=1e-10, atol=1e-10)
    grads = reference.attention_backward(do.numpy(), *arrays, **ref)
    for name, got, want in zip(("dq", "dk", "dv", "dsink"), (dq, dk, dv, dsink), grads):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6, err_msg=name)  # dsink is float32
    with pytest.raises(ValueError, match="softcap"):
        torch_attention(q, k, v, softcap=3.0, score_mod=zoo.tanh_cap)


@needs_nvrtc
def test_nvrtc_names_the_users_lines(monkeypatch):
    """The generated CUDA carries #line directives of the user's function: an error NVRTC finds in
    it (here a literal broken on purpose) is reported at the Python line that wrote it. The
    directives do not enter the name (moving a function keeps its kernels)."""
    from cupyflash.kernels import compile_check
    from cupyflash.kernels._module import kernel_source

    def scaled(score, b, h, q_idx, kv_idx):
        shifted = score - 1.25
        return shifted * 3.5  # the line NVRTC must name

    line = scaled.__code__.co_firstlineno + 2
    mods = Modifiers(ScoreMod(scaled))
    assert f'#line {line} "{__file__}"' in mods.cuda
    # the same function written elsewhere: other #line directives, the same name
    namespace = {"M": M}
    exec(compile("\n" * 40 + "def scaled(score, b, h, q_idx, kv_idx):\n    return (score - 1.25) * 3.5\n",
                 "elsewhere.py", "exec"), namespace)
    moved = Modifiers(ScoreMod(namespace["scaled"]))
    assert '"elsewhere.py"' in moved.cuda and moved.name == mods.name
    real = M._float_literal
    monkeypatch.setattr(M, "_float_literal", lambda x: "A(3.5 +)" if x == 3.5 else real(x))
    broken = Modifiers(ScoreMod(scaled))
    text = kernel_source("score.cuh") + broken.cuda + f"""
extern "C" __global__ void probe(cf::ModArgs t, float* out) {{
    float d;
    out[0] = {broken.cpp}::score<float>(1.f, 0, 0, 0, 0, t, d);
}}
"""
    with pytest.raises(RuntimeError) as error:
        compile_check.compile_text(text, "probe.cu", [], "80")
    assert f'{__file__}({line})' in str(error.value) or f'{__file__}:{line}' in str(error.value), str(error.value)[:2000]


@needs_nvrtc
def test_kernel_report_names_the_planned_kernels():
    """kernel_report: for each arch the plans' forward, dK/dV and dQ kernels with the modifier, and
    ptxas's registers (compiled on CPU)."""
    from cupyflash import backward_plans, plans
    from cupyflash.masks import mask_for
    from cupyflash.scores import Score

    report = M.kernel_report(score_mod=zoo.tanh_cap, mask_mod=zoo.causal, headdim=64, archs=("90",))
    mods = M.check_modifiers(zoo.tanh_cap, zoo.causal, None, batch=1, nheads=1, seqlen_q=1, seqlen_k=1, on_gpu=False)
    mask = mask_for(False, (-1, -1), Score(user=mods))
    planned = [plans.plan_forward("90", "bfloat16", 64, mask, 232448).spec.name]
    planned += [launch.spec.name for launch in backward_plans.plan_backward("90", "bfloat16", 64, mask.backward(), 232448,
                                                                           True).launches if launch.role in ("dkdv", "dq")]
    assert [row["name"] for row in report] == planned and [row["role"] for row in report] == ["fwd", "dkdv", "dq"]
    assert all(row["registers"] > 0 and row["spill_bytes"] == 0 for row in report)


# --- fast math (perf log modifier-fast-math) ---------------------------------------------------------

def _softcap_mods(cap: float = 30.0) -> Modifiers:
    return Modifiers(ScoreMod(lambda score, b, h, q_idx, kv_idx: cap * M.tanh(score / cap)))


def test_fast_math_is_a_struct_of_its_own_where_there_is_fast_math():
    """with_fast_math: another struct (FAST_MATH true, its own hash), the same tensors; a score with
    no division or function has no fast form, nor has a mask alone."""
    mods = _softcap_mods()
    fast = mods.with_fast_math()
    assert mods.has_fast_forms and fast.name != mods.name
    assert "FAST_MATH = true" in fast.cuda and "FAST_MATH = false" in mods.cuda
    assert "cf::mod_div<FAST>(" in mods.cuda and "cf::mod_tanh<FAST>(" in mods.cuda
    assert fast.to(np).name == fast.name and fast.for_sequence(3).fast_math
    bias = Modifiers(ScoreMod(lambda score, b, h, q_idx, kv_idx: score + 0.5 * (kv_idx - q_idx)))
    assert not bias.has_fast_forms
    # a modifier that reads tensors keeps accurate math (the example's fast form spilled)
    table = Modifiers(ScoreMod(lambda score, b, h, q_idx, kv_idx, t: score / (1.0 + t[h]),
                               t=np.ones(4, np.float32)))
    assert "<FAST>(" in table.cuda and not table.has_fast_forms and not M.example_modifiers().has_fast_forms
    assert not Modifiers(None, M._MaskOnly(MaskMod(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx))).has_fast_forms
    # a mask's predicate keeps accurate math even in a fast struct
    example = M.example_modifiers().with_fast_math()
    mask_body = example.cuda.split("static bool mask(", 1)[1]
    assert "<FAST>(" not in mask_body


@needs_nvrtc
def test_plans_keep_fast_math_in_the_producer_kernels_where_it_does_not_spill():
    """sm_90, bf16, d128, causal: the score_mod softcap's forward and both backward kernels (the
    producer kernels, FAST_MODS) take its fast-math struct; the compile check's example modifier,
    which reads tensors (its fast code spilled there), keeps the accurate struct on the same
    kernels; the float32 and mma.sync kernels never take a fast struct."""
    from cupyflash import backward_plans, plans
    from cupyflash._dtypes import SUPPORTED
    from cupyflash.masks import mask_for
    from cupyflash.scores import Score

    for mods, fast in ((_softcap_mods(), True), (M.example_modifiers(), False)):
        mask = mask_for(True, (-1, -1), Score(user=mods))
        want = (mods.with_fast_math() if fast else mods).name
        forward = plans.plan_forward("90", SUPPORTED["bfloat16"], 128, mask, 232448)
        assert forward.kernel == "flash_fwd_wgmma_ws" and want in forward.spec.name, forward.spec.name
        backward = backward_plans.plan_backward("90", SUPPORTED["bfloat16"], 128, mask.backward(), 232448, True)
        kernels = {launch.role: launch.spec.name for launch in backward.launches if launch.role in ("dkdv", "dq")}
        assert kernels["dkdv"].startswith("flash_bwd_wgmma_ws_") and kernels["dq"].startswith("flash_bwd_dq_wgmma_ws_")
        assert all(want in name for name in kernels.values()), kernels
    mask = mask_for(True, (-1, -1), Score(user=_softcap_mods()))
    for arch, dtype in (("80", "bfloat16"), ("90", "float32")):
        spec = plans.plan_forward(arch, SUPPORTED[dtype], 128, mask, 232448).spec
        assert _softcap_mods().name in spec.name, spec.name

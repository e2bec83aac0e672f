#!/usr/bin/env bash
# The GPU checks of a change, in parts that each fit a 10-minute call on one GPU. A call brings
# back at most 8 files: end its command with scripts/bundle_out.sh $OUT (a summary and one archive).
#   scripts/gpu_check.sh OUTDIR tests   every kernel compiled into CuPy's cache on all cores, then
#                                       the GPU test suite as concurrent shards (HYPOTHESIS_PROFILE,
#                                       default gpu: 200 examples per property; logs, JUnit XML)
#   scripts/gpu_check.sh OUTDIR sanitize  memcheck on the full workload, racecheck on --quick
#   scripts/gpu_check.sh OUTDIR bench   the default-kernel bench before/after (BEFORE_TREE: an
#                                       exported older tree, optional), the bench table with the
#                                       SDPA anchors, and the window/FlexAttention variants
#   scripts/gpu_check.sh OUTDIR modifiers  the user modifiers' GPU tests, then their bench: softcap
#                                       and ALiBi as score_mods and a document mask against
#                                       FlexAttention at 8k, 8 documents of 2k against no mask at 16k
#   scripts/gpu_check.sh OUTDIR kvcache  the KV-cache kernel's tests (its kernels compiled first),
#                                       then the decode bandwidth table and plot against cuDNN / FA2,
#                                       and dev/decode_fixed_cost.py (fixed cost and rate per layout)
#   scripts/gpu_check.sh OUTDIR varlen   the packed kernels compiled, the varlen GPU tests, then the
#                                       varlen bench (FA2 on the padded batch, cupyflash dense)
#   scripts/gpu_check.sh OUTDIR capture  the no_host_sync / CUDA-graph tests, then the decode-loop
#                                       bench (32 layers: checked, no_host_sync, graph) and the
#                                       varlen bench (with device cu_seqlens unread)
#   scripts/gpu_check.sh OUTDIR paged    decode-v4 (the page-id ring): KVCACHE_PART=tests, the six GPU
#                                       test files that launch the KV-cache kernel; KVCACHE_PART=bench,
#                                       the decode table (20 repeats) and dev/decode_fixed_cost.py
#   scripts/gpu_check.sh OUTDIR recheck  the GPU tests the 2026-12-02 Python changes after its GPU runs
#                                       need (capture, torch, kv cache, varlen), the decode table and
#                                       the split sweep (contiguous and page 16)
#   scripts/gpu_check.sh OUTDIR headdim_v  v's own head dim: the kernels compiled, its GPU tests and
#                                       dropout's, the 192/128 bench against cuDNN / Flex (DV_IMPLS),
#                                       the 16k table with BENCH_16K=1
#   scripts/gpu_check.sh OUTDIR warm    every kernel compiled into CuPy's cache, alone in a call: run
#                                       it first, then suite with SUITE_PART=1, 2 and 3 right after
#   (any mode) SUITE_PATCHES="a+b": those dev/experiments patches applied to this copy first
#   scripts/gpu_check.sh OUTDIR suite   SUITE_PART=1, 2 or 3: the GPU test suite's three parts (3: the
#                                       ring's tests), shards and one summary file each
#                                       (scripts/gpu_suite_part.sh); SUITE_PART=all: the three
#                                       in one call (warm, they took 200 s together on 2026-12-05)
#   scripts/gpu_check.sh OUTDIR ncu     kernel by kernel, this tree against BEFORE_TREE (required):
#                                       time, registers, instructions of NCU_CASES, then the full
#                                       section set of NCU_FULL (ncu --clock-control none); a case is
#                                       scripts/ncu_workload.py's arguments ("128 16384 causal fwd
#                                       softcap=30": a variant against plain in one tree)
#   scripts/gpu_check.sh OUTDIR dmma    a DMMA backward change (float64, the tf32x3 experiment and the
#                                       tf32 wgmma candidates): DMMA_PART=tests, its kernels compiled
#                                       and its GPU tests; DMMA_PART=check, racecheck / memcheck of
#                                       dev/sanitize_dmma_bwd.py, dev/bench_dmma_bwd.py here and in
#                                       BEFORE_TREE (optional: an exported tree inside the checkout,
#                                       carried, e.g. .before; DMMA_F64=1 runs the float64 bench
#                                       without it), then its float32 run at d64 (the wgmma candidates)
#   scripts/gpu_check.sh OUTDIR dropout  tests/test_dropout_gpu.py (DROPOUT_TESTS=0: skipped), then
#                                       dropout's cost at 8k (d128, d64) in each of BEFORE_TREES (exported
#                                       trees inside the checkout, carried) and here, on one machine
#   scripts/gpu_check.sh OUTDIR tf32_pair  the float32 backward's d128 pair kernels (candidates):
#                                       their GPU tests, racecheck / memcheck, the d128 bench
#   scripts/gpu_check.sh OUTDIR tf32_wgmma  the tf32 wgmma forward candidates (flash_fwd_tf32_wgmma,
#                                       flash_fwd_tf32_wgmma_ws): dev/smoke_tf32_wgmma_ws.py, then
#                                       tests/test_tf32_wgmma_gpu.py (TF32_WGMMA_PART=tests), then
#                                       dev/bench_tf32_wgmma.py (TF32_BENCH_ARGS) and racecheck /
#                                       memcheck of dev/sanitize_tf32_wgmma.py (TF32_WGMMA_PART=bench;
#                                       =sanitize: the sanitizer alone, 280 s each)
#   scripts/gpu_check.sh OUTDIR measure  after the suite on its warm machine: MEASURE's parts (default
#                                       "varlen decode"; also dropout, tf32): the varlen bench, the
#                                       full decode table, dropout's cost at 8k, the tf32 candidates
#   scripts/gpu_check.sh OUTDIR properties  after warm: the property files of the default kernels and
#                                       of every variant (API, windows, v's head dim; variants, dropout,
#                                       modifiers: PROPERTIES_PART=1, 2) at the gpu profile, 200
#                                       examples a property (issues 15 and 16 ask it), shards
#   scripts/gpu_check.sh OUTDIR probes  where the time goes (perf log cta-timeline, no kernel change):
#                                       dev/cta_timeline.py's GPU tests, the bf16 16k backward CTA by
#                                       CTA with and without 8 documents, the float32 4k backward causal
#                                       and not, the 16k forward causal and with a window of 1024;
#                                       then ncu's stall reasons (--print-details all)
#                                       and instruction counts of the float32 dK/dV kernel, causal and not
#   scripts/gpu_check.sh OUTDIR varlen_timeline  issue 17's packed causal batch (the varlen bench's)
#                                       against one dense causal 16k sequence, CTA by CTA
#                                       (dev/cta_timeline.py varlen): d64 / d128, backward and forward
#   scripts/gpu_check.sh OUTDIR patch_ab  a float32 backward patch before / after on one machine: PATCH
#                                       (a dev/experiments name) applied to a copy of this tree, its GPU
#                                       tests there (PATCH_TESTS), then dev/bench_dmma_bwd.py's float32
#                                       d64 route (AB_CANDIDATES) in this tree and in the copy
#   scripts/gpu_check.sh OUTDIR window_tiles  the window forward's own tiles: Local kernels compiled,
#                                       the tuner's window sweep at 16k, the window / variant GPU
#                                       tests, the window bench at 16k (and at 8k with FlexAttention:
#                                       WINDOW_FLEX=1)
#   scripts/gpu_check.sh OUTDIR wgmma_ws  the producer / ping-pong forward candidates (wgmma-fwd-ws-v0):
#                                       dev/bench_wgmma_ws.py (compiled side by side, checked, timed
#                                       beside the plan), tests/test_wgmma_ws_gpu.py in shards, the
#                                       score variants at 8k (--variants), racecheck of
#                                       dev/sanitize_wgmma_ws.py
#   scripts/gpu_check.sh OUTDIR tf32    the float32 forward: its kernels compiled, tests/test_tf32_gpu.py,
#                                       the accumulation probe's candidates, the fp32 bench table, and
#                                       racecheck / memcheck --quick (the tf32 forward in their workload)
#   scripts/gpu_check.sh OUTDIR trees   experiment patches side by side: TREE_PATCHES names patches of
#                                       dev/experiments/ ("a+b": both in one tree), each applied to its
#                                       own copy (TREES_DIR/NAME); dev/bench_variant_trees.py compiles,
#                                       checks and times this tree and each copy on one machine; with
#                                       TREE_PICK=1 the fastest copy that passed, if it beats this tree
#                                       by TREE_MARGIN (default 0.03) in softcap's TREE_PICK_CONFIG
#                                       (default "ws s3 pp"; "api bwd": the backward), is applied here
#                                       and remembered; TREES_HEADDIM=64: the problems at d64
#   scripts/gpu_check.sh OUTDIR pair-probes  the twenty-fourth session's waiting list (perf log):
#                                       ncu of the producer backward with and without dropout,
#                                       tune of the forward's 64-key producer candidates (window and
#                                       causal) and of v13's pair under a window, the window rows
#                                       with window_bwd_pair.patch, and the variants bench with
#                                       the element-step patches (bwd_ds_guard_partial,
#                                       bwd_lse_base_producer)
#   scripts/gpu_check.sh OUTDIR picked  applies what trees picked again (each call gets a fresh copy
#                                       of the checkout; the choice lives in the kept .cupy-cache/)
# Before the device: `pytest tests/kernels/test_compile_check.py` on CPU (2 minutes) compiles every
# source file; a header change that only the wgmma kernels were compiled with once broke
# flash_bwd_preprocess.cu and cost a whole suite run (2026-12-04). On the device, a warm step that
# ends "N errors" (rc 1) names kernels that did not compile: stop there, the suite would fail too.
# Runs from the source tree without installing (PYTHONPATH), so two trees never mix. CuPy's kernel
# cache is the tree's own .cupy-cache (ignored by git, kept by the device between calls of one
# machine), so a second call on a warm machine loads what the first compiled: on a fresh machine
# the first part's shards spend most of their time in NVRTC.
set -uo pipefail
out=${1:?usage: gpu_check.sh OUTDIR tests|bench}
what=${2:?usage: gpu_check.sh OUTDIR tests|bench}
cd "$(dirname "$0")/.."
mkdir -p "$out"
out=$(cd "$out" && pwd)  # the dropout bench runs in other trees too
export PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/.cupy-cache}
status=0
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to OUTDIR/NAME.log
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "$name: rc $rc in $((SECONDS - t0)) s; $(grep -E '[0-9]+ (passed|failed)|^cupyflash|bench:|^warm_kernel_cache:' "$out/$name.log" | tail -1)"
    [ $rc -eq 0 ] || status=1
}
# Dropout's cost at 8k beside the plain kernels (bench.variants, cupyflash only, d128 and d64): in
# each exported tree of BEFORE_TREES (or BEFORE_TREE; each named by its folder) and then in this
# one ("after"), on one machine.
dropout_8k() {
    local d tree
    for d in 128 64; do
        for tree in ${BEFORE_TREES:-${BEFORE_TREE:-}} .; do
            local name=after
            [ "$tree" = . ] || name=$(basename "$tree")
            (cd "$tree" && PYTHONPATH=$PWD step "dropout-$name-8k-d$d" 150 python -m cupyflash.bench.variants \
                --seqlen 8192 --headdim "$d" --impls cupyflash --variants causal "causal dropout 0.1" full "dropout 0.1" \
                --json "$out/dropout-$name-8k-d$d.json"; exit $status) || status=1
        done
    done
}
# apply_patches "a+b": dev/experiments/a.patch then b.patch to the current folder, each only if it is
# not applied yet (the checkout may already hold what an earlier call picked)
apply_patches() {
    local name p
    for name in ${1//+/ }; do
        p=$root/dev/experiments/$name.patch
        if git apply -R --check "$p" 2>/dev/null || patch -p1 -R --dry-run -s -f < "$p" >/dev/null 2>&1; then
            echo "$name: already applied"
        else
            git apply "$p" 2>/dev/null || patch -p1 -s -f < "$p" || { echo "$name: does not apply"; return 1; }
        fi
    done
}
root=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > "$out/gpu.txt" 2>&1
# SUITE_PATCHES="a+b+...": dev/experiments patches applied to this call's copy of the checkout
# before any part runs (each only once: apply_patches), so that the warm step and every suite part
# of a run of calls test the same combined tree without a branch of it
# (stacked patches cannot each be checked in reverse once a later one is on: a marker says the set
# is on, for a second gpu_check.sh in the same call). The marker holds the set's names and the
# checksum of the files they touch as patched: the next device call copies the checkout afresh (the
# patched files come back as they are in it) but keeps the ignored marker, which then no longer
# matches, so the set is applied again.
patched_state() {
    local name files=""
    for name in ${1//+/ }; do
        files="$files $(sed -n 's|^+++ b/\([^[:space:]]*\).*|\1|p' "$root/dev/experiments/$name.patch")"
    done
    echo "$1 $(cat $(echo "$files" | tr ' ' '\n' | sort -u) 2>/dev/null | sha1sum | cut -c1-16)"
}
if [ -n "${SUITE_PATCHES:-}" ] && [ "$(cat .suite-patches 2>/dev/null)" != "$(patched_state "$SUITE_PATCHES")" ]; then
    apply_patches "$SUITE_PATCHES" > "$out/suite-patches.log" 2>&1 || { echo "SUITE_PATCHES did not apply"; exit 1; }
    patched_state "$SUITE_PATCHES" > .suite-patches
    git diff --stat >> "$out/suite-patches.log" 2>&1
fi
case $what in
tests)
    export PYTHONPATH=$PWD
    step warm-cache "${WARM_LIMIT:-240}" python scripts/warm_kernel_cache.py ${WARM_ZOO:+--zoo}
    step gpu-tests "${TEST_LIMIT:-420}" env HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-gpu}" \
        python scripts/pytest_shards.py --shards "${SHARDS:-12}" --limit "$(( ${TEST_LIMIT:-420} - 20 ))" \
        --out "$out/shards" -m gpu tests/
    ;;
sanitize)
    export PYTHONPATH=$PWD
    step memcheck "${MEMCHECK_LIMIT:-300}" python -m cupyflash sanitize --tool memcheck
    # racecheck --quick's 42 shapes did not finish in 240 s on 2026-12-05: the two families side by
    # side, each under its own limit
    pids=()
    for family in simt mma; do
        (step "racecheck-quick-$family" "${RACECHECK_LIMIT:-420}" python -m cupyflash sanitize --tool racecheck \
            --quick --family "$family"; exit $status) &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    ;;
bench)
    sweep=(--dtype bf16 --headdim 64 128 256 --seqlen 2k 16k --causal both --mode fwd bwd --no-validate --quiet)
    if [ -n "${BEFORE_TREE:-}" ]; then
        (cd "$BEFORE_TREE" && PYTHONPATH=$PWD step bench-before 150 \
            python -m cupyflash bench "${sweep[@]}" --no-torch --json "$out/bench-before.json")
    fi
    export PYTHONPATH=$PWD
    step bench-after 240 python -m cupyflash bench "${sweep[@]}" --anchors FA2 cuDNN \
        --json "$out/bench-after.json" --markdown "$out/bench-after.md"
    step variants-8k 200 python -m cupyflash.bench.variants --seqlen 8192 --json "$out/variants-8k.json" \
        --variants full causal "causal window 1024" "window (512, 512)" "causal softcap 30" "causal alibi" "causal sink"
    step variants-16k 120 python -m cupyflash.bench.variants --seqlen 16384 --impls cupyflash \
        --variants causal "causal window 1024" "window (512, 512)" --json "$out/variants-16k.json"
    ;;
modifiers)
    export PYTHONPATH=$PWD
    step warm-zoo "${WARM_LIMIT:-240}" python scripts/warm_kernel_cache.py --zoo --match _mod_
    step modifier-tests "${TEST_LIMIT:-300}" env HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-gpu}" \
        python scripts/pytest_shards.py --shards "${SHARDS:-8}" --limit "$(( ${TEST_LIMIT:-300} - 20 ))" \
        --out "$out/modifier-shards" -m gpu tests/test_modifiers_gpu.py tests/test_docs.py
    step modifiers-8k 150 python -m cupyflash.bench.variants --seqlen 8192 --json "$out/modifiers-8k.json" \
        --variants causal "causal softcap 30 (score_mod)" "causal alibi (score_mod)" "causal documents 2048"
    step documents-16k 120 python -m cupyflash.bench.variants --seqlen 16384 --impls cupyflash flex \
        --variants full "documents 2048" --json "$out/documents-16k.json"
    ;;
kvcache)
    export PYTHONPATH=$PWD
    step warm-kvcache "${WARM_LIMIT:-120}" python scripts/warm_kernel_cache.py --match 'kvcache|combine'
    step kvcache-tests "${TEST_LIMIT:-240}" env HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-gpu}" \
        python -m pytest -q -m gpu tests/test_kvcache_kernel_gpu.py tests/test_kvcache_gpu.py -p no:cacheprovider
    step decode 150 python -m cupyflash.bench.kvcache_decode --json "$out/decode.json" --plot "$out/decode.png"
    step decode-fixed-cost 150 python dev/decode_fixed_cost.py --json "$out/decode-fixed-cost.json"
    ;;
varlen)
    export PYTHONPATH=$PWD
    step warm-varlen "${WARM_LIMIT:-200}" python scripts/warm_kernel_cache.py --packed --match 'packed|preprocess|convert'
    step varlen-tests "${TEST_LIMIT:-300}" env HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-gpu}" \
        python scripts/pytest_shards.py --shards "${SHARDS:-6}" --limit "$(( ${TEST_LIMIT:-300} - 20 ))" \
        --out "$out/varlen-shards" -m gpu tests/test_varlen_gpu.py
    step varlen-bench 240 python -m cupyflash.bench.varlen --json "$out/varlen.json"
    ;;
pair-probes)  # the twenty-fourth session's waiting list (docs/perf-log.md): ncu of the producer
              # backward with and without dropout, the forward's 64-key producer candidates with a
              # (1024, 0) window and causal, the window backward on the producer pair (v13), and
              # the window rows in this tree and with window_bwd_pair.patch, alternated
    # PROBES: which of them (default "ncu tune guard window"; "dropout" on request; each part fits a
    # call of its own, warm). (varlen, the packed causal batch's A/B, ran in the twenty-eighth
    # session: v16.)
    export PYTHONPATH=$PWD
    probes=" ${PROBES:-ncu tune guard window} "
    [[ $probes == *" ncu "* ]] && for v in plain dropout=0.1; do
        a=; [ "$v" = plain ] || a=$v
        step "ncu-bwd-$v" "${NCU_LIMIT:-150}" ncu --clock-control none -k regex:'flash_bwd_(dq_)?wgmma_ws' \
            --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section InstructionStats \
            python scripts/ncu_workload.py 128 8192 causal bwd $a
    done
    # dropout: dropout-v8's mask at the gpu profile's 200 examples a property, then dropout 0.1 in
    # the d128 plan's kernel and in each forward candidate, the producer ones included (whether
    # ONE_ROLE_FORWARD_TILES still pays with sixteen elements a call)
    [[ $probes == *" dropout "* ]] && {
    step dropout-properties "${TEST_LIMIT:-240}" env HYPOTHESIS_PROFILE=gpu python -m pytest -q -m gpu \
        tests/test_dropout_gpu.py -p no:cacheprovider
    step dropout-forward-kernels 200 python dev/bench_wgmma_ws.py --variants
    }
    [[ $probes == *" tune "* ]] && {
    step tune-window-fwd 240 python -m cupyflash tune --headdim 128 --seqlen 8192 16384 --window 1024 0 \
        --only default cand
    step tune-causal-fwd 240 python -m cupyflash tune --headdim 128 --seqlen 8192 16384 --only default cand
    step tune-window-bwd 240 python -m cupyflash tune --direction bwd --headdim 128 --seqlen 8192 16384 \
        --window 1024 0 --only default v13
    }
    dir=${TREES_DIR:-/tmp/cupyflash-trees}
    # guard: the consumers' shorter element steps (bwd_ds_guard_partial.patch and
    # bwd_lse_base_producer.patch, "guard") against this tree; the variants bench's plain and dropout
    # rows at 8k d128 and causal at d64, the trees alternated three times (wgmma_desc_advance.patch
    # was timed in the twenty-fifth session: no gain)
    if [[ $probes == *" guard "* ]]; then
        name=bwd_ds_guard_partial+bwd_lse_base_producer
        rm -rf "${dir:?}/$name" && mkdir -p "$dir/$name"
        tar --exclude=./.trees --exclude=./.cupy-cache --exclude=./.git --exclude=./.venv --exclude=./docs/results \
            -cf - . | tar -xf - -C "$dir/$name"
        (cd "$dir/$name" && apply_patches "$name") > "$out/tree-guard.log" 2>&1 || status=1
        for r in 1 2 3; do
            for tree in . "$dir/$name"; do
                tag=main; [ "$tree" = . ] || tag=guard
                (cd "$tree" && PYTHONPATH=$PWD step "guard-$r-$tag-d128" 150 python -m cupyflash.bench.variants \
                    --seqlen 8192 --impls cupyflash --variants full causal "causal dropout 0.1" &&
                 PYTHONPATH=$PWD step "guard-$r-$tag-d64" 100 python -m cupyflash.bench.variants \
                    --seqlen 8192 --headdim 64 --impls cupyflash --variants causal; exit $status) || status=1
            done
        done
    fi
    # window: window-bwd-pair (dev/experiments/window_bwd_pair.patch: a window at d128 on the producer
    # pair, as varlen-bwd-pair moved the packed causal batch, v16) against this tree, the variants
    # bench's window rows beside causal at 16k, the trees alternated twice
    [[ $probes == *" window "* ]] || { echo "pair-probes: done"; exit $status; }
    rm -rf "${dir:?}/window_bwd_pair" && mkdir -p "$dir/window_bwd_pair"
    tar --exclude=./.trees --exclude=./.cupy-cache --exclude=./.git --exclude=./.venv --exclude=./docs/results \
        -cf - . | tar -xf - -C "$dir/window_bwd_pair"
    (cd "$dir/window_bwd_pair" && apply_patches window_bwd_pair) > "$out/tree-window_bwd_pair.log" 2>&1 || status=1
    for r in 1 2; do
        for tree in . "$dir/window_bwd_pair"; do
            name=main; [ "$tree" = . ] || name=pair
            (cd "$tree" && PYTHONPATH=$PWD step "window-ab-$r-$name" 150 python -m cupyflash.bench.variants \
                --seqlen 16384 --impls cupyflash --variants causal "causal window 1024" "window (512, 512)"; \
             exit $status) || status=1
        done
    done
    ;;
capture)
    export PYTHONPATH=$PWD
    step capture-tests "${TEST_LIMIT:-300}" env HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-gpu}" \
        python scripts/pytest_shards.py --shards "${SHARDS:-6}" --limit "$(( ${TEST_LIMIT:-300} - 20 ))" \
        --out "$out/capture-shards" -m gpu tests/test_capture_gpu.py
    step decode-loop 240 python -m cupyflash.bench.decode_loop --json "$out/decode-loop.json"
    step varlen-bench 240 python -m cupyflash.bench.varlen --json "$out/varlen.json"
    ;;
paged)  # decode-v4: the page-id ring's GPU tests (every file that launches the KV-cache kernel), then its speed
    export PYTHONPATH=$PWD
    if [ "${KVCACHE_PART:-tests}" = tests ]; then
        step warm-paged "${WARM_LIMIT:-150}" python scripts/warm_kernel_cache.py --match 'kvcache|combine|append'
        step paged-tests "${TEST_LIMIT:-400}" env HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-dev}" \
            python scripts/pytest_shards.py --shards "${SHARDS:-14}" --limit "$(( ${TEST_LIMIT:-400} - 20 ))" \
            --out "$out/paged-shards" -m gpu tests/test_kvcache_kernel_gpu.py tests/test_kvcache_gpu.py \
            tests/test_capture_gpu.py tests/test_decode_dispatch_gpu.py tests/test_headdim_v_gpu.py tests/test_torch_gpu.py
    else
        step decode 200 python -m cupyflash.bench.kvcache_decode --json "$out/decode.json" --plot "$out/decode.png"
        step decode-fixed-cost 200 python dev/decode_fixed_cost.py --json "$out/decode-fixed-cost.json"
    fi
    ;;
recheck)  # the GPU tests of the Python changes after the 2026-12-02 GPU runs, then the decode table
    export PYTHONPATH=$PWD
    step warm-recheck "${WARM_LIMIT:-200}" python scripts/warm_kernel_cache.py --packed --match 'kvcache|combine|append|packed|preprocess|convert'
    step recheck-tests "${TEST_LIMIT:-360}" env HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-dev}" \
        python scripts/pytest_shards.py --shards "${SHARDS:-14}" --limit "$(( ${TEST_LIMIT:-360} - 20 ))" \
        --out "$out/recheck-shards" -m gpu tests/test_capture_gpu.py tests/test_torch_gpu.py tests/test_kvcache_gpu.py \
        tests/test_kvcache_kernel_gpu.py tests/test_varlen_gpu.py
    step decode 150 python -m cupyflash.bench.kvcache_decode --json "$out/decode.json" --plot "$out/decode.png"
    step splits 150 python -m cupyflash.bench.kvcache_decode --splits
    ;;
headdim_v)  # v's own head dim: its GPU tests with dropout's, its bench against cuDNN and Flex, the 16k table
    export PYTHONPATH=$PWD
    step warm-cache "${WARM_LIMIT:-220}" python scripts/warm_kernel_cache.py --packed
    step headdim-v-tests "${TEST_LIMIT:-200}" env HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-gpu}" \
        python scripts/pytest_shards.py --shards "${SHARDS:-12}" --limit "$(( ${TEST_LIMIT:-200} - 20 ))" \
        --out "$out/headdim-v-shards" -m gpu tests/test_headdim_v_gpu.py tests/test_dropout_gpu.py
    step variants-dv 150 python -m cupyflash.bench.variants --seqlen 8192 --json "$out/variants-dv.json" \
        --impls ${DV_IMPLS:-cupyflash cudnn flex} --variants full causal "causal 192/128" "causal 192/192" "192/128"
    [ -n "${BENCH_16K:-}" ] && step bench-16k 150 python -m cupyflash bench --dtype bf16 --headdim 64 128 256 --seqlen 16k --causal both \
        --mode fwd bwd --no-validate --quiet --anchors FA2 cuDNN --json "$out/bench-16k.json" \
        --markdown "$out/bench-16k.md"
    ;;
dmma)  # a DMMA backward change: compile, tests, sanitizer, bench (before / after). All of it is
       # more than one 600 s call since the tf32 wgmma candidates: DMMA_PART=tests (compile, GPU
       # tests) or DMMA_PART=check (sanitizer, both benches) runs one half; unset, both.
    export PYTHONPATH=$PWD
    if [ "${DMMA_PART:-tests}" = tests ] || [ -z "${DMMA_PART:-}" ]; then
        step warm-dmma "${WARM_LIMIT:-200}" python scripts/warm_kernel_cache.py --packed --match 'dmma|preprocess|simt|tf32_wgmma'
        step dmma-tests "${TEST_LIMIT:-240}" env HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-dev}" \
            python scripts/pytest_shards.py --shards "${SHARDS:-14}" --limit "$(( ${TEST_LIMIT:-240} - 20 ))" \
            --out "$out/dmma-shards" -m gpu tests/kernels/test_flash_bwd_dmma.py tests/test_statistics_gpu.py
    fi
    if [ "${DMMA_PART:-check}" = check ] || [ -z "${DMMA_PART:-}" ]; then
        step racecheck-dmma 150 compute-sanitizer --tool racecheck --error-exitcode 1 python dev/sanitize_dmma_bwd.py
        step memcheck-dmma 120 compute-sanitizer --tool memcheck --error-exitcode 1 python dev/sanitize_dmma_bwd.py
        if [ -n "${BEFORE_TREE:-}" ]; then
            (cd "$BEFORE_TREE" && PYTHONPATH=$PWD step bench-dmma-before 120 \
                python dev/bench_dmma_bwd.py --repeats 3 --json "$out/bench-dmma-before.json")
        fi
        [ -n "${BEFORE_TREE:-}" ] || [ -n "${DMMA_F64:-}" ] && step bench-dmma-after 120 \
            python dev/bench_dmma_bwd.py --repeats 3 --json "$out/bench-dmma-after.json"
        # float32: the tf32x3 experiment and the tf32 wgmma candidates (tf32-wgmma-bwd-v0 / v1, the
        # route, tf32-wgmma-dq-ws; compiled first in parallel, each kernel also timed apart) against
        # the SIMT backward and PyTorch's mem-efficient
        step bench-tf32-bwd 300 python dev/bench_dmma_bwd.py --dtype float32 --headdims 64 --repeats 3 --warm 16 --per-kernel \
            --json "$out/bench-tf32-bwd.json"
    fi
    ;;
tf32_pair)  # tf32-wgmma-bwd-pair (the float32 backward at d128 on the pair's kernels): the candidates'
           # kernels compiled in parallel (bench_dmma_bwd.py --warm), their GPU tests, racecheck and
           # memcheck of them alone, then the d128 bench (the pair's dK/dV with tf32x3's dQ, and
           # with the pair's dQ) against tf32x3, the SIMT backward and PyTorch's mem-efficient
    # TF32_PAIR_PART=tests (warm, tests, racecheck: about 540 s cold) or bench (memcheck, bench: about
    # 330 s); unset, both (more than one 600 s call)
    export PYTHONPATH=$PWD
    if [ "${TF32_PAIR_PART:-tests}" = tests ]; then
        step warm-pair "${WARM_LIMIT:-150}" python -c "import sys; sys.path.insert(0, 'dev'); import bench_dmma_bwd as b; b.warm_candidates([128], 16)"
        step pair-tests "${TEST_LIMIT:-240}" python scripts/pytest_shards.py --shards "${SHARDS:-12}" \
            --limit "$(( ${TEST_LIMIT:-240} - 20 ))" --out "$out/pair-shards" -m gpu -k pair \
            tests/kernels/test_flash_bwd_dmma.py
        step racecheck-pair "${RACECHECK_LIMIT:-150}" compute-sanitizer --tool racecheck --error-exitcode 1 \
            python dev/sanitize_dmma_bwd.py pair
    fi
    if [ "${TF32_PAIR_PART:-bench}" = bench ]; then
        step memcheck-pair "${MEMCHECK_LIMIT:-90}" compute-sanitizer --tool memcheck --error-exitcode 1 \
            python dev/sanitize_dmma_bwd.py pair
        step bench-pair 240 python dev/bench_dmma_bwd.py --dtype float32 --headdims 128 --repeats 5 --warm 16 \
            --per-kernel --json "$out/bench-pair.json"
    fi
    ;;
trees)  # experiment patches in their own copies beside this tree (header above)
    # the copies live outside the checkout: inside a git work tree, git apply would skip their paths
    trees=(.) dir=${TREES_DIR:-/tmp/cupyflash-trees}
    for name in ${TREE_PATCHES:?TREE_PATCHES: patch names of dev/experiments}; do
        rm -rf "${dir:?}/$name" && mkdir -p "$dir/$name"
        tar --exclude=./.trees --exclude=./.cupy-cache --exclude=./.git --exclude=./.venv --exclude=./docs/results \
            -cf - . | tar -xf - -C "$dir/$name"
        (cd "$dir/$name" && apply_patches "$name") > "$out/tree-$name.log" 2>&1 || { status=1; continue; }
        trees+=("$dir/$name")
    done
    rm -f .cupy-cache/picked-patches
    step variant-trees "${TREES_LIMIT:-300}" env PYTHONPATH=$PWD python dev/bench_variant_trees.py "${trees[@]}" \
        --json "$out/variant-trees.json" --headdim "${TREES_HEADDIM:-128}" \
        ${TREE_PICK:+--pick .cupy-cache/picked-patches --margin "${TREE_MARGIN:-0.03}" --pick-config "${TREE_PICK_CONFIG:-ws s3 pp}"}
    if [ -s .cupy-cache/picked-patches ]; then
        echo "picked: $(cat .cupy-cache/picked-patches)"
        apply_patches "$(cat .cupy-cache/picked-patches)" || status=1
    fi
    ;;
picked)  # what trees picked, applied to this call's fresh copy of the checkout
    if [ -s .cupy-cache/picked-patches ]; then
        echo "picked: $(cat .cupy-cache/picked-patches)"
        apply_patches "$(cat .cupy-cache/picked-patches)" || status=1
    else
        echo "picked: none"
    fi
    ;;
warm)  # every kernel this device runs into the tree's CuPy cache, alone in its call: then the
       # suite's parts (issued right after, on the same warm machine) load instead of compiling.
       # Cold, 14 shards compiling side by side did not finish the suite in 430 s (2026-12-03).
    export PYTHONPATH=$PWD
    step warm-cache "${WARM_LIMIT:-540}" python scripts/warm_kernel_cache.py --packed --variants ${WARM_ZOO:+--zoo}
    ;;
suite)  # the GPU test suite in three parts (SUITE_PART=1, 2 or 3), each one summary file; part 2 is
        # every test file parts 1 and 3 do not name, so a new file cannot fall between them. Part 3
        # is the ring's file and the dev harness: on 2026-12-05 the ring's 36 one-GPU cases took
        # 60-87 s each and part 2 with them did not finish in 560 s (7 of 14 shards killed, 452 of
        # 788 tests unrun); the dev harness's four backward tests, 160-194 s each, were part 1's
        # longest poles (714 of its 4,300 shard-seconds).
    part1=(tests/test_api_gpu.py tests/test_tf32_gpu.py tests/test_robustness_gpu.py tests/test_torch_gpu.py
           tests/test_kvcache_kernel_gpu.py tests/test_capture_gpu.py tests/test_varlen_gpu.py tests/test_docs.py
           tests/test_cli.py tests/test_testing.py tests/test_validation.py tests/test_plans.py tests/test_plans_bwd.py
           tests/test_dispatch.py tests/test_statistics_gpu.py tests/test_leftpad_gpu.py
           tests/test_paged_varlen_gpu.py)
    part3=(tests/test_distributed_gpu.py tests/dev)
    part2=(tests/kernels tests/benchmarks)
    for f in tests/test_*.py; do
        case " ${part1[*]} ${part3[*]} " in *" $f "*) ;; *) part2+=("$f") ;; esac
    done
    # SUITE_PART=all: the three parts one after another in one call, on a machine warmed by the
    # call before (2026-12-05, warm: 59 s, 102 s and 38 s), each with its own limit
    # (TEST_LIMIT_1/2/3, default 160 / 240 / 120 s; part 2 took 216 s of 220 on 2026-12-07)
    parts=${SUITE_PART:-1}
    [ "$parts" = all ] && parts="1 2 3"
    for part in $parts; do
        case $part in
        1) paths=("${part1[@]}") ;;
        3) paths=("${part3[@]}") ;;
        *) paths=("${part2[@]}") ;;
        esac
        if [ "${SUITE_PART:-1}" = all ]; then
            limit_var=TEST_LIMIT_$part; defaults=(0 160 240 120); limit=${!limit_var:-${defaults[$part]}}
        else
            limit=${TEST_LIMIT:-540}
        fi
        step "suite-part$part" "$limit" bash scripts/gpu_suite_part.sh "$out/suite-part$part.txt" \
            "$(( limit - 20 ))" "${paths[@]}"
    done
    ;;
properties)  # the dev profile's 25 examples a property are the suite's; the issues' bar is 200. In
             # two parts (PROPERTIES_PART=1 or 2, default both, one call each): the dev profile's
             # shard-seconds (2026-12-05, H100) times 8 over 14 shards are about 200 s and 370 s.
    limit=${TEST_LIMIT:-560}
    for part in ${PROPERTIES_PART:-1 2}; do
        case $part in
        1) paths=(tests/test_api_gpu.py tests/test_window_gpu.py tests/test_headdim_v_gpu.py) ;;
        *) paths=(tests/test_variants_gpu.py tests/test_dropout_gpu.py tests/test_modifiers_gpu.py) ;;
        esac
        step "properties$part" "$limit" env HYPOTHESIS_PROFILE=gpu bash scripts/gpu_suite_part.sh \
            "$out/properties$part.txt" "$(( limit - 20 ))" "${paths[@]}"
    done
    ;;
ncu)
    : "${BEFORE_TREE:?the ncu part compares against BEFORE_TREE}"
    cases=${NCU_CASES:-"64 16384 bwd;64 2048 bwd;128 16384 bwd;128 16384 causal fwd;128 2048 fwd"}
    full=${NCU_FULL:-"64 16384 bwd;128 16384 causal fwd"}
    metrics=gpu__time_duration.sum,launch__registers_per_thread,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__cycles_active.avg,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,dram__bytes.sum
    trees=("$BEFORE_TREE" "$PWD"); labels=(before after)
    for i in 0 1; do  # compile every case's kernels first, all cases at once
        IFS=';'; for c in $cases; do IFS=' '
            (cd "${trees[$i]}" && PYTHONPATH=$PWD python "$OLDPWD/scripts/ncu_workload.py" $c) &
        done; IFS=' '
    done; wait
    for i in 0 1; do
        IFS=';'; for c in $cases; do IFS=' '
            tag=${labels[$i]}-$(echo "$c" | tr ' =' '--')
            (cd "${trees[$i]}" && PYTHONPATH=$PWD step "ncu-$tag" 120 ncu --clock-control none -k regex:flash \
                --metrics "$metrics" --csv python "$OLDPWD/scripts/ncu_workload.py" $c)
        done; IFS=' '
        IFS=';'; for c in $full; do IFS=' '
            tag=${labels[$i]}-$(echo "$c" | tr ' =' '--')
            (cd "${trees[$i]}" && PYTHONPATH=$PWD step "full-$tag" 200 ncu --clock-control none -k regex:flash \
                --set full --import-source no -o "$out/full-$tag" python "$OLDPWD/scripts/ncu_workload.py" $c)
            ncu -i "$out/full-$tag.ncu-rep" --page details > "$out/full-$tag.txt" 2>&1
        done; IFS=' '
    done
    ;;
dropout)  # dropout's GPU tests (DROPOUT_TESTS=0: none), then its cost at 8k here and in BEFORE_TREES
    export PYTHONPATH=$PWD
    [ "${DROPOUT_TESTS:-1}" = 0 ] || step dropout-tests "${TEST_LIMIT:-240}" \
        env HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-gpu}" python -m pytest -q -m gpu tests/test_dropout_gpu.py -p no:cacheprovider
    dropout_8k
    ;;
tf32_wgmma)  # the tf32 wgmma forward candidates: their GPU tests, then their speed and accuracy beside
    # the shipped float32 forward and PyTorch's mem-efficient fp32 (dev/bench_tf32_wgmma.py), then the
    # sanitizer. Eight configurations no longer fit one 600 s call: TF32_WGMMA_PART=tests or bench
    # runs one half (the smoke step in both), unset both.
    export PYTHONPATH=$PWD
    # the producer-warpgroup candidate first, alone and small: a wrong barrier parity hangs here
    step tf32-wgmma-ws-smoke 90 python dev/smoke_tf32_wgmma_ws.py
    if [ "${TF32_WGMMA_PART:-tests}" = tests ] || [ -z "${TF32_WGMMA_PART:-}" ]; then
        step tf32-wgmma-tests "${TEST_LIMIT:-400}" env HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-gpu}" \
            python -m pytest -q -m gpu tests/test_tf32_wgmma_gpu.py -p no:cacheprovider
    fi
    if [ "${TF32_WGMMA_PART:-bench}" = bench ] || [ -z "${TF32_WGMMA_PART:-}" ]; then
        # TF32_BENCH_ARGS: e.g. "--headdims 128 --seqlens 1024 8192" (the d128 candidates alone)
        step tf32-wgmma-bench 240 python dev/bench_tf32_wgmma.py ${TF32_BENCH_ARGS:-} --json "$out/tf32-wgmma.json"
    fi
    # the sanitizer: in the bench part at 120 s each, or alone (TF32_WGMMA_PART=sanitize) at 280 s
    # each, the whole candidate list (racecheck took more than 140 s over it on an H100, 2026-12-07)
    if [ "${TF32_WGMMA_PART:-bench}" = bench ] || [ "${TF32_WGMMA_PART:-}" = sanitize ] || [ -z "${TF32_WGMMA_PART:-}" ]; then
        limit=120; [ "${TF32_WGMMA_PART:-}" = sanitize ] && limit=280
        step racecheck-tf32-wgmma "${RACECHECK_LIMIT:-$limit}" compute-sanitizer --tool racecheck --error-exitcode 1 python dev/sanitize_tf32_wgmma.py ${SANITIZE_MATCH:-}
        step memcheck-tf32-wgmma "${MEMCHECK_LIMIT:-$limit}" compute-sanitizer --tool memcheck --error-exitcode 1 python dev/sanitize_tf32_wgmma.py ${SANITIZE_MATCH:-}
    fi
    ;;
tf32)  # the float32 forward on tensor cores: tests, the probe's candidates, the bench, the sanitizer
    export PYTHONPATH=$PWD
    step warm-tf32 "${WARM_LIMIT:-120}" python scripts/warm_kernel_cache.py --match 'tf32|simt_fp32'
    step tf32-tests "${TEST_LIMIT:-200}" env HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-gpu}" \
        python scripts/pytest_shards.py --shards "${SHARDS:-8}" --limit "$(( ${TEST_LIMIT:-200} - 20 ))" \
        --out "$out/tf32-shards" -m gpu tests/test_tf32_gpu.py
    step tf32-probe 150 python dev/tf32_accumulation_probe.py --candidates
    step bench-fp32 170 python -m cupyflash bench --dtype fp32 --headdim 64 128 --seqlen 1k 4k 8k --causal both \
        --mode fwd --backends auto tf32 --anchors mem-eff --no-validate --quiet --json "$out/bench-fp32.json" \
        --markdown "$out/bench-fp32.md"
    step racecheck-quick "${RACECHECK_LIMIT:-180}" python -m cupyflash sanitize --tool racecheck --quick
    step memcheck-quick "${MEMCHECK_LIMIT:-180}" python -m cupyflash sanitize --tool memcheck --quick
    ;;
measure)  # after the suite, on its warm machine (the cache holds the shipped kernels): the parts named
         # in MEASURE (default "varlen decode"): varlen, the varlen bench (varlen-v2's issue order);
         # decode, the full decode table (20 repeats); dropout, dropout's cost at 8k, d128 and d64;
         # tf32, the tf32 wgmma candidates' smoke, tests, bench and racecheck; windows, the tuner on
         # the window case (16k, d128, window 1024 causal: the shipped tiles against dev/'s
         # candidates, forward and backward; windows-tiles in the perf log)
    export PYTHONPATH=$PWD
    for part in ${MEASURE:-varlen decode}; do
        case $part in
        varlen) step varlen-bench 240 python -m cupyflash.bench.varlen --json "$out/varlen.json" ;;
        decode) step decode 200 python -m cupyflash.bench.kvcache_decode --json "$out/decode.json" --plot "$out/decode.png" ;;
        dropout) dropout_8k ;;
        tf32)
            step tf32-wgmma-ws-smoke 90 python dev/smoke_tf32_wgmma_ws.py
            step tf32-wgmma-tests "${TEST_LIMIT:-200}" env HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-gpu}" \
                python -m pytest -q -m gpu tests/test_tf32_wgmma_gpu.py -p no:cacheprovider
            step tf32-wgmma-bench 240 python dev/bench_tf32_wgmma.py --json "$out/tf32-wgmma.json"
            step racecheck-tf32-wgmma 150 compute-sanitizer --tool racecheck --error-exitcode 1 \
                python dev/sanitize_tf32_wgmma.py ;;
        windows) step windows-tune 240 python -m cupyflash tune --headdim 64 128 --seqlen 16384 --window 1024 0 \
                     --only default cand --repeats 10 --quiet
                 # the backward's window candidates (dev/mma_bwd.py WINDOW_SPLIT_CANDIDATES) against its plan
                 step windows-tune-bwd 240 python -m cupyflash tune --direction bwd --headdim 128 --seqlen 16384 \
                     --window 1024 0 --only default "(64, 64" --repeats 10 --quiet ;;
        *) echo "unknown measure part $part"; status=1 ;;
        esac
    done
    ;;
wgmma_ws)  # wgmma-fwd-ws-v0: each step under its limit (a wrong barrier parity hangs)
    export PYTHONPATH=$PWD
    step wgmma-ws-bench "${BENCH_LIMIT:-280}" python dev/bench_wgmma_ws.py "$out/wgmma-ws.json"
    step wgmma-ws-tests "${TEST_LIMIT:-220}" env HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-dev}" \
        python scripts/pytest_shards.py --shards "${SHARDS:-4}" --limit "$(( ${TEST_LIMIT:-220} - 20 ))" \
        --out "$out/wgmma-ws-shards" -m gpu tests/test_wgmma_ws_gpu.py
    step wgmma-ws-variants 120 python dev/bench_wgmma_ws.py --variants
    step racecheck-wgmma-ws 120 compute-sanitizer --tool racecheck --error-exitcode 1 python dev/sanitize_wgmma_ws.py
    ;;
window_tiles)  # the sliding-window forward's own tiles (plans.LOCAL_FORWARD_TILES) on a fresh machine:
    # the Local kernels compiled, the tuner's window sweep (the shipped window plan, "default",
    # against v6's 128 x 128 tiles), the GPU tests that run windows, the window bench at 16k and 8k
    export PYTHONPATH=$PWD
    step warm-local "${WARM_LIMIT:-150}" python scripts/warm_kernel_cache.py --packed --variants --match local
    for w in "1024 0" "512 512" "4096 0" "2048 2048" "-1 1024"; do
        step "tune-window-${w/ /_}" 45 python -m cupyflash tune --headdim 128 --seqlen 16384 --window $w \
            --only default v6 --repeats 10 --quiet
    done
    step window-tests "${TEST_LIMIT:-200}" bash scripts/gpu_suite_part.sh "$out/window-tests.txt" \
        "$(( ${TEST_LIMIT:-200} - 20 ))" tests/test_window_gpu.py tests/test_variants_gpu.py tests/test_headdim_v_gpu.py
    step variants-16k 120 python -m cupyflash.bench.variants --seqlen 16384 --impls cupyflash \
        --variants causal "causal window 1024" "window (512, 512)" --json "$out/variants-16k.json"
    [ -n "${WINDOW_FLEX:-}" ] && step variants-8k 150 python -m cupyflash.bench.variants --seqlen 8192 \
        --json "$out/variants-8k.json" --variants causal "causal window 1024" "window (512, 512)"
    # one file of the tuner's logs (a device call returns at most 8 files)
    for f in "$out"/tune-window-*.log; do echo "== $(basename "$f" .log)"; cat "$f"; done > "$out/tune-windows.txt"
    rm -f "$out"/tune-window-*.log
    ;;
probes)  # perf log cta-timeline / doc-mask-bwd-fixed-cost / tf32-split-once-dkdv: measurements only
    export PYTHONPATH=$PWD
    step timeline-test 150 python -m pytest -q -p no:cacheprovider -m gpu tests/dev/test_cta_timeline.py
    step timeline-bf16-plain 90 python dev/cta_timeline.py 128 16384 --json "$out/timeline-bf16-plain.json"
    step timeline-bf16-documents 90 python dev/cta_timeline.py 128 16384 documents=2048 \
        --json "$out/timeline-bf16-documents.json"
    step timeline-fp32-full 90 python dev/cta_timeline.py 64 4096 dtype=float32 --json "$out/timeline-fp32-full.json"
    step timeline-fp32-causal 90 python dev/cta_timeline.py 64 4096 causal dtype=float32 \
        --json "$out/timeline-fp32-causal.json"
    # issue 15's window forward against causal at 16k (window-fixed-cost-ws: a tile's fixed cost)
    step timeline-fwd-causal 90 python dev/cta_timeline.py 128 16384 fwd causal --json "$out/timeline-fwd-causal.json"
    step timeline-fwd-window 90 python dev/cta_timeline.py 128 16384 fwd causal window=1024,0 \
        --json "$out/timeline-fwd-window.json"
    for c in full causal; do
        step "ncu-fp32-dkdv-$c" 120 ncu --clock-control none --print-details all -k regex:flash_bwd_dkdv -c 1 \
            --section WarpStateStats --section InstructionStats --metrics smsp__inst_executed.sum \
            python scripts/ncu_workload.py 64 4096 $([ $c = causal ] && echo causal) bwd dtype=float32
    done
    ;;
varlen_timeline)  # issue 17's packed causal rows against one dense 16k sequence, CTA by CTA (perf log
                  # varlen-v3: what holds the d64 backward is not in its model)
    export PYTHONPATH=$PWD
    step timeline-varlen-test 120 python -m pytest -q -p no:cacheprovider -m gpu tests/dev/test_cta_timeline.py \
        -k packed
    for d in 64 128; do
        for pass in bwd fwd; do
            fwd=$([ $pass = fwd ] && echo fwd)
            step "timeline-$d-$pass-dense" 90 python dev/cta_timeline.py $d 16384 causal $fwd \
                --json "$out/timeline-$d-$pass-dense.json"
            step "timeline-$d-$pass-varlen" 90 python dev/cta_timeline.py $d 16384 causal varlen $fwd \
                --json "$out/timeline-$d-$pass-varlen.json"
        done
    done
    ;;
patch_ab)  # PATCH (dev/experiments) in a copy of this tree: its GPU tests there, then the float32 d64
           # backward's bench here and there on one machine
    copy=${TREES_DIR:-/tmp/cupyflash-trees}/ab
    rm -rf "$copy" && mkdir -p "$copy"
    tar --exclude=./.trees --exclude=./.cupy-cache --exclude=./.git --exclude=./.venv --exclude=./docs/results \
        -cf - . | tar -xf - -C "$copy"
    (cd "$copy" && apply_patches "${PATCH:?PATCH: a patch name of dev/experiments}") > "$out/patch.log" 2>&1 || exit 1
    (cd "$copy" && PYTHONPATH=$copy step patch-tests "${TEST_LIMIT:-240}" bash scripts/gpu_suite_part.sh \
        "$out/patch-tests.txt" "$(( ${TEST_LIMIT:-240} - 20 ))" ${PATCH_TESTS:-tests/kernels/test_flash_bwd_dmma.py \
        tests/test_tf32_gpu.py tests/test_modifiers_gpu.py}; exit $status) || status=1
    for tree in . "$copy"; do
        name=before; [ "$tree" = . ] || name=after
        (cd "$tree" && PYTHONPATH=$PWD step "bench-$name" 200 python dev/bench_dmma_bwd.py --dtype float32 \
            --headdims 64 --per-kernel --repeats 3 --warm 16 --candidates ${AB_CANDIDATES:-wgmma_presplit_both_c2} \
            --json "$out/bench-$name.json"; exit $status) || status=1
    done
    ;;
*) echo "unknown part $what"; exit 2 ;;
esac
exit $status

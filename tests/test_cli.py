"""The command line, python -m cupyflash: help and version, one dtype spelling for every command,
a summary line and an exit status per command, the demo's verdict and argument checks,
compile-check's progress and summary (a stand-in compiler, and NVRTC on one kernel), tune's and
sanitize's command-line part with stand-ins for the GPU work. The demo on a GPU: marked gpu."""
from __future__ import annotations

import importlib
import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import cupyflash
from cupyflash import _dtypes, api, cli, dispatch
from cupyflash.bench.progress import Progress
from cupyflash.kernels import compile_check

REPO = Path(__file__).resolve().parents[1]
NAMES = [c.name for c in cli.COMMANDS]
EXIT_NAMES = {0: "ok", 1: "failed", 2: "usage", 3: "unavailable"}


def last_line(text: str) -> str:
    return text.rstrip("\n").splitlines()[-1]


# --- help, version, commands ----------------------------------------------------------------

def test_help_lists_every_command_with_its_summary(capsys):
    assert cli.main(["--help"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m cupyflash")
    squeezed = "".join(out.split())  # argparse wraps the summaries where it likes
    for command in cli.COMMANDS:
        assert "".join((command.name + command.summary).split()) in squeezed
    assert "helpthishelp,oronecommand's" in squeezed
    assert "exit status: 0 done" in out and "bf16, fp16, fp32, fp64" in out


@pytest.mark.parametrize("name", NAMES)
def test_every_command_has_a_description_and_help(name, capsys):
    assert cli.main([name, "--help"]) == cli.EXIT_OK
    text = capsys.readouterr().out
    assert text.startswith(f"usage: python -m cupyflash {name}")
    description = cli.command_parser(name).description
    assert description and description.splitlines()[0] in text
    assert "Exit status: 0 " in text
    assert cli.main(["help", name]) == cli.EXIT_OK
    assert capsys.readouterr().out == text


def test_version_and_bare_help(capsys):
    assert cli.main(["--version"]) == cli.EXIT_OK
    assert capsys.readouterr().out == f"cupyflash {cupyflash.__version__}\n"
    assert cli.main(["help"]) == cli.EXIT_OK
    assert "commands:" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [[], ["frobnicate"], ["help", "frobnicate"], ["--verbose"]])
def test_no_or_unknown_command_is_a_usage_error(argv, capsys):
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m cupyflash") and "error:" in err


def test_console_script_name(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/usr/bin/cupyflash"])
    assert cli.prog_name() == "cupyflash"
    monkeypatch.setattr(sys, "argv", [str(REPO / "cupyflash" / "__main__.py")])
    assert cli.prog_name() == "python -m cupyflash"


def test_module_aliases_are_the_same_command_line():
    """python -m cupyflash.sanitize and friends: the subcommand under its old module name."""
    runs = {
        ("-m", "cupyflash", "--version"): f"cupyflash {cupyflash.__version__}",
        ("-m", "cupyflash.sanitize", "--help"): "usage: python -m cupyflash sanitize",
        ("-m", "cupyflash.bench.tune", "--help"): "usage: python -m cupyflash tune",
        ("-m", "cupyflash.bench.io_complexity", "--model-only", "--quick"):
            "cupyflash io-complexity: model of 6 configurations",
    }
    for argv, expected in runs.items():
        done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=REPO,
                              timeout=120)
        assert done.returncode == 0, (argv, done.stderr)
        assert expected in done.stdout, (argv, done.stdout)


# --- dtypes ------------------------------------------------------------------------------------

SPELLINGS = {"bfloat16": ["bf16", "bfloat16", "BF16"], "float16": ["fp16", "float16", "Float16"],
             "float32": ["fp32", "float32"], "float64": ["fp64", "float64", " fp64 "]}


def test_dtype_parser_accepts_both_spellings():
    for name, spellings in SPELLINGS.items():
        assert all(_dtypes.parse_dtype_name(s) == name for s in spellings)
    for bad in ("fp8", "half", "int8", "", "float"):
        with pytest.raises(ValueError, match="unknown dtype"):
            _dtypes.parse_dtype_name(bad)
    with pytest.raises(ValueError, match=r"'fp32' \(choose from bf16 \(bfloat16\), fp16 \(float16\)\)$"):
        _dtypes.parse_dtype_name("fp32", allowed=("bfloat16", "float16"))


@pytest.mark.parametrize("name, parsed, allowed", [
    ("demo", lambda a: a.dtype, ("bfloat16", "float16", "float32", "float64")),
    ("bench", lambda a: _dtypes._SPELLINGS[a.dtype[0]], ("bfloat16", "float16", "float32")),
    ("io-complexity", lambda a: a.dtype, ("bfloat16", "float16", "float32", "float64")),
    ("tune", lambda a: a.dtype, ("bfloat16", "float16")),
])
def test_every_command_spells_dtypes_the_same(name, parsed, allowed, capsys):
    parser = cli.command_parser(name)
    for dtype, spellings in SPELLINGS.items():
        for spelling in spellings:
            if dtype in allowed:
                assert parsed(parser.parse_args(["--dtype", spelling])) == dtype
            else:
                assert cli.main([name, "--dtype", spelling]) == cli.EXIT_USAGE
                assert f"argument --dtype: unknown dtype {spelling!r}" in capsys.readouterr().err


# --- demo --------------------------------------------------------------------------------------

SMALL = ["--backend", "numpy", "--batch", "1", "--seqlen", "40", "--nheads", "4",
         "--nheads-kv", "2", "--headdim", "24"]


@pytest.mark.parametrize("dtype", ["bf16", "float16", "fp32", "float64"])
@pytest.mark.parametrize("causal", [[], ["--causal"]])
def test_demo_passes_on_the_numpy_backend(dtype, causal, capsys):
    assert cli.main(["demo", *SMALL, "--dtype", dtype, *causal]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "batch 1, seqlen 40, heads 4/2, headdim 24" in out and "backend numpy" in out
    for name in ("o", "lse", "dq", "dk", "dv"):
        assert f"\n  {name:4} " in out
    assert last_line(out).startswith("cupyflash demo: PASS: o, lse, dq, dk, dv within the tolerance")


def test_demo_defaults_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(dispatch, "gpu_available", lambda: False)
    assert cli.main(["demo", "--batch", "1", "--nheads", "1", "--headdim", "8"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "no GPU used; backend numpy" in out and "seqlen 256" in out and "bfloat16" in out


@pytest.mark.parametrize("wrong, failing", [("o", "o, dq, dk"), ("dk", "dk")])
def test_demo_fails_when_an_output_is_wrong(wrong, failing, monkeypatch, capsys):
    """A wrong o fails o and, through D = rowsum(dO * o), dq and dk of the backward handed it."""
    forward, backward = api.flash_attn_func, api.flash_attn_backward

    def bad_forward(*args, **kwargs):
        o, lse = forward(*args, **kwargs)
        return (o * 1.01 if wrong == "o" else o), lse

    def bad_backward(*args, **kwargs):
        dq, dk, dv = backward(*args, **kwargs)
        return dq, (dk + 0.01 if wrong == "dk" else dk), dv

    monkeypatch.setattr(api, "flash_attn_func", bad_forward)
    monkeypatch.setattr(api, "flash_attn_backward", bad_backward)
    assert cli.main(["demo", *SMALL, "--dtype", "fp32"]) == cli.EXIT_FAILED
    out = capsys.readouterr().out
    assert f"  {wrong} (float32): max abs error" in out
    assert last_line(out) == (f"cupyflash demo: FAIL: {failing} beyond the tolerance (the "
                              "float32 rounding bound)")


@pytest.mark.parametrize("flag, value, message", [
    ("--batch", "0", "must be at least 1, got 0"),
    ("--seqlen", "0", "must be at least 1, got 0"),
    ("--seqlen", "-3", "must be at least 1, got -3"),
    ("--nheads", "0", "must be at least 1, got 0"),
    ("--nheads-kv", "0", "must be at least 1, got 0"),
    ("--headdim", "257", "must be between 1 and 256, got 257"),
    ("--headdim", "0", "must be between 1 and 256, got 0"),
    ("--batch", "two", "expected an integer, got 'two'"),
    ("--dtype", "fp8", "unknown dtype 'fp8'"),
    ("--backend", "tpu", "invalid choice: 'tpu'"),
])
def test_demo_rejects_invalid_arguments_naming_the_flag(flag, value, message, capsys):
    assert cli.main(["demo", flag, value]) == cli.EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"python -m cupyflash demo: error: argument {flag}: {message}" in captured.err


@pytest.mark.parametrize("argv, message", [
    (["tune", "--seqlen", "4096", "0"], "argument --seqlen: must be at least 1, got 0"),
    (["tune", "--headdim", "512"], "argument --headdim: must be between 1 and 256, got 512"),
    (["tune", "--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
    (["io-complexity", "--model-only", "--batch", "0"], "argument --batch: must be at least 1"),
    (["io-complexity", "--model-only", "--headdim", "x"], "argument --headdim: expected an integer"),
    (["bench", "--list", "--headdim", "64,0"], "argument --headdim: must be at least 1, got 0"),
])
def test_sizes_are_checked_by_every_command(argv, message, capsys):
    assert cli.main(argv) == cli.EXIT_USAGE
    assert f"python -m cupyflash {argv[0]}: error: {message}" in capsys.readouterr().err


def test_demo_rejects_heads_that_do_not_group(capsys):
    assert cli.main(["demo", "--nheads", "6", "--nheads-kv", "4"]) == cli.EXIT_USAGE
    assert "error: --nheads 6 is not a multiple of --nheads-kv 4" in capsys.readouterr().err


def test_demo_gpu_backend_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(dispatch, "gpu_available", lambda: False)
    assert cli.main(["demo", "--backend", "mma"]) == cli.EXIT_UNAVAILABLE
    assert last_line(capsys.readouterr().err).startswith("cupyflash demo: cannot run: backend='mma'")


@pytest.mark.gpu
@pytest.mark.parametrize("options", [
    [],
    ["--dtype", "fp16", "--causal", "--headdim", "128", "--seqlen", "333"],
    ["--dtype", "bf16", "--nheads", "8", "--nheads-kv", "2", "--headdim", "72", "--causal"],
    ["--dtype", "bf16", "--headdim", "256", "--seqlen", "257", "--batch", "1"],
    ["--dtype", "fp32", "--seqlen", "200"],
    ["--dtype", "fp64", "--seqlen", "130", "--headdim", "40", "--causal"],
    ["--dtype", "fp16", "--backend", "simt", "--seqlen", "100"],
])
def test_demo_passes_on_the_gpu(options, capsys):
    assert cli.main(["demo", *options]) == cli.EXIT_OK, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "cupyflash demo: GPU " in out and "(NumPy backend)" not in out
    assert last_line(out).startswith("cupyflash demo: PASS")


# --- compile-check -----------------------------------------------------------------------------

def fake_check(spilling=(), serialized=(), broken_files=()):
    """Stands in for compile_check.check: resources of every specialization without NVRTC."""
    def check(arch, specs, with_sass=False):
        if specs[0].source_file in broken_files:
            raise RuntimeError(f"{specs[0].source_file} for sm_{arch}:\nerror: expected ';'")
        return [compile_check.Resources(s.name, "_Z" + s.name, 64, 0,
                                        8 if s.name in spilling else 0,
                                        16 if s.name in spilling else 0, "",
                                        s.name in serialized)
                for s in specs]

    return check


@pytest.fixture
def stand_in_compiler(monkeypatch):
    monkeypatch.setattr(compile_check, "_nvrtc", lambda: None)
    monkeypatch.setattr(compile_check, "find_cuobjdump", lambda: "cuobjdump")

    def use(**problems):
        monkeypatch.setattr(compile_check, "check", fake_check(**problems))

    return use


def compiled_pairs(archs=compile_check.ARCHS):
    """(arch, specialization) of everything the check compiles, and the number of programs."""
    specs = compile_check.all_specializations()
    pairs = [(a, s) for a in archs for s in specs if compile_check.compiled_for(s, a)]
    return pairs, len({(a, s.source_file) for a, s in pairs})


def test_compile_check_prints_progress_and_a_summary(stand_in_compiler, capsys):
    stand_in_compiler()
    pairs, programs = compiled_pairs()
    assert cli.main(["compile-check"]) == cli.EXIT_OK
    captured = capsys.readouterr()
    assert captured.out == (f"cupyflash compile-check: {len(pairs)} kernels compiled for sm_80, "
                            f"sm_90, sm_90a: {len(pairs)} ok, 0 with spills, 0 failed\n")
    progress = captured.err.splitlines()  # not a terminal: one plain line per NVRTC program
    assert len(progress) == programs > 3
    assert progress[-1].startswith(f"[{programs}/{programs} ") and " compiled" in progress[-1]


def test_compile_check_verbose_prints_one_line_per_kernel(stand_in_compiler, capsys):
    stand_in_compiler()
    pairs, _ = compiled_pairs(["80"])
    assert cli.main(["compile-check", "--arch", "80", "-v", "--quiet"]) == cli.EXIT_OK
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == len(pairs) + 1 and captured.err == ""
    assert all(line.startswith("sm_80 ") and "regs   64" in line for line in lines[:-1])


def test_compile_check_fails_on_spills_serialization_and_compile_errors(stand_in_compiler, capsys):
    pairs, _ = compiled_pairs()
    names = [s.name for _, s in pairs]
    spilling, serialized = names[0], next(n for n in names if "wgmma" in n)
    stand_in_compiler(spilling={spilling}, serialized={serialized},
                      broken_files={"flash_fwd_mma.cu"})
    broken = sum(s.source_file == "flash_fwd_mma.cu" for _, s in pairs)
    spills = sum(n == spilling for n in names)
    assert cli.main(["compile-check"]) == cli.EXIT_FAILED
    captured = capsys.readouterr()
    failed = broken + sum(n == serialized for n in names)
    assert last_line(captured.out) == (
        f"cupyflash compile-check: {len(pairs)} kernels compiled for sm_80, sm_90, sm_90a: "
        f"{len(pairs) - spills - failed} ok, {spills} with spills, {failed} failed")
    offending = captured.out.splitlines()[:-1]  # without -v: only the kernels that fail
    assert any(spilling in line and line.endswith("SPILL") for line in offending)
    assert any(serialized in line and line.endswith("WGMMA-SERIALIZED") for line in offending)
    assert "sm_80 flash_fwd_mma.cu: RuntimeError: flash_fwd_mma.cu for sm_80" in captured.err
    assert "sm_90 flash_fwd_mma.cu: FAILED" in captured.err  # its progress line


def test_compile_check_without_nvrtc_or_a_match(monkeypatch, capsys):
    def missing():
        raise FileNotFoundError("libnvrtc not found (pip install 'cuda-toolkit[nvrtc]')")

    monkeypatch.setattr(compile_check, "_nvrtc", missing)
    assert cli.main(["compile-check"]) == cli.EXIT_UNAVAILABLE
    assert last_line(capsys.readouterr().err) == ("cupyflash compile-check: cannot run: libnvrtc "
                                                  "not found (pip install 'cuda-toolkit[nvrtc]')")
    assert cli.main(["compile-check", "--kernel", "no_such_kernel"]) == cli.EXIT_USAGE
    assert "matches --kernel no_such_kernel" in capsys.readouterr().err
    assert cli.main(["compile-check", "--arch", "75"]) == cli.EXIT_USAGE


def _have_nvrtc() -> bool:
    try:
        compile_check._nvrtc()
    except OSError:  # FileNotFoundError: none installed
        return False
    return True


@pytest.mark.skipif(not _have_nvrtc(), reason="NVRTC not installed (pip install '.[cuda13]')")
def test_compile_check_compiles_one_kernel_with_nvrtc(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("CUPYFLASH_CACHE_DIR", str(tmp_path))  # compiled here, not read back
    assert cli.main(["compile-check", "--arch", "80", "--kernel", "flash_bwd_preprocess_fp16",
                     "-v"]) == cli.EXIT_OK
    captured = capsys.readouterr()
    line, summary = captured.out.splitlines()
    assert line.split()[:2] == ["sm_80", "flash_bwd_preprocess_fp16"] and "spill     0" in line
    assert summary == ("cupyflash compile-check: 1 kernels compiled for sm_80: 1 ok, "
                       "0 with spills, 0 failed")
    assert captured.err.startswith("[1/1 ") and "sm_80 flash_bwd_preprocess.cu: 1 compiled" in captured.err
    # the kernel's result was written here (the spec list's own ptxas questions, asked once a
    # process, may add results of theirs beside it when this test runs first)
    written = [json.loads(path.read_text()) for path in tmp_path.rglob("*.json")]
    assert sum("cf::flash_bwd_preprocess<cf::half_t>" in result for result in written) == 1


# --- tune, sanitize, bench, io-complexity: the command-line parts ------------------------------

@pytest.fixture
def stand_in_tuner(monkeypatch):
    """tune's GPU work replaced: three forward variants, one failing its check and one that does
    not fit; 'times' from the configuration and the shape."""
    from cupyflash.bench import harness, tune

    monkeypatch.setattr(harness, "gpu_unavailable_reason", lambda: None)
    variants = [(64, "default+v3", "(64, 64)", "a"), (64, "cand", "(128, 64)", "b"),
                (64, "cand", "(256, 128)", "c")]
    monkeypatch.setattr(tune, "_variants", lambda direction, headdims, *plan_inputs: variants)

    def check(config, headdim, dtype, causal, window=(-1, -1)):
        if config == "c":
            raise RuntimeError("needs 300 KiB of shared memory")
        return {"a": 0.5, "b": 3.0}[config]

    monkeypatch.setattr(tune, "_check", check)
    monkeypatch.setattr(tune, "_time_forward", lambda config, headdim, seqlen, causal, *rest, window=(-1, -1):
                        {"a": 2.0, "b": 1.0}[config] * seqlen / 1024)


def test_tune_reports_each_variant_and_fails_on_a_failed_check(stand_in_tuner, capsys):
    assert cli.main(["tune", "--headdim", "64", "--seqlen", "1024", "2048"]) == cli.EXIT_FAILED
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    assert out[0].split() == ["d", "seqlen", "causal", "variant", "check", "ms", "TFLOP/s"]
    rows = [line.split() for line in out[1:9]]
    assert [r[:4] for r in rows] == [["64", str(s), str(c), label] for label in ("default+v3", "cand")
                                     for s in (1024, 2048) for c in (False, True)]
    assert {r[-3] for r in rows} == {"ok", "x3.0"} and rows[4][-3] == "x3.0"
    assert out[9].split()[:4] == ["64", "cand", "(256,", "128)"]
    assert out[9].endswith("skipped: needs 300 KiB of shared memory")
    # the fastest that passed its check, although "cand" is faster
    assert "  d64 seqlen 1024 causal False  default+v3" in captured.out
    assert out[-1] == ("cupyflash tune: FAIL: 2 fwd variants timed, 1 failed the float64 check, "
                       "1 skipped (do not fit this GPU): d64 cand")
    progress = captured.err.splitlines()
    assert len(progress) == 3 and progress[2].startswith("[3/3 ") and "skipped" in progress[2]


def test_tune_only_and_usage(stand_in_tuner, capsys):
    assert cli.main(["tune", "--seqlen", "1024", "--only", "default", "--quiet"]) == cli.EXIT_OK
    captured = capsys.readouterr()
    assert captured.err == ""
    assert last_line(captured.out) == ("cupyflash tune: 1 fwd variants timed, 0 failed the "
                                       "float64 check, 0 skipped (do not fit this GPU)")
    assert cli.main(["tune", "--only", "v99"]) == cli.EXIT_USAGE
    assert "no fwd variant matches --only v99" in capsys.readouterr().err


def test_tune_without_a_gpu(monkeypatch, capsys):
    from cupyflash.bench import harness

    monkeypatch.setattr(harness, "gpu_unavailable_reason", lambda: "no CUDA device found")
    assert cli.main(["tune"]) == cli.EXIT_UNAVAILABLE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "cupyflash tune: no usable CUDA device (no CUDA device found); nothing timed\n"


def test_sanitize_reports_each_tool_and_fails_on_one(monkeypatch, capsys):
    from cupyflash import sanitize

    monkeypatch.setattr(sanitize, "_sanitizer", lambda: "/opt/cuda/bin/compute-sanitizer")
    monkeypatch.setattr(dispatch, "gpu_available", lambda: True)
    commands = []

    def run(command, **kwargs):
        commands.append(command)
        failing = "racecheck" in command
        stdout = ("========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)"
                  if failing else "========= ERROR SUMMARY: 0 errors")
        return subprocess.CompletedProcess(command, 99 if failing else 0, stdout, "")

    monkeypatch.setattr(sanitize.subprocess, "run", run)
    assert cli.main(["sanitize", "--quick", "--family", "mma"]) == cli.EXIT_FAILED
    out = capsys.readouterr().out
    assert commands[0][1:] == ["-m", "cupyflash.sanitize", "--worker", "--family", "mma", "--quick"]
    assert [c[2] for c in commands[1:]] == list(sanitize.TOOLS)
    assert "memcheck   clean" in out and "racecheck  FAILED (exit 99)" in out
    assert last_line(out) == ("cupyflash sanitize: FAIL: racecheck reported errors on the mma "
                              "kernels (--quick); 3 of 4 tools clean")
    assert cli.main(["sanitize", "--tool", "memcheck", "--family", "simt"]) == cli.EXIT_OK
    assert last_line(capsys.readouterr().out) == ("cupyflash sanitize: 1 of 1 tools clean on the "
                                                  "simt kernels")


def test_sanitize_without_its_tool_or_a_gpu(monkeypatch, capsys):
    from cupyflash import sanitize

    monkeypatch.setattr(sanitize, "_sanitizer", lambda: None)
    assert cli.main(["sanitize"]) == cli.EXIT_UNAVAILABLE
    assert "no compute-sanitizer" in capsys.readouterr().err
    monkeypatch.setattr(sanitize, "_sanitizer", lambda: "/opt/cuda/bin/compute-sanitizer")
    monkeypatch.setattr(dispatch, "gpu_available", lambda: False)
    assert sanitize.main(["--quick"]) == cli.EXIT_UNAVAILABLE
    assert "cannot run: no usable CUDA device; nothing checked" in capsys.readouterr().err


def test_bench_and_io_complexity_end_with_a_summary(capsys):
    assert cli.main(["bench", "--list", "--quick"]) == cli.EXIT_OK
    assert last_line(capsys.readouterr().out) == ("cupyflash bench: 32 measurements planned "
                                                  "(--list: none run)")
    assert cli.main(["io-complexity", "--model-only", "--quick"]) == cli.EXIT_OK
    assert last_line(capsys.readouterr().out) == ("cupyflash io-complexity: model of 6 "
                                                  "configurations (--model-only: nothing measured)")
    assert cli.main(["io-complexity", "--passes", "flash-sideways"]) == cli.EXIT_USAGE
    assert "error: unknown pass flash-sideways" in capsys.readouterr().err


# --- progress ----------------------------------------------------------------------------------

class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_rewrites_one_line_on_a_terminal_and_keeps_results_apart():
    term, results = Terminal(), io.StringIO()
    now = iter([0.0, 10.0, 20.0])
    progress = Progress(2, stream=term, clock=lambda: next(now))
    progress.write("header", file=results)  # nothing shown yet: nothing to clear
    progress.step("first")
    progress.write("row", file=results)
    progress.close()
    assert results.getvalue() == "header\nrow\n"
    shown = "[1/2 0:10, ~0:10 left] first"
    assert term.getvalue() == f"\r\033[2K{shown}\r\033[2K{shown}\n"
    plain = io.StringIO()
    progress = Progress(1, stream=plain)
    progress.write("row", file=results)
    progress.step("only")
    progress.close()
    assert plain.getvalue().endswith("] only\n") and "\r" not in plain.getvalue()


# --- the commands the documentation shows --------------------------------------------------------

DOCUMENTS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
COMMAND_IN_TEXT = re.compile(r"python -m cupyflash ([^`#\n]*)")
MODULE_IN_TEXT = re.compile(r"python -m (cupyflash\.[\w.]+)")


def documented_command_lines():
    """(document, words after 'python -m cupyflash') of every command line in the docs and in
    the examples of each command's --help; a line with placeholders ([...], <...>) or continued
    on the next one gives its command name only."""
    texts = [(path.name, path.read_text()) for path in DOCUMENTS]
    texts += [(f"{name} --help", cli.command_parser(name).epilog or "") for name in NAMES]
    for document, text in texts:
        for match in COMMAND_IN_TEXT.finditer(text):
            line = match.group(1).strip()
            if any(c in line for c in "[]<>\\") or "..." in line:
                line = line.split(" ", 1)[0]
            yield document, shlex.split(line)


def test_the_documented_command_lines_parse():
    seen, with_options = set(), 0
    for document, words in documented_command_lines():
        if not words or words[0] in ("--help", "--version", "help") or words[0].startswith("<"):
            continue
        with_options += len(words) > 1
        assert words[0] in NAMES, f"{document}: python -m cupyflash {' '.join(words)}"
        try:
            cli.command_parser(words[0]).parse_args(words[1:])
        except SystemExit:
            pytest.fail(f"{document}: python -m cupyflash {' '.join(words)} does not parse")
        seen.add(words[0])
    assert seen == set(NAMES)  # the README names every command
    assert with_options > 10


def test_the_documented_modules_have_a_main():
    for path in DOCUMENTS:
        for module in MODULE_IN_TEXT.findall(path.read_text()):
            imported = importlib.import_module(module.rstrip("."))
            if module != "cupyflash.bench":  # its __main__ runs the bench
                assert callable(getattr(imported, "main", None)), f"{path.name}: {module}"


# --- plan ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, kernels, wanted", [
    (["--arch", "90", "--dtype", "bf16", "--headdim", "128", "--causal"], 4,
     ["flash_fwd_wgmma_ws_bf16_hdim128_causal", "kernels_cu/flash_fwd_wgmma_ws.cu",
      "flash_bwd_wgmma_ws_bf16_hdim128_causal", "flash_bwd_dq_wgmma_ws"]),
    (["--arch", "80", "--dtype", "fp16", "--headdim", "64", "--window", "100", "0"], None,
     ["flash_fwd_mma_fp16_hdim64_local", "kernels_cu/flash_fwd_mma.cu"]),
    (["--arch", "80", "--dtype", "bf16", "--headdim", "64", "--atomic"], None, ["'atomic' (atomic adds)"]),
    (["--arch", "90", "--dtype", "fp32", "--statistics", "recomputed"], 4,
     ["flash_fwd_tf32_wgmma_ws_fp32_hdim128", "stats:", "flash_bwd_stats_dmma_fp32_hdim128", "_tf32x3"]),
    (["--arch", "90", "--dtype", "fp32", "--headdim", "200", "--statistics", "recomputed"], 4,
     ["stats:", "flash_bwd_stats_simt_fp32_hdim256"]),
    (["--arch", "90", "--dtype", "fp64", "--headdim", "200"], None, ["flash_fwd_simt_fp64"]),
])
def test_plan_prints_what_the_plans_choose(argv, kernels, wanted, capsys):
    """The plans' answer, no GPU: the specialization names are plan_forward's / plan_backward's."""
    from cupyflash import plan_cli

    assert cli.main(["plan", *argv]) == cli.EXIT_OK
    out = capsys.readouterr().out
    for text in wanted:
        assert text in out, (text, out)
    last = out.strip().splitlines()[-1]
    assert last.startswith("cupyflash plan: sm_")
    if kernels is not None:
        assert last.endswith(f"{kernels} kernels")
    args = cli.command_parser("plan").parse_args(argv)
    lines, count = plan_cli.describe(args.arch, plan_cli.SMEM_OPTIN[args.arch], args.dtype, args.headdim,
                                     args.headdim_v, args.causal, args.window, not args.atomic, args.precision,
                                     args.statistics)
    assert "\n".join(lines) in out and last.endswith(f"{count} kernels")


def test_plan_names_the_specializations_the_launchers_run():
    from cupyflash import plan_cli
    from cupyflash._dtypes import SUPPORTED
    from cupyflash.backward_plans import plan_backward
    from cupyflash.masks import mask_for
    from cupyflash.plans import plan_forward

    lines, _ = plan_cli.describe("90", 227 * 1024, "bfloat16", 64, None, True, (-1, -1), True)
    mask = mask_for(True)
    forward = plan_forward("90", SUPPORTED["bfloat16"], 64, mask, 227 * 1024)
    backward = plan_backward("90", SUPPORTED["bfloat16"], 64, mask, 227 * 1024, True)
    text = "\n".join(lines)
    assert forward.spec.name in text and all(launch.spec.name in text for launch in backward.launches)


def test_plan_refuses_what_no_plan_takes(capsys):
    assert cli.main(["plan", "--dtype", "bf16", "--statistics", "recomputed"]) == cli.EXIT_USAGE
    assert "no plan: statistics='recomputed'" in capsys.readouterr().out
    assert cli.main(["plan", "--headdim", "300"]) == cli.EXIT_USAGE


def test_tune_window_reaches_the_backwards_check_and_timing(monkeypatch, capsys, tmp_path):
    """--window with --direction bwd: every check and timing gets the window, and the TFLOP/s count
    the band's pairs; without --window the calls take no window argument (their default)."""
    from cupyflash.bench import harness, tune

    monkeypatch.setattr(harness, "gpu_unavailable_reason", lambda: None)
    calls = []
    monkeypatch.setattr(tune, "_check_bwd",
                        lambda kwargs, headdim, dtype, causal, **kw: calls.append(("check", kw)) or 0.5)
    monkeypatch.setattr(tune, "_time_backward", lambda kwargs, *rest, **kw: calls.append(("time", kw)) or 1.0)
    argv = ["tune", "--direction", "bwd", "--headdim", "128", "--seqlen", "4096", "--dev", str(tmp_path)]
    assert cli.main(argv + ["--window", "64", "0"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert calls and all(kw == {"window": (64, 0)} for _, kw in calls)
    assert {what for what, _ in calls} == {"check", "time"}
    # 1 ms for 2.5 x 4 B H D x the band's pairs, B H D = 4 x 16 x 128
    pairs = tune._visible_pairs(4096, False, (64, 0))
    assert f"{2.5 * 4 * 4 * 16 * 128 * pairs / 1e9:8.1f}" in out
    calls.clear()
    assert cli.main(argv) == cli.EXIT_OK
    assert calls and all(kw == {} for _, kw in calls)


def test_tune_counts_a_windows_visible_pairs():
    from cupyflash import reference
    from cupyflash.bench.tune import _visible_pairs

    for seqlen, causal, window in ((100, True, (10, 0)), (100, False, (10, 5)), (77, False, (-1, 3)),
                                   (64, True, (200, 0)), (50, False, (0, 0))):
        assert _visible_pairs(seqlen, causal, window) == reference.visible_keys(seqlen, seqlen, causal, window).sum()
    assert _visible_pairs(64, True, (-1, -1)) == 64 * 64 / 2  # the papers' causal count

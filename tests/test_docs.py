"""The documentation cannot rot: its code runs, what it prints is what the text shows, its links
into the sources point at the code they name, and docs/io-complexity.md's tables and script agree
with the kernels' current tile sizes.

Conventions for docs/*.md and README.md:
- A ```python block runs. The blocks of one file share one namespace and run top to bottom on the
  CPU; a block tagged ```python gpu runs only where a CUDA device is usable (test marked gpu).
- A ```text block that directly follows a python block (blank lines between are allowed) is that
  block's exact standard output, trailing spaces aside.
- A link with a line range, [`rescale`](../kernels_cu/flash_fwd_simt.cu#L76-L81), names in its
  text at least one `identifier` between backticks, and each of them occurs in those lines.
  Every relative link points to a file that exists.

The second half tests the pure parts of cupyflash/bench/io_complexity.py (byte model, ncu CSV
parsing, tables, the driver with a stand-in for ncu), which produce docs/io-complexity.md.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import stat
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from cupyflash import reference
from cupyflash._dtypes import SUPPORTED
from cupyflash.bench import io_complexity as iox

REPO = Path(__file__).resolve().parents[1]
MARKDOWN = sorted((REPO / "docs").glob("*.md")) + [p for p in [REPO / "README.md"] if p.is_file()]
KNOWN_TAGS = {"gpu"}


# --- reading Markdown ---------------------------------------------------------------------------

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^`]*)$")


@dataclass
class Block:
    language: str
    tags: frozenset
    body: str
    line: int  # 1-based line of the opening fence
    expected: str | None = None  # the ```text block right after a python block


def fenced_blocks(text: str) -> list[Block]:
    """Fenced code blocks in order, each python block paired with the text block after it."""
    lines = text.splitlines()
    raw = []  # (language, tags, body, first line, last line)
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, info = match.groups()
        words = info.split()
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        raw.append((words[0] if words else "", frozenset(words[1:]), "\n".join(body), start, i))
        i += 1
    blocks = []
    for index, (language, tags, body, start, end) in enumerate(raw):
        block = Block(language, tags, textwrap.dedent(body), start + 1)
        if language == "python" and index + 1 < len(raw):
            nxt = raw[index + 1]
            if nxt[0] == "text" and all(not line.strip() for line in lines[end + 1:nxt[3]]):
                block.expected = nxt[2]
        blocks.append(block)
    return blocks


def without_code(text: str) -> str:
    """The text with its fenced code blocks blanked out (line numbers kept)."""
    out, in_fence, fence = [], False, ""
    for line in text.splitlines():
        match = FENCE.match(line)
        if match and (not in_fence or line.strip().startswith(fence)):
            in_fence, fence = (not in_fence), match.group(2)
            out.append("")
        else:
            out.append("" if in_fence else line)
    return "\n".join(out)


def _normalise(output: str) -> str:
    return "\n".join(line.rstrip() for line in output.strip("\n").splitlines())


def run_python_blocks(path: Path, *, gpu: bool) -> int:
    """Run the file's python blocks (gpu ones only when ``gpu``); returns how many ran."""
    namespace = {"__name__": f"doc_{path.stem.replace('-', '_')}"}
    ran = 0
    for block in fenced_blocks(path.read_text()):
        if block.language != "python":
            continue
        unknown = block.tags - KNOWN_TAGS
        assert not unknown, f"{path.name}:{block.line}: unknown tag(s) {sorted(unknown)} on a python block"
        if "gpu" in block.tags and not gpu:
            continue
        code = compile(block.body, f"{path.relative_to(REPO)}:{block.line}", "exec")
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            exec(code, namespace)  # noqa: S102 - documentation examples, by design
        ran += 1
        if block.expected is not None:
            got, want = _normalise(stdout.getvalue()), _normalise(block.expected)
            assert got == want, (f"{path.name}:{block.line}: printed output differs from the text "
                                 f"block after it.\n--- printed ---\n{got}\n--- documented ---\n{want}")
    return ran


def _with_python(paths):
    return [p for p in paths if any(b.language == "python" for b in fenced_blocks(p.read_text()))]


def _ids(paths):
    return [str(p.relative_to(REPO)) for p in paths]


# --- the documents ------------------------------------------------------------------------------

DOCS_WITH_CODE = _with_python(MARKDOWN)


def test_the_documents_exist():
    names = {p.name for p in MARKDOWN}
    assert {"algorithm.md", "api.md", "io-complexity.md"} <= names


@pytest.mark.parametrize("path", DOCS_WITH_CODE, ids=_ids(DOCS_WITH_CODE))
def test_examples_run_and_print_what_the_text_shows(path, monkeypatch):
    monkeypatch.chdir(REPO)
    assert run_python_blocks(path, gpu=False) > 0 or all(
        "gpu" in b.tags for b in fenced_blocks(path.read_text()) if b.language == "python")


GPU_DOCS = [p for p in DOCS_WITH_CODE
            if any("gpu" in b.tags for b in fenced_blocks(p.read_text()) if b.language == "python")]


@pytest.mark.gpu
@pytest.mark.parametrize("path", GPU_DOCS, ids=_ids(GPU_DOCS))
def test_gpu_examples_run(path, monkeypatch):
    monkeypatch.chdir(REPO)
    run_python_blocks(path, gpu=True)


LINK = re.compile(r"!?\[((?:[^\[\]`]|`[^`]*`)*)\]\(([^)\s]+)\)")
LINE_RANGE = re.compile(r"^L(\d+)(?:-L(\d+))?$")


def links(path: Path):
    """(line number, link text, target) of every Markdown link outside code."""
    for number, line in enumerate(without_code(path.read_text()).splitlines(), 1):
        for match in LINK.finditer(line):
            yield number, match.group(1), match.group(2)


def heading_anchors(path: Path) -> set:
    """GitHub's anchors for the headings of a Markdown file."""
    anchors = set()
    for line in without_code(path.read_text()).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
            anchor, n = slug, 0
            while anchor in anchors:
                n += 1
                anchor = f"{slug}-{n}"
            anchors.add(anchor)
    return anchors


def check_link(path: Path, number: int, text: str, target: str) -> str | None:
    """None if the link is sound, else what is wrong with it."""
    if re.match(r"^[a-z]+:", target):
        return None
    file_part, _, fragment = target.partition("#")
    file = (path.parent / file_part).resolve() if file_part else path
    where = f"{path.name}:{number}: [{text}]({target})"
    if not file.is_file():
        return f"{where}: {file_part} does not exist"
    lines_match = LINE_RANGE.match(fragment)
    if not lines_match:
        if fragment and file.suffix == ".md" and fragment not in heading_anchors(file):
            return f"{where}: no heading of {file.name} has the anchor #{fragment}"
        return None
    first = int(lines_match.group(1))
    last = int(lines_match.group(2) or first)
    lines = file.read_text().splitlines()
    if not 1 <= first <= last <= len(lines):
        return f"{where}: lines {first}-{last} outside the file's {len(lines)} lines"
    names = re.findall(r"`([^`]+)`", text)
    if not names:
        return f"{where}: a link into lines must name an `identifier` that those lines contain"
    excerpt = "\n".join(lines[first - 1:last])
    for name in names:
        if name not in excerpt:
            found = [i for i, line in enumerate(lines, 1) if name in line]
            return (f"{where}: `{name}` is not in lines {first}-{last} of {file_part} "
                    f"(it is on lines {found or 'none'}); update the link")
    return None


@pytest.mark.parametrize("path", MARKDOWN, ids=_ids(MARKDOWN))
def test_links_point_at_what_they_name(path):
    problems = [p for p in (check_link(path, *link) for link in links(path)) if p]
    assert not problems, "\n".join(problems)


def test_link_checker_catches_drift(tmp_path):
    source = tmp_path / "src.cu"
    source.write_text("a\nconst float rescale = 1;\nb\n")
    doc = tmp_path / "doc.md"
    assert check_link(doc, 1, "`rescale`", "src.cu#L2") is None
    assert check_link(doc, 1, "the `rescale` step", "src.cu#L1-L3") is None
    assert "is on lines [2]" in check_link(doc, 1, "`rescale`", "src.cu#L3")
    assert "must name" in check_link(doc, 1, "rescale", "src.cu#L2")
    assert "outside" in check_link(doc, 1, "`rescale`", "src.cu#L2-L9")
    assert "does not exist" in check_link(doc, 1, "x", "nope.cu")
    assert check_link(doc, 1, "paper", "https://arxiv.org/abs/2205.14135") is None
    doc.write_text("# Title\n\n## 2. The backward pass: `dQ`, dK\n\n## Title\n")
    assert heading_anchors(doc) == {"title", "2-the-backward-pass-dq-dk", "title-1"}
    assert check_link(doc, 1, "back", "#2-the-backward-pass-dq-dk") is None
    assert "no heading" in check_link(doc, 1, "back", "doc.md#backward")


def test_block_reader_pairs_output_with_its_code():
    text = "x\n```python\nprint(1)\n```\n\n```text\n1\n```\n```python gpu\npass\n```\n```text\nnot output\n"
    text += "```\n"
    blocks = fenced_blocks(text)
    assert [b.language for b in blocks] == ["python", "text", "python", "text"]
    assert blocks[0].expected == "1" and blocks[0].line == 2
    assert blocks[2].tags == {"gpu"} and blocks[2].expected == "not output"


def test_api_reference_covers_the_public_api():
    import cupyflash

    text = (REPO / "docs" / "api.md").read_text()
    public = [n for n in cupyflash.__all__ if callable(getattr(cupyflash, n))]
    public += [f"reference.{n}" for n in reference.__all__]
    missing = [n for n in public if f"`{n}" not in text and f"### {n}" not in text]
    assert not missing, f"docs/api.md does not document {missing}"


def test_io_complexity_model_table_is_current():
    text = (REPO / "docs" / "io-complexity.md").read_text()
    section = iox.section_text(text, "model")
    assert section is not None, "docs/io-complexity.md lost its cupyflash-io:model markers"
    assert section.strip() == iox.model_section(iox.default_configs()).strip(), (
        "the tile sizes changed: python -m cupyflash.bench.io_complexity --model-only "
        "--markdown docs/io-complexity.md")


# --- io_complexity: the byte model --------------------------------------------------------------

def test_tile_sizes_are_those_of_the_launched_specializations():
    from cupyflash import plans
    from cupyflash.kernels import mma_fwd, simt

    for d in (64, 128, 256):
        tiles = iox.flash_tiles(iox.Config("flash-fwd", 1024, d))
        plan = plans.plan_forward(mma_fwd.current_arch(), SUPPORTED["bfloat16"], d, False,
                                  mma_fwd.current_smem_optin())
        assert tiles["fwd"] == (plan.tiles.block_m, plan.tiles.block_n)
    for dtype, d in (("float32", 64), ("float64", 128), ("bfloat16", 48)):
        tiles = iox.flash_tiles(iox.Config("flash-fwd", 1024, d, dtype=dtype, family="simt"))
        assert tiles["fwd"] == simt.tile_config(SUPPORTED[dtype], d)[:2]
        assert tiles["dkdv"] == tiles["dq"] == tiles["fwd"]
    assert iox._block_sizes("flash_bwd_dkdv_mma_bf16_hdim128_full_bm64_ms32_bn128_w8_wd1") == (64, 128)
    with pytest.raises(ValueError, match="tile sizes"):
        iox._block_sizes("flash_bwd_preprocess_bf16")


@pytest.mark.parametrize("family,dtype,d", [("mma", "bfloat16", 64), ("mma", "float16", 128),
                                            ("simt", "float32", 64), ("simt", "float64", 32)])
def test_forward_model_closed_form(family, dtype, d):
    """No mask: Q once, K and V once per query block, O and lse written once."""
    e, a = SUPPORTED[dtype].itemsize, 8 if dtype == "float64" else 4
    for n, h, hkv in ((1000, 4, 4), (4096, 8, 2)):
        c = iox.Config("flash-fwd", n, d, dtype=dtype, batch=2, nheads=h, nheads_kv=hkv, family=family)
        br = iox.flash_tiles(c)["fwd"][0]
        (k,) = iox.model(c)
        assert k.tile_read == 2 * h * n * d * e * (1 + 2 * math.ceil(n / br))
        assert k.once_read == 2 * n * d * e * (h + 2 * hkv)
        assert k.tile_write == k.once_write == 2 * h * n * (d * e + a)


def test_backward_model_closed_form():
    c = iox.Config("flash-bwd", 3000, 128, nheads=8, nheads_kv=2)
    tiles = iox.flash_tiles(c)
    n, d, e, h, hkv, a = 3000, 128, 2, 8, 2, 4
    pre, dkdv, dq = iox.model(c)
    assert (pre.tile_read, pre.tile_write) == (2 * h * n * d * e, h * n * a)
    tc = math.ceil(n / tiles["dkdv"][1])
    assert dkdv.tile_read == 2 * hkv * n * d * e + tc * 2 * h * n * (d * e + a)
    assert dkdv.once_read == 2 * hkv * n * d * e + 2 * h * n * (d * e + a)
    assert dkdv.tile_write == 2 * hkv * n * d * e
    tr = math.ceil(n / tiles["dq"][0])
    assert dq.tile_read == 2 * h * n * (d * e + a) + tr * 2 * h * n * d * e
    assert dq.once_read == 2 * h * n * (d * e + a) + 2 * hkv * n * d * e
    assert dq.tile_write == h * n * d * e


def _visible_key_rows(rows, seqlen_q, seqlen_k, block_n):
    """Key rows in the key blocks that hold a key visible to some query in ``rows``."""
    visible = reference.visible_keys(seqlen_q, seqlen_k, True)[rows].any(axis=0)
    if not visible.any():
        return 0
    blocks = np.flatnonzero(visible).max() // block_n + 1
    return min(seqlen_k, blocks * block_n)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(100, 100), (64, 200), (200, 64), (1, 77), (130, 128)])
@pytest.mark.parametrize("block_m,block_n", [(64, 64), (128, 32), (16, 48)])
def test_causal_loop_bounds_agree_with_the_mask(seqlen_q, seqlen_k, block_m, block_n):
    """The kernels skip exactly the key blocks above the diagonal, and (backward) the query blocks
    before it; recomputed here from the float64 reference's mask."""
    for m0 in range(0, seqlen_q, block_m):
        rows = slice(m0, min(m0 + block_m, seqlen_q))
        want = _visible_key_rows(rows, seqlen_q, seqlen_k, block_n)
        assert iox._key_rows_fwd(seqlen_q, seqlen_k, m0, block_m, block_n, True) >= want
        assert iox._key_rows_dq("mma", seqlen_q, seqlen_k, m0, block_m, block_n, True) == want
    mask = reference.visible_keys(seqlen_q, seqlen_k, True)
    for n0 in range(0, seqlen_k, block_n):
        seen_by = np.flatnonzero(mask[:, n0:n0 + block_n].any(axis=1))
        rows = iox._query_rows_dkdv(seqlen_q, seqlen_k, n0, block_m, True)
        if len(seen_by):
            assert seqlen_q - rows <= seen_by.min() < seqlen_q - rows + block_m


def test_standard_attention_model_is_the_papers_count():
    """Θ(Nd + N²): Q, K, V read and O written once, S and P each written and read once."""
    n, d, h = 2048, 64, 8
    k = iox.totals(iox.model(iox.Config("standard-fwd", n, d, nheads=h, nheads_kv=h)))
    assert k.once_read == h * (3 * n * d + 2 * n * n) * 2
    assert k.once_write == h * (n * d + 2 * n * n) * 2
    assert k.tile_read is None
    in_float32 = iox.totals(iox.model(iox.Config("standard-fwd", n, d), standard_itemsize=4))
    assert in_float32.once_write == 8 * (n * d + 2 * n * n) * 4


def test_reread_factor_grows_like_n_over_block_m():
    """The paper's Θ(N²d²/M): K and V cross the chip boundary N / Br times."""
    small, large = (iox.totals(iox.model(iox.Config("flash-fwd", n, 128))) for n in (2048, 8192))
    assert large.once_read == 4 * small.once_read
    assert 15 < large.tile_read / small.tile_read <= 16


def test_papers_block_sizes():
    # 100 KB of on-chip memory (the paper's example), d = 64, 16-bit elements
    assert iox.paper_tile_sizes(64, 100_000, 2) == (64, 196)
    assert iox.paper_tile_sizes(128, 227 * 1024, 2) == (128, 227)


# --- io_complexity: configurations, ncu output, tables ------------------------------------------

def test_worker_spec_round_trip():
    c = iox.Config("flash-bwd", 2048, 64, dtype="float16", batch=2, nheads=16, nheads_kv=4, causal=True)
    assert iox.Config.from_spec(c.to_spec()) == c
    with pytest.raises(ValueError, match="key=value"):
        iox.Config.from_spec("kind=flash-fwd,1024")
    with pytest.raises(ValueError, match="unknown worker spec keys"):
        iox.Config.from_spec("kind=flash-fwd,seqlen=1,headdim=64,colour=red")
    with pytest.raises(ValueError, match="mma family"):
        iox.Config("flash-fwd", 128, 64, dtype="float32")
    with pytest.raises(ValueError, match="no GQA"):
        iox.Config("standard-fwd", 128, 64, nheads=8, nheads_kv=2)


HEADER_NEW = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
              '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
              '"Metric Value"')
HEADER_OLD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Kernel Time","Context",'
              '"Stream","Section Name","Metric Name","Metric Unit","Metric Value"')
FWD_KERNEL = "void cf::flash_fwd_mma<cf::bf16_t, 64, false, 128, 64, 4, false, 2, 2>(const T1 *, ...)"


def _row_new(launch, kernel, metric, unit, value):
    return (f'"{launch}","4242","python3.11","gpu-host","{kernel}","1","7","(128, 1, 1)","(8, 8, 1)",'
            f'"0","9.0","Command line profiler metrics","{metric}","{unit}","{value}"')


def _row_old(launch, kernel, metric, unit, value):
    return (f'"{launch}","4242","python3.11","gpu-host","{kernel}","2026-Nov-30 10:00:00","1","7",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"')


SAMPLE_CSV = "\n".join([
    "==PROF== Connected to process 4242 (/usr/bin/python3.11)",
    '==PROF== Profiling "flash_fwd_mma": 0%....50%....100% - 1 pass',
    HEADER_NEW,
    _row_new(0, FWD_KERNEL, "dram__bytes_read.sum", "byte", "3,145,728"),
    _row_new(0, FWD_KERNEL, "dram__bytes_write.sum", "byte", "1081344"),
    _row_new(0, FWD_KERNEL, "lts__t_sectors_srcunit_tex_op_read.sum", "sector", "557,056"),
    _row_new(0, FWD_KERNEL, "lts__t_sectors_srcunit_tex_op_write.sum", "sector", "33,792"),
    "==PROF== Disconnected from process 4242",
])


def test_parse_ncu_csv():
    (launch,) = iox.parse_ncu_csv(SAMPLE_CSV)
    assert launch.kernel == FWD_KERNEL  # template arguments' commas stay inside the quotes
    assert launch.values == {"dram__bytes_read.sum": 3 * 2**20, "dram__bytes_write.sum": 1081344,
                             "lts__t_sectors_srcunit_tex_op_read.sum": 557056 * 32,
                             "lts__t_sectors_srcunit_tex_op_write.sum": 33792 * 32}


def test_parse_ncu_csv_older_columns_prefixed_units_and_several_kernels():
    text = "\n".join([
        HEADER_OLD,
        _row_old(0, "flash_bwd_preprocess", "dram__bytes_read.sum", "Mbyte", "4.19"),
        _row_old(0, "flash_bwd_preprocess", "dram__bytes_write.sum", "Kbyte", "32.77"),
        _row_old(1, "flash_bwd_dkdv_mma", "dram__bytes_read.sum", "Gbyte", "1.5"),
        _row_old(1, "flash_bwd_dkdv_mma", "dram__bytes_write.sum", "byte", "0"),
        '==WARNING== a warning ncu prints after the table',
    ])
    pre, dkdv = iox.parse_ncu_csv(text)
    assert pre.values["dram__bytes_read.sum"] == pytest.approx(4.19e6)
    assert pre.values["dram__bytes_write.sum"] == pytest.approx(32770)
    assert dkdv.kernel == "flash_bwd_dkdv_mma" and dkdv.values["dram__bytes_read.sum"] == 1.5e9


def test_parse_ncu_csv_errors():
    with pytest.raises(ValueError, match="no CSV header"):
        iox.parse_ncu_csv("==PROF== Connected\n==ERROR== The application returned an error code (1).")
    with pytest.raises(ValueError, match="unknown ncu metric unit"):
        iox.parse_ncu_csv(HEADER_NEW + "\n" + _row_new(0, "k", "dram__bytes_read.sum", "furlong", "1"))


def _measurement(config, dram, l2=None, **worker):
    values = {"dram__bytes_read.sum": dram[0], "dram__bytes_write.sum": dram[1]}
    if l2:
        values.update({"lts__t_sectors_srcunit_tex_op_read.sum": l2[0],
                       "lts__t_sectors_srcunit_tex_op_write.sum": l2[1]})
    return iox.Measurement(config, [iox.KernelCounters("0", "k", values)], worker)


def test_measured_table():
    fwd = iox.Config("flash-fwd", 1024, 64)
    t = iox.totals(iox.model(fwd))
    ok = _measurement(fwd, (t.once_read, t.once_write), (t.tile_read // 2, t.tile_write // 2))
    failed = iox.Measurement(iox.Config("standard-fwd", 1024, 64), error="boom")
    lines = iox.measured_table([ok, failed]).splitlines()
    assert lines[0].startswith("| pass | d | N |") and lines[1].startswith("|---|---:|")
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:6] == ["flash-fwd", "64", "1024", "3.00 + 1.03", "3.00 + 1.03", "1.00"]
    assert cells[6:] == ["17.0 + 1.03", "8.50 + 0.52", "0.50"]
    assert "failed" in lines[3]
    section = iox.measured_section([ok, failed], ncu_version="ncu 2025.3",
                                   plot="io-complexity.png")
    assert "Failed: standard-fwd d64 N1024: boom" in section
    assert section.rstrip().endswith("![bytes against N](io-complexity.png)")


def test_markdown_sections_are_replaced_between_markers(tmp_path):
    begin, end = iox.markers("measured")
    doc = tmp_path / "io.md"
    doc.write_text(f"# Title\n\n{begin}\nTo be measured.\n{end}\n\nAfter.\n")
    assert iox.write_markdown(doc, {"measured": "| a |\n|---|\n| 1 |"}) == []
    assert doc.read_text() == f"# Title\n\n{begin}\n| a |\n|---|\n| 1 |\n{end}\n\nAfter.\n"
    assert iox.section_text(doc.read_text(), "measured") == "| a |\n|---|\n| 1 |\n"
    assert iox.write_markdown(doc, {"model": "m"}) == ["model"]
    assert iox.section_text(doc.read_text(), "model") == "m\n"


def test_model_only_command_line(capsys, tmp_path):
    assert iox.main(["--model-only", "--quick", "--passes", "flash-fwd"]) == 0
    out = capsys.readouterr().out
    assert "| flash-fwd | 128 | 4096 |" in out and "standard" not in out
    assert iox.main(["--model-only", "--passes", "flash-sideways"]) == iox.EXIT_USAGE


def test_plot_of_the_model(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "model.png"
    assert iox.plot(iox.default_configs((1024, 2048), (64,)), path) is None
    assert path.read_bytes().startswith(b"\x89PNG")


def test_missing_ncu_is_reported(capsys, monkeypatch):
    monkeypatch.setattr(iox, "find_ncu", lambda explicit=None: None)
    assert iox.main(["--quick"]) == iox.EXIT_NO_NCU
    assert "ncu (Nsight Compute) not found" in capsys.readouterr().err


FAKE_NCU = r'''#!{python}
"""Stands in for ncu: prints a details-page CSV whose DRAM bytes equal the model's distinct
bytes, and rejects the L2 metrics (as an ncu that does not know them would)."""
import json, sys
sys.path.insert(0, {root!r})
from cupyflash.bench import io_complexity as iox
args = sys.argv[1:]
if args == ["--version"]:
    print("NVIDIA (R) Nsight Compute Command Line Profiler\nVersion 2099.1.0.0 (build 1)")
    sys.exit(0)
metrics = args[args.index("--metrics") + 1].split(",")
if any(m.startswith("lts__") for m in metrics):
    print("==ERROR== Failed to find metric regex:^lts__t_sectors_srcunit_tex_op_read.sum$")
    sys.exit(1)
config = iox.Config.from_spec(args[args.index("--worker") + 1])
report = args[args.index("--worker-report") + 1]
json.dump({{"device": "Fake H200", "sm_count": 132, "l2_bytes": 52428800, "cupy": "14.2.0"}},
          open(report, "w"))
print("==PROF== Connected to process 1")
print({header!r})
for i, k in enumerate(iox.model(config)):
    for metric, value in (("dram__bytes_read.sum", k.once_read), ("dram__bytes_write.sum", k.once_write)):
        print(f'"{{i}}","1","python","h","{{k.kernel}}","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0","s",'
              f'"{{metric}}","byte","{{value:,}}"')
print("==PROF== Disconnected from process 1")
'''


def test_driver_end_to_end_with_a_stand_in_for_ncu(tmp_path, capsys):
    fake = tmp_path / "ncu"
    fake.write_text(FAKE_NCU.format(python=sys.executable, root=str(REPO), header=HEADER_NEW))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    doc = tmp_path / "io.md"
    begin, end = iox.markers("measured")
    doc.write_text(f"# IO\n{begin}\nTo be measured.\n{end}\n")
    out_json = tmp_path / "io.json"
    status = iox.main(["--ncu", str(fake), "--seqlen", "256", "512", "--headdim", "64",
                       "--passes", "flash-fwd,flash-bwd", "--markdown", str(doc), "--json", str(out_json)])
    log = capsys.readouterr().out
    assert status == 0, log
    assert "ncu 2099.1.0.0" in log and "measuring DRAM only" in log
    section = iox.section_text(doc.read_text(), "measured")
    assert "Fake H200 (132 SMs, L2 50 MiB)" in section
    rows = [line for line in section.splitlines() if line.startswith("| flash")]
    assert len(rows) == 4 and all("| 1.00 |" in row for row in rows)
    data = json.loads(out_json.read_text())
    assert data["ncu"] == "ncu 2099.1.0.0"
    assert [len(m["kernels"]) for m in data["measurements"]] == [1, 1, 3, 3]


def test_driver_stops_at_a_permission_error(tmp_path, capsys):
    calls = tmp_path / "calls"
    fake = tmp_path / "ncu"
    fake.write_text(f"#!/bin/sh\necho run >> {calls}\necho '==ERROR== ERR_NVGPUCTRPERM - The user does "
                    "not have permission to access NVIDIA GPU Performance Counters'\nexit 1\n")
    fake.chmod(0o755)
    status = iox.main(["--ncu", str(fake), "--quick"])
    assert status == iox.EXIT_FAILED
    assert calls.read_text().count("run") == 2  # the version query and the first configuration
    log = capsys.readouterr().out
    assert log.count("NVreg_RestrictProfilingToAdminUsers=0") == 1
    assert log.count("not run (the same permission error)") == 5
    assert log.count("| failed |") == 2 * 6  # DRAM and L2 cells of every row


def test_worker_reports_a_missing_gpu(tmp_path):
    from cupyflash import dispatch

    if dispatch.gpu_available():
        pytest.skip("a GPU is present")
    report = tmp_path / "report.json"
    status = iox.main(["--worker", iox.Config("flash-fwd", 128, 64).to_spec(),
                       "--worker-report", str(report)])
    assert status == iox.EXIT_FAILED
    assert json.loads(report.read_text())["error"]


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
        return nvrtc
    except Exception:  # no CuPy or no NVRTC library
        return None


@pytest.mark.skipif(_nvrtc() is None, reason="NVRTC not installed (pip install '.[test]')")
@pytest.mark.parametrize("arch", ["80", "90"])
def test_the_baselines_softmax_kernel_compiles(arch):
    nvrtc = _nvrtc()
    expressions = [iox.softmax_expression(n) for n in ("bfloat16", "float16", "float32")]
    program = nvrtc.createProgram(iox.softmax_source(), "io_softmax.cu", [], [])
    try:
        for expression in expressions:
            nvrtc.addNameExpression(program, expression)
        try:
            nvrtc.compileProgram(program, ["-std=c++17", f"-arch=sm_{arch}"])
        except Exception:
            pytest.fail(nvrtc.getProgramLog(program))
        assert all(nvrtc.getLoweredName(program, e) for e in expressions)
    finally:
        nvrtc.destroyProgram(program)


def test_find_ncu_prefers_the_explicit_path(tmp_path, monkeypatch):
    fake = tmp_path / "my-ncu"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert iox.find_ncu(str(fake)) == str(fake)
    monkeypatch.setenv("NCU", str(fake))
    assert iox.find_ncu() == str(fake)
    assert os.access(fake, os.X_OK)

"""Tables of a run: plain text for the terminal, Markdown for docs/benchmarks.md.

Throughput cells are TFLOP/s (decode: TB/s of K+V read; memory: MiB); "—" marks a case the
implementation rejected, "err" one that failed, and a trailing "!" a cupyflash result that
failed validation. Ratio columns divide each cupyflash implementation by each anchor.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .environment import summary_line
from .impls import STANDARD
from .shapes import format_size

MISSING = "—"
FAILED_MARK = "!"
MEMORY_CELLS = {"rejected": MISSING, "skipped": MISSING, "oom": "OOM"}
LEGEND = (f"{MISSING}: rejected by that implementation (reason in the JSON) · err: failed · "
          f"{FAILED_MARK}: cupyflash result failed validation against float64")


@dataclass
class Table:
    header: list
    rows: list
    left: int = 1  # leading columns (the case's keys) aligned left, the figures right


def fmt(value, digits: int) -> str:
    return MISSING if value is None else f"{value:,.{digits}f}"


def ratio(numerator, denominator) -> str:
    if numerator is None or denominator is None or denominator == 0:
        return MISSING
    return f"{numerator / denominator:.2f}"


def heads(case) -> str:
    h = str(case.nheads) if case.nheads == case.nheads_kv else f"{case.nheads}/{case.nheads_kv}"
    return f"{case.batch}×{h}"


THROUGHPUT_KEYS = ("dtype", "d", "seqlen", "B×H", "causal", "mode")
DECODE_KEYS = ("dtype", "d", "B×H", "kv len")
MEMORY_KEYS = ("dtype", "d", "seqlen", "B×H", "causal")


def keys_of(case, keys) -> list:
    values = {
        "dtype": case.dtype,
        "d": str(case.headdim),
        "seqlen": format_size(case.seqlen_q) if case.seqlen_q == case.seqlen_k
        else f"{format_size(case.seqlen_q)}×{format_size(case.seqlen_k)}",
        "B×H": heads(case),
        "causal": "yes" if case.causal else "no",
        "mode": case.mode,
        "kv len": format_size(case.seqlen_k),
    }
    return [values[k] for k in keys]


def impl_columns(measurements) -> tuple[list, list]:
    """(cupyflash labels, anchor labels), each in order of first appearance."""
    ours, anchors = [], []
    for m in measurements:
        bucket = ours if m.impl.family == "cupyflash" else anchors
        if m.impl.label not in bucket:
            bucket.append(m.impl.label)
    return ours, anchors


def by_case(measurements) -> dict:
    """case -> {impl label: measurement}, cases in order of first appearance."""
    table: dict = {}
    for m in measurements:
        table.setdefault(m.case, {})[m.impl.label] = m
    return table


def cell(m, figure: str, digits: int) -> str:
    if m is None or m.status == "rejected":
        return MISSING
    if not m.ok:
        return "err"
    text = fmt(getattr(m, figure), digits)
    return text + (FAILED_MARK if m.valid is False else "")


def _figure_table(measurements, keys, figure: str, digits: int) -> Table:
    ours, anchors = impl_columns(measurements)
    header = list(keys) + ours + anchors + [f"{a}/{b}" for a in ours for b in anchors]
    rows = []
    for case, impls in by_case(measurements).items():
        values = {label: (getattr(m, figure) if m.ok else None) for label, m in impls.items()}
        rows.append(keys_of(case, keys)
                    + [cell(impls.get(label), figure, digits) for label in ours + anchors]
                    + [ratio(values.get(a), values.get(b)) for a in ours for b in anchors])
    return Table(header, rows, len(keys))


def throughput_table(measurements) -> Table:
    """TFLOP/s per case, with cupyflash/anchor ratios."""
    return _figure_table(measurements, THROUGHPUT_KEYS, "tflops", 1)


def decode_table(measurements, copy=None) -> Table:
    """K+V read TB/s per case, with ratios and the fraction of the copy bandwidth reached by
    each cupyflash implementation."""
    t = _figure_table(measurements, DECODE_KEYS, "kv_tbps", 2)
    if copy is None:
        return t
    ours, _ = impl_columns(measurements)
    t.header += [f"{label}/copy" for label in ours]
    for row, impls in zip(t.rows, by_case(measurements).values()):
        row += [ratio(impls[label].kv_tbps if label in impls and impls[label].ok else None,
                      copy.tbps) for label in ours]
    return t


def memory_table(records) -> Table:
    """Extra peak MiB per case, and standard / each cupyflash implementation."""
    labels, ours = [], []
    for r in records:
        if r.label not in labels:
            labels.append(r.label)
            if r.family == "cupyflash":
                ours.append(r.label)
    baseline = STANDARD if STANDARD in labels else None
    header = list(MEMORY_KEYS) + labels + ([f"{STANDARD}/{label}" for label in ours]
                                           if baseline else [])
    rows = []
    for case, recs in by_case_records(records).items():
        mib = {label: r.peak_bytes / 2**20 for label, r in recs.items() if r.status == "ok"}
        cells = [fmt(mib[label], 0) if label in mib
                 else MEMORY_CELLS.get(recs[label].status, "err") if label in recs
                 else MISSING for label in labels]
        ratios = [ratio(mib.get(baseline), mib.get(label)) for label in ours] if baseline else []
        rows.append(keys_of(case, MEMORY_KEYS) + cells + ratios)
    return Table(header, rows, len(MEMORY_KEYS))


def by_case_records(records) -> dict:
    """case -> {label: MemoryRecord}, cases in order of first appearance."""
    table: dict = {}
    for r in records:
        table.setdefault(r.case, {})[r.label] = r
    return table


def render_text(t: Table) -> str:
    """Aligned columns: keys left, figures right."""
    widths = [max(len(str(x)) for x in column) for column in zip(t.header, *t.rows)]

    def line(values):
        return "  ".join(str(v).ljust(w) if i < t.left else str(v).rjust(w)
                         for i, (v, w) in enumerate(zip(values, widths))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(t.header), rule] + [line(r) for r in t.rows])


def render_markdown(t: Table) -> str:
    def line(values):
        return "| " + " | ".join(str(v).replace("|", "\\|") for v in values) + " |"

    align = ["---"] * t.left + ["---:"] * (len(t.header) - t.left)
    return "\n".join([line(t.header), "|" + "|".join(align) + "|"] + [line(r) for r in t.rows])


def _split_by_dtype(measurements) -> dict:
    groups: dict = {}
    for m in measurements:
        groups.setdefault(m.case.dtype, []).append(m)
    return groups


def text_report(report) -> str:
    """Everything the run measured, for stdout."""
    parts = [summary_line(report.environment)]
    if report.throughput:
        parts += ["", "Throughput, TFLOP/s", render_text(throughput_table(report.throughput))]
    if report.decode:
        title = "Decode, K+V read TB/s"
        if report.copy is not None:
            title += f" (device-to-device copy: {report.copy.tbps:.2f} TB/s, read + written)"
        parts += ["", title, render_text(decode_table(report.decode, report.copy))]
    if report.memory:
        parts += ["", "Extra peak device memory of forward+backward, MiB",
                  render_text(memory_table(report.memory))]
    parts += ["", LEGEND] + list(report.notes)
    return "\n".join(parts)


def markdown_sections(report) -> dict:
    """Section name -> Markdown body, only for what this run measured."""
    sections = {"environment": "\n".join(
        [f"Measured: {summary_line(report.environment)}."]
        + [f"\n{note}" for note in report.notes])}
    if report.throughput:
        blocks = [f"TFLOP/s (FLOPs = 4·B·H·Sq·Sk·D, ×0.5 causal, ×2.5 bwd, ×3.5 fwd+bwd). "
                  f"{LEGEND}."]
        for dtype, ms in _split_by_dtype(report.throughput).items():
            blocks += [f"#### {dtype}", render_markdown(throughput_table(ms))]
        sections["throughput"] = "\n\n".join(blocks)
    if report.decode:
        head = "K+V read bandwidth, TB/s."
        if report.copy is not None:
            head += (f" Device-to-device copy in the same run: {report.copy.tbps:.2f} TB/s "
                     f"(bytes read + written, {report.copy.nbytes / 2**30:.1f} GiB).")
        sections["decode"] = head + "\n\n" + render_markdown(decode_table(report.decode,
                                                                          report.copy))
    if report.memory:
        sections["memory"] = ("Extra peak device memory of one forward+backward, MiB.\n\n"
                              + render_markdown(memory_table(report.memory)))
    return sections


SECTION_NAMES = ("environment", "throughput", "decode", "memory")
_MARKER = re.compile(
    r"(<!-- cupyflash-bench:(\w+):begin -->\n)(.*?)(<!-- cupyflash-bench:\2:end -->)", re.DOTALL)


def markers(name: str) -> tuple[str, str]:
    return (f"<!-- cupyflash-bench:{name}:begin -->", f"<!-- cupyflash-bench:{name}:end -->")


def fill_markdown(document: str, sections: dict) -> tuple[str, list]:
    """Replace the body between each section's markers; sections this run did not measure keep
    their previous text. Returns (new document, names of sections that had no markers)."""
    found = set()

    def replace(match):
        name = match.group(2)
        if name not in sections:
            return match.group(0)
        found.add(name)
        return match.group(1) + sections[name].rstrip("\n") + "\n" + match.group(4)

    text = _MARKER.sub(replace, document)
    return text, [name for name in sections if name not in found]


def standalone_markdown(sections: dict) -> str:
    """A new document holding every section, with markers so that later runs can refill it."""
    parts = ["# cupyflash benchmark results", ""]
    for name in SECTION_NAMES:
        begin, end = markers(name)
        body = sections.get(name, "Not measured in this run.")
        parts += [f"## {name.capitalize()}", "", begin, body.rstrip("\n"), end, ""]
    return "\n".join(parts)

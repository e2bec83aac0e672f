"""PNG plots of a run, with matplotlib when it is installed (``pip install cupyflash[bench]``).

Throughput: TFLOP/s against seqlen, one panel per dtype x headdim (rows) and causal x mode
(columns), one line per implementation. Memory: extra peak MiB against seqlen, log-log.
"""
from __future__ import annotations

from pathlib import Path

from .shapes import format_size


def _figure_class():
    """matplotlib's Figure (drawn with the Agg canvas, no pyplot state), or None."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure


def panels(measurements) -> tuple[list, list]:
    """(row keys (dtype, headdim), column keys (causal, mode)) present in ``measurements``."""
    rows, cols = [], []
    for m in measurements:
        row, col = (m.case.dtype, m.case.headdim), (m.case.causal, m.case.mode)
        if row not in rows:
            rows.append(row)
        if col not in cols:
            cols.append(col)
    return rows, sorted(cols, key=lambda c: (c[1] != "fwd", c[1], c[0]))


def series(measurements, row, col) -> dict:
    """impl label -> sorted [(seqlen, TFLOP/s)] of one panel (failed cases left out)."""
    lines: dict = {}
    for m in measurements:
        if (m.case.dtype, m.case.headdim) == row and (m.case.causal, m.case.mode) == col and m.ok:
            lines.setdefault(m.impl.label, []).append((m.case.seqlen_q, m.tflops))
    return {label: sorted(points) for label, points in lines.items()}


def plot_throughput(measurements, path) -> str | None:
    """Write the throughput PNG; returns None, or why nothing was written."""
    Figure = _figure_class()
    if Figure is None:
        return "matplotlib is not installed (pip install matplotlib); no plot written"
    rows, cols = panels(measurements)
    if not rows:
        return "no throughput results to plot"
    fig = Figure(figsize=(3.6 * len(cols), 2.8 * len(rows)), layout="constrained")
    axes = fig.subplots(len(rows), len(cols), squeeze=False, sharex=True)
    styles = {}
    for i, row in enumerate(rows):
        for j, col in enumerate(cols):
            ax = axes[i][j]
            for label, points in series(measurements, row, col).items():
                marker = "o" if label.startswith("cupyflash") else "."
                style = styles.setdefault(label, f"C{len(styles)}")
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker=marker, color=style, label=label,
                        linewidth=2 if label.startswith("cupyflash") else 1)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{row[0]} d{row[1]} {'causal' if col[0] else 'full'} {col[1]}",
                         fontsize=9)
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            if j == 0:
                ax.set_ylabel("TFLOP/s")
            if i == len(rows) - 1:
                ax.set_xlabel("seqlen")
    seqlens = sorted({m.case.seqlen_q for m in measurements})
    for ax in axes[-1]:
        ax.set_xticks(seqlens, [format_size(s) for s in seqlens], fontsize=8)
    handles, labels = {}, []
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in handles:
                handles[label] = handle
                labels.append(label)
    fig.legend([handles[label] for label in labels], labels, loc="outside lower center",
               ncols=min(len(labels), 6), fontsize=8)
    fig.savefig(Path(path), dpi=120)
    return None


def plot_memory(records, path) -> str | None:
    """Write the memory PNG; returns None, or why nothing was written."""
    Figure = _figure_class()
    if Figure is None:
        return "matplotlib is not installed (pip install matplotlib); no plot written"
    lines: dict = {}
    for r in records:
        if r.status == "ok":
            lines.setdefault(r.label, []).append((r.case.seqlen_q, r.peak_bytes / 2**20))
    if not lines:
        return "no memory results to plot"
    fig = Figure(figsize=(5, 3.6), layout="constrained")
    ax = fig.subplots()
    for label, points in lines.items():
        xs, ys = zip(*sorted(points))
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    seqlens = sorted({r.case.seqlen_q for r in records})
    ax.set_xticks(seqlens, [format_size(s) for s in seqlens])
    first = records[0].case
    ax.set_title(f"{first.dtype} d{first.headdim} b{first.batch} h{first.nheads} "
                 f"{'causal' if first.causal else 'full'} fwd+bwd", fontsize=9)
    ax.set_xlabel("seqlen")
    ax.set_ylabel("extra peak memory, MiB")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(Path(path), dpi=120)
    return None


def memory_plot_path(path) -> Path:
    """bench.png -> bench-memory.png"""
    path = Path(path)
    return path.with_name(f"{path.stem}-memory{path.suffix or '.png'}")

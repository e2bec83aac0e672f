"""Bytes that attention moves to and from GPU memory: the FlashAttention IO model, exact for the
kernels cupyflash launches, and the same kernels measured with Nsight Compute.

The FlashAttention paper counts accesses to HBM with one level of on-chip memory of M bytes:
standard attention needs Θ(N·d + N²) (S and P make a round trip through HBM), the tiled
algorithm Θ(N²·d²/M) (K and V are streamed once per query block of Θ(M/d) rows). Here the
count is exact, from the loop bounds of each kernel and the tile sizes of the specializations
cupyflash launches, in two forms per kernel:

* ``tile``: every byte its tiles request, re-reads included. This is the paper's count: the
  traffic between the SMs and the next level, which Nsight Compute reports as L2 sectors
  requested by the SMs (``lts__t_sectors_srcunit_tex_op_{read,write}.sum``).
* ``once``: every distinct byte it touches, once. This is what DRAM must serve when the L2
  holds the re-read tiles while they are re-read (one head's K and V at these sizes are a few
  MiB; an H200's L2 is tens of MiB), i.e. the DRAM traffic expected from
  ``dram__bytes_{read,write}.sum`` with caches flushed before each kernel.

Standard attention is measured as three kernels: S = Q Kᵀ and O = P V by cuBLAS (``cupy.matmul``)
and a one-pass-per-row softmax between them; only its ``once`` count is modelled (cuBLAS's tile
order is its own), and it is the paper's Θ(N·d + N²).

    python -m cupyflash io-complexity --model-only          # the predictions; no GPU
    python -m cupyflash io-complexity --markdown docs/io-complexity.md \\
        --plot docs/io-complexity.png --json io.json         # measure (GPU + ncu)

The driver runs each configuration in its own process, ``--worker SPEC``, under
``ncu --clock-control none --cache-control all --profile-from-start off --print-units base --csv
--metrics ...``; the worker launches the kernels of one call between cudaProfilerStart and
cudaProfilerStop, so the CSV holds exactly that call's kernels. Exit status: 0 done, 1 some
configuration failed, 2 bad arguments, 3 no ncu.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .._dtypes import dtype_argument
from ..masks import as_mask
from .shapes import parse_size

PASSES = ("flash-fwd", "flash-bwd", "standard-fwd")
FAMILIES = ("mma", "simt")
DTYPES = ("bfloat16", "float16", "float32", "float64")

DRAM_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
L2_METRICS = ("lts__t_sectors_srcunit_tex_op_read.sum", "lts__t_sectors_srcunit_tex_op_write.sum")
SECTOR_BYTES = 32

DEFAULT_SEQLENS = (1024, 2048, 4096, 8192)
DEFAULT_HEADDIMS = (64, 128)
QUICK_SEQLENS = (1024, 4096)
QUICK_HEADDIMS = (128,)

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_NCU = 0, 1, 2, 3
LOG2E = 1.4426950408889634
MIB = 2**20


# --- configurations ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    """One measured call: self-attention (seqlen_q == seqlen_k), (batch, seqlen, heads, headdim)."""

    kind: str  # "flash-fwd" | "flash-bwd" | "standard-fwd"
    seqlen: int
    headdim: int
    dtype: str = "bfloat16"
    batch: int = 1
    nheads: int = 8
    nheads_kv: int = 8
    causal: bool = False
    family: str = "mma"  # kernel family of the flash passes: tensor cores or SIMT

    def __post_init__(self):
        if self.kind not in PASSES:
            raise ValueError(f"kind must be one of {', '.join(PASSES)}; got {self.kind!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {', '.join(FAMILIES)}; got {self.family!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if min(self.seqlen, self.headdim, self.batch, self.nheads, self.nheads_kv) < 1:
            raise ValueError(f"sizes must be positive: {self}")
        if self.nheads % self.nheads_kv:
            raise ValueError(f"nheads {self.nheads} is not a multiple of nheads_kv {self.nheads_kv}")
        if self.kind == "standard-fwd" and self.nheads_kv != self.nheads:
            raise ValueError("the materialised baseline has no GQA: nheads_kv must equal nheads")
        if self.kind != "standard-fwd" and self.family == "mma":
            if self.dtype not in ("bfloat16", "float16") or self.headdim % 8 or self.headdim > 256:
                raise ValueError("the mma family takes float16/bfloat16 and headdim % 8 == 0, <= 256")

    @property
    def label(self) -> str:
        return f"{self.kind} d{self.headdim} N{self.seqlen}"

    def to_spec(self) -> str:
        """'kind=flash-fwd,seqlen=1024,...': the --worker argument."""
        return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in asdict(self).items())

    @classmethod
    def from_spec(cls, text: str) -> "Config":
        fields = {}
        for item in text.split(","):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"worker spec items are key=value; got {item!r}")
            fields[key.strip()] = value.strip()
        types = {"seqlen": int, "headdim": int, "batch": int, "nheads": int, "nheads_kv": int,
                 "causal": lambda s: bool(int(s))}
        unknown = set(fields) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown worker spec keys: {', '.join(sorted(unknown))}")
        return cls(**{k: types.get(k, str)(v) for k, v in fields.items()})


def default_configs(seqlens=DEFAULT_SEQLENS, headdims=DEFAULT_HEADDIMS, kinds=PASSES, **common) -> list:
    """The sweep: every pass at every headdim and seqlen, bf16, batch 1, 8 heads."""
    return [Config(kind=kind, seqlen=n, headdim=d, **common)
            for kind in kinds for d in headdims for n in seqlens]


# --- the model ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelBytes:
    """Modelled bytes of one kernel. ``tile_*`` is None where the kernel's tiling is not ours."""

    kernel: str
    once_read: int
    once_write: int
    tile_read: int | None = None
    tile_write: int | None = None


@dataclass
class _Ledger:
    once_read: int = 0
    once_write: int = 0
    tile_read: int = 0
    tile_write: int = 0

    def read(self, visited: int, distinct: int | None = None) -> None:
        self.tile_read += visited
        self.once_read += visited if distinct is None else distinct

    def write(self, nbytes: int) -> None:
        self.tile_write += nbytes
        self.once_write += nbytes

    def done(self, kernel: str) -> KernelBytes:
        return KernelBytes(kernel, self.once_read, self.once_write, self.tile_read, self.tile_write)


def _block_sizes(name: str) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) from a specialization's name (``..._bm128_bn64_...``)."""
    bm, bn = re.search(r"_bm(\d+)(?:_|$)", name), re.search(r"_bn(\d+)(?:_|$)", name)
    if not (bm and bn):
        raise ValueError(f"no _bm<M>_..._bn<N> tile sizes in specialization name {name!r}")
    return int(bm.group(1)), int(bn.group(1))


def flash_tiles(config: Config) -> dict:
    """{kernel: (BLOCK_M, BLOCK_N)} of the specializations cupyflash launches for ``config``,
    and the head dimension the kernels read (the mma family pads it to a multiple of 8)."""
    from .. import dispatch
    from .._dtypes import SUPPORTED

    dtype = SUPPORTED[config.dtype]
    if config.family == "mma":
        from ..kernels import mma_bwd, mma_fwd

        headdim = dispatch.mma_headdim(config.headdim)
        specs = {"fwd": mma_fwd.specialization(dtype, headdim, config.causal),
                 "dkdv": mma_bwd.dkdv_spec(dtype, headdim, config.causal, dq_add="none"),
                 "dq": mma_bwd.dq_spec(dtype, headdim, config.causal)}
    else:
        from ..kernels import simt

        headdim = config.headdim
        specs = {kind: simt.specialization(kind, dtype, headdim, config.causal)
                 for kind in ("fwd", "dkdv", "dq")}
    tiles = {kind: _block_sizes(spec.name) for kind, spec in specs.items()}
    tiles["headdim"] = headdim
    return tiles


def _itemsizes(config: Config) -> tuple[int, int]:
    """(bytes per element of q/k/v/o, bytes per element of lse and D)."""
    import numpy as np

    from .._dtypes import SUPPORTED, lse_dtype

    dtype = SUPPORTED[config.dtype]
    return np.dtype(dtype).itemsize, np.dtype(lse_dtype(dtype)).itemsize


def _rows(blocks: range, block: int, limit: int) -> int:
    """Rows of the blocks a kernel visits, rows past ``limit`` excepted (zero-filled, not read)."""
    return max(0, min(limit, blocks.stop * block) - blocks.start * block) if blocks else 0


def _key_rows_fwd(seqlen_q, seqlen_k, m0, block_m, block_n, mask) -> int:
    """Key rows a query block at m0 loads: the key blocks the policy has it visit (flash_fwd_*)."""
    return _rows(as_mask(mask).key_blocks(m0, block_m, block_n, seqlen_q, seqlen_k), block_n, seqlen_k)


def _key_rows_dq(family, seqlen_q, seqlen_k, m0, block_m, block_n, mask) -> int:
    """Key rows the dQ kernel's query block at m0 loads (flash_bwd_dq_*; the mma.sync kernels ask
    for the block's existing rows only)."""
    rows = min(block_m, seqlen_q - m0) if family == "mma" else block_m
    return _rows(as_mask(mask).key_blocks(m0, rows, block_n, seqlen_q, seqlen_k), block_n, seqlen_k)


def _query_rows_dkdv(seqlen_q, seqlen_k, n0, block_m, mask, block_n=None) -> int:
    """Query rows the dK/dV kernel's key block at n0 (of block_n keys) loads: the query blocks the
    policy has it visit (flash_bwd_dkdv_*). Without a left bound the key block's size does not
    matter."""
    mask = as_mask(mask)
    if block_n is None:
        if mask.HAS_LEFT:
            raise ValueError("a window's left bound needs the key block size")
        block_n = 1
    return _rows(mask.query_blocks(n0, block_n, block_m, seqlen_q, seqlen_k), block_m, seqlen_q)


def _flash_fwd(config: Config, tiles: dict) -> list:
    e, stat = _itemsizes(config)
    n, row = config.seqlen, tiles["headdim"] * e
    bm, bn = tiles["fwd"]
    q_heads, kv_heads = config.batch * config.nheads, config.batch * config.nheads_kv
    keys = [_key_rows_fwd(n, n, m0, bm, bn, config.causal) for m0 in range(0, n, bm)]
    ledger = _Ledger()
    ledger.read(q_heads * n * row)  # Q_i, once per query block
    ledger.read(2 * q_heads * sum(keys) * row, 2 * kv_heads * max(keys) * row)  # K_j, V_j
    ledger.write(q_heads * n * row)  # O
    ledger.write(q_heads * n * stat)  # lse
    return [ledger.done("fwd")]


def _flash_bwd(config: Config, tiles: dict) -> list:
    e, stat = _itemsizes(config)
    n, row = config.seqlen, tiles["headdim"] * e
    q_heads, kv_heads = config.batch * config.nheads, config.batch * config.nheads_kv
    group = config.nheads // config.nheads_kv

    pre = _Ledger()  # D = rowsum(dO * O)
    pre.read(2 * q_heads * n * row)
    pre.write(q_heads * n * stat)

    bm, bn = tiles["dkdv"]
    dkdv = _Ledger()  # one block per key block: K_j, V_j once, then every query block of the group
    dkdv.read(2 * kv_heads * n * row)
    q_rows = [_query_rows_dkdv(n, n, n0, bm, config.causal, bn) for n0 in range(0, n, bn)]
    dkdv.read(2 * kv_heads * group * sum(q_rows) * row, 2 * q_heads * max(q_rows) * row)  # Q_i, dO_i
    dkdv.read(2 * kv_heads * group * sum(q_rows) * stat, 2 * q_heads * max(q_rows) * stat)  # lse, D
    dkdv.write(2 * kv_heads * n * row)  # dK, dV

    bm, bn = tiles["dq"]
    dq = _Ledger()  # one block per query block: Q_i, dO_i, lse_i, D_i once, then every key block
    dq.read(2 * q_heads * n * row)
    dq.read(2 * q_heads * n * stat)
    keys = [_key_rows_dq(config.family, n, n, m0, bm, bn, config.causal) for m0 in range(0, n, bm)]
    dq.read(2 * q_heads * sum(keys) * row, 2 * kv_heads * max(keys) * row)  # K_j, V_j
    dq.write(q_heads * n * row)  # dQ
    return [pre.done("bwd_preprocess"), dkdv.done("bwd_dkdv"), dq.done("bwd_dq")]


def _standard_fwd(config: Config, itemsize: int | None = None) -> list:
    """S = Q Kᵀ, P = softmax(S), O = P V with S and P materialised, every array in the input
    dtype unless ``itemsize`` says otherwise (the worker's float32 fallback). Only the distinct
    bytes are modelled for the cuBLAS kernels; the softmax reads each row twice (its second pass
    hits L2)."""
    e = itemsize or _itemsizes(config)[0]
    heads, n, d = config.batch * config.nheads, config.seqlen, config.headdim
    scores = heads * n * n * e
    return [KernelBytes("gemm_qk", once_read=2 * heads * n * d * e, once_write=scores),
            KernelBytes("softmax", once_read=scores, once_write=scores,
                        tile_read=2 * scores, tile_write=scores),
            KernelBytes("gemm_pv", once_read=scores + heads * n * d * e, once_write=heads * n * d * e)]


def model(config: Config, *, standard_itemsize: int | None = None) -> list:
    """Modelled bytes of every kernel of one call, in launch order. ``standard_itemsize``: the
    element size the materialised baseline actually used, if not the input's."""
    if config.kind == "standard-fwd":
        return _standard_fwd(config, standard_itemsize)
    tiles = flash_tiles(config)
    return _flash_fwd(config, tiles) if config.kind == "flash-fwd" else _flash_bwd(config, tiles)


@dataclass(frozen=True)
class Totals:
    once_read: int
    once_write: int
    tile_read: int | None
    tile_write: int | None


def totals(kernels: list) -> Totals:
    tiles_known = all(k.tile_read is not None for k in kernels)
    return Totals(sum(k.once_read for k in kernels), sum(k.once_write for k in kernels),
                  sum(k.tile_read for k in kernels) if tiles_known else None,
                  sum(k.tile_write for k in kernels) if tiles_known else None)


def paper_tile_sizes(headdim: int, sram_bytes: int, itemsize: int) -> tuple[int, int]:
    """The paper's choice for M elements of on-chip memory: Bc = ceil(M / 4d), Br = min(Bc, d)."""
    elements = sram_bytes // itemsize
    block_c = math.ceil(elements / (4 * headdim))
    return min(block_c, headdim), block_c


# --- ncu output ---------------------------------------------------------------------------------

_UNIT_BYTES = {
    "byte": 1, "bytes": 1, "b": 1,
    "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12,
    "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "sector": SECTOR_BYTES, "sectors": SECTOR_BYTES,
}


@dataclass
class KernelCounters:
    """One profiled kernel launch: metric name -> value in bytes."""

    launch_id: str
    kernel: str
    values: dict = field(default_factory=dict)


def metric_bytes(value: str, unit: str) -> float:
    """A CSV 'Metric Value' with its 'Metric Unit' as bytes; '1,234' groups are allowed."""
    scale = _UNIT_BYTES.get(unit.strip().lower())
    if scale is None:
        raise ValueError(f"unknown ncu metric unit {unit!r} (expected bytes or sectors)")
    number = float(value.replace(",", "").strip())
    return number * scale


def parse_ncu_csv(text: str) -> list:
    """Kernel launches of an ``ncu --csv`` details page, in launch order.

    The program's and ncu's own lines (``==PROF==``, ``==WARNING==``) may surround the CSV; the
    header is the line that names 'ID', 'Kernel Name', 'Metric Name', 'Metric Unit' and
    'Metric Value' (other columns vary between ncu versions and are ignored).
    """
    lines = text.splitlines()
    start = None
    for i, line in enumerate(lines):
        if line.startswith('"ID"'):
            header = next(csv.reader([line]))
            if {"ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value"} <= set(header):
                start = i
                break
    if start is None:
        raise ValueError("no CSV header (\"ID\",...,\"Metric Value\") in the ncu output")
    col = {name: header.index(name) for name in header}
    launches: dict = {}
    for row in csv.reader(line for line in lines[start + 1:] if line.startswith('"')):
        if len(row) < len(header) or not row[col["ID"]]:
            continue
        launch = launches.setdefault(row[col["ID"]], KernelCounters(row[col["ID"]], row[col["Kernel Name"]]))
        launch.values[row[col["Metric Name"]]] = metric_bytes(row[col["Metric Value"]],
                                                              row[col["Metric Unit"]])
    return list(launches.values())


# --- measurements -------------------------------------------------------------------------------

@dataclass
class Measurement:
    config: Config
    kernels: list = field(default_factory=list)  # KernelCounters
    worker: dict = field(default_factory=dict)  # what the worker reported (device, score dtype)
    error: str | None = None

    def total(self, metric: str) -> float | None:
        values = [k.values.get(metric) for k in self.kernels]
        if not values or any(v is None for v in values):
            return None
        return sum(values)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.kernels)

    def model_kernels(self) -> list:
        return model(self.config, standard_itemsize=self.worker.get("itemsize"))

    def to_json(self) -> dict:
        return {"config": asdict(self.config), "error": self.error, "worker": self.worker,
                "kernels": [asdict(k) for k in self.kernels],
                "model": [asdict(k) for k in self.model_kernels()]}


def find_ncu(explicit: str | None = None) -> str | None:
    """The ncu executable: ``explicit``, $NCU, PATH, then the usual install folders."""
    candidates = [explicit, os.environ.get("NCU"), shutil.which("ncu"), "/usr/local/cuda/bin/ncu"]
    for pattern in ("/usr/local/cuda*/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu"):
        candidates += sorted((str(p) for p in Path("/").glob(pattern.lstrip("/"))), reverse=True)
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def ncu_command(ncu: str, config: Config, report: str | Path, *, l2: bool = True,
                python: str = sys.executable) -> list:
    metrics = DRAM_METRICS + (L2_METRICS if l2 else ())
    return [ncu, "--clock-control", "none", "--cache-control", "all", "--profile-from-start", "off",
            "--print-units", "base", "--csv", "--page", "details", "--metrics", ",".join(metrics),
            python, "-m", "cupyflash.bench.io_complexity", "--worker", config.to_spec(),
            "--worker-report", str(report)]


def _worker_env() -> dict:
    """The worker imports this checkout of cupyflash even when it is not installed."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


_PERMISSION_HINT = ("ncu may not read GPU performance counters (ERR_NVGPUCTRPERM): run as root, or "
                    "load the driver with NVreg_RestrictProfilingToAdminUsers=0")


def _tail(text: str, n: int = 1500) -> str:
    return text[-n:].strip()


def run_one(ncu: str, config: Config, report: Path, *, l2: bool, timeout: float) -> Measurement:
    """Profile one configuration; raises _MetricRejected when ncu does not know a metric."""
    report.unlink(missing_ok=True)
    command = ncu_command(ncu, config, report, l2=l2)
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=_worker_env())
    except subprocess.TimeoutExpired:
        return Measurement(config, error=f"ncu timed out after {timeout:.0f} s")
    output = proc.stdout + "\n" + proc.stderr
    if "ERR_NVGPUCTRPERM" in output:
        return Measurement(config, error=_PERMISSION_HINT)
    if l2 and re.search(r"metric.*(not found|invalid|unknown)|failed to find metric", output, re.I):
        raise _MetricRejected(_tail(output))
    measurement = Measurement(config)
    if report.is_file():
        measurement.worker = json.loads(report.read_text())
    if measurement.worker.get("error"):
        measurement.error = f"worker: {measurement.worker['error']}"
        return measurement
    try:
        measurement.kernels = parse_ncu_csv(proc.stdout)
    except ValueError:
        try:
            measurement.kernels = parse_ncu_csv(output)
        except ValueError as exc:
            measurement.error = f"{exc} (ncu exit status {proc.returncode}): {_tail(output)}"
            return measurement
    if not measurement.kernels:
        measurement.error = f"ncu profiled no kernel (exit status {proc.returncode}): {_tail(output)}"
    elif proc.returncode != 0:
        measurement.error = f"ncu exit status {proc.returncode}: {_tail(output)}"
    return measurement


class _MetricRejected(RuntimeError):
    pass


def measure(configs: list, ncu: str, *, l2: bool = True, timeout: float = 300.0, log=print) -> list:
    """Every configuration under ncu, one process each. Without the L2 metrics after the first
    rejection of them (older ncu or another GPU); nothing more after a permission error."""
    results = []
    with tempfile.TemporaryDirectory(prefix="cupyflash-io-") as tmp:
        for index, config in enumerate(configs, 1):
            if results and results[-1].error == _PERMISSION_HINT:
                results.append(Measurement(config, error=_PERMISSION_HINT))
                log(f"[{index}/{len(configs)}] {config.label}: not run (the same permission error)")
                continue
            report = Path(tmp) / f"worker-{index}.json"
            try:
                m = run_one(ncu, config, report, l2=l2, timeout=timeout)
            except _MetricRejected as exc:
                log(f"ncu rejected the L2 metrics; measuring DRAM only from here on\n{exc}")
                l2 = False
                m = run_one(ncu, config, report, l2=l2, timeout=timeout)
            results.append(m)
            log(f"[{index}/{len(configs)}] {config.label}: " + (_summary(m) if m.ok else f"FAILED: {m.error}"))
    return results


def _summary(m: Measurement) -> str:
    t = totals(m.model_kernels())
    read, write = m.total(DRAM_METRICS[0]), m.total(DRAM_METRICS[1])
    return (f"DRAM {_mib(read)} + {_mib(write)} MiB (model {_mib(t.once_read)} + {_mib(t.once_write)}), "
            f"{len(m.kernels)} kernel(s)")


# --- the worker ---------------------------------------------------------------------------------

_SOFTMAX_SOURCE = r"""
namespace cf_io {

// (m, l) of one set of scores merged into (m_o, l_o) of another: the online softmax's update.
// A lane that saw no score holds (-inf, 0); a base of 0 then keeps exp2(-inf - -inf) out.
__device__ __forceinline__ void merge(float& m, float& l, float m_o, float l_o) {
    const float m_new = fmaxf(m, m_o);
    const float base = m_new == cf::neg_inf<float>() ? 0.f : m_new;
    l = l * cf::exp2_(m - base) + l_o * cf::exp2_(m_o - base);
    m = m_new;
}

// Row softmax of a materialised score matrix S (rows of seqlen_k), the middle kernel of standard
// attention. One block per row; P may alias S (each element is read and written by one thread).
// Pass 1 keeps a running (max, sum) per thread, pass 2 writes P; the row is read twice, the
// second time from L2, so DRAM sees S read once and P written once.
template <typename T>
__global__ void __launch_bounds__(256)
softmax_rows(const T* s, T* p, int seqlen_q, int seqlen_k, int causal, float scale_log2) {
    const long long row = blockIdx.x;
    const int query = (int)(row % seqlen_q);
    const int keys = causal ? min(seqlen_k, max(0, query + 1 + seqlen_k - seqlen_q)) : seqlen_k;
    const T* in = s + row * seqlen_k;
    T* out = p + row * seqlen_k;

    float m = cf::neg_inf<float>(), l = 0.f;
    for (int j = threadIdx.x; j < keys; j += 256) merge(m, l, cf::to_acc(in[j]) * scale_log2, 1.f);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2)
        merge(m, l, __shfl_xor_sync(0xffffffffu, m, offset), __shfl_xor_sync(0xffffffffu, l, offset));
    __shared__ float warp_m[8], warp_l[8];
    if (threadIdx.x % 32 == 0) {
        warp_m[threadIdx.x / 32] = m;
        warp_l[threadIdx.x / 32] = l;
    }
    __syncthreads();
    m = warp_m[0];
    l = warp_l[0];
    for (int w = 1; w < 8; ++w) merge(m, l, warp_m[w], warp_l[w]);

    const float base = m == cf::neg_inf<float>() ? 0.f : m;
    const float inv_l = l > 0.f ? 1.f / l : 0.f;
    for (int j = threadIdx.x; j < seqlen_k; j += 256) {
        const float x = j < keys ? cf::to_acc(in[j]) * scale_log2 : cf::neg_inf<float>();
        cf::store_as(out + j, cf::exp2_(x - base) * inv_l);
    }
}

}  // namespace cf_io
"""

_SOFTMAX_CTYPE = {"bfloat16": "cf::bf16_t", "float16": "cf::half_t", "float32": "float"}


def softmax_source() -> str:
    """CUDA source of the baseline's softmax, on top of kernels_cu/common.cuh."""
    from ..kernels._module import kernel_source

    return kernel_source("common.cuh") + _SOFTMAX_SOURCE


def softmax_expression(dtype_name: str) -> str:
    return f"cf_io::softmax_rows<{_SOFTMAX_CTYPE[dtype_name]}>"


def _device_facts() -> dict:
    import cupy

    device = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(device.id)
    name = props["name"]
    attributes = device.attributes
    return {"device": name.decode() if isinstance(name, bytes) else str(name),
            "compute_capability": device.compute_capability,
            "sm_count": attributes.get("MultiProcessorCount"),
            "l2_bytes": attributes.get("L2CacheSize"),
            "smem_per_block_optin": attributes.get("MaxSharedMemoryPerBlockOptin"),
            "cupy": cupy.__version__}


def _prepare(config: Config, report: dict):
    """Inputs and the call to profile (a function launching exactly the kernels of one call)."""
    import cupy
    import numpy as np

    from .._dtypes import SUPPORTED, lse_dtype

    dtype = SUPPORTED[config.dtype]
    b, n, h, hkv, d = config.batch, config.seqlen, config.nheads, config.nheads_kv, config.headdim
    rng = cupy.random.default_rng(0)

    def normal(shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    q, k, v = normal((b, n, h, d)), normal((b, n, hkv, d)), normal((b, n, hkv, d))
    scale = 1.0 / math.sqrt(d)

    if config.kind != "standard-fwd":
        if config.family == "mma":
            from ..kernels import mma_bwd as bwd
            from ..kernels import mma_fwd as fwd
        else:
            from ..kernels import simt as bwd
            from ..kernels import simt as fwd
        o = cupy.empty_like(q)
        lse = cupy.empty((b, h, n), dtype=lse_dtype(dtype))

        def forward():
            fwd.forward(q, k, v, o, lse, softmax_scale=scale, causal=config.causal)

        if config.kind == "flash-fwd":
            return forward
        forward()
        do = normal((b, n, h, d))
        dq, dk, dv = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)

        def backward():
            bwd.backward(do, q, k, v, o, lse, dq, dk, dv, softmax_scale=scale, causal=config.causal,
                         deterministic=True)

        return backward

    # Standard attention: heads-first contiguous operands (in ``compute_dtype``) prepared outside
    # the profiled range, so that it holds the two GEMMs and the softmax and nothing else.
    def attention_with(compute_dtype):
        from ..kernels._module import NVRTC_OPTIONS

        name = np.dtype(compute_dtype).name
        expression = softmax_expression(name)
        module = cupy.RawModule(code=softmax_source(), options=NVRTC_OPTIONS,
                                name_expressions=(expression,))
        softmax = module.get_function(expression)
        qh, kt, vh = (cupy.ascontiguousarray(x.transpose(axes)).astype(compute_dtype, copy=False)
                      for x, axes in ((q, (0, 2, 1, 3)), (k, (0, 2, 3, 1)), (v, (0, 2, 1, 3))))
        args_tail = (np.int32(n), np.int32(n), np.int32(config.causal), np.float32(scale * LOG2E))

        def call():
            s = cupy.matmul(qh, kt)
            softmax((b * h * n,), (256,), (s, s) + args_tail)
            return cupy.matmul(s, vh)

        call()
        cupy.cuda.runtime.deviceSynchronize()
        report["dtype"] = name
        report["itemsize"] = np.dtype(compute_dtype).itemsize
        return call

    try:
        return attention_with(dtype)
    except Exception as exc:  # a CuPy without this dtype's GEMM: the baseline runs in float32
        report["fallback"] = f"{type(exc).__name__}: {exc}"
        return attention_with(np.dtype(np.float32))


def run_worker(config: Config, report_path: str | None) -> int:
    """Launch one call's kernels between cudaProfilerStart and cudaProfilerStop. Prints nothing
    on stdout (that is ncu's CSV); writes what it ran to ``report_path`` as JSON."""
    report: dict = {"config": asdict(config)}

    def write_report():
        if report_path:
            Path(report_path).write_text(json.dumps(report, indent=1, default=str))

    try:
        import cupy

        report.update(_device_facts())
        call = _prepare(config, report)
        call()  # compiles (NVRTC, cuBLAS heuristics) and warms up outside the profiled range
        cupy.cuda.runtime.deviceSynchronize()
        cupy.cuda.profiler.start()
        call()
        cupy.cuda.runtime.deviceSynchronize()
        cupy.cuda.profiler.stop()
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        write_report()
        print(f"io_complexity worker: {report['error']}", file=sys.stderr)
        return EXIT_FAILED
    write_report()
    return EXIT_OK


# --- tables, documents, plots -------------------------------------------------------------------

def _mib(nbytes) -> str:
    if nbytes is None:
        return "—"
    x = nbytes / MIB
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _pair(read, write) -> str:
    return "—" if read is None or write is None else f"{_mib(read)} + {_mib(write)}"


def _ratio(measured_r, measured_w, model_r, model_w) -> str:
    if None in (measured_r, measured_w, model_r, model_w) or model_r + model_w == 0:
        return "—"
    return f"{(measured_r + measured_w) / (model_r + model_w):.2f}"


def _render(header, rows, left: int = 1) -> str:
    """A Markdown table, the first ``left`` columns left-aligned and the rest right-aligned."""
    def line(values):
        return "| " + " | ".join(str(v) for v in values) + " |"

    align = ["---"] * left + ["---:"] * (len(header) - left)
    return "\n".join([line(header), "|" + "|".join(align) + "|"] + [line(r) for r in rows])


def model_table(configs: list) -> str:
    """Markdown: the modelled bytes of every configuration (no measurement involved)."""
    header = ["pass", "d", "N", "tiles: read + write, MiB", "distinct: read + write, MiB",
              "re-read factor"]
    rows = []
    for c in configs:
        t = totals(model(c))
        factor = "—" if t.tile_read is None else f"{t.tile_read / t.once_read:.1f}"
        rows.append([c.kind, c.headdim, c.seqlen, _pair(t.tile_read, t.tile_write),
                     _pair(t.once_read, t.once_write), factor])
    return _render(header, rows)


def model_section(configs: list) -> str:
    c = configs[0]
    family = "tensor-core (mma)" if c.family == "mma" else "SIMT"
    kv = "" if c.nheads_kv == c.nheads else f", {c.nheads_kv} kv heads"
    return (f"{c.dtype}, batch {c.batch}, {c.nheads} heads{kv}, {'causal' if c.causal else 'no mask'}, "
            f"{family} kernels; MiB = 2^20 bytes. Written by "
            f"`python -m cupyflash.bench.io_complexity --model-only --markdown docs/io-complexity.md`; "
            f"tests/test_docs.py checks that it matches the current tile sizes.\n\n" + model_table(configs))


def measured_table(measurements: list) -> str:
    header = ["pass", "d", "N", "model, distinct: R + W", "DRAM: R + W", "DRAM / model",
              "model, tiles: R + W", "L2 from SMs: R + W", "L2 / model"]
    rows = []
    for m in measurements:
        c, t = m.config, totals(m.model_kernels())
        if not m.ok:
            rows.append([c.kind, c.headdim, c.seqlen, _pair(t.once_read, t.once_write), "failed",
                         "—", _pair(t.tile_read, t.tile_write), "failed", "—"])
            continue
        dram = m.total(DRAM_METRICS[0]), m.total(DRAM_METRICS[1])
        l2 = m.total(L2_METRICS[0]), m.total(L2_METRICS[1])
        rows.append([c.kind, c.headdim, c.seqlen, _pair(t.once_read, t.once_write), _pair(*dram),
                     _ratio(*dram, t.once_read, t.once_write), _pair(t.tile_read, t.tile_write),
                     _pair(*l2), _ratio(*l2, t.tile_read, t.tile_write)])
    return _render(header, rows)


def measured_section(measurements: list, *, ncu_version: str | None, plot: str | None) -> str:
    facts = next((m.worker for m in measurements if m.worker.get("device")), {})
    when = datetime.date.today().isoformat()
    parts = [f"Measured {when} on {facts.get('device', 'an unknown device')}"
             + (f" ({facts['sm_count']} SMs, L2 {facts['l2_bytes'] / MIB:.0f} MiB)"
                if facts.get("l2_bytes") and facts.get("sm_count") else "")
             + f", {ncu_version or 'ncu'}, CuPy {facts.get('cupy', '?')}. MiB = 2^20 bytes; "
             "R + W = read + written.", ""]
    fallbacks = {m.worker.get("fallback") for m in measurements if m.worker.get("fallback")}
    if fallbacks:
        parts += ["Standard attention ran in float32 (its model counts 4-byte elements); in the "
                  f"input dtype it failed with: {'; '.join(sorted(fallbacks))}", ""]
    parts.append(measured_table(measurements))
    failed = [m for m in measurements if not m.ok]
    if failed:
        parts += ["", "Failed: " + "; ".join(f"{m.config.label}: {m.error}" for m in failed)]
    if plot:
        parts += ["", f"![bytes against N]({plot})"]
    return "\n".join(parts)


_MARKER = re.compile(r"(<!-- cupyflash-io:(\w+):begin -->\n)(.*?)(<!-- cupyflash-io:\2:end -->)", re.DOTALL)


def markers(name: str) -> tuple:
    return f"<!-- cupyflash-io:{name}:begin -->", f"<!-- cupyflash-io:{name}:end -->"


def section_text(document: str, name: str) -> str | None:
    """The text between the markers of section ``name``, or None."""
    for match in _MARKER.finditer(document):
        if match.group(2) == name:
            return match.group(3)
    return None


def fill_markdown(document: str, sections: dict) -> tuple:
    """Replace the text between each section's markers. Returns (document, names without markers)."""
    found = set()

    def refill(match):
        name = match.group(2)
        if name not in sections:
            return match.group(0)
        found.add(name)
        return match.group(1) + sections[name].rstrip("\n") + "\n" + match.group(4)

    text = _MARKER.sub(refill, document)
    return text, [name for name in sections if name not in found]


def write_markdown(path: str | Path, sections: dict) -> list:
    """Refresh ``path``'s sections (a new file gets them with markers). Returns sections that
    had no markers and were appended."""
    path = Path(path)
    document = path.read_text() if path.is_file() else "# IO complexity: results\n"
    document, missing = fill_markdown(document, sections)
    for name in missing:
        begin, end = markers(name)
        document = document.rstrip("\n") + f"\n\n{begin}\n{sections[name].rstrip()}\n{end}\n"
    path.write_text(document)
    return missing


def plot(configs_or_measurements: list, path: str | Path) -> str | None:
    """Log-log bytes against N, one panel per head dim: modelled (dashed) and, where measured,
    DRAM (solid) and L2 traffic from the SMs (dotted). Returns None, or why nothing was written."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib); no plot written"
    items = [m if isinstance(m, Measurement) else Measurement(m) for m in configs_or_measurements]
    headdims = sorted({m.config.headdim for m in items})
    if not headdims:
        return "nothing to plot"
    fig = Figure(figsize=(5.2 * len(headdims), 5.2), layout="constrained")
    axes = fig.subplots(1, len(headdims), squeeze=False)[0]
    colors = {kind: f"C{i}" for i, kind in enumerate(PASSES)}
    for ax, d in zip(axes, headdims):
        for kind in PASSES:
            series = sorted((m for m in items if m.config.headdim == d and m.config.kind == kind),
                            key=lambda m: m.config.seqlen)
            if not series:
                continue
            ns = [m.config.seqlen for m in series]
            model_totals = [totals(m.model_kernels()) for m in series]
            ax.plot(ns, [(t.once_read + t.once_write) / MIB for t in model_totals], "--",
                    color=colors[kind], label=f"{kind}: model, distinct")
            if all(t.tile_read is not None for t in model_totals) and kind != "standard-fwd":
                ax.plot(ns, [(t.tile_read + t.tile_write) / MIB for t in model_totals], ":",
                        color=colors[kind], alpha=0.6, label=f"{kind}: model, tiles")
            measured = [(m.config.seqlen, m.total(DRAM_METRICS[0]), m.total(DRAM_METRICS[1]))
                        for m in series if m.ok]
            points = [(n, r + w) for n, r, w in measured if r is not None and w is not None]
            if points:
                ax.plot(*zip(*((n, b / MIB) for n, b in points)), "o-", color=colors[kind],
                        label=f"{kind}: DRAM measured")
            l2 = [(m.config.seqlen, m.total(L2_METRICS[0]), m.total(L2_METRICS[1])) for m in series if m.ok]
            l2 = [(n, (r + w) / MIB) for n, r, w in l2 if r is not None and w is not None]
            if l2 and kind != "standard-fwd":
                ax.plot(*zip(*l2), "s:", color=colors[kind], markerfacecolor="none",
                        label=f"{kind}: L2 from SMs measured")
        seqlens = sorted({m.config.seqlen for m in items})
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqlens, [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in seqlens])
        ax.set_yscale("log")
        ax.set_title(f"headdim {d}", fontsize=10)
        ax.set_xlabel("N (seqlen)")
        ax.set_ylabel("MiB read + written")
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=3, fontsize=7)
    fig.savefig(Path(path), dpi=120)
    return None


# --- command line -------------------------------------------------------------------------------

DESCRIPTION = """\
HBM traffic of cupyflash's kernels and of materialised attention: the FlashAttention IO model,
exact for the kernels cupyflash launches, against Nsight Compute's DRAM and L2 counters (one ncu
process per configuration). --model-only prints the model and needs neither a GPU nor ncu.
Exit status: 0 done, 1 some configuration failed, 2 bad arguments, 3 no ncu."""

EPILOG = """\
examples:
  python -m cupyflash io-complexity --model-only
  python -m cupyflash io-complexity --markdown docs/io-complexity.md --plot docs/io-complexity.png --json io.json
  python -m cupyflash io-complexity --quick --no-l2"""


def build_parser() -> argparse.ArgumentParser:
    from .. import cli

    return cli.command_parser("io-complexity")


def configure(p: argparse.ArgumentParser) -> None:
    from .. import cli

    p.add_argument("--seqlen", type=parse_size, nargs="+", help=f"default {' '.join(map(str, DEFAULT_SEQLENS))}")
    p.add_argument("--headdim", type=cli.integer(1), nargs="+", help=f"default {' '.join(map(str, DEFAULT_HEADDIMS))}")
    p.add_argument("--passes", default=",".join(PASSES), help=f"comma-separated subset of {','.join(PASSES)}")
    p.add_argument("--family", default="mma", choices=FAMILIES, help="kernel family of the flash passes")
    p.add_argument("--dtype", default="bfloat16", type=dtype_argument(DTYPES),
                   help="bf16, fp16, fp32 or fp64 (default bf16)")
    p.add_argument("--batch", type=cli.integer(1), default=1)
    p.add_argument("--nheads", type=cli.integer(1), default=8)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help=f"seqlen {' '.join(map(str, QUICK_SEQLENS))}, headdim {' '.join(map(str, QUICK_HEADDIMS))}")
    p.add_argument("--model-only", action="store_true", help="print the model; run nothing")
    p.add_argument("--ncu", help="ncu executable (default: $NCU, PATH, /usr/local/cuda*/bin)")
    p.add_argument("--no-l2", action="store_true", help="DRAM metrics only")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration")
    p.add_argument("--markdown", help="refresh this file's cupyflash-io sections (docs/io-complexity.md)")
    p.add_argument("--plot", help="write a PNG here (needs matplotlib)")
    p.add_argument("--json", help="write every measurement and its model here")
    p.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    p.add_argument("--worker-report", help=argparse.SUPPRESS)


def configs_from_args(args) -> list:
    kinds = [k.strip() for k in args.passes.split(",") if k.strip()]
    bad = [k for k in kinds if k not in PASSES]
    if bad:
        raise ValueError(f"unknown pass {', '.join(bad)} (choose from {', '.join(PASSES)})")
    seqlens = args.seqlen or (QUICK_SEQLENS if args.quick else DEFAULT_SEQLENS)
    headdims = args.headdim or (QUICK_HEADDIMS if args.quick else DEFAULT_HEADDIMS)
    return default_configs(seqlens, headdims, kinds, dtype=args.dtype, batch=args.batch,
                           nheads=args.nheads, nheads_kv=args.nheads, causal=args.causal,
                           family=args.family)


def _ncu_version(ncu: str) -> str | None:
    try:
        out = subprocess.run([ncu, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"Version\s+(\S+)", out)
    return f"ncu {match.group(1)}" if match else None


def run(args) -> int:
    from .. import cli

    if args.worker:  # under ncu: stdout is ncu's CSV, so no summary line
        try:
            config = Config.from_spec(args.worker)
        except (TypeError, ValueError) as exc:
            print(f"io_complexity worker: {exc}", file=sys.stderr)
            return EXIT_USAGE
        return run_worker(config, args.worker_report)
    try:
        configs = configs_from_args(args)
    except ValueError as exc:
        raise cli.UsageError(str(exc)) from None

    if args.model_only:
        print(model_table(configs))
        if args.markdown:
            write_markdown(args.markdown, {"model": model_section(configs)})
            print(f"model section written to {args.markdown}")
        if args.plot:
            why = plot(configs, args.plot)
            print(why or f"plot written to {args.plot}")
        cli.summary("io-complexity", f"model of {len(configs)} configurations (--model-only: "
                                     "nothing measured)")
        return EXIT_OK

    ncu = find_ncu(args.ncu)
    if ncu is None:
        cli.summary("io-complexity", "ncu (Nsight Compute) not found: pass --ncu PATH or set "
                    "$NCU. Nothing measured; --model-only prints the predictions.",
                    file=sys.stderr)
        return EXIT_NO_NCU
    version = _ncu_version(ncu)
    print(f"{version or ncu}: {len(configs)} configurations, one ncu process each")
    measurements = measure(configs, ncu, l2=not args.no_l2, timeout=args.timeout)
    print()
    print(measured_table(measurements))
    plot_note = None
    if args.plot:
        plot_note = plot(measurements, args.plot)
        print(plot_note or f"plot written to {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"ncu": version, "measurements": [m.to_json() for m in measurements]}, indent=1, default=str))
    if args.markdown:
        plot_link = None
        if args.plot and plot_note is None:
            plot_link = os.path.relpath(Path(args.plot).resolve(), Path(args.markdown).resolve().parent)
        sections = {"measured": measured_section(measurements, ncu_version=version, plot=plot_link)}
        write_markdown(args.markdown, sections)
        print(f"sections {', '.join(sections)} written to {args.markdown}")
    failed = sum(not m.ok for m in measurements)
    text = f"{len(measurements) - failed} of {len(measurements)} configurations measured"
    cli.summary("io-complexity", f"FAIL: {failed} failed, {text}" if failed else text)
    return EXIT_FAILED if failed else EXIT_OK


def main(argv=None) -> int:
    from .. import cli

    return cli.alias("io-complexity", argv)


if __name__ == "__main__":
    sys.exit(main())

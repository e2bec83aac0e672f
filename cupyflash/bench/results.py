"""What a benchmark run produces, and its JSON form (every figure, plus where it came from).

``from_json`` reads that form back, so that a report measured on a GPU machine can be rendered
(``python -m cupyflash bench --from-json``) where there is none. Derived figures (TFLOP/s,
percentiles, MiB) are not read: they are recomputed from what they were derived from.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from .impls import Impl, known_impl
from .shapes import Case
from .timing import Timing

SCHEMA = "cupyflash-bench/1"


def case_from_json(data: dict) -> Case:
    """The Case whose fields a record's JSON carries flattened among its own."""
    return Case(**{f.name: data[f.name] for f in fields(Case)})


@dataclass
class Measurement:
    """One implementation timed on one case; status "ok", "rejected" or "error"."""

    case: Case
    impl: Impl
    status: str
    reason: str = ""
    timing: Timing | None = None
    validation: dict | None = None  # cupyflash only: see standard.validate

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.timing is not None

    @property
    def seconds(self) -> float | None:
        return self.timing.median_ms * 1e-3 if self.ok else None

    @property
    def tflops(self) -> float | None:
        return self.case.flops / self.seconds / 1e12 if self.ok else None

    @property
    def kv_tbps(self) -> float | None:
        """K+V bytes read per second, the figure of merit of a decode step."""
        return self.case.kv_bytes / self.seconds / 1e12 if self.ok else None

    @property
    def valid(self) -> bool | None:
        return None if self.validation is None else bool(self.validation["ok"])

    def to_json(self) -> dict:
        return {
            **asdict(self.case),
            "flops": self.case.flops,
            "kv_bytes": self.case.kv_bytes,
            "impl": self.impl.label,
            "family": self.impl.family,
            "backend": self.impl.backend,
            "status": self.status,
            "reason": self.reason,
            "tflops": self.tflops,
            "kv_tbps": self.kv_tbps,
            "timing": None if self.timing is None else self.timing.to_json(),
            "validation": self.validation,
        }

    @classmethod
    def from_json(cls, data: dict) -> Measurement:
        timing = data["timing"]
        return cls(case_from_json(data), known_impl(data["impl"], data["family"], data["backend"]),
                   data["status"], data["reason"],
                   timing=None if timing is None else Timing.from_json(timing),
                   validation=data["validation"])


@dataclass
class MemoryRecord:
    """Extra peak device memory of one forward+backward."""

    case: Case
    label: str  # an Impl label, or impls.STANDARD
    family: str  # "cupyflash", "torch" or "standard"
    status: str  # "ok", "rejected", "error", "oom", "skipped"
    peak_bytes: int | None = None
    reason: str = ""

    def to_json(self) -> dict:
        return {**asdict(self.case), "impl": self.label, "family": self.family,
                "status": self.status,
                "peak_bytes": self.peak_bytes,
                "peak_mib": None if self.peak_bytes is None else self.peak_bytes / 2**20,
                "reason": self.reason}

    @classmethod
    def from_json(cls, data: dict) -> MemoryRecord:
        return cls(case_from_json(data), data["impl"], data["family"], data["status"],
                   peak_bytes=data["peak_bytes"], reason=data["reason"])


@dataclass
class CopyRecord:
    """Device-to-device copy of nbytes; bandwidth counts bytes read plus bytes written."""

    nbytes: int
    timing: Timing

    @property
    def tbps(self) -> float:
        return 2 * self.nbytes / (self.timing.median_ms * 1e-3) / 1e12

    def to_json(self) -> dict:
        return {"nbytes": self.nbytes, "tbps": self.tbps, "timing": self.timing.to_json()}

    @classmethod
    def from_json(cls, data: dict) -> CopyRecord:
        return cls(data["nbytes"], Timing.from_json(data["timing"]))


@dataclass
class Report:
    environment: dict
    config: dict
    throughput: list = field(default_factory=list)  # Measurement
    memory: list = field(default_factory=list)  # MemoryRecord
    decode: list = field(default_factory=list)  # Measurement (seqlen_q = 1)
    copy: CopyRecord | None = None
    notes: list = field(default_factory=list)  # str, shown under the tables

    @property
    def validation_failures(self) -> list:
        return [m for m in self.throughput + self.decode if m.valid is False]

    def to_json(self) -> dict:
        return json_safe({
            "schema": SCHEMA,
            "environment": self.environment,
            "config": self.config,
            "notes": self.notes,
            "throughput": [m.to_json() for m in self.throughput],
            "memory": [r.to_json() for r in self.memory],
            "decode": {"copy": None if self.copy is None else self.copy.to_json(),
                       "results": [m.to_json() for m in self.decode]},
        })

    @classmethod
    def from_json(cls, data: dict) -> Report:
        """The report that to_json wrote; raises ValueError for another schema (a future
        version's fields would be misread, or silently dropped)."""
        schema = data.get("schema") if isinstance(data, dict) else None
        if schema != SCHEMA:
            raise ValueError(f"not a benchmark report of schema {SCHEMA!r} "
                             f"(its schema: {schema!r})")
        decode = data["decode"]
        return cls(environment=data["environment"], config=data["config"],
                   throughput=[Measurement.from_json(m) for m in data["throughput"]],
                   memory=[MemoryRecord.from_json(r) for r in data["memory"]],
                   decode=[Measurement.from_json(m) for m in decode["results"]],
                   copy=None if decode["copy"] is None else CopyRecord.from_json(decode["copy"]),
                   notes=data["notes"])


def json_safe(value):
    """Strict JSON has no inf/nan: they become the strings "inf", "-inf", "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value

"""What a benchmark run produces, and its JSON form (every figure, plus where it came from)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .impls import Impl
from .shapes import Case
from .timing import Timing

SCHEMA = "cupyflash-bench/1"


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


def json_safe(value):
    """Strict JSON has no inf/nan: they become the strings "inf", "-inf", "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value

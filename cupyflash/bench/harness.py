"""The device side of a run: one stream for everything, input sets, validation, timing."""
from __future__ import annotations

from .impls import Rejected
from .inputs import make_input_sets, set_bytes
from .results import Measurement
from .runners import cupyflash_outputs, cupyflash_runner
from .shapes import group_by_shape
from .standard import validate
from .timing import RepeatPolicy, rotation_count, time_region


def gpu_unavailable_reason() -> str | None:
    """None when CuPy sees a CUDA device, else why not."""
    try:
        import cupy
    except Exception as exc:
        return f"CuPy is not importable ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError without a driver, e.g.
        return f"{type(exc).__name__}: {exc}"
    return None if count > 0 else "no CUDA device found"


def describe(m: Measurement, *, decode: bool = False) -> str:
    """One progress-line summary of a measurement."""
    head = f"{m.case.label()} · {m.impl.label}: "
    if not m.ok:
        return head + m.status
    figure = f"{m.kv_tbps:.2f} TB/s" if decode else f"{m.tflops:.1f} TFLOP/s"
    return head + figure + ("  (FAILED validation)" if m.valid is False else "")


class Harness:
    """Runs implementations on cases, on one CuPy stream that torch shares (see torch_sdpa)."""

    def __init__(self, *, impls, policy: RepeatPolicy, bridge=None, validate: bool = True,
                 seed: int = 0, softmax_scale=None, deterministic: bool = True):
        import cupy

        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.l2_bytes = int(cupy.cuda.Device().attributes["L2CacheSize"])
        self.impls = list(impls)
        self.policy = policy
        self.bridge = bridge
        self.validate = validate
        self.seed = seed
        self.softmax_scale = softmax_scale
        self.deterministic = deterministic  # cupyflash's backward
        self._validations: dict = {}

    def input_sets(self, case):
        """As many input sets as rotation_count allows within a quarter of free memory."""
        import cupy

        free = cupy.cuda.runtime.memGetInfo()[0] + cupy.get_default_memory_pool().free_bytes()
        n_sets = rotation_count(set_bytes(case), self.l2_bytes, free // 4)
        with self.stream:
            return make_input_sets(case, n_sets, seed=self.seed)

    def runner(self, impl, case, inputs):
        if impl.family == "cupyflash":
            return cupyflash_runner(impl.backend, case, inputs, softmax_scale=self.softmax_scale,
                                    deterministic=self.deterministic)
        if self.bridge is None:
            raise Rejected("torch is not available")
        from .torch_sdpa import sdpa_runner

        return sdpa_runner(self.bridge, impl.backend, case, inputs,
                           softmax_scale=self.softmax_scale)

    def validation(self, impl, case, inputs) -> dict | None:
        """cupyflash's result on input set 0 against float64 (once per backend, shape, mask and
        direction family: forward-only cases check o and lse, the others also the gradients)."""
        if not self.validate or impl.family != "cupyflash":
            return None
        grads = case.mode != "fwd"
        key = (impl.label, case.shape_key, case.causal, grads)
        if key not in self._validations:
            s = inputs[0]
            outputs = cupyflash_outputs(impl.backend, case, s, softmax_scale=self.softmax_scale,
                                        deterministic=self.deterministic)
            self._validations[key] = validate(
                outputs, s.q, s.k, s.v, s.do if grads else None, dtype=case.dtype,
                softmax_scale=self.softmax_scale, causal=case.causal)
        return self._validations[key]

    def measure(self, impl, case, inputs) -> Measurement:
        """Prepare (rejections surface here), validate, then time."""
        try:
            with self.stream, self.runner(impl, case, inputs) as run:
                validation = self.validation(impl, case, inputs)
                timing = time_region(run, len(inputs), policy=self.policy, stream=self.stream)
        except Rejected as exc:
            return Measurement(case, impl, "rejected", str(exc))
        except Exception as exc:  # recorded, and the sweep goes on
            return Measurement(case, impl, "error", f"{type(exc).__name__}: {exc}")
        return Measurement(case, impl, "ok", timing=timing, validation=validation)

    def run_cases(self, cases, progress, *, decode: bool = False) -> list[Measurement]:
        results = []
        for group in group_by_shape(cases):
            try:
                inputs = self.input_sets(group[0])
            except Exception as exc:
                reason = f"inputs: {type(exc).__name__}: {exc}"
                inputs = None
            for case in group:
                for impl in self.impls:
                    if inputs is None:
                        m = Measurement(case, impl, "error", reason)
                    else:
                        m = self.measure(impl, case, inputs)
                    results.append(m)
                    progress.step(describe(m, decode=decode))
            del inputs
            self.release_memory()
        return results

    def release_memory(self) -> None:
        """Hand cached blocks back so that the other library's allocator can use them."""
        import cupy

        self.stream.synchronize()
        cupy.get_default_memory_pool().free_all_blocks()
        if self.bridge is not None:
            self.bridge.torch.cuda.empty_cache()

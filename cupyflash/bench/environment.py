"""Where the numbers came from: GPU, clocks, library versions, date."""
from __future__ import annotations

import datetime
import platform
import subprocess
from pathlib import Path

NVIDIA_SMI_FIELDS = ("name", "driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem",
                     "clocks.max.mem", "power.limit", "pstate", "temperature.gpu")


def _version_tuple(code: int) -> str:
    """CUDA's 13000 -> '13.0'."""
    return f"{code // 1000}.{code % 1000 // 10}"


def nvidia_smi(pci_bus_id: str, *, timeout: float = 10.0) -> dict | None:
    """Clocks, power limit and driver of one GPU from nvidia-smi, or None if unreadable."""
    query = ",".join(NVIDIA_SMI_FIELDS)
    try:
        text = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits",
             "-i", pci_bus_id],
            capture_output=True, text=True, timeout=timeout, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_nvidia_smi(text)


def parse_nvidia_smi(text: str) -> dict | None:
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    values = [v.strip() for v in lines[0].split(",")]
    if len(values) != len(NVIDIA_SMI_FIELDS):
        return None
    return dict(zip(NVIDIA_SMI_FIELDS, values))


def git_commit() -> str | None:
    """The source checkout's commit, when cupyflash runs from one."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out + ("+dirty" if dirty else "")


def library_versions(torch=None) -> dict:
    """Versions of what the figures depend on; absent libraries are None."""
    import numpy

    versions = {"python": platform.python_version(), "numpy": numpy.__version__}
    try:
        import cupyflash

        versions["cupyflash"] = getattr(cupyflash, "__version__", None)
    except Exception:
        versions["cupyflash"] = None
    if versions["cupyflash"] is None:
        try:
            from importlib.metadata import version

            versions["cupyflash"] = version("cupyflash")
        except Exception:
            pass
    versions["cupyflash_git"] = git_commit()
    try:
        import cupy

        versions["cupy"] = cupy.__version__
        versions["nvrtc"] = ".".join(map(str, cupy.cuda.nvrtc.getVersion()))
        versions["cuda_runtime"] = _version_tuple(cupy.cuda.runtime.runtimeGetVersion())
        versions["cuda_driver"] = _version_tuple(cupy.cuda.runtime.driverGetVersion())
    except Exception:
        versions.setdefault("cupy", None)
    if torch is not None:
        versions["torch"] = torch.__version__
        versions["torch_cuda"] = torch.version.cuda
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        versions["cudnn"] = cudnn
    return versions


def gpu_info() -> dict:
    """Name, SM count, memory and clocks of CuPy's current device."""
    import cupy

    device = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(device.id)
    attrs = device.attributes
    name = props["name"]
    info = {
        "index": device.id,
        "name": name.decode() if isinstance(name, bytes) else name,
        "compute_capability": device.compute_capability,
        "sm_count": attrs["MultiProcessorCount"],
        "l2_bytes": attrs["L2CacheSize"],
        "memory_bytes": cupy.cuda.runtime.memGetInfo()[1],
        "pci_bus_id": device.pci_bus_id,
    }
    info["nvidia_smi"] = nvidia_smi(device.pci_bus_id)
    return info


def collect(torch=None) -> dict:
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "versions": library_versions(torch),
    }
    try:
        env["gpu"] = gpu_info()
    except Exception as exc:
        env["gpu"] = None
        env["gpu_error"] = f"{type(exc).__name__}: {exc}"
    return env


def summary_line(env: dict) -> str:
    """'NVIDIA H200 (132 SMs, sm_90) · cupyflash 0.1.0 · CuPy 14.2.0 · NVRTC 13.0 · ...'"""
    gpu = env.get("gpu")
    parts = []
    if gpu:
        major_minor = gpu["compute_capability"]
        parts.append(f"{gpu['name']} ({gpu['sm_count']} SMs, sm_{major_minor})")
        smi = gpu.get("nvidia_smi")
        if smi:
            parts.append(f"SM clock {smi['clocks.sm']}/{smi['clocks.max.sm']} MHz")
    v = env["versions"]
    names = (("cupyflash", "cupyflash"), ("cupy", "CuPy"), ("nvrtc", "NVRTC"),
             ("cuda_driver", "driver CUDA"), ("torch", "PyTorch"), ("cudnn", "cuDNN"))
    parts += [f"{label} {v[key]}" for key, label in names if v.get(key) is not None]
    parts.append(env["date"])
    return " · ".join(parts)

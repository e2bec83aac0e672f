"""The repository's dev/ folder (superseded kernel versions and tuning candidates), loaded as
modules from a source checkout; an installation has none (a wheel ships only the library)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def dev_dir() -> Path | None:
    """dev/ of the source checkout this package runs from, or None when it runs from an
    installation."""
    root = Path(__file__).resolve().parents[1]
    return root / "dev" if (root / "kernels_cu").is_dir() else None


def load(name: str, folder: Path | None = None):
    """dev/``name``.py of ``folder`` (default: this checkout's dev/) as a module (loaded once per
    path), or None when it is not there."""
    folder = folder or dev_dir()
    path = Path(folder) / f"{name}.py" if folder is not None else None
    if path is None or not path.is_file():
        return None
    module_name = f"cupyflash_dev_{name}"
    loaded = sys.modules.get(module_name)
    if loaded is not None and Path(loaded.__file__).resolve() == path.resolve():
        return loaded
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module

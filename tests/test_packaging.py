"""What a user installs: setup.cfg lists every subpackage and kernel source, and a wheel and an sdist
built from the tree carry them, the LICENSE, and CUDA extras that bring all a kernel compile needs
(a non-editable install must find everything; CI also checks one from outside the source tree)."""
import configparser
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed():
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    listed = {p.strip() for p in config["options"]["packages"].split() if p.strip()}
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "cupyflash").rglob("__init__.py")}
    assert on_disk <= listed, f"missing from setup.cfg [options] packages: {sorted(on_disk - listed)}"
    assert "cupyflash.kernels_cu" in listed
    data = config["options.package_data"]["cupyflash.kernels_cu"]
    kinds = {p.suffix for p in (REPO / "kernels_cu").iterdir() if p.suffix in (".cu", ".cuh")}
    assert all(f"*{kind}" in data for kind in kinds)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(wheel, sdist) built from a copy of the tree, as pip would without build isolation."""
    pytest.importorskip("setuptools", minversion="77")
    tmp = tmp_path_factory.mktemp("build")
    source = tmp / "src"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "LICENSE", "README.md"):
        shutil.copy(REPO / name, source / name)
    for folder in ("cupyflash", "kernels_cu"):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp / "dist"
    names = []
    for hook in ("build_wheel", "build_sdist"):  # one process each: setuptools keeps state between them
        script = (f"import sys, setuptools.build_meta as backend; "
                  f"print('built:', backend.{hook}(sys.argv[1]))")  # setuptools logs to stdout too
        run = subprocess.run([sys.executable, "-c", script, str(out)], cwd=source, capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
        names.append(run.stdout.rsplit("built:", 1)[1].strip())
    wheel_name, sdist_name = names
    return out / wheel_name, out / sdist_name


def _metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        return z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()


def test_the_wheel_and_the_sdist_carry_the_license(built):
    wheel, sdist = built
    license_text = (REPO / "LICENSE").read_bytes()
    assert b"BSD 3-Clause License" in license_text and b"the cupyflash authors" in license_text
    with zipfile.ZipFile(wheel) as z:
        licenses = [n for n in z.namelist() if ".dist-info/" in n and n.rsplit("/", 1)[-1] == "LICENSE"]
        assert licenses, f"no LICENSE in {wheel.name}"
        assert all(z.read(n) == license_text for n in licenses)
    metadata = _metadata(wheel)
    assert "License-Expression: BSD-3-Clause" in metadata.splitlines()
    assert "License-File: LICENSE" in metadata.splitlines()
    with tarfile.open(sdist) as t:
        member = next(m for m in t.getmembers() if m.name.count("/") == 1 and m.name.endswith("/LICENSE"))
        assert t.extractfile(member).read() == license_text


def test_the_wheel_carries_every_module_and_kernel_source(built):
    wheel, _ = built
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "cupyflash").rglob("*.py")
               if "__pycache__" not in p.parts}
    kernels = {f"cupyflash/kernels_cu/{p.name}" for p in (REPO / "kernels_cu").iterdir()
               if p.suffix in (".cu", ".cuh")}
    assert modules and kernels
    assert modules <= names, f"missing from the wheel: {sorted(modules - names)}"
    assert kernels <= names, f"missing from the wheel: {sorted(kernels - names)}"


@pytest.mark.parametrize("extra, cuda", [("cuda12", "12"), ("cuda13", "13")])
def test_each_cuda_extra_brings_cupy_nvrtc_and_the_headers(built, extra, cuda):
    requirements = [line.split(":", 1)[1].strip() for line in _metadata(built[0]).splitlines()
                    if line.startswith("Requires-Dist:") and f'extra == "{extra}"' in line]
    assert any(r.startswith(f"cupy-cuda{cuda}x") for r in requirements), requirements
    toolkit = [r for r in requirements if r.startswith("cuda-toolkit[")]
    assert len(toolkit) == 1, requirements
    parts = set(re.match(r"cuda-toolkit\[([^\]]*)\]", toolkit[0]).group(1).split(","))
    assert {"nvrtc", "cudart"} <= parts  # cudart's wheel holds the CUDA headers
    assert f"=={cuda}.*" in toolkit[0]


def test_the_wheel_installs_the_cupyflash_command(built):
    wheel, _ = built
    with zipfile.ZipFile(wheel) as z:
        entry_points = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "[console_scripts]" in entry_points
    assert "cupyflash = cupyflash.cli:main" in entry_points.splitlines()

"""setup.cfg ships every Python subpackage and every kernel source (a non-editable install must
find them; CI checks that install from outside the source tree)."""
import configparser
from pathlib import Path

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

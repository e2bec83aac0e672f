"""scripts/bundle_out.sh: a device command's OUT folder becomes two files (the device tool brings
back at most 8), with nothing lost and the summary lines kept readable."""
from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bundle_out.sh"


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("tar") is None, reason="needs bash and tar")
def test_out_becomes_a_summary_and_a_bundle(tmp_path):
    files = {
        "s1.log": "suite-part1: rc 0 in 89 s; \n",
        "s1/suite-part1.txt": "shard 0: 4 tests, rc 0: 4 passed\nxfailed 1  passed 571  skipped 1  \n",
        "s2/suite-part2.txt": "shard 3: 5 tests, rc 1: 4 passed, 1 failed\n=== shard3.log\nFAILED tests/x.py::t\n",
        "p/pair-shards/shard0.log": "noise\n",
        "bench.json": "{}\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True, check=True)
    assert "5 files in bundle.tar.gz" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle.tar.gz", "summary.txt"]
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert "./s1.log:suite-part1: rc 0 in 89 s; " in summary
    assert "./s1/suite-part1.txt:xfailed 1  passed 571  skipped 1  " in summary
    assert "./s2/suite-part2.txt:shard 3: 5 tests, rc 1: 4 passed, 1 failed" in summary
    assert not any("noise" in line for line in summary)
    with tarfile.open(tmp_path / "bundle.tar.gz") as tar:
        got = {m.name.removeprefix("./"): tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}
    assert got == files

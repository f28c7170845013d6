"""The documentation builds without warnings; the code is lint-clean."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(
    shutil.which("mkdocs") is None and not (Path(sys.executable).parent / "mkdocs").exists(),
    reason="mkdocs is installed with the test extra",
)
@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path):
    mkdocs = shutil.which("mkdocs") or str(Path(sys.executable).parent / "mkdocs")
    proc = subprocess.run([mkdocs, "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_ruff_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    proc = subprocess.run([ruff, "check", "lowrank_laplace", "tests", "benchmarks"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]

"""The quality gates, run with the suite: ruff and mypy clean with their committed configuration
(``pyproject.toml``), and ``src/`` within its line budget (the count is printed at the end of the run)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINE_BUDGET = 9_000  # lines of src/jitserve, comments and docstrings included


def source_lines() -> int:
    return sum(len(path.read_text().splitlines()) for path in (ROOT / "src" / "jitserve").rglob("*.py"))


def tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(f"{name} is not installed: it comes with the dev extra (python3 dev.py test installs it)")
    return found


def test_ruff_is_clean():
    result = subprocess.run([tool("ruff"), "check", "src", "tests", "bench", "dev.py"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean():
    result = subprocess.run([tool("mypy")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


def test_src_stays_within_its_line_budget():
    assert source_lines() <= LINE_BUDGET, f"src/jitserve has {source_lines():,} lines, over {LINE_BUDGET:,}"


def test_the_sdist_carries_the_tests_examples_and_benches(tmp_path):
    """Everything tracked under tests/, examples/ and bench/ is in the source distribution, with the license."""
    if not (ROOT / ".git").exists():
        pytest.skip("run from a git checkout: the sdist is checked against the tracked files")
    subprocess.run([sys.executable, "-m", "build", "--sdist", "--outdir", str(tmp_path), str(ROOT)], check=True,
                   capture_output=True, timeout=600)
    (archive,) = tmp_path.glob("jitserve-*.tar.gz")
    with tarfile.open(archive) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    tracked = subprocess.run(["git", "ls-files", "tests", "examples", "bench"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    assert not sorted(set(tracked) - names), "files missing from the sdist"
    assert {"LICENSE", "README.md", "pyproject.toml", "dev.py", "src/jitserve/protocol/inference.binpb"} <= names

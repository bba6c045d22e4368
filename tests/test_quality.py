"""The quality gates, run with the suite: ruff and mypy clean with their committed configuration
(``pyproject.toml``), ``src/`` within its line budget (the count is printed at the end of the run), and
every module importing only from its own layer or those below (DESIGN.md's layers)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINE_BUDGET = 11_300  # lines of src/jitserve, comments and docstrings included (+500: params, +1,000: generation;
# +800: issue 31 hardening, per-request sampling and generation over the network)


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


# DESIGN.md's layers, bottom up: a module may import from its own layer and those below, never above.
LAYERS = (
    ("errors", "template", "defaults", "device", "version", "params"),
    ("graph",),
    ("interpreter", "primitives"),
    ("iree",),
    ("compilers",),
    ("defn",),
    ("batch", "loadtest"),
    ("serving",),
    ("protocol", "cluster"),
    ("cli", "__main__", "__init__"),
)
LAYER_OF = {name: level for level, names in enumerate(LAYERS) for name in names}


def jitserve_imports(path: Path) -> set[str]:
    """The top-level jitserve modules (``serving``, ``errors``, ...) that one source file imports, at any
    depth of the file (imports inside functions count)."""
    package = path.relative_to(ROOT / "src").with_suffix("").parts[:-1]  # ("jitserve", "protocol")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            parts = base + (node.module.split(".") if node.module else [])
            if parts[:1] != ["jitserve"]:
                continue
            found |= {parts[1]} if len(parts) > 1 else {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("jitserve.")}
    return found


def module_name(path: Path) -> str:
    """The top-level jitserve module a file belongs to (``protocol`` for protocol/http.py)."""
    return path.relative_to(ROOT / "src" / "jitserve").with_suffix("").parts[0]


def test_every_module_imports_only_from_its_layer_or_below():
    upward = []
    for path in sorted((ROOT / "src" / "jitserve").rglob("*.py")):
        importer = module_name(path)
        for imported in jitserve_imports(path) - {importer}:
            assert imported in LAYER_OF, f"{path.name} imports jitserve.{imported}, which has no layer in LAYERS"
            if LAYER_OF[imported] > LAYER_OF[importer]:
                upward.append(f"{path.relative_to(ROOT)} imports jitserve.{imported}")
    assert not upward, "imports pointing up the layers:\n" + "\n".join(upward)


def test_the_layer_check_sees_relative_and_local_imports(tmp_path, monkeypatch):
    """The checker itself: a relative import inside a function counts, resolved against the file's package."""
    fake = ROOT / "src" / "jitserve" / "protocol" / "probe.py"
    monkeypatch.setattr(Path, "read_text", lambda self: "def f():\n    from ..cli import main\n    from . import http\n"
                        if self == fake else Path.read_bytes(self).decode())
    assert jitserve_imports(fake) == {"cli", "protocol"}


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

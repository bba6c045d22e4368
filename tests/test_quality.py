"""The quality gates, run with the suite: ruff and mypy clean with their committed configuration
(``pyproject.toml``), ``src/`` within its budget of code lines (printed per folder at the end of the run),
and every module importing only from its own layer or those below (the layers of docs/design.md)."""

from __future__ import annotations

import ast
import io
import shutil
import subprocess
import sys
import tarfile
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# lines of src/jitserve that hold code (comments, docstrings and blank lines are free), raised on purpose when
# a capability lands; 7,800 after weights as params, generation, issue 31's hardening, sampling, and generation
# over the network and on Ray (7,666 code lines of 10,900 in all when the count changed to code only);
# 8,850 when generation warm-up learnt to run its programs where a first run costs extra (a GPU); 8,880 when
# a generation's programs took its weights packed into few arrays (jitserve/packed.py); 8,900 when a step's
# outputs reached the asyncio streams of one event loop in one hand-over; 8,930 for IREE's one scatter form,
# 8,970 for sharded checkpoints, 9,000 for protecting IREE's inputs from in-place writes; 9,050 when generations
# learnt to swap and reload their weights (update_params, params=PATH); 9,080 for a generation's text in and
# out (preprocess, postprocess); 9,150 for stop sequences on a text generation's pieces; 9,900 for
# from_pretrained (models/: checkpoints checked key by key, real tokenizers, GPT-2, Llama-family and BERT);
# 9,980 when cluster/ray.py became a package of five rooms (their own imports, a protocol for what the
# autoscaler scales, the autoscaling decision's reading and result as records) and Serving and Generation
# declared their fingerprint fields; 10,000 when a Serving declared its tensors on the wire (wire=); 10,130 when
# the generation became a package of rooms with a scheduler on plain data (its plans, its imports per module);
# 10,150 when a model.py's SystemExit became its failed load and the poll interval was checked; 10,200 for
# issue 47's size checks (BYTES shapes, stop sequences, .npz members)
LINE_BUDGET = 10_200
SOURCE = ROOT / "src" / "jitserve"


def code_lines(path: Path) -> int:
    """The lines of a module that hold code: not blank, not only a comment, not part of a docstring."""
    text = path.read_text()
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    lines: set[int] = set()
    free = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER,
            tokenize.ENCODING}
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in free:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def lines_by_folder() -> dict[str, int]:
    """Code lines per package folder of src/jitserve (``.`` for the top level)."""
    folders: dict[str, int] = {}
    for path in sorted(SOURCE.rglob("*.py")):
        folder = str(path.parent.relative_to(SOURCE))
        folders[folder] = folders.get(folder, 0) + code_lines(path)
    return folders


def source_lines() -> int:
    return sum(lines_by_folder().values())


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
    ("errors", "template", "defaults", "device", "version", "params", "packed"),
    ("graph",),
    ("compilers",),
    ("defn",),
    ("batch", "loadtest", "workloads"),
    ("serving",),
    ("models",),
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
    assert source_lines() <= LINE_BUDGET, f"src/jitserve has {source_lines():,} code lines, over {LINE_BUDGET:,}"


def test_code_lines_count_code_only(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""A docstring\nof two lines."""\n\n# a comment\nx = (1,\n     2)  # trailing\n\n\n'
                      'def f():\n    """Its docstring."""\n    return """a string\nthat is code"""\n')
    assert code_lines(module) == 5  # x = (1, / 2) / def f(): / return """a string / that is code"""


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


def test_no_bench_script_is_named_after_an_importable_module():
    """A bench script run as ``python bench/x.py`` puts bench/ first on sys.path: one named after a package
    (bench/iree.py, bench/ray.py once) would shadow it for everything the script imports."""
    stems = [path.stem for path in sorted((ROOT / "bench").glob("*.py"))]
    found = subprocess.run([sys.executable, "-P", "-c", "import importlib.util, sys; "
                            "print(' '.join(n for n in sys.argv[1:] if importlib.util.find_spec(n)))", *stems],
                           cwd="/", capture_output=True, text=True, check=True)  # installed modules only
    assert not found.stdout.split(), f"bench scripts named after importable modules: {found.stdout.split()}"

"""The README: its Python examples run, and its two commands work from a fresh clone."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_the_two_commands():
    first_block = re.search(r"```sh\n(.*?)```", README, re.S).group(1).splitlines()
    assert [line.split("#")[0].strip() for line in first_block] == ["python3 dev.py demo", "python3 dev.py test"]


@pytest.mark.parametrize("index", range(len(re.findall(r"```python\n", README))))
def test_readme_python_examples_run(index):
    code = re.findall(r"```python\n(.*?)```", README, re.S)[index]
    exec(compile(code, f"README.md[python {index}]", "exec"), {"__name__": "readme"})


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("JITSERVE_FRESH_CLONE") == "1", reason="already inside the fresh-clone run")
@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to clone")
def test_two_commands_from_a_fresh_clone(tmp_path):
    """Clone the working tree, then run both README commands there (a new .venv)."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    for path in subprocess.run(["git", "ls-files", "--others", "--modified", "--exclude-standard"],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout.split():
        target = clone / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / path).exists():
            shutil.copy2(ROOT / path, target)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env["JITSERVE_FRESH_CLONE"] = "1"
    demo = subprocess.run([sys.executable, "dev.py", "demo", "--budget", "0.05"], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "| 1000x1000x5 |" in demo.stdout and "numpy eager" in demo.stdout
    test = subprocess.run([sys.executable, "dev.py", "test", "-q", "tests/test_readme.py"], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert test.returncode == 0, test.stdout[-3000:]
    assert re.search(r"\d+ passed", test.stdout)

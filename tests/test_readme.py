"""The README: its Python examples run, and its two commands work from a fresh clone."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from netutil import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_the_two_commands():
    first_block = re.search(r"```sh\n(.*?)```", README, re.S).group(1).splitlines()
    assert [line.split("#")[0].strip() for line in first_block] == ["python3 dev.py serve", "python3 dev.py test"]


# the client example needs a running server, the scale-out one a Ray cluster (tests/cluster runs it)
EXAMPLES = [code for code in re.findall(r"```python\n(.*?)```", README, re.S)
            if "localhost:8000" not in code and "ray.init" not in code]


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_readme_python_examples_run(index):
    code = EXAMPLES[index]
    exec(compile(code, f"README.md[python {index}]", "exec"), {"__name__": "readme"})


CLIENT_EXAMPLE = next(code for code in re.findall(r"```python\n(.*?)```", README, re.S) if "localhost:8000" in code)
CURL_LINES = re.search(r"```sh\n(curl .*?)```", README, re.S).group(1)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("JITSERVE_FRESH_CLONE") == "1", reason="already inside the fresh-clone run")
@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to clone")
def test_two_commands_from_a_fresh_clone(tmp_path):
    """Clone the working tree, run both README commands there (a new .venv), and the README's client code."""
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
    port, grpc_port = free_port(), free_port()
    serve = subprocess.Popen([sys.executable, "dev.py", "serve", "--port", str(port), "--grpc-port", str(grpc_port)],
                             cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(port, serve, 1800)
        client_code = CLIENT_EXAMPLE.replace("localhost:8000", f"127.0.0.1:{port}")
        # the client runs where tritonclient is installed (this suite's environment): serving does not need it
        client = subprocess.run([sys.executable, "-c", client_code], capture_output=True, text=True, timeout=120)
        assert client.returncode == 0, client.stderr
        assert client.stdout.count("[") >= 3, client.stdout
        for command in re.findall(r"^curl .*?(?=^curl |\Z)", CURL_LINES, re.S | re.M):
            if shutil.which("curl") is None:
                break
            shell = command.replace("localhost:8000", f"127.0.0.1:{port}").replace("\n", " ")
            result = subprocess.run(["bash", "-c", shell.split("#")[0]], capture_output=True, text=True, timeout=60)
            assert result.returncode == 0 and result.stdout, (shell, result.stderr)
            assert "error" not in result.stdout
    finally:
        serve.send_signal(signal.SIGTERM)
        output, _ = serve.communicate(timeout=120)
    assert serve.returncode == 0, output[-3000:]
    assert "SIGTERM: shutting down" in output
    test = subprocess.run([sys.executable, "dev.py", "test", "-q", "tests/test_readme.py"], cwd=clone, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert test.returncode == 0, test.stdout[-3000:]
    assert re.search(r"\d+ passed", test.stdout)


def test_every_serve_flag_is_documented():
    help_text = subprocess.run([sys.executable, "-m", "jitserve", "serve", "--help"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", help_text)) - {"--help"}
    assert len(flags) > 20
    missing = sorted(flag for flag in flags if f"`{flag}" not in README and f" {flag} " not in README
                     and f"[{flag}" not in README)
    assert not missing, f"flags of jitserve serve --help that the README does not mention: {missing}"

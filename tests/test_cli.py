"""The command line: devices, mlir, demo's table and bench, run as a user would."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jitserve as js
from jitserve.cli import main
from jitserve.loadtest import closed_loop, closed_loop_async

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jitserve", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_devices(capsys):
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^xla\s+xla:cpu:0\s+cpu$", out, re.M)
    assert "evaluator:cpu:0" in out


def test_mlir_prints_stablehlo(capsys):
    assert main(["mlir", "jitserve.workloads:softmax", "--shape", "2x3"]) == 0
    out = capsys.readouterr().out
    assert "func.func public @main(%arg0: tensor<2x3xf32>)" in out and "stablehlo.exponential" in out


def test_demo_prints_a_row_per_size_and_compiler():
    result = run_cli("demo", "--budget", "0.01")
    assert result.returncode == 0, result.stderr
    header = result.stdout.splitlines()[0]
    assert "numpy eager" in header and "xla" in header and "evaluator" in header
    for size in ["| 1,000 ", "| 1,000,000 ", "| 1000x1000x5 "]:
        assert size in result.stdout


def test_bench_drives_a_serving_and_reports():
    result = run_cli("bench", "examples/mlp.py:serving", "--seconds", "0.5", "--callers", "4", "--rows", "3")
    assert result.returncode == 0, result.stderr
    row = result.stdout.strip().splitlines()[-1]
    rate, p50, p99, mean_batch, waste, compiles = [cell.strip() for cell in row.strip("|").split("|")]
    assert float(rate.replace(",", "")) > 0 and float(p99) >= float(p50) > 0
    assert 3 <= float(mean_batch) <= 32 and compiles == "0"
    result = run_cli("bench", "examples/mlp.py:serving", "--seconds", "0.3", "--async", "--batch-size", "8")
    assert result.returncode == 0, result.stderr
    assert "batch_size=8" in result.stdout and "asyncio tasks" in result.stdout


def test_bad_target_is_a_clear_error():
    result = run_cli("serve", "examples/mlp.py")
    assert result.returncode != 0
    assert "TARGET must look like path/to/file.py:attr or package.module:attr" in result.stderr
    result = run_cli("serve", "examples/mlp.py:W1")
    assert "examples/mlp.py:W1 is a ndarray, not a jitserve.Serving or Generation or a dict of them" in result.stderr


def test_closed_loops_count_rows_and_latencies():
    serving = js.Serving(lambda x: x + 1, batch_size=4, batch_timeout=0.001, compiler="eager")
    with js.serve(serving, name="loadtest"):
        batch = js.Batch.stack([np.ones(2)])
        threads = closed_loop(lambda seed: lambda: (js.batched_run("loadtest", batch), 1)[1], 3, 0.2)

        def make_async(seed):
            async def call():
                await js.batched_run_async("loadtest", batch)
                return 1
            return call

        tasks = closed_loop_async(make_async, 3, 0.2)
    for load in (threads, tasks):
        assert load.calls == len(load.latencies) > 0 and load.rows_per_s > 0
        assert load.percentile(99) >= load.percentile(50) > 0


@pytest.mark.parametrize(("source", "expected"), [
    (None, "jitserve serve: no such file: {path}"),
    ("def broken(:\n", "jitserve serve: {path}:1: syntax error: "),
    ("raise RuntimeError('model weights missing')\n", "jitserve serve: cannot load {path}: RuntimeError: model "
                                                      "weights missing (--debug shows the traceback)"),
])
def test_a_target_that_does_not_load_is_one_line_and_exit_2(tmp_path, source, expected):
    path = tmp_path / "model.py"
    if source is not None:
        path.write_text(source)
    done = subprocess.run([sys.executable, "-m", "jitserve", "serve", f"{path}:serving"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], "one line, no traceback"
    assert done.stderr.startswith(expected.format(path=path))
    if source is not None:
        debug = subprocess.run([sys.executable, "-m", "jitserve", "--debug", "serve", f"{path}:serving"],
                               capture_output=True, text=True, timeout=120)
        assert "Traceback (most recent call last)" in debug.stderr


@pytest.mark.parametrize(("flags", "expected"), [
    (["--drain-timeout", "nan"], "jitserve serve: drain_timeout must be a finite number of seconds >= 0 or None, got nan"),
    (["--request-timeout", "-1"], "jitserve serve: request_timeout must be a finite number of seconds >= 0 or None, "
                                  "got -1.0"),
    (["--read-timeout", "inf"], "jitserve serve: limit read_timeout must be a finite positive number, got inf"),
    (["--api-key", ""], "jitserve serve: the API key is empty, which would admit every caller; give a key, or none "
                        "for an open server (an unset variable in --api-key \"$KEY\"?)"),
    (["--api-key", "  "], "jitserve serve: the API key is empty, which would admit every caller; give a key, or "
                          "none for an open server (an unset variable in --api-key \"$KEY\"?)"),
    (["--api-key", "cl\u00e9"], "jitserve serve: the API key must be printable ASCII without spaces at either end: "
                                 "HTTP headers carry no other characters, so no caller could present it"),
])
def test_a_bad_timeout_flag_is_one_line_and_exit_2_before_anything_starts(flags, expected):
    done = run_cli("serve", "examples/mlp.py:serving", "--port", "0", "--no-grpc", *flags, timeout=120)
    assert (done.returncode, done.stderr.strip()) == (2, expected)


@pytest.mark.parametrize("shape", ["2xa", "-1x3", "2x"])
def test_a_bad_mlir_shape_is_a_usage_error_naming_the_format(shape):
    done = run_cli("mlir", "jitserve.workloads:softmax", f"--shape={shape}", timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().endswith(f"argument --shape: expected dimensions joined by 'x', each a non-negative "
                                        f"integer (e.g. 1000x1000x5, or '' for a scalar); got '{shape}'")


def test_version_and_help_show_defaults_and_examples():
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"jitserve {js.__version__}"
    help_text = run_cli("serve", "--help").stdout
    assert "``" not in help_text, "no raw RST markup"
    assert "(default 8000)" in help_text and "(default 33,554,432)" not in help_text
    assert "examples:\n  jitserve serve examples/mlp.py:serving" in help_text


def test_targets_import_from_the_working_directory_and_beside_their_file(tmp_path):
    """A package target found from the working directory, a file target that imports its sibling module, and
    a single serving named after its file."""
    (tmp_path / "shared_weights.py").write_text("SCALE = 3.0\n")
    (tmp_path / "tripler.py").write_text(
        "import jitserve as js\nfrom shared_weights import SCALE\n"
        "serving = js.Serving(lambda x: x * SCALE, input_template=js.template((2,), 'float32'))\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "models.py").write_text("from tripler import serving as mlp\n")
    script = ("import sys, argparse; from jitserve.cli import load_servings\n"
              "for target in sys.argv[1:]:\n"
              "    args = argparse.Namespace(target=target, name=None, batch_size=None, batch_timeout=None, "
              "compiler=None)\n"
              "    print(sorted(load_servings(args)))\n")
    result = subprocess.run([sys.executable, "-c", script, "tripler.py:serving", "pkg.models:mlp"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["['tripler']", "['models']"]
    elsewhere = subprocess.run([sys.executable, "-c", script, str(tmp_path / "tripler.py") + ":serving"], cwd=ROOT,
                               capture_output=True, text=True, timeout=120)
    assert elsewhere.returncode == 0 and elsewhere.stdout.strip() == "['tripler']", elsewhere.stderr


def test_serve_keeps_its_compiled_programs_across_restarts_unless_told_not_to(tmp_path):
    """``jitserve serve`` writes its compiled programs to the persistent cache by default (``$XDG_CACHE_HOME/
    jitserve`` here) and a restart reads them; ``--no-compile-cache`` writes none (issue 57)."""
    from netutil import start_server, stop

    cache = tmp_path / "xdg"
    env = {"XDG_CACHE_HOME": str(cache), "JITSERVE_CACHE_DIR": ""}
    for _ in range(2):  # the second start finds the first's programs
        stop(start_server("examples/mlp.py:serving", "--no-grpc", env=env))
        written = sorted(p.name for p in (cache / "jitserve").rglob("*") if p.is_file())
        assert written, "the compiled programs are in the cache folder"
    assert sorted(p.name for p in (cache / "jitserve").rglob("*") if p.is_file()) == written, "nothing new compiled"
    off = tmp_path / "off"
    stop(start_server("examples/mlp.py:serving", "--no-grpc", "--no-compile-cache",
                      env={"XDG_CACHE_HOME": str(off), "JITSERVE_CACHE_DIR": str(off / "env")}))
    assert not off.exists() or not any(p.is_file() for p in off.rglob("*"))

"""Shared fixtures: every test starts from the process-wide default options, with the evaluator's checks on."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("JITSERVE_CHECKS", "1")  # the evaluator checks every result's shape and dtype

import jitserve as js


@pytest.fixture(autouse=True)
def _default_options():
    previous = js.set_default_options()
    yield
    js.set_default_options(**previous)


def pytest_terminal_summary(terminalreporter) -> None:
    """The code lines of src/ per folder against their caps (tests/test_quality.py), at the end of every run."""
    from test_quality import FOLDER_CAPS, lines_by_folder

    folders = lines_by_folder()
    table = ", ".join(f"{folder} {lines:,}/{FOLDER_CAPS.get(folder, 0):,}" for folder, lines in folders.items())
    terminalreporter.write_line(f"src/jitserve: {sum(folders.values()):,} code lines (per folder, of its cap): {table}")

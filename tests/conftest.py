"""Shared fixtures: every test starts from the process-wide default options."""

from __future__ import annotations

import pytest

import jitserve as js


@pytest.fixture(autouse=True)
def _default_options():
    previous = js.set_default_options()
    yield
    js.set_default_options(**previous)

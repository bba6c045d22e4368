"""Checkpoints made once per run (tests/models/checkpoints.py) and float32 matrix products, as the
references compute them."""

from __future__ import annotations

import jax
import pytest
from checkpoints import TOKENIZERS, VARIANTS


@pytest.fixture(scope="session")
def made(tmp_path_factory):
    """``made(name)``: the folder of checkpoint ``name`` (a key of checkpoints.VARIANTS, or of
    checkpoints.TOKENIZERS for a tokenizer alone), made on first use."""
    root = tmp_path_factory.mktemp("checkpoints")
    folders = {}

    def make(name):
        if name not in folders:
            folders[name] = {**VARIANTS, **TOKENIZERS}[name](root / name)
        return folders[name]
    return make


@pytest.fixture(autouse=True, scope="package")
def full_float32():
    """A GPU multiplies float32 matrices in TF32 unless told otherwise; the comparisons need float32."""
    before = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    yield
    jax.config.update("jax_default_matmul_precision", before)

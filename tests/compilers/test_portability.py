"""The portability suite: every corpus definition on xla (through jitserve), the evaluator and IREE,
compared with jax.jit's answer at a dtype-appropriate tolerance.

The evaluator must agree on every case. IREE must agree or raise a jitserve error that says what it
cannot do and which compiler can (linear algebra, FFTs of lengths other than powers of two, float64
library functions on CPU), and agree on every gather and scatter; a wrong answer or a raw error fails. ``bench/portability.py`` prints the
counts per compiler (the table in docs/compilers.md).
"""

from __future__ import annotations

import pytest
from corpus import CASES, run

IDS = [case.name for case in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_xla_through_jitserve_agrees(case):
    outcome, detail = run(case, "xla")
    assert outcome == "agree", detail


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_evaluator_agrees_with_xla(case):
    outcome, detail = run(case, "evaluator")
    assert outcome == "agree", detail


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_iree_agrees_with_xla_or_says_clearly_why_not(case):
    pytest.importorskip("iree.runtime")
    outcome, detail = run(case, "iree")
    if case.name.startswith(("gather/", "scatter/")):  # jitserve puts every one in a form IREE compiles
        assert outcome == "agree", detail
    assert outcome in ("agree", "clear error"), detail
    if outcome == "clear error":
        assert "compiler='xla' or compiler='evaluator'" in detail, detail


def test_the_corpus_covers_at_least_200_definitions_in_every_area():
    areas = {case.name.split("/")[0] for case in CASES}
    assert len(CASES) >= 200
    assert areas >= {"elementwise", "reduce", "broadcast", "dot", "conv", "gather", "scatter", "sort", "cumulative",
                     "control", "dynamic", "shape", "int", "dtype", "random", "grad", "linalg", "fft"}

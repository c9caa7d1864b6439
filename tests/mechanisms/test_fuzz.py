"""Property-based fuzz tests of every registered mechanism (hypothesis, derandomized).

Per mechanism, hypothesis draws a valid config (``fuzz_configs``: windows, blocks, chunks,
landmark counts below and above the length; global positions repeated, out of order, at
and past the last position), shapes (b 1-3, h 1-4, n 1-70, m = n), a key mask (none, all
real, right/left/inner padding, a row with one real key), causal on/off where supported,
need_weights, train/eval; ``fuzz_checks`` holds the checks and their tolerances (exact
mechanisms equal the reference over their own bias at 1e-5, outputs and gradients).
Derandomized with a modest example count, so the run is fixed and fast; a longer campaign
runs the same checks with ``fuzz_configs.RandomPick`` and other seeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import pytest
from fuzz_checks import Case, check_bf16, check_case, check_weights_times_v, draw_case
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import attnlab
from attnlab.core import resolve_config

T = TypeVar("T")
NAMES = attnlab.list_mechanisms()
FUZZ = settings(max_examples=6, derandomize=True, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))


class DataPick:
    """``fuzz_configs.Pick`` over hypothesis' ``data.draw`` (shrinkable draws)."""

    def __init__(self, data: st.DataObject) -> None:
        self.data = data

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def choice(self, options: Sequence[T]) -> T:
        return options[self.data.draw(st.integers(0, len(options) - 1))]

    def float(self, lo: float, hi: float) -> float:
        return round(self.data.draw(st.floats(lo, hi)), 3)


def draw(data: st.DataObject, name: str) -> Case:
    case = draw_case(name, DataPick(data))
    resolve_config(case.spec())  # the drawn values are valid: an error here is the table's
    note(repr(case))
    return case


@pytest.mark.parametrize("name", NAMES)
@FUZZ
@given(data=st.data())
def test_fuzz_invariants(name, data):
    """Finite outputs and gradients, exactness, padding, causality, determinism."""
    check_case(draw(data, name))


@pytest.mark.parametrize("name", NAMES)
@settings(FUZZ, max_examples=3)
@given(data=st.data())
def test_fuzz_weights_and_bf16(name, data):
    case = draw(data, name)
    check_weights_times_v(case)
    check_bf16(case)

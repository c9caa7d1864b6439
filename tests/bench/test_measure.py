"""The measuring functions themselves, run on stand-in mechanisms whose cost is known: a
fake clock that each call advances by a set amount (which calls are timed, which
statistic is taken), and calls that allocate a known number of bytes (what the peak
counts, in which unit). In this process: no subprocess, no real mechanism."""

from __future__ import annotations

import types

import pytest
import torch

from attnlab.bench import lra_cell, speed
from attnlab.core import AttnOutput
from attnlab.train.memory import reset_peak_rss

MIB = 2**20


class Clock:
    """A fake ``time`` module: ``perf_counter`` reads ``now``; each call of the stand-in
    advances it by the next of ``costs`` (seconds), so each measured duration is known."""

    def __init__(self, costs: list[float]):
        self.costs, self.now, self.calls = list(costs), 0.0, 0

    def perf_counter(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += self.costs[self.calls] if self.calls < len(self.costs) else 0.0
        self.calls += 1


class Stand(torch.nn.Module):
    """A mechanism stand-in: out = q (a fresh tensor); ``clock`` ticks once per call;
    ``temp_bytes``: a temporary of that size, written, freed before returning; ``param_bytes``:
    a parameter of that size, allocated when built."""

    def __init__(self, clock: Clock | None = None, temp_bytes: int = 0, param_bytes: int = 0):
        super().__init__()
        self.clock, self.temp_bytes = clock, temp_bytes
        self.weight = torch.nn.Parameter(torch.ones(max(param_bytes // 4, 1)))

    def forward(self, q, k, v, ctx=None):
        if self.clock is not None:
            self.clock.tick()
        if self.temp_bytes:
            tmp = torch.empty(self.temp_bytes // 4)
            tmp.fill_(1.0)  # touched: resident
            del tmp
        return AttnOutput(q * 1.0)


def _use(monkeypatch, **kw) -> None:
    monkeypatch.setattr(speed, "build_mechanism", lambda spec, dims: Stand(**kw))


def test_time_is_the_median_of_the_repeats_after_the_warm_ups(monkeypatch):
    """Calls: two warm-ups at the tiny length (forward, forward+backward), then per part a
    warm-up at n and the timed repeats. The warm-ups never count; of an even number of
    repeats the median is the mean of the middle two (not the upper one)."""
    ms = 1e-3
    #        tiny warm-ups | fwd: warm-up, 4 repeats  | fwd+bwd: warm-up, 4 repeats
    costs = [9.0, 9.0, 9.0, 10 * ms, 40 * ms, 20 * ms, 30 * ms,
             9.0, 50 * ms, 80 * ms, 70 * ms, 60 * ms]
    clock = Clock(costs)
    _use(monkeypatch, clock=clock)
    monkeypatch.setattr(speed, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    res = speed.measure("stand", 128, heads=2, head_dim=8, repeats=4, part="time")
    assert clock.calls == len(costs)
    assert res["fwd_ms"] == pytest.approx(25.0)  # median of 10, 40, 20, 30
    assert res["fwdbwd_ms"] == pytest.approx(65.0)  # median of 50, 80, 70, 60


def test_odd_repeats_take_the_middle_one(monkeypatch):
    ms = 1e-3
    costs = [9.0, 9.0, 9.0, 30 * ms, 10 * ms, 20 * ms, 9.0, 5 * ms, 7 * ms, 6 * ms]
    clock = Clock(costs)
    _use(monkeypatch, clock=clock)
    monkeypatch.setattr(speed, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    res = speed.measure("stand", 128, heads=2, head_dim=8, repeats=3, part="time")
    assert res["fwd_ms"] == pytest.approx(20.0) and res["fwdbwd_ms"] == pytest.approx(6.0)


def test_lra_step_time_is_the_median_of_the_repeats(monkeypatch):
    """bench lra's speed cell: a warm-up step at 64 tokens and one at full size never
    count; of 4 timed steps the median is the mean of the middle two."""
    ms = 1e-3
    clock = Clock([9.0, 9.0, 10 * ms, 40 * ms, 20 * ms, 30 * ms])
    monkeypatch.setattr(lra_cell, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(lra_cell, "build_model", lambda *a, **k: torch.nn.Linear(2, 2))
    monkeypatch.setattr(lra_cell, "_optimizer", lambda model, lr, steps: (None, None))
    monkeypatch.setattr(lra_cell, "_step", lambda *a: clock.tick())
    monkeypatch.setattr(lra_cell, "_kernels", lambda fn: [])
    res = lra_cell.measure_step("stand", 128, 2, repeats=4)
    assert clock.calls == 6
    assert res["step_ms"] == pytest.approx(25.0)
    assert res["steps_per_s"] == pytest.approx(40.0)


needs_vmhwm = pytest.mark.skipif(not reset_peak_rss(), reason="needs Linux's resettable VmHWM")


@needs_vmhwm
def test_peak_counts_a_known_temporary_in_mib(monkeypatch):
    """A forward that touches a 48 MiB temporary: the forward peak is those 48 MiB plus
    the small output, in MiB (not KiB, not bytes), above what was resident before."""
    _use(monkeypatch, temp_bytes=48 * MIB)
    res = speed.measure("stand", 64, heads=2, head_dim=8, part="memory")
    assert 47.5 <= res["peak_fwd_mb"] <= 56
    assert 47.5 <= res["peak_mem_mb"] <= 56


@needs_vmhwm
def test_inputs_and_model_are_outside_the_measured_region(monkeypatch):
    """A 64 MiB parameter and 3 x 40 MiB inputs exist before the mark is reset: neither is
    charged to the call, whose own allocations are 40 MiB at a time: the output, then (it
    is not saved for the backward, so it is freed first) the gradient of q (k and v are
    unused and get none). Every buffer is above glibc's largest dynamic mmap threshold
    (32 MiB), so each is mapped and unmapped as it lives and dies, here in the test's
    process as under ``MALLOC_MMAP_THRESHOLD_`` in the benchmark's."""
    _use(monkeypatch, param_bytes=64 * MIB)
    res = speed.measure("stand", 10240, heads=16, head_dim=64, part="memory")
    assert 39.5 <= res["peak_fwd_mb"] <= 48
    assert 39.5 <= res["peak_mem_mb"] <= 48

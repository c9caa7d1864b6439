"""``train.accel.run_accelerator``: a run's Accelerator takes the run's own mixed precision,
whatever an earlier Accelerator in the process used (Accelerate keeps one process-wide
state: a plain ``Accelerator()`` after a bf16 run silently trained in bf16 autocast)."""

from __future__ import annotations

from accelerate import Accelerator

from attnlab.train.accel import run_accelerator


def test_each_run_gets_its_own_precision():
    try:
        assert run_accelerator("bf16").mixed_precision == "bf16"  # an earlier run
        assert Accelerator(cpu=True).mixed_precision == "bf16"  # what a plain one inherits
        assert run_accelerator().mixed_precision == "no"
        assert run_accelerator("bf16").mixed_precision == "bf16"
        assert run_accelerator("no").mixed_precision == "no"
    finally:
        run_accelerator("no")  # leave the process in full precision for the other tests

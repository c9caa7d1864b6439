"""Peak memory per run: the kernel's high-water mark is reset when a run starts."""

import sys

import pytest
import torch

from attnlab.train.memory import peak_rss_mb, reset_peak_rss


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM reset is Linux-only")
def test_reset_forgets_an_earlier_peak():
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB touched
    big += 1
    before = peak_rss_mb()
    del big
    if not reset_peak_rss():
        pytest.skip("this kernel refuses writes to /proc/self/clear_refs")
    after = peak_rss_mb()
    assert after < before - 32  # the 64 MiB peak is gone from the mark
    again = torch.ones(64 * 2**20 // 4)
    again += 1
    assert peak_rss_mb() >= after + 32  # and new allocations raise it again

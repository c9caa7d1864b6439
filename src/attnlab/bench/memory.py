"""Peak memory of a CPU call, from the PyTorch profiler's allocation events.

PyTorch has no CPU allocator statistics (``torch.cuda.max_memory_allocated`` has no CPU
twin), so we replay the profiler's ``[memory]`` events (allocations > 0, frees < 0) in
time order and take the running maximum. The result is the peak of tensor memory
allocated *during* the call, above what was live before it; Python objects and the
allocator's own caching are not counted. On CUDA use ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


def peak_memory_mb(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``fn()`` once under the profiler; return (its result, peak extra MiB on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.device_type() == DeviceType.CPU and e.name() == "[memory]"
    ]
    events.sort()
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return result, peak / 2**20

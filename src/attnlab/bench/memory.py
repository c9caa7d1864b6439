"""Peak memory of a CPU call, from the PyTorch profiler's allocation events.

PyTorch has no CPU allocator statistics (``torch.cuda.max_memory_allocated`` has no CPU
twin), so we replay the profiler's ``[memory]`` events (allocations > 0, frees < 0) in
time order and take the running maximum. The result is the peak of tensor memory
allocated *during* the call, above what was live before it; Python objects and the
allocator's own caching are not counted. On CUDA use ``torch.cuda.max_memory_allocated``.

The profiler's native library (Kineto) writes trace markers such as
``USDT:... SyncActivityProfilerHandler.cpp:52] profiler_start`` straight to file
descriptor 2 at every start and stop, whatever ``KINETO_LOG_LEVEL`` says (torch 2.13), so
they would land in the middle of ``attnlab demo``'s table. :func:`quiet_native_stderr`
holds fd 2 in a temporary file while the profiler runs and writes back every line that is
not one of those markers.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

# Kineto's own progress/trace lines: "USDT:2026-11-24 22:51:24 9016:9016 File.cpp:52] ...",
# "STAGE:... Completed Stage: Warm Up" (the latter at KINETO_LOG_LEVEL < 4).
_KINETO_LINE = re.compile(r"^(USDT|STAGE):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+:\d+\] ")


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """Drop Kineto's marker lines from fd 2 inside the block; keep every other line.

    Native code writes to the file descriptor, not to ``sys.stderr``, so the descriptor
    itself is swapped (``os.dup2``) for a temporary file and restored afterwards; what was
    written there, minus the markers, then goes to ``sys.stderr`` (so pytest's and
    Click's capture still see it). Where fd 2 cannot be swapped (no such descriptor), the
    block runs unchanged.
    """
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode("utf-8", errors="replace")
            kept = [ln for ln in text.splitlines(keepends=True) if not _KINETO_LINE.match(ln)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def peak_memory_mb(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``fn()`` once under the profiler; return (its result, peak extra MiB on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    with quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU],
                                        profile_memory=True) as prof:
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

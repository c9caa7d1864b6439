"""Peak resident memory of one run, not of the whole process.

``compare`` runs its variants one after another in one process (``--parallel 1``), so the
process's lifetime high-water mark (``ru_maxrss``) would charge every run with the largest
run before it. On Linux the kernel's mark (``VmHWM``) can be reset by writing 5 to
``/proc/self/clear_refs``; each run resets it when it starts and reads it when it ends.
Elsewhere the lifetime mark is the fallback (an upper bound).
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

_STATUS, _CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def reset_peak_rss() -> bool:
    """Restart the high-water mark at the current resident size; False where impossible."""
    try:
        _CLEAR.write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    """MiB: the high-water mark since the last :func:`reset_peak_rss` (Linux ``VmHWM``),
    else the process's lifetime ``ru_maxrss``."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return lifetime_peak_rss_mb()


def lifetime_peak_rss_mb() -> float:
    """MiB: the process's resident-set high-water mark since it started (``ru_maxrss``)."""
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit / 2**20

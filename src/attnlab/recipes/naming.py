"""Short names for models and output folders, shared by the analysis recipes."""

from __future__ import annotations

import re
from pathlib import Path


def safe_name(label: str) -> str:
    """A label made safe for a file or folder name."""
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", label).strip("_")


def run_label(path: str | Path) -> str:
    """Short name of a model folder; ``attnlab compare``'s ``<variant>/seed-<k>`` folders keep
    their variant (``baseline/seed-0``), so two seeds of different variants stay apart."""
    path = Path(path).resolve()
    if re.fullmatch(r"seed-\d+", path.name) and path.parent.name:
        return f"{path.parent.name}/{path.name}"
    return path.name

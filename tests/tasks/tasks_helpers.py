"""Helpers shared by the task tests (imported as a plain module from this folder)."""

from __future__ import annotations

from pathlib import Path

import pytest

# ../shared/data relative to the repository root.
DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def need_data(*parts: str) -> Path:
    """The shared data path, or skip the test when the staged data is absent."""
    path = DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip("../shared/data not found")
    return path


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8", newline="\n")
    return path

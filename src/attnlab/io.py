"""Files that are never half-written: one home for atomic writes (and for the message
of a file read back that is not UTF-8, ``not_utf8``).

Every file attnlab writes for a user (run summaries, configs, tables, plots, weights,
reports) is written to a temporary file beside its target and renamed over it
(``os.replace``, atomic on one file system), so a kill leaves either the old file or the
new one, never a cut one. The temporary name starts with a dot and carries the process id,
so concurrent writers (processes of one job) never share one, and readers that list a
folder skip it. The result gets the usual permissions (0644 under the default umask), not
the private 0600 of ``tempfile.mkstemp``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

R = TypeVar("R")


def _temp_for(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp{path.suffix}")


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces ``path``, on error it goes.

    For writers that take a path (safetensors, matplotlib's ``savefig``); the temporary
    name keeps ``path``'s suffix so format-by-extension writers still work.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_for(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` atomically; returns the path.

    The bytes reach the disk (``fsync``) before the rename, so a crash right after it leaves
    the new content, not an empty file.
    """
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    return path


def write_json(path: str | os.PathLike, data: Any, indent: int | None = 2,
               default: Callable[[Any], Any] | None = float) -> Path:
    """JSON to ``path`` atomically (numbers that JSON lacks, e.g. numpy floats, as float)."""
    return atomic_write(path, json.dumps(data, indent=indent, default=default))


# JSON Lines logs (metrics.jsonl, benchmark rows) grow by appends, so a kill can cut their
# last line; these two are the one place that reads past such a line and writes after it.


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The JSON objects of a JSON Lines file, one per line; blank lines, lines that are not
    objects and a line cut by an interrupted append are skipped; a missing file gives []."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def append_jsonl(path: str | os.PathLike, record: Any, default: Callable | None = None) -> None:
    """Append ``record`` as one line; after a cut last line it starts on a line of its own
    (so the cut line stays the only casualty)."""
    path = Path(path)
    text = json.dumps(record, default=default) + "\n"
    with path.open("a+b") as f:
        f.seek(0, os.SEEK_END)
        if f.tell():
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                text = "\n" + text
        f.write(text.encode("utf-8"))


def not_utf8(data: bytes, err: UnicodeDecodeError, first_line: int = 1) -> tuple[int, str]:
    """(line, ``byte 0x.. at column c is not UTF-8; save the file as UTF-8``) for the decoding
    error ``err`` of ``data`` (a whole file, or one line of it numbered ``first_line``); the
    caller names the file."""
    line = first_line + data.count(b"\n", 0, err.start)
    column = err.start - data.rfind(b"\n", 0, err.start)  # 1-based
    return line, (f"byte {data[err.start]:#04x} at column {column} is not UTF-8; save the "
                  "file as UTF-8")


def write_splits(out: str | os.PathLike, splits: Mapping[str, R], files: Mapping[str, str],
                 write: Callable[[R, Path], Path]) -> dict[str, Path]:
    """``write(rows, out / files[split])`` for each split, the data built beforehand (so a
    bad option fails before anything is made): each file written atomically by ``write``,
    the folder made by the first. If a write fails or is interrupted, the files and the
    folders this call made are removed again, so a failed command leaves no empty folder
    and no partial set of splits (a file it replaced stays replaced, whole)."""
    out = Path(out)
    new_dirs = [p for p in (out, *out.parents) if not p.exists()]  # deepest first
    paths = {split: out / files[split] for split in splits}
    new_files = [p for p in paths.values() if not p.exists()]
    try:
        return {split: write(rows, paths[split]) for split, rows in splits.items()}
    except BaseException:
        for p in new_files:
            p.unlink(missing_ok=True)
        for d in new_dirs:
            try:
                d.rmdir()  # only while empty
            except OSError:
                break
        raise

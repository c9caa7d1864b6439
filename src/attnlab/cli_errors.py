"""Errors of use at the command line: one line on the console and exit status 2.

The one home of the CLI's error handling, shared by every ``cli*`` module: the ``--debug``
switch (``attnlab --debug CMD`` shows the traceback instead), ``fail`` (the one-line
printer), ``user_errors`` (turns the exceptions that mean bad input into ``fail``) and
``positive_ints`` / ``at_least`` (lengths and counts) and ``folder_option`` /
``file_option`` (output paths), all checked before any work; ``on_interrupt`` says what
Ctrl-C (or SIGTERM, as ``timeout`` and job schedulers send) left and how to continue.
Anything else is a bug and keeps its traceback.

The message is printed as text, not rich markup, so shapes such as ``[b, h, n]`` in a
message reach the user whole; only its first line is shown (the rest is for ``--debug``).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.text import Text

_STATE = {"debug": False}  # --debug: tracebacks instead of one-line errors
_console = Console(stderr=True)  # errors go to stderr: `attnlab ... > file` keeps them on screen


def set_debug(on: bool) -> None:
    """``attnlab --debug``: let errors of use raise with their traceback."""
    _STATE["debug"] = on


def fail(message: object) -> NoReturn:
    """Print ``error: <first line of message>`` and exit with status 2."""
    lines = str(message).strip().splitlines() or ["(no message)"]
    _console.print(Text.assemble(("error:", "bold red"), " ", lines[0]), soft_wrap=True)
    raise typer.Exit(code=2)


def positive_ints(value: str, option: str) -> tuple[int, ...]:
    """A comma-separated option of whole numbers >= 1 (``--n 4096,8192``), or ``fail``
    naming the option and the form it takes."""
    try:
        out = tuple(int(x) for x in value.split(","))
    except ValueError:
        out = ()
    if not out or min(out) < 1:
        fail(f"{option} {value!r}: expected whole numbers >= 1 separated by commas, e.g. "
             f"{option} 1024,4096")
    return out


def at_least(option: str, value: int, low: int = 1) -> None:
    """``fail`` unless a count option (``--repeats``, ``--batch``) is at least ``low``."""
    if value < low:
        fail(f"{option} {value}: give {low} or more")


def _file_in_the_way(path: Path) -> Path | None:
    """The nearest existing path among ``path`` and the folders above it, if it is a file."""
    for p in (path, *path.parents):
        if p.exists():
            return None if p.is_dir() else p
    return None


def folder_option(option: str, path: Path) -> Path:
    """An output folder option (``--out``): ``fail`` before any work when the path, or a
    folder above it, is an existing file; returns ``path``."""
    blocker = _file_in_the_way(Path(path))
    if blocker is not None:
        fail(f"{option} {path}: {blocker} is a file, not a folder; give a folder path")
    return path


def file_option(option: str, path: Path) -> Path:
    """An output file option (``--plot x.png``): ``fail`` before any work when the path is
    an existing folder or a folder above it is an existing file; returns ``path``."""
    path = Path(path)
    if path.is_dir():
        fail(f"{option} {path}: a folder is there; give a file name")
    blocker = _file_in_the_way(path.parent)
    if blocker is not None:
        fail(f"{option} {path}: {blocker} is a file, not a folder; give a path in a folder")
    return path


def user_error_types() -> tuple[type[BaseException], ...]:
    """Errors of use (bad config, data, model, plan, tuner, missing package, unwritable
    folder, a folder where a file goes)."""
    # start-up: imported on use, so that ``attnlab --help`` loads no transformers
    from .config import ConfigError
    from .core import RegistryError
    from .hf.arch import UnsupportedModelError
    from .hf.plan import PlanError
    from .tasks.base import DataFormatError, MissingPackageError
    from .tuning.base import TuningError

    return (ConfigError, RegistryError, PlanError, UnsupportedModelError, DataFormatError,
            MissingPackageError, TuningError, FileNotFoundError, NotADirectoryError,
            IsADirectoryError, PermissionError)


def message_of(error: BaseException) -> str:
    """The text of an error; a KeyError's without the quotes ``str`` puts around it."""
    if isinstance(error, KeyError) and error.args:
        return str(error.args[0])
    return str(error)


@contextmanager
def on_interrupt(note: Callable[[], str]) -> Iterator[None]:
    """Ctrl-C inside: print ``interrupted: <note()>`` (what is kept, how to continue, as it
    stands then) and exit with status 130, the shell's for SIGINT (``--debug``: the
    traceback). SIGTERM inside (``timeout``, a job scheduler) takes the same path, as a
    KeyboardInterrupt, so the run records that it was interrupted; it exits with 143."""
    terminated: list[int] = []

    def on_term(signum: int, frame: object) -> None:
        terminated.append(signum)
        raise KeyboardInterrupt

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_term) if main else None
    try:
        yield
    except KeyboardInterrupt:
        if _STATE["debug"]:
            raise
        word = "terminated:" if terminated else "interrupted:"
        _console.print(Text.assemble("\n", (word, "bold yellow"), " ", note()),
                       soft_wrap=True)  # "\n": off a progress bar's unfinished line
        raise typer.Exit(code=143 if terminated else 130) from None
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


@contextmanager
def user_errors(*extra: type[BaseException]) -> Iterator[None]:
    """``with user_errors(ValueError): ...``: errors of use (``user_error_types`` and
    ``extra``) become one line and exit status 2, unless ``--debug`` is on."""
    try:
        yield
    except (*user_error_types(), *extra) as e:
        if _STATE["debug"]:
            raise
        fail(message_of(e))

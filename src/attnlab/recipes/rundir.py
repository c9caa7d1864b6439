"""Run folders: a fresh one per run, what a run records about itself, and what it keeps.

- :func:`fresh_run` never lets a new run write into an existing run's folder: ``runs/x``
  taken gives ``runs/x-2`` (then ``-3``, ...), unless ``overwrite`` (the folder is emptied
  first) or ``resume`` (the run continues there, or starts there if it never began).
- :func:`finished_summary` reads back a run that finished, so that ``--resume`` (of
  ``attnlab run`` and ``attnlab compare``) reports it instead of training it again, and
  refuses it when the config asks for other settings.
- :func:`provenance` is what ``summary.json`` says about where a run came from: attnlab's
  version and git commit (when run from a checkout), the versions of Python and the
  fast-moving libraries, and the device.
- :func:`is_tlm_run` tells a folder of ``attnlab tlm`` from the other runs' folders.
- :func:`prune_finished` deletes what a finished run no longer needs: the checkpoints
  (model, optimizer, RNG states) and the best-model copy the loop restored from; the
  result, ``tuned.safetensors`` (only the trained parameters for partial tuners), stays.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError, ExperimentConfig, run_config_changes
from .summary import RunSummary, read_summary

LIBRARIES = ("torch", "transformers", "peft", "accelerate", "tokenizers", "datasets")


def fresh_run(cfg: ExperimentConfig, resume: bool = False, overwrite: bool = False
              ) -> tuple[ExperimentConfig, str | None]:
    """(config whose run folder a new run may use, a note for the user or None)."""
    if resume and overwrite:
        raise ConfigError("--resume continues a run and --overwrite deletes it: give one")
    run_dir = cfg.run_dir
    if resume:
        return cfg, (None if run_dir.is_dir() else f"nothing to resume in {run_dir}: started")
    if not run_dir.exists() or (run_dir.is_dir() and not any(run_dir.iterdir())):
        return cfg, None
    if overwrite:
        if not run_dir.is_dir():
            raise ConfigError(f"{run_dir} is a file, not a run folder; move it away")
        if os.environ.get("RANK", "0") == "0":  # one process of a torchrun job deletes
            shutil.rmtree(run_dir)
        return cfg, f"{run_dir} emptied (--overwrite)"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # the processes of one job could pick different new names: refuse, same in each
        raise ConfigError(f"{run_dir} exists: give --overwrite, --resume or another name "
                          "(a multi-process run does not pick a new folder itself)")
    i = 2
    while (run_dir.parent / f"{cfg.name}-{i}").exists():
        i += 1
    new = dataclasses.replace(cfg, name=f"{cfg.name}-{i}")
    return new, f"{run_dir} exists: this run writes {new.run_dir} (--overwrite replaces it)"


def finished_summary(cfg: ExperimentConfig) -> RunSummary | None:
    """The summary of the run in ``cfg.run_dir`` if it finished (not failed, not
    interrupted), else None. A finished run whose saved config differs from ``cfg`` (other
    than its name and folder) is an error: its result would be reported under settings it
    did not use, and training it again would replace it."""
    if not (cfg.run_dir / "summary.json").exists():
        return None
    summary = read_summary(cfg.run_dir)
    if not summary.is_finished:
        return None
    if changes := run_config_changes(cfg.run_dir, cfg):
        raise ConfigError(
            f"--resume: {cfg.run_dir} finished under another config (" + "; ".join(changes)
            + "). Use another name or output_dir for the new settings, or replace that run "
            "(attnlab run --overwrite).")
    return summary


def check_writable(folder: Path) -> None:
    """Refuse an output folder that cannot be created or written, before any work."""
    probe = folder
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write the run folder {folder}: {probe} is not a writable "
                          "folder; set output_dir to one you can write")


def versions() -> dict[str, str | None]:
    """Installed versions of Python, attnlab and the libraries it depends on fastest."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("attnlab", *LIBRARIES):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit() -> str | None:
    """The commit of the checkout attnlab runs from (with ``-dirty`` if changed), else None.

    A copy of the tree run elsewhere (without its ``.git``, or over another checkout's
    ``.git``) names its commit in ``ATTNLAB_GIT_COMMIT``, which is then reported as given."""
    if os.environ.get("ATTNLAB_GIT_COMMIT"):
        return os.environ["ATTNLAB_GIT_COMMIT"]
    src = Path(__file__).resolve().parents[3]  # <checkout>/src/attnlab/recipes/rundir.py
    if not (src / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], text=True,
                              capture_output=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--", "src"],
                               text=True, capture_output=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def device_name() -> str:
    if torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    return f"cpu: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def provenance() -> dict[str, Any]:
    v = versions()
    return {"attnlab_version": v.pop("attnlab"), "git_commit": git_commit(), "versions": v,
            "device": device_name()}


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def prune_finished(run_dir: Path) -> int:
    """Delete a finished run's checkpoints and best-model copy; returns the bytes freed."""
    freed = 0
    for sub in (run_dir, run_dir / "masked"):
        for path in (sub / "checkpoints", sub / "best.safetensors"):
            if not path.exists():
                continue
            files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
            freed += sum(p.stat().st_size for p in files)
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
    return freed


def folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


TLM_RECORD = "tlm.json"  # what ``attnlab tlm train`` records about its run


def is_tlm_run(path: Path) -> bool:
    """A folder of ``attnlab tlm train``: its record, or the stage-1 folder of a run that
    has not written it yet."""
    return (path / TLM_RECORD).is_file() or (path / "stage1").is_dir()

"""The main job: fine-tune the embedded MiniLM on CoLA and print the result table.

Uses the real CoLA from ``../shared/data`` when present (1 epoch over 8,551 sentences), else
the built-in CoLA-format sample shipped in the package (400 sentences; 4 epochs, since
that small set needs a few passes before the MCC moves). Both finish in a few minutes on
2 CPU cores with no network.
"""

from __future__ import annotations

from pathlib import Path

from ..config import ExperimentConfig, load_config

SHARED_DATA = Path("../shared/data")


def quickstart_config(data_dir: str | None = None, overrides: list[str] | None = None
                      ) -> ExperimentConfig:
    """The quickstart config for the data at hand (``data_dir`` None: shared, else builtin)."""
    if data_dir is None:
        data_dir = str(SHARED_DATA) if (SHARED_DATA / "glue" / "CoLA").is_dir() else "builtin"
    builtin = data_dir == "builtin"
    base = {
        "name": "quickstart",
        "model": {"name": "default", "max_length": 64},
        "task": {"name": "cola", "data_dir": data_dir},
        "optim": {"lr": 5e-5 if not builtin else 1e-4, "warmup_ratio": 0.1},
        "train": {"batch_size": 32 if not builtin else 16, "epochs": 1 if not builtin else 4},
    }
    return load_config(None, overrides or [], base=base)

"""The main job: fine-tune the embedded MiniLM on CoLA and print the result table.

With the real CoLA (``../shared/data``: 8,551 training sentences, 268 batches of 32) the
recipe is 3 epochs at lr 1e-4 (10% warmup, linear decay) with
- batches of similar length (``group_by_length``): CoLA sentences are short and vary, so
  this pads far fewer tokens than random batches (0.165 vs 0.268 s per step here);
- no dropout: the model leaves the majority class within the first epoch, not the second;
- the word-embedding table fixed (``full(freeze_embeddings=True)``: 11.7 M of 22.7 M
  weights), which AdamW would otherwise update densely every step;
- an evaluation every half epoch (134 steps), keeping the best.
Measured on 2 CPU cores, seed 0: dev MCC 0.330 in under 3 minutes; the recipes tried on the
way, with their commands, are in docs/results.md. Without the shared data it uses the
built-in CoLA-format sample shipped in the package (400 sentences; 4 epochs, since that
small set needs a few passes before the MCC moves).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import ExperimentConfig, load_config

SHARED_DATA = Path("../shared/data")


def quickstart_config(data_dir: str | None = None, overrides: list[str] | None = None
                      ) -> ExperimentConfig:
    """The quickstart config for the data at hand (``data_dir`` None: shared, else builtin)."""
    if data_dir is None:
        data_dir = str(SHARED_DATA) if (SHARED_DATA / "glue" / "CoLA").is_dir() else "builtin"
    builtin = data_dir == "builtin"
    base: dict[str, Any] = {
        "name": "quickstart",
        "model": {"name": "default", "max_length": 64},
        "task": {"name": "cola", "data_dir": data_dir},
        "optim": {"lr": 1e-4, "warmup_ratio": 0.1},
        "train": {"batch_size": 16, "epochs": 4} if builtin else
                 {"batch_size": 32, "epochs": 3, "group_by_length": True, "eval_every": 134},
    }
    if not builtin:  # see the module docstring
        base["model"]["dropout"] = 0.0
        base["tuning"] = {"method": "full(freeze_embeddings=True)"}
    return load_config(None, overrides or [], base=base)

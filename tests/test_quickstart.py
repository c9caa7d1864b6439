"""The quickstart recipe: the shared-data recipe and configs/quickstart.yaml are one recipe;
without the shared data the built-in sample is used."""

from __future__ import annotations

from pathlib import Path

from attnlab.config import config_changes, load_config
from attnlab.recipes.quickstart import quickstart_config

ROOT = Path(__file__).resolve().parents[1]


def test_the_config_file_is_the_recipe(tmp_path):
    data = tmp_path / "data"
    (data / "glue" / "CoLA").mkdir(parents=True)
    recipe = quickstart_config(str(data))
    from_file = load_config(ROOT / "configs" / "quickstart.yaml", [f"task.data_dir={data}"])
    assert config_changes(recipe, from_file) == []
    assert recipe.model.dropout == 0.0 and recipe.train.group_by_length
    assert recipe.tuning.method == "full(freeze_embeddings=True)"
    assert (recipe.optim.lr, recipe.train.epochs, recipe.train.batch_size) == (1e-4, 3, 32)


def test_builtin_sample_recipe():
    cfg = quickstart_config("builtin")
    assert cfg.task.data_dir == "builtin" and cfg.train.epochs == 4
    assert cfg.model.dropout is None and not cfg.train.group_by_length

"""Experiment config: YAML -> dataclasses, overrides, errors."""

import pytest

from attnlab.config import ConfigError, load_config, resolved_yaml


def test_defaults_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("name: x\ntask: {name: mrpc}\noptim: {lr: 2.0e-5}\n")
    cfg = load_config(p, ["train.batch_size=8", "optim.betas=[0.9, 0.98]", "plan=[]",
                          "task.data_dir=builtin"])
    assert cfg.task.name == "mrpc" and cfg.optim.lr == 2e-5 and cfg.train.batch_size == 8
    assert cfg.optim.betas == (0.9, 0.98) and cfg.task.data_dir == "builtin"
    assert cfg.run_dir.name == "x"
    again = tmp_path / "r.yaml"
    again.write_text(resolved_yaml(cfg))
    assert load_config(again) == cfg


def test_unknown_key_names_close_match(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("optim: {lrr: 1}\n")
    with pytest.raises(ConfigError,
                       match=r"unknown parameter 'lrr' for config section 'optim'; did you mean"):
        load_config(p)


@pytest.mark.parametrize("override,msg", [
    ("train.batch_size=abc", "integer"),
    ("train.batch_size=0", ">= 1"),
    ("optim.schedule=cosine", "linear"),
    ("nonsense", "key.sub=value"),
    ("train.keep_best=3", "true or false"),
])
def test_bad_values(override, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, [override])


def test_missing_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/config.yaml")


@pytest.mark.parametrize("overrides,expected", [
    # PASTA's official scripts: AdamW, lr 2.5e-4, weight decay 0, no warmup, linear decay
    (["tuning.method=pasta"], (2.5e-4, 0.0, 0.0, "linear")),
    # what the config sets wins; the rest still comes from the recipe
    (["tuning.method=pasta", "optim.lr=1e-3", "optim.warmup_ratio=0.06"],
     (1e-3, 0.0, 0.06, "linear")),
    (["tuning.method=diff_prune(mask_lr=1e-3)"], (1e-5, 0.0, 0.0, "linear")),
    # no published recipe: the library defaults
    ([], (5e-5, 0.01, 0.1, "linear")),
    (["tuning.method=bitfit", "optim.schedule=constant"], (5e-5, 0.01, 0.1, "constant")),
])
def test_unset_optim_fields_take_the_tuners_recipe(overrides, expected):
    from attnlab.config import with_optim_defaults

    o = with_optim_defaults(load_config(None, overrides)).optim
    assert (o.lr, o.weight_decay, o.warmup_ratio, o.schedule) == expected


def test_compare_variants_take_their_own_tuners_recipe():
    """--vary tuning.method=full,pasta on a config without optim: each variant gets its own
    tuner's settings (PASTA: weight decay 0, no warmup), not the first one's."""
    from attnlab.recipes.compare import expand

    base = load_config(None, ["optim.lr=1e-3", "task.data_dir=builtin"])
    (_, [full]), (_, [pasta]) = expand(base, [("tuning.method", ["full", "pasta"])], 1)
    assert (full.optim.lr, full.optim.weight_decay, full.optim.warmup_ratio) == (1e-3, 0.01, 0.1)
    assert (pasta.optim.lr, pasta.optim.weight_decay, pasta.optim.warmup_ratio) == (1e-3, 0.0, 0.0)


def test_unknown_tuner_in_optim_defaults_is_a_config_error():
    from attnlab.config import with_optim_defaults

    with pytest.raises(ConfigError, match="tuning.method 'pastaa'"):
        with_optim_defaults(load_config(None, ["tuning.method=pastaa"]))


def test_a_pasta_run_trains_with_pastas_recipe(tmp_path):
    """End to end: `attnlab run` with tuning.method=pasta and no optim section saves (and
    trains with) the official settings; `attnlab validate` prints them."""
    import yaml
    from typer.testing import CliRunner

    from attnlab.cli import app

    args = [f"output_dir={tmp_path}", "name=p", "tuning.method=pasta", "task.data_dir=builtin",
            "model.name=scratch:tiny", "model.max_length=16", "train.max_steps=1",
            "train.batch_size=4", "task.train_limit=8", "task.eval_limit=4"]
    res = CliRunner().invoke(app, ["validate", *args])
    assert res.exit_code == 0, res.output
    assert "weight_decay: 0.0" in res.output and "lr: 0.00025" in res.output
    res = CliRunner().invoke(app, ["run", *args])
    assert res.exit_code == 0, res.output
    saved = yaml.safe_load((tmp_path / "p" / "config.yaml").read_text())["optim"]
    assert (saved["lr"], saved["weight_decay"], saved["warmup_ratio"]) == (2.5e-4, 0.0, 0.0)

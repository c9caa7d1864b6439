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
    ("train.max_steps=-5", r"train.max_steps must be >= 1, got -5"),
    ("train.max_steps=0", r"train.max_steps must be >= 1"),
    ("train.eval_every=0", r"train.eval_every must be >= 1"),
    ("eval.batch_size=0", r"eval.batch_size must be >= 1"),
    ("task.train_limit=-3", r"task.train_limit must be >= 1"),
    ("model.max_length=0", r"model.max_length must be >= 2"),
    ("optim.lr=-1", r"optim.lr must be >= 0, got -1"),
    ("optim.warmup_ratio=3", r"optim.warmup_ratio must be in \[0, 1\]"),
    ("optim.weight_decay=-0.1", r"optim.weight_decay must be >= 0"),
    ("optim.max_grad_norm=0", r"optim.max_grad_norm must be > 0"),
    ("optim.betas=[0.9, 1.5]", r"optim.betas two numbers in \[0, 1\)"),
    ("model.dropout=1.0", r"model.dropout must be in \[0, 1\)"),
    ("name=a/../../b", r"name 'a/../../b' must be one folder name"),
    ("name=..", r"must be one folder name"),
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


def test_unset_limits_and_steps_stay_allowed():
    cfg = load_config(None, ["train.max_steps=null", "task.train_limit=null",
                             "optim.lr=null", "optim.max_grad_norm=null"])
    assert cfg.train.max_steps is None and cfg.optim.max_grad_norm is None


def test_a_config_file_that_is_not_utf8_names_its_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_bytes(b"task: {name: cola}\nname: caf\xe9\n")
    with pytest.raises(ConfigError, match=r"c.yaml:2: byte 0xe9 at column 10 is not UTF-8"):
        load_config(p)


def test_invalid_yaml_names_its_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("task: {name: cola}\ntrain:\n  batch_size: [1, 2\n  epochs: 3\n")
    with pytest.raises(ConfigError, match=r"c.yaml:\d+: not valid YAML: "):
        load_config(p)


def test_a_key_given_twice_is_refused(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("task: {name: cola}\ntrain:\n  batch_size: 8\n  batch_size: 16\n")
    with pytest.raises(ConfigError, match=r"c.yaml:4: not valid YAML: key 'batch_size' is "
                       "given twice; keep one"):
        load_config(p)


def test_an_empty_config_file_is_refused(tmp_path):
    p = tmp_path / "c.yaml"
    for text in ("", "\n# nothing but a comment\n"):
        p.write_text(text)
        with pytest.raises(ConfigError, match="is empty; a config needs at least its task"):
            load_config(p)

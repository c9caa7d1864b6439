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
    with pytest.raises(ConfigError, match=r"optim.lrr.*'lr'"):
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

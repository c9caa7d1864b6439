"""``attnlab compare``'s variant folders: readable, distinct, never shared by two variants."""

import pytest

from attnlab.config import ConfigError, load_config
from attnlab.recipes.compare import expand, variant_folder


def test_folder_names_drop_punctuation_at_the_ends():
    assert variant_folder("jat(rho=4.5)") == "jat_rho=4.5"
    assert variant_folder("baseline") == "baseline"
    assert variant_folder("method=pasta,lr=1e-2") == "method=pasta_lr=1e-2"
    assert variant_folder("0-2:all:band(window=8)") == "0-2_all_band_window=8"


def test_long_labels_keep_a_hash_of_the_whole_label():
    a = "0-5:all:" + "x" * 100 + "(a=1)"
    b = "0-5:all:" + "x" * 100 + "(a=2)"
    fa, fb = variant_folder(a), variant_folder(b)
    assert len(fa) == len(fb) == 80 and fa != fb
    # a fixed name across processes and versions (sha1, not hash()): --resume finds it again
    assert fa == "0-5_all_" + "x" * 63 + "-2a9fe3ff"


def test_expand_refuses_two_variants_in_one_folder(tmp_path):
    base = load_config(None, [f"output_dir={tmp_path}", "task.data_dir=builtin"])
    with pytest.raises(ConfigError, match="would share the folder 'jat_rho=5.0'"):
        expand(base, [("plan", ["jat(rho=5.0)", "jat(rho=5.0,)"])], seeds=1)
    folders = [runs[0].output_dir for _, runs in
               expand(base, [("plan", ["jat(rho=4.5)", "jat(rho=5.0)"])], seeds=1)]
    assert [f.rsplit("/", 1)[-1] for f in folders] == ["jat_rho=4.5", "jat_rho=5.0"]


def test_a_bad_variant_stops_the_grid_before_any_run(tmp_path):
    from attnlab.core import RegistryError
    from attnlab.recipes.compare import run_compare

    base = load_config(None, [f"output_dir={tmp_path}", "task.data_dir=builtin"])
    ran: list = []

    def run(cfg, **kw):  # no variant may get this far
        ran.append(cfg)
        raise RuntimeError("a run started")

    bad = [("plan", ["all:all:softmax", "all:all:band(window=-3)"]),  # a mechanism's value
           ("tuning.method", ["full", "nope"]),  # an unknown tuner
           ("model.name", ["default", "scratch:huge"])]  # an unknown from-scratch size
    for vary, says in zip(bad, ["band window must be >= 0", "nope", "unknown size 'huge'"],
                          strict=True):
        with pytest.raises((ConfigError, RegistryError, ValueError), match=says):
            run_compare(base, [vary], 1, run)
    assert ran == [] and not any(tmp_path.iterdir())  # nothing ran, nothing was written


def _row(variant, mean):
    return {"variant": variant, "mean": mean}


def test_best_variant_direction_nan_and_ties():
    from attnlab.recipes.compare import best_variant

    rows = [_row("a", 0.2), _row("b", float("nan")), _row("c", 0.5), _row("d", 0.1)]
    assert best_variant(rows, True) == (2, [])
    assert best_variant(rows, False) == (3, [])  # a loss: lower is better, NaN never wins
    tie = [_row("1e-5", 0.0), _row("5e-5", 0.0)]
    assert best_variant(tie, True) == (0, ["5e-5"])


def test_table_says_when_the_selected_variant_was_a_tie():
    from attnlab.recipes.compare import to_csv, to_markdown

    row = {"variant": "1e-5", "metric": "mcc", "mean": 0.0, "std": 0.0, "seeds": 3,
           "values": [0.0, 0.0, 0.0], "trainable_total": 10, "trainable_without_head": 8,
           "percent_of_backbone": 1.0, "sec_per_step": 1.0, "peak_rss_mb": 1.0,
           "selected": True, "tied_with": ["5e-5"]}
    assert "1e-5 (selected; tied with 5e-5: first in grid order)" in to_markdown([row])
    assert "5e-5" in to_csv([row]).splitlines()[1]
    old = {k: v for k, v in row.items() if k != "tied_with"}  # a comparison.json from before
    assert to_csv([old]).splitlines()[0].endswith("tied_with,values")

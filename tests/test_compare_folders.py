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
    assert fa == variant_folder(a)  # stable across calls and processes (sha1, not hash())


def test_expand_refuses_two_variants_in_one_folder(tmp_path):
    base = load_config(None, [f"output_dir={tmp_path}", "task.data_dir=builtin"])
    with pytest.raises(ConfigError, match="would share the folder 'jat_rho=5.0'"):
        expand(base, [("plan", ["jat(rho=5.0)", "jat(rho=5.0,)"])], seeds=1)
    folders = [runs[0].output_dir for _, runs in
               expand(base, [("plan", ["jat(rho=4.5)", "jat(rho=5.0)"])], seeds=1)]
    assert [f.rsplit("/", 1)[-1] for f in folders] == ["jat_rho=4.5", "jat_rho=5.0"]

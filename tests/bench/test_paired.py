"""``python -m attnlab.bench.paired``: alternated timing and per-round ratios (tiny shapes)."""

from __future__ import annotations

import json

import pytest

from attnlab.bench.paired import format_markdown, main, paired


def test_ratios_are_per_round_against_the_first():
    res = paired(["band(window=8)", "longformer(window=8, global_tokens=(0,))"], 300,
                 heads=2, head_dim=8, rounds=3)
    base, other = res["rows"]
    assert base["fwd_ratio"] == (1.0, 1.0, 1.0) and base["fwdbwd_ratio"] == (1.0, 1.0, 1.0)
    med, lo, hi = other["fwdbwd_ratio"]
    assert 0 < lo <= med <= hi
    assert "`band(window=8)`" in format_markdown(res) and "3 rounds" in format_markdown(res)


def test_bare_names_take_the_bench_settings(tmp_path, capsys):
    out = tmp_path / "p.json"
    main(["--mechanisms", "band", "longformer", "--n", "300", "--rounds", "1", "--heads", "1",
          "--head-dim", "8", "--json", str(out)])
    methods = [r["method"] for r in json.loads(out.read_text())["rows"]]
    assert methods == ["band(window=128)", "longformer(window=128, global_tokens=(0,))"]
    assert "fwd+bwd / baseline" in capsys.readouterr().out


def test_bad_input_is_one_line(capsys):
    for argv in (["--mechanisms", "band"], ["--mechanisms", "band", "nosuch"],
                 ["--mechanisms", "band", "band", "--rounds", "0"]):
        with pytest.raises(SystemExit) as e:
            main(argv + ["--n", "300"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "Traceback" not in err

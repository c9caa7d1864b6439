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


def test_rounds_alternate_the_order(monkeypatch):
    """Even rounds time the mechanisms in the given order, odd rounds in reverse: none is
    always first (after the warm-up, which runs each once in order)."""
    import attnlab.bench.paired as mod

    calls = []
    real = mod.build_mechanism

    def recording(spec, dims):
        mech = real(spec, dims)
        forward = mech.forward

        def traced(*args, **kwargs):
            calls.append(spec.split("(")[0])
            return forward(*args, **kwargs)

        mech.forward = traced
        return mech

    monkeypatch.setattr(mod, "build_mechanism", recording)
    paired(["band(window=8)", "dilated(window=4, dilation=2)", "block_local(block=8)"], 64,
           heads=1, head_dim=4, rounds=2)
    firsts = [c for i, c in enumerate(calls) if i % 2 == 0]  # fwd, then fwd+bwd, per mechanism
    assert firsts == ["band", "dilated", "block_local",  # warm-up
                      "band", "dilated", "block_local",  # round 0
                      "block_local", "dilated", "band"]  # round 1


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

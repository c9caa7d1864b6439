"""The HTML report is one self-contained file with the data and the explorer elements."""

import base64
import json
import re

import pytest
import torch

import attnlab.analysis.report as report_module
from attnlab.analysis import (
    TokenInfo,
    build_report,
    classify_heads,
    example_maps,
    read_history,
    replaced_heads,
    score_heads,
)
from attnlab.analysis.runfiles import PROVENANCE_KEYS


def _inputs(n=12, L=2, H=3):
    g = torch.Generator().manual_seed(0)
    maps = (torch.rand(L, 1, H, n, n, generator=g) * 4).softmax(-1)  # [L, b, h, n, n]
    tokens = ["[CLS]", *(f"w{i}" for i in range(n - 3)), "</script><b>x", "[SEP]"]
    scores = score_heads(maps, [TokenInfo.from_length(n, tokens=tokens)])
    return maps, tokens, scores


def _data(text: str) -> dict:
    m = re.search(r'<script type="application/json" id="attnlab-data">(.*?)</script>', text, re.S)
    assert m, "inline data block missing"
    return json.loads(m.group(1))


def test_report_is_self_contained(tmp_path):
    maps, tokens, scores = _inputs()
    out = build_report(
        tmp_path / "r" / "report.html", title="My <run> & co", config={"lr": 1e-4},
        plan={"rules": [{"layers": "all", "heads": [0], "mechanism": "band(window=4)"}]},
        metrics={"dev": {"mcc": 0.3125, "loss": 1.5}}, scores=scores,
        classes=classify_heads(scores), examples=[{"tokens": tokens, "maps": maps[:, 0]}],
    )
    text = out.read_text(encoding="utf-8")
    for banned in ("http://", "https://", 'src="//', "src='//", "<link", "@import", "url("):
        assert banned not in text, banned
    # every src attribute is a data URI
    assert all(s.startswith("data:") for s in re.findall(r'\bsrc="([^"]*)"', text))
    assert "default-src 'none'" in text  # CSP: the page itself cannot fetch
    for element in ("example-select", "layer-select", "head-select", "attn-canvas",
                    "attn-lines", "class-grid", "score-grid", "score-select"):
        assert f'id="{element}"' in text, element
    assert "My &lt;run&gt; &amp; co" in text
    assert "band(window=4)" in text and "mcc" in text and "0.3125" in text
    # a token cannot close the data <script> early
    assert text.count("</script>") == 2
    data = _data(text)
    assert data["layers"] == 2 and data["heads"] == 3
    assert set(data["scores"]) == set(scores)
    assert data["scores"]["block"][0][0] is None  # NaN -> null (single-segment input)
    ex = data["examples"][0]
    assert ex["tokens"] == tokens and ex["n"] == 12
    assert len(ex["maps"]) == 2 * 3 * 12 * 12
    want = round(float(maps[1, 0, 2, 5, 7]) * 1000)  # 3 decimals, as integer thousandths
    assert ex["maps"][((1 * 3 + 2) * 12 + 5) * 12 + 7] == want
    imgs = re.findall(r'src="data:image/png;base64,([^"]+)"', text)
    assert len(imgs) == 2 and all(base64.b64decode(i)[:4] == b"\x89PNG" for i in imgs)
    assert not list(out.parent.glob(".*tmp"))


def test_report_limits_examples_and_tokens(tmp_path, monkeypatch):
    maps, tokens, scores = _inputs(n=30)
    ex = {"tokens": tokens, "maps": maps[:, 0]}
    out = build_report(tmp_path / "r.html", title="t", scores=scores, examples=[ex] * 6,
                       max_examples=2, max_tokens=10)
    data = _data(out.read_text(encoding="utf-8"))
    assert len(data["examples"]) == 2
    assert data["examples"][0]["n"] == 10 and data["examples"][0]["total"] == 30
    assert len(data["examples"][0]["maps"]) == 2 * 3 * 10 * 10
    assert data["classes"] is None
    monkeypatch.setattr(report_module, "MAX_REPORT_WEIGHTS", 100)
    with pytest.raises(ValueError, match="lower max_examples or max_tokens"):
        build_report(tmp_path / "big.html", title="t", scores=scores, examples=[ex])


def test_report_rejects_mismatched_examples(tmp_path):
    maps, tokens, scores = _inputs()
    with pytest.raises(ValueError, match=r"\[L, H, n, n\] = \[2, 3, n, n\]"):
        build_report(tmp_path / "r.html", title="t", scores=scores,
                     examples=[{"tokens": tokens, "maps": maps[:, 0, :2]}])
    with pytest.raises(ValueError, match="11 tokens for maps over 12"):
        build_report(tmp_path / "r.html", title="t", scores=scores,
                     examples=[{"tokens": tokens[:-1], "maps": maps[:, 0]}])
    with pytest.raises(ValueError, match="unknown head class 'x'"):
        build_report(tmp_path / "r.html", title="t", scores=scores, classes=[["x"] * 3] * 2)


def test_example_maps_crop_padding_for_the_report(tmp_path):
    g = torch.Generator().manual_seed(1)
    maps = torch.rand(2, 2, 3, 9, 9, generator=g)  # [L, b, h, n, n] with padding beyond 6
    infos = [TokenInfo.from_length(9, tokens=list("abcdefghi")),
             TokenInfo.from_length(6, tokens=list("abcdef"))]
    exs = example_maps(maps, infos)
    assert exs[1]["maps"].shape == (2, 3, 6, 6) and exs[1]["tokens"] == list("abcdef")
    torch.testing.assert_close(exs[1]["maps"], maps[:, 1, :, :6, :6], rtol=0, atol=0)
    assert len(example_maps(maps, infos, limit=1)) == 1
    out = build_report(tmp_path / "r.html", title="t", scores=score_heads(maps, infos),
                       examples=exs)
    assert [e["n"] for e in _data(out.read_text(encoding="utf-8"))["examples"]] == [9, 6]


# ----------------------------------------------------------------------------- run files

BAND_RULE = {"layers": [0], "heads": "all", "mechanism": {"name": "band", "window": 2}}
JAT_FREE_RULE = {"layers": [1], "heads": [2], "mechanism": "linear_elu"}
SUMMARY = {
    "name": "ra", "task": "cola", "seed": 0, "tuning": "full", "main_metric": "mcc",
    "greater_is_better": True, "best_metric": 0.3125, "best_step": 20,
    "best_eval": {"mcc": 0.3125, "accuracy": 0.71}, "final_eval": {"mcc": 0.25},
    "before_finalize": None, "steps": 30, "train_examples": 96, "train_seconds": 12.5,
    "seconds_per_step": 0.4167, "peak_rss_mb": 812.5,
    "params": {"trainable_total": 1000, "trainable_without_head": 900,
               "backbone_total": 900, "percent_of_backbone": 100.0},
    "interrupted": False, "num_processes": 1,
    # provenance (new summaries only)
    "status": "finished", "attnlab_version": "0.1.0", "git_commit": "abc1234",
    "versions": {"python": "3.11.7", "torch": "2.13.0", "transformers": "5.24.0",
                 "peft": "0.21.2"},
    "device": "cpu", "started": "2026-11-24T10:00:00+00:00",
    "finished": "2026-11-24T10:01:00+00:00", "wall_seconds": 60.0,
}


def _history(tmp_path):
    lines = [{"step": s, "epoch": (s - 1) // 10, "loss": 0.7 - 0.01 * s, "lr": 1e-4}
             for s in range(1, 31)]
    lines += [{"step": s, "epoch": (s - 1) // 10, "eval": {"mcc": m, "accuracy": 0.7}}
              for s, m in ((10, 0.1), (20, 0.3125), (30, 0.25))]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n{\"step\": 31, \"lo")  # torn
    return read_history(path)


def _section(text: str, element_id: str) -> str:
    m = re.search(rf'<div class="metric-group" id="{element_id}">(.*?)</table></div>', text,
                  re.S)
    assert m, element_id
    return m.group(1)


def test_report_draws_the_training_curves_from_metrics_jsonl(tmp_path):
    from attnlab.analysis import plots

    maps, tokens, scores = _inputs()
    history = _history(tmp_path)
    assert len(history) == 33  # the torn last line is skipped
    out = build_report(tmp_path / "r.html", title="t", scores=scores, metrics=SUMMARY,
                       config={"model": {"name": "default"}, "task": {"name": "cola"}},
                       history=history, model="all-MiniLM-L6-v2")
    text = out.read_text(encoding="utf-8")
    m = re.search(r'<figure class="static" id="training-curves"><img alt="training curves" '
                  r'src="data:image/png;base64,([^"]+)">', text)
    assert m and base64.b64decode(m.group(1))[:4] == b"\x89PNG"
    assert "30 logged loss values, 3 evaluations (cola, all-MiniLM-L6-v2)" in text
    assert 'id="evaluations"' in text and "0.3125" in text
    data = _data(text)
    assert len(data["history"]["loss"]) == 30 and data["history"]["loss"][0] == [1, 0.69]
    assert [s for s, _ in data["history"]["eval"]] == [10, 20, 30]
    # the axes name the task, the model and the unit
    fig = plots.training_curves(history, task="cola", model="all-MiniLM-L6-v2",
                                main_metric="mcc")
    loss_ax, dev_ax = fig.axes
    assert loss_ax.get_ylabel() == "training loss (cross-entropy, nats)"
    assert dev_ax.get_ylabel() == "dev mcc (Matthews corr., -1 to 1)"
    for ax in (loss_ax, dev_ax):
        assert ax.get_xlabel() == "optimizer step"
        assert "cola" in ax.get_title() and "all-MiniLM-L6-v2" in ax.get_title()
    assert dev_ax.get_ylim()[0] > 0.05  # scaled to the data, not forced to zero
    # no metrics.jsonl: no curve, and the report says so
    bare = build_report(tmp_path / "b.html", title="t", scores=scores).read_text("utf-8")
    assert 'id="training-curves"' not in bare and "No training history" in bare


@pytest.mark.parametrize("form", ["old-string", "list", "object", "surgery"])
def test_report_marks_the_heads_the_plan_replaced(tmp_path, form):
    maps, tokens, scores = _inputs()  # 2 layers x 3 heads
    rules = [BAND_RULE, JAT_FREE_RULE]
    plan = {
        "old-string": json.dumps({"plan": rules}, indent=2),  # summary/plan.json before
        "list": rules,
        "object": {"plan": rules},
        "surgery": None,
    }[form]
    surgery = {"table": [["band(window=2)"] * 3,
                         ["softmax", "softmax", "linear_elu(eps=1e-06, chunk=64)"]],
               "params_added": 0, "params_removed": 0} if form == "surgery" else None
    out = build_report(tmp_path / "r.html", title="t", scores=scores,
                       classes=classify_heads(scores), plan=plan, surgery=surgery,
                       examples=[{"tokens": tokens, "maps": maps[:, 0]}])
    text = out.read_text(encoding="utf-8")
    data = _data(text)
    replaced = data["replaced"]
    assert [[bool(x) for x in row] for row in replaced] == [[True] * 3, [False, False, True]]
    assert replaced[0][0] == "band(window=2)" and replaced[1][2].startswith("linear_elu")
    assert data["mechanisms"]["band(window=2)"] == "band"
    for element in ("mech-grid", "mech-legend", "head-mechanism"):
        assert f'id="{element}"' in text, element
    assert "td.replaced" in text and "markReplaced" in text  # drawn by the page's script
    assert "heads replaced by the plan" in text and "4 of 6" in text
    if form == "old-string":  # shown as the plan, not as an escaped string
        assert '\\"plan\\"' not in text and '&quot;layers&quot;' in text


def test_replaced_heads_without_a_usable_plan():
    shape = (2, 3)
    assert replaced_heads(shape) is None
    assert replaced_heads(shape, plan=[]) == [[None] * 3] * 2  # all softmax
    assert replaced_heads(shape, plan="[]") == [[None] * 3] * 2
    assert replaced_heads(shape, plan={"rules": []}) is None  # unknown form
    assert replaced_heads(shape, plan=["0:1:band(window=4)"])[0] == [
        None, "band(window=4)", None]


def test_report_groups_the_metrics_and_shows_provenance(tmp_path):
    maps, tokens, scores = _inputs()
    out = build_report(tmp_path / "r.html", title="t", scores=scores,
                       classes=classify_heads(scores), metrics=SUMMARY, plan=[BAND_RULE])
    text = out.read_text(encoding="utf-8")
    task = _section(text, "metrics-task")
    cost = _section(text, "metrics-cost")
    attention = _section(text, "metrics-attention")
    assert "<h3>Task metrics</h3>" in task and "<h3>Cost</h3>" in cost
    assert "<h3>Attention statistics</h3>" in attention
    assert "best dev mcc" in task and "0.3125" in task and "accuracy" in task
    assert "time per optimizer step (s)" in cost and "0.4167" in cost
    assert "peak memory, process RSS (MB)" in cost and "812.5" in cost
    assert "trainable parameters, without the head" in cost and "900" in cost
    for wrong in ("seconds", "peak memory", "trainable"):
        assert wrong not in task and wrong not in attention
    assert "heads replaced by the plan" in attention and "3 of 6" in attention
    assert "heads classed" in attention and "vertical: mean over heads" in attention
    assert "before_finalize" not in text  # None for every tuner but Diff-Prune: left out
    prov = re.search(r'<table class="metrics" id="provenance">(.*?)</table>', text, re.S)
    assert prov, "provenance table missing"
    for shown in ("abc1234", "version of torch", "2.13.0", "version of peft", "finished",
                  "wall time (s)", "2026-11-24T10:00:00+00:00"):
        assert shown in prov.group(1), shown
    assert "abc1234" not in task + cost + attention  # provenance only in the Run section
    # an old summary without provenance: no provenance table, groups as before
    old = {k: v for k, v in SUMMARY.items() if k not in PROVENANCE_KEYS}
    text = build_report(tmp_path / "o.html", title="t", scores=scores,
                        metrics=old).read_text("utf-8")
    assert 'id="provenance"' not in text and "time per optimizer step (s)" in text

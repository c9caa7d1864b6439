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
    score_heads,
)


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

"""Text the analysis writes for people: the report's evaluation table, the CLI tables, figure
labels. Markup in run files must stay text; no number or header may be cut."""

import io

import torch
from rich.console import Console
from rich.table import Table

from attnlab import cli_analyze
from attnlab.analysis import plots
from attnlab.analysis.report import build_report

BAD = "</script><script>alert(1)</script>"


def test_report_escapes_step_and_epoch_of_the_evaluation_table(tmp_path):
    scores = {"vertical": torch.rand(2, 2), "diagonal": torch.rand(2, 2)}
    maps = torch.rand(2, 2, 3, 3).softmax(-1)
    history = [{"step": 1, "epoch": "<i>0.5</i>", "loss": 0.7},
               {"step": "<b>2</b>", "epoch": BAD, "eval": {BAD: 0.5}}]
    path = build_report(tmp_path / "r.html", title=BAD, config={"k": BAD},
                        metrics={"task": BAD}, scores=scores,
                        examples=[{"tokens": ["[CLS]", BAD, "[SEP]"], "maps": maps}],
                        history=history)
    page = path.read_text()
    assert "alert(1)</script>" not in page  # nowhere raw: title, tokens, table cells
    assert page.count("<script>") == 1  # the report's own script only
    assert "<b>2</b>" not in page and "&lt;b&gt;2&lt;/b&gt;" in page
    assert "&lt;/script&gt;&lt;script&gt;alert(1)" in page  # the epoch cell, as text


def test_cli_tables_never_cut_numbers_or_headers(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(cli_analyze, "console", Console(file=out, width=40))
    table = Table(title="major connections")
    for key in ("layer", "vertical_pasta", "vertical_tlm", "total_nosep", "total"):
        table.add_column(key, justify="right")
    table.add_row("all", "0.417", "0.792", "179760", "397223")
    cli_analyze._print_table(table)
    text = out.getvalue()
    assert "…" not in text
    for cell in ("vertical_pasta", "vertical_tlm", "total_nosep", "179760", "397223"):
        assert cell in text, cell


def test_cli_tables_that_fit_are_printed_as_before(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(cli_analyze, "console", Console(file=out, width=80))
    table = Table()
    table.add_column("layer")
    table.add_row("0")
    cli_analyze._print_table(table)
    assert max(len(line) for line in out.getvalue().splitlines()) <= 80


def test_attention_map_colorbar_is_labelled():
    fig = plots.attention_map(torch.rand(4, 4).softmax(-1), list("abcd"))
    colorbar_axes = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert [ax.get_ylabel() for ax in colorbar_axes] == ["attention weight"]
    heat = fig.axes[0]
    assert (heat.get_xlabel(), heat.get_ylabel()) == ("key", "query")


def test_capture_gives_the_eager_probabilities_with_padded_keys_at_zero(tiny_bert,
                                                                        padded_batch):
    from attnlab.hf.capture import capture_attention

    cache = capture_attention(tiny_bert, padded_batch)
    tiny_bert.set_attn_implementation("eager")
    with torch.no_grad():
        eager = tiny_bert(**padded_batch, output_attentions=True).attentions
    mask = padded_batch["attention_mask"].bool()  # [b, n]
    for layer, p in cache.items():
        torch.testing.assert_close(p, eager[layer].float())
        assert float(p.masked_select(~mask[:, None, None, :].expand_as(p)).abs().max()) == 0.0
        rows = p.sum(-1).masked_select(mask[:, None, :].expand(p.shape[:-1]))  # real queries
        torch.testing.assert_close(rows, torch.ones_like(rows))

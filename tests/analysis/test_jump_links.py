"""Jump-link shares (attnlab.analysis.jump_links) against a brute-force count with the
official n^3 form ``naive_jump_counts`` on q and k recomputed from the hidden states, on a
tiny random BERT (offline; the embedded tokenizer only pads), and `attnlab analyze links`."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from attnlab.analysis.jump_links import head_set, jump_link_shares, parse_rhos
from attnlab.mechanisms.jat import key_length, naive_jump_counts

LENGTHS = (12, 7, 3)  # one batch padded to 12: 5 and 9 padding tokens
RHOS = (1e-4, 4e-4)  # the tiny model's strengths U are ~1e-4: both give some links, not all
H, D = 4, 8  # heads and head dim of conftest's tiny BERT


@pytest.fixture(scope="module")
def tok():
    import transformers

    from attnlab.models import default_model_path

    return transformers.AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture
def feats():
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(5, 100, (n,), generator=g).tolist()} for n in LENGTHS]


def brute_force(model, tok, feats, rho, heads, padding):
    """(linked [L], pairs): q and k from each layer's input hidden states and its own
    query/key projections, one padded batch, counts by ``naive_jump_counts``. ``exclude``:
    each example cropped to its real tokens first; ``include``: the padded block as is."""
    batch = tok.pad(feats, return_tensors="pt")
    mask = batch["attention_mask"].bool()  # [b, n]
    b, n = mask.shape
    with torch.no_grad():
        hidden = model(**batch, output_hidden_states=True).hidden_states
    linked, pairs = [], 0
    for layer, block in enumerate(model.encoder.layer):
        att = block.attention.self
        x = hidden[layer]  # the layer's input [b, n, hidden]
        q = att.query(x).view(b, n, H, D).transpose(1, 2)[:, heads]  # [b, s, n, d]
        k = att.key(x).view(b, n, H, D).transpose(1, 2)[:, heads]  # [b, s, n, d]
        total = 0
        if padding == "include":
            s = q @ k.transpose(-1, -2)  # [b, s, n, n]
            total = int((naive_jump_counts(s, key_length(k), D, rho) > 0).sum())
            pairs = b * n * n * len(heads)
        else:
            pairs = 0
            for i in range(b):
                m = int(mask[i].sum())
                qi, ki = q[i, :, :m], k[i, :, :m]  # [s, m, d] real tokens only
                s = qi @ ki.transpose(-1, -2)  # [s, m, m]
                total += int((naive_jump_counts(s, key_length(ki), D, rho) > 0).sum())
                pairs += m * m * len(heads)
        linked.append(total)
    return linked, pairs


@pytest.mark.parametrize("heads", [[0, 1, 2, 3], [0, 2]])
@pytest.mark.parametrize("padding", ["exclude", "include"])
def test_shares_equal_a_brute_force_count_with_naive_jump_counts(bert_factory, tok, feats,
                                                                 heads, padding):
    model = bert_factory()
    res = jump_link_shares(model, tok, feats, RHOS, heads=heads, padding=padding)
    assert res.linked.shape == (len(RHOS), 3) and res.heads == tuple(heads)
    for r, rho in enumerate(RHOS):
        linked, pairs = brute_force(model, tok, feats, rho, heads, padding)
        assert res.linked[r].tolist() == linked
        assert res.pairs == pairs
    shares = res.shares
    assert ((shares > 0) & (shares < 1)).any()  # not a trivial all-or-nothing comparison
    torch.testing.assert_close(shares, res.linked.double() / res.pairs, rtol=0, atol=0)


def test_padding_is_excluded(bert_factory, tok, feats):
    model = bert_factory()
    batched = jump_link_shares(model, tok, feats, RHOS)
    alone = jump_link_shares(model, tok, feats, RHOS, batch_size=1)
    # the real-token pairs only: sum n_i^2 per head, whatever the batching
    assert batched.pairs == alone.pairs == H * sum(n * n for n in LENGTHS)
    assert batched.linked.tolist() == alone.linked.tolist()
    # with padding taking part, the padded batch counts other pairs and other links
    included = jump_link_shares(model, tok, feats, RHOS, padding="include")
    assert included.pairs == H * len(LENGTHS) * max(LENGTHS) ** 2
    assert included.linked.tolist() != batched.linked.tolist()
    # one example per batch has no padding: both modes agree
    assert jump_link_shares(model, tok, feats, RHOS, padding="include",
                            batch_size=1).linked.tolist() == alone.linked.tolist()
    # every pair linked (rho far below any strength): exactly the real pairs, share 1
    everything = jump_link_shares(model, tok, feats, [-1e30])
    assert everything.linked.tolist() == [[batched.pairs] * 3]
    assert everything.shares.eq(1).all()


def test_a_very_large_rho_gives_no_links(bert_factory, tok, feats):
    model = bert_factory()
    res = jump_link_shares(model, tok, feats, [1e30, RHOS[0]], padding="include")
    assert res.linked[0].tolist() == [0, 0, 0] and res.shares[0].eq(0).all()
    assert res.linked[1].sum() > 0  # the same run with a small rho does link pairs


def test_hooks_go_and_the_training_flag_is_restored(bert_factory, tok, feats):
    model = bert_factory().train()
    jump_link_shares(model, tok, feats, RHOS)
    assert model.training
    assert not any(m._forward_hooks for m in model.modules())


def test_bad_input_is_refused(bert_factory, tok, feats):
    model = bert_factory()
    with pytest.raises(ValueError, match="head 4 is out of range: the model has heads 0-3"):
        jump_link_shares(model, tok, feats, RHOS, heads=[0, 4])
    with pytest.raises(ValueError, match="rho must be finite"):
        jump_link_shares(model, tok, feats, [float("inf")])
    with pytest.raises(ValueError, match="padding must be 'exclude' or 'include'"):
        jump_link_shares(model, tok, feats, RHOS, padding="both")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no examples"):
        jump_link_shares(model, tok, [], RHOS)


def test_parsers():
    assert parse_rhos("5, 10,5") == [5.0, 10.0]
    with pytest.raises(ValueError, match="bad --rho entry 'x'"):
        parse_rhos("5,x")
    with pytest.raises(ValueError, match="finite"):
        parse_rhos("nan")
    assert head_set("all", 4) == [0, 1, 2, 3]
    assert head_set("even", 12) == [0, 2, 4, 6, 8, 10]
    assert head_set("odd", 4) == [1, 3]
    assert head_set("3,1,3", 4) == [3, 1]
    with pytest.raises(ValueError, match="bad --heads"):
        head_set("evens", 4)
    with pytest.raises(ValueError, match="out of range"):
        head_set("4", 4)


# ----------------------------------------------------------------------------- the command

runner = CliRunner()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tok):
    from transformers import BertModel

    from attnlab.hf.saving import save_pretrained
    from attnlab.models import encoder_config

    torch.manual_seed(0)
    model = BertModel(encoder_config("tiny", vocab_size=tok.vocab_size)).eval()
    path = tmp_path_factory.mktemp("links") / "tinybert"
    save_pretrained(model, path, tokenizer=tok)
    return path


def test_the_command_prints_the_table_and_writes_json(saved, tmp_path):
    from attnlab.cli import app

    out = tmp_path / "links.json"
    res = runner.invoke(app, ["analyze", "links", str(saved), "--data-dir", "builtin",
                              "--sentences", "4", "--rho", "0.001,1e30", "--heads", "even",
                              "--max-length", "16", "--out", str(out)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    text = " ".join(res.output.split())
    assert "4 examples of cola dev from builtin" in text and "heads even" in text
    assert "rho=0.001" in text and "rho=1e+30" in text
    doc = json.loads(out.read_text())
    assert doc["rhos"] == [0.001, 1e30] and doc["heads"] == [0] and doc["examples"] == 4
    assert doc["padding"] == "exclude" and doc["shares"][1] == [0.0, 0.0]
    assert len(doc["shares"][0]) == 2 and doc["meta"]["max_length"] == 16


@pytest.mark.parametrize(("args", "message"), [
    (["--rho", "5,abc"], "bad --rho entry 'abc'"),
    (["--heads", "0,2"], "head 2 is out of range: the model has heads 0-1"),
    (["--heads", "some"], "bad --heads 'some'"),
    (["--padding", "both"], "padding must be 'exclude' or 'include'"),
    (["--sentences", "0"], "--sentences must be at least 1"),
    (["--split", "tran"], "no split 'tran'"),
])
def test_bad_input_gives_a_clear_error(saved, args, message):
    from attnlab.cli import app

    res = runner.invoke(app, ["analyze", "links", str(saved), "--data-dir", "builtin", *args])
    assert res.exit_code == 2, res.output
    assert "error:" in res.output and message in " ".join(res.output.split())

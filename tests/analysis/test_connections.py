"""The JAT connection case study: labels, threshold, golden counts, padding, CLI end to end.

The golden sentence is [CLS] John Smith visited Paris . [SEP] (classes SEP PER PER O LOC O
SEP) with two hand-made heads whose above-threshold entries are known, so every class count
is worked out by hand below. The CLI tests use two tiny runs (scratch:tiny, one training
step on a small CoNLL file written to tmp_path; run B has JAT in layer 1).
"""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from attnlab.analysis.connections import (
    PAIR_CLASSES,
    ConnectionCounter,
    available_pairs,
    count_connections,
    major_connections,
    pair_classes,
    token_classes,
)
from attnlab.cli import app

runner = CliRunner()

LABELS = ["SEP", "PER", "PER", "O", "LOC", "O", "SEP"]  # [CLS] John Smith visited Paris . [SEP]
# Peak column of each query row: 0.4 there, 0.1 elsewhere (rows sum to 1). With n = 7 the
# map has 7 entries of 0.4 and 42 of 0.1: mean 1/7, population std 0.10498, threshold
# 0.2478, so exactly the peaks are major.
PEAKS = [
    [0, 2, 1, 5, 6, 3, 6],  # head 0: diag, PER, PER, O(visited->.), SEP, O(.->visited), diag
    [1, 4, 3, 3, 1, 5, 0],  # head 1: SEP, CROSS(PER-LOC), CROSS(PER-O), diag, CROSS, diag, SEP
]


def golden_maps() -> torch.Tensor:
    maps = torch.full((2, 7, 7), 0.1)  # [h, n, n]
    for h, peaks in enumerate(PEAKS):
        for i, j in enumerate(peaks):
            maps[h, i, j] = 0.4
    return maps


def counts(**classes: int) -> list[int]:
    return [classes.get(c, 0) for c in PAIR_CLASSES]


# ----------------------------------------------------------------------------- labels


def test_token_classes_follow_word_ids():
    # "Smith" split in two sub-words, both PER; I-ORG -> ORG; no word -> SEP
    word_ids = [None, 0, 1, 1, 2, 3, None]
    tags = ["B-PER", "I-PER", "O", "I-ORG"]
    assert token_classes(word_ids, tags) == ["SEP", "PER", "PER", "PER", "O", "ORG", "SEP"]
    with pytest.raises(ValueError, match="unknown NER tag 'B-CITY'"):
        token_classes([0], ["B-CITY"])
    with pytest.raises(ValueError, match="word id 3 out of range"):
        token_classes([3], ["O"])


def test_pair_classes_rules():
    p = pair_classes(LABELS)
    name = {i: c for i, c in enumerate(PAIR_CLASSES)} | {-1: None}
    assert name[int(p[1, 2])] == "PER" and name[int(p[3, 5])] == "O"
    assert name[int(p[1, 4])] == "CROSS" and name[int(p[2, 3])] == "CROSS"
    assert name[int(p[0, 4])] == "SEP" and name[int(p[4, 6])] == "SEP"
    assert bool((p.diagonal() == -1).all())
    assert int(pair_classes(LABELS, include_diagonal=True)[3, 3]) == PAIR_CLASSES.index("O")
    e = pair_classes(LABELS, entities_only=True)
    assert int(e[2, 3]) == -1 and int(e[6, 5]) == -1  # any pair with an O token is dropped
    assert name[int(e[1, 4])] == "CROSS" and name[int(e[0, 1])] == "SEP"
    # ordered pairs: both directions are candidates, each of the same class
    assert torch.equal(p, p.T)
    avail = available_pairs(LABELS)
    assert int(avail.sum()) == 7 * 6
    assert avail.tolist() == counts(PER=2, O=2, CROSS=2 * (2 * 3 + 1 * 2), SEP=2 * 5 * 2 + 2)
    with pytest.raises(ValueError, match="unknown token classes"):
        pair_classes(["PER", "B-PER"])


# ----------------------------------------------------------------------------- threshold


def test_major_is_strictly_above_mean_plus_population_std():
    g = torch.Generator().manual_seed(0)
    maps = torch.rand(3, 4, 9, 9, generator=g).softmax(-1)  # [L, h, n, n]
    flat = maps.double().numpy().reshape(3, 4, -1)
    want = flat > flat.mean(-1, keepdims=True) + flat.std(-1, keepdims=True)  # numpy ddof=0
    assert np.array_equal(major_connections(maps).numpy().reshape(3, 4, -1), want)
    # an entry exactly at the threshold is not major: mean 0.5, std 0.5, threshold 1.0
    assert not major_connections(torch.eye(2)).any()
    # each map has its own threshold: scaling one head changes nothing for either head
    scaled = golden_maps() * torch.tensor([1.0, 10.0])[:, None, None]
    assert torch.equal(major_connections(scaled), major_connections(golden_maps()))
    assert int(major_connections(golden_maps()).sum()) == 14  # exactly the 7 peaks per head


# ----------------------------------------------------------------------------- golden counts


@pytest.mark.parametrize("entities_only, diagonal, expected", [
    (False, False, counts(PER=2, O=2, CROSS=3, SEP=3)),
    (False, True, counts(PER=2, O=4, CROSS=3, SEP=5)),  # + 2 SEP diag (head 0), 2 O (head 1)
    (True, False, counts(PER=2, CROSS=2, SEP=3)),  # pairs with visited or "." drop out
    (True, True, counts(PER=2, CROSS=2, SEP=5)),
])
def test_golden_counts(entities_only, diagonal, expected):
    got = count_connections(golden_maps(), LABELS, entities_only=entities_only,
                            include_diagonal=diagonal)
    assert got.tolist() == expected
    # leading dims (layers) are kept: two identical layers count twice, separately
    two = count_connections(torch.stack([golden_maps(), golden_maps()]), LABELS,
                            entities_only=entities_only, include_diagonal=diagonal)
    assert two.tolist() == [expected, expected]


def _padded(maps: torch.Tensor, n_pad: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """maps [h, n, n] inside a [1, h, n+p, n+p] map whose padded rows/columns hold 5.0."""
    h, n, _ = maps.shape
    big = torch.full((1, h, n + n_pad, n + n_pad), 5.0)
    sl = slice(n_pad, None) if left else slice(0, n)
    big[0, :, sl, sl] = maps
    mask = torch.zeros(1, n + n_pad, dtype=torch.long)
    mask[0, sl] = 1
    return big, mask


@pytest.mark.parametrize("left", [False, True])
def test_padding_never_changes_counts(left):
    want = count_connections(golden_maps(), LABELS)
    big, mask = _padded(golden_maps(), 3, left)
    acc = ConnectionCounter()
    acc.update({0: big, 1: big}, [LABELS], mask)
    res = acc.result()
    assert res.counts.tolist() == [want.tolist(), want.tolist()]
    assert res.n_sentences == 1 and res.n_heads == 2
    assert res.available.tolist() == (2 * available_pairs(LABELS)).tolist()


def test_counter_sums_a_mixed_length_batch():
    short = ["SEP", "ORG", "ORG", "SEP"]
    g = torch.Generator().manual_seed(3)
    short_maps = torch.rand(2, 4, 4, generator=g).softmax(-1)  # [h, 4, 4]
    batch = torch.zeros(2, 2, 7, 7)
    batch[0] = golden_maps()
    batch[1, :, :4, :4] = short_maps
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    acc = ConnectionCounter()
    acc.update({0: batch}, [LABELS, short], mask)
    want = count_connections(golden_maps(), LABELS) + count_connections(short_maps, short)
    assert acc.result().counts[0].tolist() == want.tolist()
    assert acc.result().without_sep().shape == (1, len(PAIR_CLASSES) - 1)
    with pytest.raises(ValueError, match="example 1: 4 token labels for 7 real tokens"):
        acc.update({0: batch}, [LABELS, short], None)
    with pytest.raises(ValueError, match="no attention probabilities"):
        acc.update({0: None}, [LABELS], None)
    with pytest.raises(ValueError, match="no batches were counted"):
        ConnectionCounter().result()


# ----------------------------------------------------------------------------- end to end

CONLL = """-DOCSTART- -X- -X- O

John NNP B-NP B-PER
Smith NNP I-NP I-PER
visited VBD B-VP O
Paris NNP B-NP B-LOC
. . O O

The DT B-NP O
European NNP I-NP B-ORG
Commission NNP I-NP I-ORG
rejected VBD B-VP O
German JJ B-NP B-MISC
beef NN I-NP O
. . O O

Peter NNP B-NP B-PER
Blackburn NNP I-NP I-PER
of IN B-PP O
Reuters NNP B-NP B-ORG
reported VBD B-VP O
from IN B-PP O
London NNP B-NP B-LOC

Spain NNP B-NP B-LOC
beat VBD B-VP O
Germany NNP B-NP B-LOC
2-1 CD B-NP O
"""
BASE = ["task.name=conll2003", "model.name=scratch:tiny", "model.max_length=32",
        "train.max_steps=1", "train.batch_size=2", "eval.batch_size=4"]


def _invoke(args, code=0):
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == code, res.output + repr(res.exception)
    return res


def _text(res) -> str:
    """CLI output with rich's line wrapping undone."""
    return " ".join(res.output.split())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from attnlab.config import load_config
    from attnlab.recipes.finetune import run_experiment

    root = tmp_path_factory.mktemp("conn")
    data = root / "data"
    data.mkdir()
    for name in ("train.txt", "valid.txt"):
        (data / name).write_text(CONLL)
    plans = {"base": [], "jat": ["plan=['1:all:jat(rho=3)']"]}
    for seed, (name, plan) in enumerate(plans.items()):
        cfg = load_config(None, [*BASE, *plan, f"task.data_dir={data}", f"name={name}",
                                 f"seed={seed}", f"output_dir={root}"])
        run_experiment(cfg)
    return root / "base", root / "jat", data


def test_cli_on_a_run_writes_csv_json_and_plots(runs):
    base, _, _ = runs
    res = _invoke(["analyze", "connections", base, "--batch-size", "3"])
    out = base / "analysis"
    for stem in ("connections_per_layer", "connections_per_layer_nosep"):
        assert (out / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", stem
        assert "<svg" in (out / f"{stem}.svg").read_text()[:500], stem
    doc = json.loads((out / "connections.json").read_text())
    lines = (out / "connections.csv").read_text().splitlines()
    assert lines[0] == "layer," + ",".join(PAIR_CLASSES) + ",total,total_nosep"
    assert len(lines) == 1 + 2  # scratch:tiny has 2 layers
    assert doc["meta"]["sentences"] == 4 and doc["heads"] == 2
    assert doc["meta"]["text"].startswith("conll2003 dev from")  # the run's own data
    assert doc["meta"]["tokens"]["SEP"] == 8  # [CLS] + [SEP] per sentence
    for row, line, counts_row in zip(doc["rows"], lines[1:], doc["counts"], strict=True):
        assert line.split(",")[1:8] == [str(x) for x in counts_row]
        assert row["total_nosep"] == row["total"] - row["SEP"] == sum(counts_row[:-1])
    assert all(sum(r) > 0 for r in doc["counts"])
    assert doc["classes_nosep"] == [c for c in PAIR_CLASSES if c != "SEP"]
    avail = [doc["available_pairs"][c] for c in PAIR_CLASSES]
    assert avail[PAIR_CLASSES.index("SEP")] > 0 and avail[PAIR_CLASSES.index("PER")] > 0
    for counts_row, rates in zip(doc["counts"], doc["rates"], strict=True):
        assert rates == [round(c / a, 6) if a else None
                         for c, a in zip(counts_row, avail, strict=True)]
    assert "major connections per layer" in res.output


def test_batching_and_padding_do_not_change_run_counts(runs):
    from attnlab.recipes.connections import ConllSource, count_model, load_ner_model

    base, _, _ = runs
    loaded = load_ner_model(str(base))
    one = count_model(loaded, ConllSource(), batch_size=1).counts  # no padding at all
    many = count_model(loaded, ConllSource(), batch_size=4).counts  # padded to the longest
    assert torch.equal(one.counts, many.counts) and torch.equal(one.available, many.available)
    ents = count_model(loaded, ConllSource(limit=2), batch_size=2, entities_only=True).counts
    assert int(ents.counts[:, PAIR_CLASSES.index("O")].sum()) == 0
    assert ents.n_sentences == 2


def test_cli_compare_baseline_and_jat(runs, tmp_path):
    base, jat, _ = runs
    out = tmp_path / "cmp"
    _invoke(["analyze", "connections", "--compare", base, jat, "--entities-only",
             "--out", out])
    for stem in ("connections_compare", "connections_compare_nosep"):
        assert (out / f"{stem}.png").is_file() and (out / f"{stem}.svg").is_file()
    lines = (out / "connections_compare.csv").read_text().splitlines()
    assert lines[0].startswith("model,name,layer,PER")
    assert [ln.split(",")[0] for ln in lines[1:]] == ["a", "a", "b", "b"]
    doc = json.loads((out / "connections_compare.json").read_text())
    assert doc["b"]["meta"]["mechanisms"]["1"] == ["jat"]  # the JAT plan was re-applied
    assert doc["a"]["entities_only"] and doc["b"]["meta"]["sentences"] == 4
    a, b = np.array(doc["a"]["counts"]), np.array(doc["b"]["counts"])
    assert np.array_equal(np.array(doc["difference_b_minus_a"]), b - a)
    assert (out / "a-base" / "connections.csv").is_file()
    assert (out / "b-jat" / "connections_per_layer.png").is_file()


def test_clear_errors(runs, tmp_path):
    from attnlab.config import load_config, resolved_yaml

    missing = _invoke(["analyze", "connections", tmp_path / "nope"], code=2)
    assert "does not exist; pass a finished token-classification run" in _text(missing)
    cola = tmp_path / "cola-run"
    cola.mkdir()
    (cola / "config.yaml").write_text(resolved_yaml(load_config(None, ["task.name=cola"])))
    res = _invoke(["analyze", "connections", cola], code=2)
    assert "needs a token-classification run" in _text(res)
    base, _, _ = runs
    both = _invoke(["analyze", "connections", base, "--compare", base, base], code=2)
    assert "not both" in _text(both)
    bad = _invoke(["analyze", "connections", base, "--limit", "0"], code=2)
    assert "--limit must be at least 1" in _text(bad)


def test_compare_seed_folders_keep_their_variant_in_labels(tmp_path):
    from attnlab.recipes.analyze import run_label
    from attnlab.recipes.connections import compare_connections_out

    assert run_label(tmp_path / "conll" / "jat" / "seed-0") == "jat/seed-0"
    assert run_label(tmp_path / "my-run") == "my-run"
    out = compare_connections_out(str(tmp_path / "b" / "seed-0"), str(tmp_path / "j" / "seed-0"))
    assert out.name == "connections-compare-b_seed-0-vs-j_seed-0"

"""The built-in CoLA-format sample: committed files equal the generator's output."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from attnlab.tasks import sample as S

SAMPLE = Path(str(resources.files("attnlab") / "data" / "cola_sample"))


def test_committed_files_are_the_generator_output(tmp_path):
    S.write_sample(tmp_path)  # the defaults: seed 0, 400 train, 150 dev
    for name in ("train.tsv", "dev.tsv"):
        assert (tmp_path / name).read_bytes() == (SAMPLE / name).read_bytes(), (
            f"{name} is stale: regenerate with `python -m attnlab.tasks.sample`")


def test_generator_is_deterministic():
    assert S.generate(60, seed=3) == S.generate(60, seed=3)
    assert S.generate(60, seed=3) != S.generate(60, seed=4)


def rows(name):
    return [line.split("\t") for line in (SAMPLE / name).read_text().splitlines()]


def test_format_balance_and_no_overlap():
    train, dev = rows("train.tsv"), rows("dev.tsv")
    assert (len(train), len(dev)) == (400, 150)
    for r in train + dev:
        assert len(r) == 4 and r[1] in ("0", "1")
        assert r[2] == ("" if r[1] == "1" else "*")  # CoLA's original-judgement column
        assert r[0] == "attn_ok" if r[1] == "1" else r[0] in {f"attn_{k}" for k in S.KINDS}
    for part in (train, dev):
        share = sum(r[1] == "1" for r in part) / len(part)
        assert 0.4 < share < 0.65  # balanced-ish
    sentences = [r[3] for r in train + dev]
    assert len(set(sentences)) == len(sentences)  # no duplicates, no train/dev overlap
    assert {r[0] for r in train} >= {f"attn_{k}" for k in S.KINDS}  # every error type


BASE = S.Clause(det="the", adj=None, noun=("teacher", "teachers"), plural=False,
                frame="present", verb=S.OBLIG_TRANS[0], kind="trans", obj=("the", "key"),
                loc=(), adjunct=(), aux_past=False, modal="will")


def text(words):
    return " ".join(words)


@pytest.mark.parametrize(
    "clause, kind, expected",
    [
        (BASE, "agreement", {"the teacher find the key ."}),
        (BASE, "verb_form", {"the teacher finding the key ."}),
        (BASE, "missing_arg", {"the teacher finds ."}),
        (BASE, "order", {"teacher the finds the key .", "the teacher the key finds ."}),
        (BASE, "extra_arg", {None}),
        (S.Clause(**{**BASE.__dict__, "frame": "perfect", "plural": True}), "verb_form",
         {"the teachers have find the key .", "the teachers have finds the key .",
          "the teachers have finding the key ."}),
        (S.Clause(**{**BASE.__dict__, "kind": "intrans", "verb": S.INTRANS[0], "obj": ()}),
         "extra_arg", None),
        (S.Clause(**{**BASE.__dict__, "kind": "put", "verb": S.PUT, "loc": ("on", "it")}),
         "missing_arg", {"the teacher puts the key ."}),
        (S.Clause(**{**BASE.__dict__, "det": "this", "frame": "past"}), "agreement",
         {"these teacher found the key ."}),
    ],
)
def test_each_corruption_is_one_targeted_edit(clause, kind, expected):
    import random

    assert text(S.sentence(clause)) != "" and "  " not in text(S.sentence(clause))
    for seed in range(8):
        got = S.corrupt(clause, kind, random.Random(seed))
        if expected is None:  # extra_arg on an intransitive: some object after the verb
            words = text(got).split()
            assert words[:3] == ["the", "teacher", "sleeps"] and len(words) > 4
        else:
            assert (None if got is None else text(got)) in expected

"""SQuAD: JSON parsing, article split, sliding-window labels, span post-processing, v2."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
from tasks_helpers import need_data, write

from attnlab.tasks import DataFormatError, SquadExample, get_task, read_squad, split_articles
from attnlab.tasks.metrics import normalize_answer

CTX = ("Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
       "rho sigma tau upsilon phi chi psi omega one two three four five six seven eight nine "
       "ten.")


def example(answer: str | None, qid: str = "q1") -> SquadExample:
    if answer is None:
        return SquadExample(id=qid, title="Greek", context=CTX, question="Which letters?",
                            answers=(), answer_starts=(), is_impossible=True)
    start = re.search(rf"\b{answer}\b", CTX).start()
    return SquadExample(id=qid, title="Greek", context=CTX, question="Which letters?",
                        answers=(answer,), answer_starts=(start,))


# max_length 24 with stride 4 gives three windows over CTX; the first ends at "omicron"
TASK = dataclasses.replace(get_task("squad"), stride=4)
MAXLEN = 24


def squad_json(articles) -> dict:
    return {"version": "1.1", "data": [
        {"title": title, "paragraphs": [{"context": ctx, "qas": [
            {"id": qid, "question": q, "answers": [{"text": a, "answer_start": ctx.index(a)}]}
            for qid, q, a in qas]}]}
        for title, ctx, qas in articles]}


def test_read_squad(tmp_path):
    doc = squad_json([("A", "Paris is in France.", [("1", "Where is Paris?", "France")]),
                      ("B", "Rome is old.", [("2", "What is old?", "Rome")])])
    rows = read_squad(write(tmp_path / "dev-v1.1.json", json.dumps(doc)))
    assert [(r.id, r.title, r.answers, r.answer_starts) for r in rows] == [
        ("1", "A", ("France",), (12,)), ("2", "B", ("Rome",), (0,))]
    task = get_task("squad")
    assert task.load("dev", tmp_path) == rows  # folder with dev-v1.1.json
    assert task.load("dev", tmp_path / "dev-v1.1.json") == rows  # or the file itself


def test_broken_json_names_the_line(tmp_path):
    path = write(tmp_path / "dev-v1.1.json", '{\n  "data": [\n    {"title": "A",,}\n  ]\n}\n')
    with pytest.raises(DataFormatError, match="broken JSON") as e:
        read_squad(path)
    assert e.value.line == 3 and str(e.value).startswith(f"{path}:3: ")


@pytest.mark.parametrize(
    "mutate, message",
    [(lambda qa: qa["answers"][0].update(answer_start=3), "answer_start 3 does not point"),
     (lambda qa: qa.pop("question"), r"data\[0\].paragraphs\[0\].qas\[0\]: missing or bad "
                                     "'question'"),
     (lambda qa: qa.update(answers=[]), "no answers and not marked is_impossible")],
)
def test_structural_errors_point_into_the_json(tmp_path, mutate, message):
    doc = squad_json([("A", "Paris is in France.", [("1", "Where is Paris?", "France")])])
    mutate(doc["data"][0]["paragraphs"][0]["qas"][0])
    path = write(tmp_path / "x.json", json.dumps(doc))
    with pytest.raises(DataFormatError, match=message):
        read_squad(path)


def test_split_articles_is_deterministic_and_disjoint():
    titles = [f"T{i}" for i in range(48)] * 2  # repeated titles count once
    train, held = split_articles(titles)
    assert (len(train), len(held)) == (36, 12)
    assert not train & held and train | held == set(titles)
    assert split_articles(list(reversed(titles))) == (train, held)  # order does not matter
    assert split_articles(titles, seed=1) != (train, held)


def windows(answer: str, tokenizer):
    return TASK.encode([example(answer)], tokenizer, MAXLEN)


def span_text(f, ctx: str = CTX) -> str:
    o = f["offset_mapping"]
    return ctx[o[f["start_positions"]][0]:o[f["end_positions"]][1]]


def test_labels_for_an_answer_across_the_window_boundary(tokenizer):
    feats = windows("omicron pi rho", tokenizer)
    assert len(feats) == 3 and all(len(f["input_ids"]) <= MAXLEN for f in feats)
    first_ctx = [o for o in feats[0]["offset_mapping"] if o]
    assert CTX[:first_ctx[-1][1]].endswith("omicron")  # window 1 cuts the answer
    assert (feats[0]["start_positions"], feats[0]["end_positions"]) == (0, 0)  # -> [CLS]
    assert span_text(feats[1]) == "omicron pi rho"
    assert (feats[2]["start_positions"], feats[2]["end_positions"]) == (0, 0)


def test_labels_for_an_answer_inside_the_overlap(tokenizer):
    feats = windows("xi omicron", tokenizer)
    assert [span_text(f) for f in feats[:2]] == ["xi omicron", "xi omicron"]
    assert feats[0]["start_positions"] > feats[1]["start_positions"] > 0


def crafted_logits(feats, picks):
    """Logits -100 everywhere except ``picks[i] = [(pos, start_val, end_val), ...]``."""
    out = []
    for f, pick in zip(feats, picks, strict=True):
        s = np.full(len(f["input_ids"]), -100.0)
        e = np.full(len(f["input_ids"]), -100.0)
        for pos, sv, ev in pick:
            s[pos] = max(s[pos], sv)
            e[pos] = max(e[pos], ev)
        out.append((s, e))
    return out


def position_of(f, word: str, end: bool = False) -> int:
    """Token position where ``word`` starts (or, with ``end``, ends) in feature ``f``."""
    a = re.search(rf"\b{word}\b", CTX).start()
    return next(i for i, o in enumerate(f["offset_mapping"])
                if o and (o[1] == a + len(word) if end else o[0] == a))


def test_postprocess_picks_the_span_in_the_window_that_holds_it(tokenizer):
    ex = example("omicron pi rho")
    feats = TASK.encode([ex], tokenizer, MAXLEN)
    w1, w2, w3 = feats
    last1 = max(i for i, o in enumerate(w1["offset_mapping"]) if o)
    picks = [
        # window 1: the answer's start and the window's last token: "omicron", score 18
        [(position_of(w1, "omicron"), 9.0, -100), (last1, -100, 9.0),
         (2, 100.0, 100.0)],  # a question token: outside the context, never chosen
        # window 2: the gold span (20) plus a higher-scoring reversed pair (end < start)
        [(w2["start_positions"], 10.0, -100), (w2["end_positions"], -100, 10.0),
         (position_of(w2, "omega"), 50.0, -100), (position_of(w2, "xi"), -100, 50.0)],
        # window 3: a high-scoring span longer than max_answer_length (8 tokens)
        [(position_of(w3, "psi"), 40.0, -100), (len(w3["input_ids"]) - 2, -100, 40.0)],
    ]
    task = dataclasses.replace(TASK, max_answer_length=8)  # gold span: 6 tokens
    preds = crafted_logits(feats, picks)
    assert task.answers(preds, feats, [ex]) == {"q1": "omicron pi rho"}
    out = task.compute_metrics(preds, feats, [ex])
    assert out == {"exact_match": 100.0, "f1": 100.0}
    # with a long enough max_answer_length the window-3 span wins (score 80)
    long = dataclasses.replace(TASK, max_answer_length=30).answers(preds, feats, [ex])
    assert long["q1"].startswith("psi") and long["q1"].endswith("ten.")


def test_v2_no_answer_threshold(tokenizer):
    task = dataclasses.replace(get_task("squad_v2"), stride=4)
    ex_none, ex_ans = example(None, "none"), example("pi rho", "ans")
    feats = task.encode([ex_none, ex_ans], tokenizer, MAXLEN)
    assert all(f["start_positions"] == 0 for f in feats if f["example_index"] == 0)
    picks = []
    for f in feats:
        if f["example_index"] == 0:  # null 2+2 = 4 against a span of 3+3 = 6: diff -2
            has_beta = any(o and CTX[o[0]:o[1]] == "beta" for o in f["offset_mapping"])
            picks.append([(0, 2.0, 2.0)] + ([(position_of(f, "beta"), 3.0, 3.0)]
                                            if has_beta else []))
        else:  # null 0 against the gold span 5+5 = 10: diff -10
            gold = f["start_positions"] > 0
            picks.append([(0, 0.0, 0.0)] + ([(f["start_positions"], 5.0, -100),
                                             (f["end_positions"], -100, 5.0)] if gold else []))
    preds = crafted_logits(feats, picks)
    assert task.answers(preds, feats, [ex_none, ex_ans]) == {"none": "beta", "ans": "pi rho"}
    strict = dataclasses.replace(task, null_threshold=-3.0)  # diff -2 > -3: abstain
    assert strict.answers(preds, feats, [ex_none, ex_ans]) == {"none": "", "ans": "pi rho"}
    out = strict.compute_metrics(preds, feats, [ex_none, ex_ans])
    assert out["exact_match"] == 100.0 and out["NoAns_exact"] == 100.0
    assert out["best_exact"] == 100.0 and -10.0 <= out["best_exact_thresh"] < -2.0


def test_too_large_stride_is_a_clear_error(tokenizer):
    task = dataclasses.replace(TASK, stride=20)  # room: 24 - 3 question tokens - 3 = 18
    with pytest.raises(ValueError, match="stride 20 must be smaller than .* 18 tokens"):
        task.encode([example("pi rho")], tokenizer, MAXLEN)


def test_collate_and_batch_predictions(tokenizer):
    import torch

    feats = windows("xi omicron", tokenizer)
    batch = TASK.collator(tokenizer)(feats)
    assert set(batch) == {"input_ids", "attention_mask", "token_type_ids", "start_positions",
                          "end_positions"}
    n = batch["input_ids"].shape[1]
    logits = torch.arange(3 * n, dtype=torch.float32).reshape(3, n)
    preds = TASK.batch_predictions({"start_logits": logits, "end_logits": -logits}, batch)
    assert [len(s) for s, _ in preds] == [len(f["input_ids"]) for f in feats]
    assert np.array_equal(preds[2][1], -logits[2, : len(feats[2]["input_ids"])].numpy())


def test_real_squad_dev_counts_and_article_split():
    task = get_task("squad")
    root = need_data("squad")
    dev = task.load("dev", root)
    assert len(dev) == 10570 and len({e.id for e in dev}) == 10570
    assert len({e.title for e in dev}) == 48
    tr, ev = task.load("dev_train", root), task.load("dev_eval", root)
    assert len(tr) + len(ev) == 10570
    assert len({e.title for e in tr}) == 36 and len({e.title for e in ev}) == 12
    assert not {e.title for e in tr} & {e.title for e in ev}


def test_real_squad_labels_recover_the_answers(tokenizer):
    task = get_task("squad")
    dev = task.load("dev", need_data("squad"))[:300]
    feats = task.encode(dev, tokenizer, max_length=192)
    labelled = [f for f in feats if f["start_positions"] > 0]
    assert len(labelled) >= 300  # every question has at least one window holding its answer
    same = 0
    for f in labelled:
        ex = dev[f["example_index"]]
        o = f["offset_mapping"]
        text = ex.context[o[f["start_positions"]][0]:o[f["end_positions"]][1]]
        same += normalize_answer(text) == normalize_answer(ex.answers[0])
    # the rest are answers inside a word piece ("gold" in "golden"): a tokenizer limit
    assert same / len(labelled) > 0.95
    # logits that put all mass on the labels: official EM 96.7 on these 300 (the misses are
    # the word-piece cases above, where no token span equals the answer)
    preds = crafted_logits(feats, [[(f["start_positions"], 10.0, -100),
                                    (f["end_positions"], -100, 10.0)] for f in feats])
    assert task.compute_metrics(preds, feats, dev)["exact_match"] > 95.0


def test_windows_cover_the_whole_context(tokenizer):
    """Every character of a long context lies in some window (tokenizers 0.23.1-0.23.2 cut
    the tail of overflowing pairs, huggingface/tokenizers#2091; this test fails there)."""
    long_ctx = " ".join(f"word{i} and more text number {i}." for i in range(120))
    ex = SquadExample(id="long", title="T", context=long_ctx, question="Which word?",
                      answers=("word119",), answer_starts=(long_ctx.index("word119"),))
    feats = dataclasses.replace(get_task("squad"), stride=20).encode([ex], tokenizer, 64)
    assert len(feats) > 10
    last = max(o[1] for f in feats for o in f["offset_mapping"] if o)
    assert last == len(long_ctx)
    assert any(f["start_positions"] and span_text(f, long_ctx) == "word119" for f in feats)


class _CutTail:
    """A tokenizer whose overflowing pair windows stop 10 characters before the context ends
    (what the tokenizers bug does), for the guard's test."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, *args, **kwargs):
        if kwargs.get("return_overflowing_tokens"):
            questions, contexts = args
            return self.inner(questions, [c[:-10] for c in contexts], **kwargs)
        return self.inner(*args, **kwargs)


def test_cut_contexts_are_a_clear_error(tokenizer):
    with pytest.raises(RuntimeError, match=r"1 of 1 SQuAD contexts lost their end.*>=0.23.3"):
        TASK.encode([example("pi rho")], _CutTail(tokenizer), MAXLEN)


def test_window_coverage_counts_cut_contexts_and_lost_answers(tokenizer):
    """The counts `attnlab data squad-windows` prints: with the tail cut (as tokenizers
    0.23.1-0.23.2 cut it) an answer at the context's end lies in no window; uncut, none."""
    exs = [example("pi rho", "q1"), example("ten", "q2"), example(None, "q3")]
    whole = TASK.window_coverage(exs, tokenizer, MAXLEN)
    assert whole == {"questions": 3, "windows": len(TASK.encode(exs, tokenizer, MAXLEN)),
                     "cut_contexts": 0, "answers_in_no_window": 0}
    cut = TASK.window_coverage(exs, _CutTail(tokenizer), MAXLEN)  # no refusal here
    assert cut["cut_contexts"] == 3  # every example shares CTX
    assert cut["answers_in_no_window"] == 1  # "ten" was in the last 10 characters


def test_squad_windows_command(tmp_path):
    from typer.testing import CliRunner

    from attnlab.cli import app

    doc = squad_json([("A", CTX, [("1", "Which?", "pi rho"), ("2", "Last?", "ten")])])
    write(tmp_path / "dev-v1.1.json", json.dumps(doc))
    res = CliRunner().invoke(app, ["data", "squad-windows", "--data-dir", str(tmp_path),
                                   "--splits", "dev:2", "--max-length", "24", "--stride", "4"])
    assert res.exit_code == 0, res.output
    assert re.search(r"\| dev \(first 2\) \| 2 \| \d+ \| 0 \| 0 \(0.0%\) \|", res.output)
    bad = CliRunner().invoke(app, ["data", "squad-windows", "--splits", "dev"])
    assert bad.exit_code == 2 and "SPLIT:LIMIT" in bad.output

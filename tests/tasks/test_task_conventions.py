"""Task conventions users and outside checkers rely on: the official SQuAD v2.0 script's
answerable/unanswerable split and Hugging Face's split names."""

from __future__ import annotations

import pytest
from tasks_helpers import write

from attnlab.tasks import get_task
from attnlab.tasks import metrics as M

# ----------------------------------------------------------------------------- SQuAD v2.0
# evaluate-v2.0.py: a question is answerable when its answer list is non-empty
# (make_qid_to_has_ans), even if every answer normalises to "" (then the gold list
# becomes [""] for scoring).


def test_v2_answerable_is_a_non_empty_answer_list():
    gold = {"dot": ["."], "real": ["Denver"], "none": []}
    out = M.squad_scores({"dot": "", "real": "Denver", "none": ""}, gold, "2.0")
    assert out["exact_match"] == pytest.approx(100.0)
    # "dot" and "real" are HasAns (2 questions), "none" alone is NoAns
    assert out["HasAns_exact"] == pytest.approx(100.0)
    assert out["NoAns_exact"] == pytest.approx(100.0)
    out = M.squad_scores({"dot": "x", "real": "Denver", "none": ""}, gold, "2.0")
    assert out["HasAns_exact"] == pytest.approx(50.0)  # official: (0 + 1) / 2
    assert out["NoAns_exact"] == pytest.approx(100.0)  # official: 1 / 1


def official_best_thresh(preds, scores, na_probs, has_ans):
    """find_best_thresh of evaluate-v2.0.py, transcribed."""
    cur = best = sum(1 for k in has_ans if not has_ans[k])
    thresh = 0.0
    for qid in sorted(na_probs, key=lambda k: na_probs[k]):
        if qid not in scores:
            continue
        diff = scores[qid] if has_ans[qid] else (-1 if preds[qid] else 0)
        cur += diff
        if cur > best:
            best, thresh = cur, na_probs[qid]
    return 100.0 * best / len(scores), thresh


def test_v2_best_threshold_counts_answerable_as_the_official_script():
    gold = {"q1": ["."], "q2": ["Denver"], "q3": []}
    texts = {"q1": "Broncos", "q2": "Denver", "q3": "x"}
    diffs = {"q1": -1.0, "q2": 0.5, "q3": 2.0}
    has_ans = {q: bool(a) for q, a in gold.items()}
    for name, fn in (("exact", M.squad_exact), ("f1", lambda p, g: M.squad_f1(p, g, "2.0"))):
        golds = {q: [g for g in a if M.normalize_answer(g)] or [""] for q, a in gold.items()}
        raw = {q: max(fn(texts[q], g) for g in golds[q]) for q in gold}
        want, want_thresh = official_best_thresh(texts, raw, diffs, has_ans)
        got = M.best_null_threshold(texts, diffs, gold)
        assert got[f"best_{name}"] == pytest.approx(want)
        assert got[f"best_{name}_thresh"] == want_thresh


# ----------------------------------------------------------------------------- split names


def test_mnli_accepts_the_hub_split_names(tmp_path):
    header = ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse"
              "\tsentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label\n")
    for split, label in (("dev_matched", "neutral"), ("dev_mismatched", "contradiction")):
        write(tmp_path / "MNLI" / f"{split}.tsv",
              header + f"0\t1\t1e\tgov\t(x)\t(y)\t(X)\t(Y)\tP.\tH.\t{label}\t{label}\n")
    mnli = get_task("mnli")
    for hub, ours in (("validation_matched", "dev_matched"),
                      ("validation_mismatched", "dev_mismatched")):
        assert mnli.load(hub, tmp_path) == mnli.load(ours, tmp_path)
    assert [r.label for r in mnli.load("validation_matched", tmp_path)] == [1]
    assert [r.label for r in mnli.load("validation_mismatched", tmp_path)] == [2]
    with pytest.raises(ValueError, match="available splits"):
        mnli.load("validation", tmp_path)  # MNLI has no plain dev split

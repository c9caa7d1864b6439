"""Metrics against values computed by hand (tolerance 1e-12: exact arithmetic up to rounding)."""

from __future__ import annotations

import math

import pytest

from attnlab.tasks import metrics as M

TOL = 1e-12

# labels / preds: TP = 3 (idx 0, 2, 5), FN = 1 (idx 1), TN = 1 (idx 3), FP = 1 (idx 4)
LABELS = [1, 1, 1, 0, 0, 1]
PREDS = [1, 0, 1, 0, 1, 1]


def test_mcc_from_a_hand_confusion_matrix():
    # (TP*TN - FP*FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) = (3 - 1) / sqrt(4*4*2*2) = 0.25
    assert M.matthews(PREDS, LABELS) == pytest.approx(0.25, abs=TOL)
    out = M.glue_metrics("mcc", PREDS, LABELS)
    assert out["mcc"] == pytest.approx(0.25, abs=TOL)
    assert out["accuracy"] == pytest.approx(4 / 6, abs=TOL)


def test_mcc_degenerate_predictions_are_zero():
    assert M.matthews([1, 1, 1], [1, 0, 1]) == 0.0


def test_f1_and_accuracy():
    # precision 3/4, recall 3/4 -> F1 0.75; accuracy 4/6
    out = M.glue_metrics("f1_accuracy", PREDS, LABELS)
    assert out["f1"] == pytest.approx(0.75, abs=TOL)
    assert out["accuracy"] == pytest.approx(4 / 6, abs=TOL)
    assert out["combined_score"] == pytest.approx((0.75 + 4 / 6) / 2, abs=TOL)
    # F1 is of the positive class: swapping which class is 1 changes it (P 1/2, R 1/2)
    flip = M.binary_f1([1 - p for p in PREDS], [1 - y for y in LABELS])
    assert flip == pytest.approx(0.5, abs=TOL)


def test_pearson_spearman_by_hand():
    # deviations dp = [-1.5, -.5, .5, 1.5], dl = [-3, -1, 0, 4]: cov 11, ss 5 and 26
    out = M.pearson_spearman([1, 2, 3, 4], [2, 4, 5, 9])
    assert out["pearson"] == pytest.approx(11 / math.sqrt(5 * 26), abs=TOL)
    assert out["spearman"] == pytest.approx(1.0, abs=TOL)
    # rank differences d = [0, -1, 1, 0]: rho = 1 - 6 * 2 / (4 * 15) = 0.8
    assert M.pearson_spearman([1, 2, 3, 4], [1, 3, 2, 4])["spearman"] == pytest.approx(0.8)


def test_pearson_of_constant_predictions_is_nan():
    out = M.glue_metrics("pearson_spearman", [2.0, 2.0, 2.0], [1.0, 2.0, 3.0])
    assert math.isnan(out["pearson"]) and math.isnan(out["combined_score"])


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="3 predictions for 2 labels"):
        M.glue_metrics("accuracy", [0, 1, 1], [0, 1])


def test_seqeval_entity_f1_on_a_crafted_example():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    pred = [["B-PER", "I-PER", "O", "B-ORG"], ["B-ORG", "O"]]
    # gold entities PER, LOC, ORG; predicted PER, ORG, ORG; 2 correct -> P = R = F1 = 2/3
    out = M.ner_metrics(gold, pred)
    assert out["precision"] == pytest.approx(2 / 3, abs=TOL)
    assert out["recall"] == pytest.approx(2 / 3, abs=TOL)
    assert out["f1"] == pytest.approx(2 / 3, abs=TOL)
    assert out["accuracy"] == pytest.approx(5 / 6, abs=TOL)  # one of six tags wrong
    assert out["f1_PER"] == 1.0 and out["f1_LOC"] == 0.0
    assert out["f1_ORG"] == pytest.approx(2 / 3, abs=TOL)  # P 1/2, R 1


def test_seqeval_split_entity_is_wrong():
    # B-PER B-PER makes two one-token entities: neither equals the gold two-token PER
    out = M.ner_metrics([["B-PER", "I-PER"]], [["B-PER", "B-PER"]])
    assert out["f1"] == 0.0 and out["accuracy"] == 0.5


@pytest.mark.parametrize(
    "raw, norm",
    [
        ("The  Cat!", "cat"),  # lower, punctuation, article, whitespace
        ("an apple", "apple"),
        ("Theatre", "theatre"),  # articles only as whole words
        ("A.B.C.", "abc"),  # punctuation goes first, so no stray "a"
        ("the-the", "thethe"),  # ... and the hyphen joins the words before article removal
        ("a  b\tthe c", "b c"),
        ("\u201cx\u201d", "\u201cx\u201d"),  # only ASCII punctuation is removed
        ("1,000", "1000"),
    ],
)
def test_squad_normalisation_matches_the_official_script(raw, norm):
    assert M.normalize_answer(raw) == norm


def test_squad_em_f1():
    assert M.squad_exact("Denver Broncos", "the Denver Broncos!") == 1.0
    # normalised pred "cat sat on mat" (4), gold "cat on mat" (3): 3 common, P 3/4, R 1
    assert M.squad_f1("the cat sat on the mat", "cat on mat") == pytest.approx(6 / 7)
    # repeated tokens count with multiplicity: x x y / x y y share 2 -> P = R = 2/3
    assert M.squad_f1("x x y", "x y y") == pytest.approx(2 / 3)
    assert M.squad_f1("nothing shared", "at all") == 0.0


def test_squad_empty_answers_v1_versus_v2():
    assert M.squad_f1("", "the", "1.1") == 0.0  # v1: an empty side scores 0
    assert M.squad_f1("", "the", "2.0") == 1.0  # v2: both empty -> 1
    assert M.squad_f1("x", "", "2.0") == 0.0


def test_squad_scores_take_the_max_over_gold_answers():
    gold = {"q1": ["Denver Broncos", "Broncos"], "q2": ["in 1990", "1990s"]}
    out = M.squad_scores({"q1": "Broncos", "q2": "1990"}, gold)
    # q1 exact; q2: EM 0, F1 max(2*1/2*1/(1/2+1)=2/3 vs "in 1990", 0 vs "1990s") = 2/3
    assert out["exact_match"] == pytest.approx(50.0)
    assert out["f1"] == pytest.approx(100 * (1 + 2 / 3) / 2)
    assert M.squad_scores({}, gold)["f1"] == 0.0  # missing predictions score 0


def test_squad_v2_no_answer_scoring_and_best_threshold():
    gold = {"q1": ["a1"], "q2": []}  # q2 has no answer
    out = M.squad_scores({"q1": "a1", "q2": ""}, gold, "2.0")
    assert out["exact_match"] == 100.0 and out["NoAns_f1"] == 100.0
    assert M.squad_scores({"q1": "", "q2": "x"}, gold, "2.0")["exact_match"] == 0.0
    # answering q1 (diff -2) and abstaining on q2 (diff 1) is best: threshold -2
    best = M.best_null_threshold({"q1": "a1", "q2": "junk"}, {"q1": -2.0, "q2": 1.0}, gold)
    assert best["best_exact"] == 100.0 and best["best_exact_thresh"] == -2.0
    assert best["best_f1"] == 100.0


def test_perplexity():
    out = M.perplexity(nll_sum=3 * math.log(4), count=3)
    assert out["loss"] == pytest.approx(math.log(4), abs=TOL)
    assert out["perplexity"] == pytest.approx(4.0, abs=1e-9)
    with pytest.raises(ValueError, match="no masked tokens"):
        M.perplexity(0.0, 0)


@pytest.mark.parametrize("version", ["1.1", "2.0"])
def test_a_question_without_a_prediction_scores_zero(version):
    # the official scripts: an unanswered question gets 0, even when a gold answer
    # normalises to the empty string (SQuAD v1.1 dev has three answers ".")
    scores = M.squad_scores({"a": "x"}, {"a": ["x"], "q": ["."]}, version=version)
    assert scores["exact_match"] == pytest.approx(50.0) and scores["f1"] == pytest.approx(50.0)

"""Task metrics on top of scikit-learn, scipy and seqeval, plus the official SQuAD scoring.

Scales: GLUE and CoNLL metrics are fractions in [0, 1] (Hugging Face ``evaluate``
convention); SQuAD exact match and F1 are percentages in [0, 100], as the official scripts
print them and papers report them. ``evaluate.load`` is not used: it fetches metric code from
the hub, and this project runs offline.
"""

from __future__ import annotations

import collections
import math
import re
import string
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

MetricSet = Literal["mcc", "accuracy", "f1_accuracy", "pearson_spearman"]


# ----------------------------------------------------------------------------- GLUE


def accuracy(preds: Sequence[int], labels: Sequence[int]) -> float:
    from sklearn.metrics import accuracy_score  # heavy: sklearn; tasks load at CLI start

    return float(accuracy_score(labels, preds))


def binary_f1(preds: Sequence[int], labels: Sequence[int]) -> float:
    """F1 of the positive class (label 1), as GLUE reports it for MRPC and QQP."""
    from sklearn.metrics import f1_score  # heavy: sklearn; tasks load at CLI start

    return float(f1_score(labels, preds, pos_label=1, average="binary", zero_division=0.0))


def matthews(preds: Sequence[int], labels: Sequence[int]) -> float:
    """Matthews correlation (CoLA); 0.0 when a row or column of the confusion matrix is empty."""
    from sklearn.metrics import matthews_corrcoef  # heavy: sklearn; tasks load at CLI start

    return float(matthews_corrcoef(labels, preds))


def pearson_spearman(preds: Sequence[float], labels: Sequence[float]) -> dict[str, float]:
    """Pearson and Spearman correlation (STS-B); nan when either side is constant."""
    from scipy.stats import pearsonr, spearmanr  # heavy: scipy; tasks load at CLI start

    p, y = np.asarray(preds, dtype=np.float64), np.asarray(labels, dtype=np.float64)
    if len(p) < 2 or np.ptp(p) == 0 or np.ptp(y) == 0:
        return {"pearson": math.nan, "spearman": math.nan}
    return {"pearson": float(pearsonr(p, y)[0]), "spearman": float(spearmanr(p, y)[0])}


def glue_metrics(kind: MetricSet, preds: Sequence, labels: Sequence) -> dict[str, float]:
    """The GLUE metric family ``kind`` on class ids (or scores, for ``pearson_spearman``).

    ``f1_accuracy`` and ``pearson_spearman`` also give ``combined_score``, the mean of the
    two, which is how the GLUE leaderboard averages those tasks.
    """
    if len(preds) != len(labels):
        raise ValueError(f"{len(preds)} predictions for {len(labels)} labels")
    if kind == "mcc":
        return {"mcc": matthews(preds, labels), "accuracy": accuracy(preds, labels)}
    if kind == "accuracy":
        return {"accuracy": accuracy(preds, labels)}
    if kind == "f1_accuracy":
        f1, acc = binary_f1(preds, labels), accuracy(preds, labels)
        return {"f1": f1, "accuracy": acc, "combined_score": (f1 + acc) / 2}
    if kind == "pearson_spearman":
        out = pearson_spearman(preds, labels)
        out["combined_score"] = (out["pearson"] + out["spearman"]) / 2
        return out
    raise ValueError(f"unknown GLUE metric family {kind!r}")


# ----------------------------------------------------------------------------- NER


def ner_metrics(gold: Sequence[Sequence[str]], pred: Sequence[Sequence[str]]) -> dict[str, float]:
    """Entity-level micro precision/recall/F1 (seqeval, conlleval rules) and token accuracy.

    Also ``f1_<TYPE>`` per entity type present in the gold tags.
    """
    from seqeval.metrics import (  # heavy: seqeval (sklearn); tasks load at CLI start
        accuracy_score,
        classification_report,
        f1_score,
        precision_score,
        recall_score,
    )

    gold, pred = [list(g) for g in gold], [list(p) for p in pred]
    for i, (g, p) in enumerate(zip(gold, pred, strict=True)):
        if len(g) != len(p):
            raise ValueError(f"sentence {i}: {len(p)} predicted tags for {len(g)} gold tags")
    out = {
        "precision": float(precision_score(gold, pred, zero_division=0)),
        "recall": float(recall_score(gold, pred, zero_division=0)),
        "f1": float(f1_score(gold, pred, zero_division=0)),
        "accuracy": float(accuracy_score(gold, pred)),
    }
    report = classification_report(gold, pred, output_dict=True, zero_division=0)
    for key, row in report.items():
        if " avg" not in key:
            out[f"f1_{key}"] = float(row["f1-score"])
    return out


# ----------------------------------------------------------------------------- SQuAD
# Transcribed from the official evaluate-v1.1.py / evaluate-v2.0.py scripts.

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower case, drop punctuation, drop articles a/an/the, collapse whitespace (official)."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def squad_exact(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def squad_f1(prediction: str, gold: str, version: Literal["1.1", "2.0"] = "1.1") -> float:
    """Token-overlap F1 after normalisation.

    v2.0: if either side normalises to no tokens, F1 is 1 when both are empty, else 0.
    v1.1 has no such rule: an empty side gives 0.
    """
    p_toks, g_toks = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if version == "2.0" and (not p_toks or not g_toks):
        return float(p_toks == g_toks)
    common = collections.Counter(p_toks) & collections.Counter(g_toks)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p_toks), same / len(g_toks)
    return 2 * precision * recall / (precision + recall)


def _gold_list(answers: Sequence[str], version: str) -> list[str]:
    if version == "2.0":  # v2 drops golds that normalise to nothing; none left = no-answer
        kept = [a for a in answers if normalize_answer(a)]
        return kept or [""]
    return list(answers)


def squad_scores(
    predictions: Mapping[str, str],
    gold_answers: Mapping[str, Sequence[str]],
    version: Literal["1.1", "2.0"] = "1.1",
) -> dict[str, float]:
    """Official scoring: max over gold answers per question, mean over questions, x100.

    Every gold question must have a prediction (a missing one scores 0, as in the official
    scripts). v2.0 also reports ``HasAns_*`` and ``NoAns_*`` breakdowns.
    """
    if not gold_answers:
        raise ValueError("no gold questions to score")
    em, f1, has = {}, {}, {}
    for qid, answers in gold_answers.items():
        golds = _gold_list(answers, version)
        if qid not in predictions:  # the official scripts give it 0 (not the empty answer's
            em[qid] = f1[qid] = 0.0  # score, which matches a gold that normalises to "")
        else:
            pred = predictions[qid]
            em[qid] = max(squad_exact(pred, g) for g in golds)
            f1[qid] = max(squad_f1(pred, g, version) for g in golds)
        has[qid] = bool(answers)  # official: answerable = a non-empty answer list
    out = {"exact_match": 100 * _mean(em.values()), "f1": 100 * _mean(f1.values())}
    if version == "2.0":
        for tag, want in (("HasAns", True), ("NoAns", False)):
            ids = [q for q in em if has[q] == want]
            if ids:
                out[f"{tag}_exact"] = 100 * _mean(em[q] for q in ids)
                out[f"{tag}_f1"] = 100 * _mean(f1[q] for q in ids)
    return out


def best_null_threshold(
    answer_texts: Mapping[str, str],
    null_diffs: Mapping[str, float],
    gold_answers: Mapping[str, Sequence[str]],
) -> dict[str, float]:
    """SQuAD v2 ``best_f1`` / ``best_exact`` and their thresholds (official find_best_thresh).

    ``answer_texts``: best non-null answer per question; ``null_diffs``: null score minus best
    span score (predict "no answer" when it exceeds the threshold).
    """
    out = {}
    for name, fn in (("exact", squad_exact), ("f1", lambda p, g: squad_f1(p, g, "2.0"))):
        has = {q: bool(a) for q, a in gold_answers.items()}
        raw = {
            q: max(fn(answer_texts.get(q, ""), g) for g in _gold_list(a, "2.0"))
            for q, a in gold_answers.items()
        }
        cur = best = float(sum(not h for h in has.values()))
        thresh = 0.0
        for q in sorted(raw, key=lambda k: null_diffs.get(k, 0.0)):
            if has[q]:
                cur += raw[q]
            else:
                cur += -1.0 if answer_texts.get(q, "") else 0.0
            if cur > best:
                best, thresh = cur, null_diffs.get(q, 0.0)
        out[f"best_{name}"] = 100 * best / len(raw)
        out[f"best_{name}_thresh"] = float(thresh)
    return out


def _mean(values) -> float:
    vals = list(values)
    return sum(vals) / len(vals)


# ----------------------------------------------------------------------------- MLM


def perplexity(nll_sum: float, count: int) -> dict[str, float]:
    """Mean masked-token loss (nats) and its exponential; count = number of predicted tokens."""
    if count <= 0:
        raise ValueError("no masked tokens were scored; the evaluation set is empty")
    loss = nll_sum / count
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0))}


def argmax_accuracy(predictions: Sequence[Any], features: Sequence[Mapping[str, Any]]
                    ) -> dict[str, float]:
    """``{"accuracy": ...}`` of one logits row per feature against its ``labels``."""
    if len(predictions) != len(features):
        raise ValueError(f"{len(predictions)} predictions for {len(features)} features")
    preds = [int(np.asarray(p).reshape(-1).argmax()) for p in predictions]
    return {"accuracy": accuracy(preds, [f["labels"] for f in features])}

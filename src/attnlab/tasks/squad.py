"""SQuAD v1.1 / v2.0 extractive question answering.

Loading: the official JSON (``train-v1.1.json``, ``dev-v1.1.json``, ``*-v2.0.json``) from
``data_dir`` (the shared root, its ``squad/`` folder, or a JSON file path read as is). Every
``answer_start`` must point at its answer text; anything else raises DataFormatError.

Only SQuAD v1.1 dev is staged here, so the task also offers ``dev_train`` / ``dev_eval``:
the dev file's articles split by title, deterministically (``split_articles``: sort titles,
shuffle with ``random.Random(split_seed)``, first ``round(eval_fraction * n)`` go to
``dev_eval``; 48 articles -> 36 train / 12 eval with the defaults). Questions of one article
never straddle the two parts. Use it as ``dataclasses.replace(task, train_split="dev_train",
eval_splits=("dev_eval",))``.

Features: question first, context second, ``truncation="only_second"``,
``return_overflowing_tokens`` with ``stride`` tokens of overlap between windows, and offsets.
A window whose context does not hold the whole (first) answer, or a v2 question without
answer, is labelled with the [CLS] position 0. Metadata: ``example_index`` and
``offset_mapping`` (character spans, None outside the context).

Post-processing: per example, the best span over all its windows among the ``n_best`` top
start and end logits, with ``start <= end`` and at most ``max_answer_length`` tokens, scored
``start_logit + end_logit``. v2: "no answer" when the smallest [CLS] score over the windows
exceeds the best span score by more than ``null_threshold``.
"""

from __future__ import annotations

import json
import math
import random
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from .base import (
    BUILTIN,
    MODEL_INPUT_KEYS,
    DataFormatError,
    Feature,
    HeadType,
    ProblemType,
    canonical_split,
    find_dir,
    padding_collator,
    register_task,
    require_fast,
    unpad,
)
from .metrics import best_null_threshold, squad_scores


@dataclass(frozen=True)
class SquadExample:
    """One question. ``answers``/``answer_starts`` are empty for v2 unanswerable questions."""

    id: str
    title: str
    context: str
    question: str
    answers: tuple[str, ...]
    answer_starts: tuple[int, ...]
    is_impossible: bool = False


def read_squad(path: Path) -> list[SquadExample]:
    """Parse official SQuAD JSON (v1.1 or v2.0) into one example per question."""
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except json.JSONDecodeError as e:
        raise DataFormatError(path, e.lineno, f"broken JSON: {e.msg} (column {e.colno})") from None
    out: list[SquadExample] = []

    def need(obj: Any, key: str, kind: type, where: str) -> Any:
        if not isinstance(obj, dict) or not isinstance(obj.get(key), kind):
            raise DataFormatError(path, None, f"{where}: missing or bad {key!r} "
                                              f"(expected {kind.__name__})")
        return obj[key]

    for a, art in enumerate(need(doc, "data", list, "top level")):
        title = art.get("title", f"article{a}") if isinstance(art, dict) else ""
        for p, par in enumerate(need(art, "paragraphs", list, f"data[{a}]")):
            where_p = f"data[{a}].paragraphs[{p}]"
            context = need(par, "context", str, where_p)
            for q, qa in enumerate(need(par, "qas", list, where_p)):
                where = f"{where_p}.qas[{q}]"
                impossible = isinstance(qa, dict) and bool(qa.get("is_impossible", False))
                texts, starts = [], []
                for k, ans in enumerate(need(qa, "answers", list, where)):
                    text = need(ans, "text", str, f"{where}.answers[{k}]")
                    start = need(ans, "answer_start", int, f"{where}.answers[{k}]")
                    if context[start:start + len(text)] != text:
                        raise DataFormatError(
                            path, None, f"{where}.answers[{k}]: answer_start {start} does not "
                            f"point at {text!r} in the context"
                        )
                    texts.append(text)
                    starts.append(start)
                if not texts and not impossible:
                    raise DataFormatError(path, None, f"{where}: no answers and not marked "
                                                      "is_impossible")
                out.append(SquadExample(
                    id=str(need(qa, "id", str, where)), title=str(title), context=context,
                    question=need(qa, "question", str, where), answers=tuple(texts),
                    answer_starts=tuple(starts), is_impossible=impossible,
                ))
    return out


def split_articles(titles: Sequence[str], eval_fraction: float = 0.25, seed: int = 0
                   ) -> tuple[frozenset[str], frozenset[str]]:
    """Deterministic ``(train_titles, eval_titles)`` split of article titles."""
    if not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    order = sorted(set(titles))
    random.Random(seed).shuffle(order)
    n_eval = min(len(order) - 1, max(1, round(eval_fraction * len(order))))
    return frozenset(order[n_eval:]), frozenset(order[:n_eval])


def postprocess(examples: Sequence[SquadExample], features: Sequence[Feature],
                predictions: Sequence[tuple[Any, Any]], n_best: int = 20,
                max_answer_length: int = 30) -> tuple[dict[str, str], dict[str, float]]:
    """Best non-null span text per question id, and its null-score difference.

    ``predictions[i] = (start_logits [n_i], end_logits [n_i])`` for ``features[i]``.
    The difference is ``min over windows of (start[0] + end[0]) - best span score``
    (+inf when no valid span exists).
    """
    if len(predictions) != len(features):
        raise ValueError(f"{len(predictions)} predictions for {len(features)} features")
    by_example: dict[int, list[int]] = defaultdict(list)
    for i, f in enumerate(features):
        by_example[f["example_index"]].append(i)
    texts, diffs = {}, {}
    for e, ex in enumerate(examples):
        best_score, best_text, min_null = -math.inf, "", math.inf
        for i in by_example.get(e, []):
            start, end = (np.asarray(x, dtype=np.float64) for x in predictions[i])
            offsets = features[i]["offset_mapping"]
            if not len(start) == len(end) == len(offsets):
                raise ValueError(f"feature {i}: logits of length {len(start)}/{len(end)} for "
                                 f"{len(offsets)} tokens")
            min_null = min(min_null, start[0] + end[0])  # [CLS] sits at position 0
            top_s = np.argsort(start)[::-1][:n_best]
            top_e = np.argsort(end)[::-1][:n_best]
            for s in top_s:
                if offsets[s] is None:
                    continue
                for t in top_e:
                    if offsets[t] is None or t < s or t - s + 1 > max_answer_length:
                        continue
                    score = start[s] + end[t]
                    if score > best_score:
                        best_score = score
                        best_text = ex.context[offsets[s][0]:offsets[t][1]]
        texts[ex.id] = best_text
        diffs[ex.id] = min_null - best_score if best_score > -math.inf else math.inf
    return texts, diffs


def _cut_contexts(examples: Sequence[SquadExample], reached: Sequence[int],
                  tokenizer: Any) -> list[tuple[int, int]]:
    """(example index, character where its last token ends) for each context whose windows
    stop before its last token. Only contexts whose windows stop before their last non-space
    character are tokenized again (normally none)."""
    maybe = [i for i, e in enumerate(examples) if reached[i] < len(e.context.rstrip())]
    if not maybe:
        return []
    spans = tokenizer([examples[i].context for i in maybe], add_special_tokens=False,
                      return_offsets_mapping=True, verbose=False)["offset_mapping"]
    return [(i, o[-1][1]) for i, o in zip(maybe, spans, strict=True)
            if o and reached[i] < o[-1][1]]


def _check_windows_cover(examples: Sequence[SquadExample], reached: Sequence[int],
                         tokenizer: Any) -> None:
    """The windows of each example must reach its context's last token. tokenizers 0.23.1 and
    0.23.2 stop tokenizing a truncated pair early and drop the tail of long contexts from the
    overflowing windows (huggingface/tokenizers#2091): fail loudly rather than train and
    evaluate on cut contexts."""
    short = _cut_contexts(examples, reached, tokenizer)
    if short:
        i, end = short[0]
        import tokenizers  # only for its version in this error message

        raise RuntimeError(
            f"{len(short)} of {len(examples)} SQuAD contexts lost their end in the tokenizer's "
            f"overflowing windows (e.g. question {examples[i].id!r}: the windows stop at "
            f"character {reached[i]} of {end}). tokenizers {tokenizers.__version__} "
            "drops the tail of truncated pairs (tokenizers 0.23.1-0.23.2, "
            "huggingface/tokenizers#2091); fix: pip install -U 'tokenizers>=0.23.3'"
        )


@dataclass(frozen=True, kw_only=True)
class SquadTask:
    """Extractive QA on SQuAD; ``num_labels`` is 2 (start and end logits), as in HF configs."""

    name: str = "squad"
    version: Literal["1.1", "2.0"] = "1.1"
    splits: tuple[str, ...] = ("train", "dev", "dev_train", "dev_eval")
    train_split: str = "train"
    eval_splits: tuple[str, ...] = ("dev",)
    stride: int | None = None  # window overlap in tokens; None = max_length // 3 (128 at 384)
    n_best: int = 20  # top start / end logits searched per window
    max_answer_length: int = 30  # in tokens
    null_threshold: float = 0.0  # v2: predict no answer when null - best span > this
    eval_fraction: float = 0.25  # share of dev articles in dev_eval
    split_seed: int = 0
    main_metric: str = "f1"
    greater_is_better: bool = True
    head: HeadType = "question-answering"
    num_labels: int = 2
    label_names: tuple[str, ...] = ()
    problem_type: ProblemType | None = None

    def load(self, split: str, data_dir: str | Path | None = None) -> list[SquadExample]:
        split = canonical_split(split, self.splits, self.name)
        if data_dir is None or str(data_dir) == BUILTIN:
            raise ValueError(
                f"task {self.name!r} reads local files only: pass data_dir with "
                f"dev-v{self.version}.json (e.g. ../shared/data or ../shared/data/squad)"
            )
        source = "train" if split == "train" else "dev"
        if Path(data_dir).is_file():
            path = Path(data_dir)
        else:
            fname = f"{source}-v{self.version}.json"
            path = find_dir(data_dir, ["", "squad"], fname, f"{self.name} {split}") / fname
        examples = read_squad(path)
        if split in ("dev_train", "dev_eval"):
            train, held = split_articles([e.title for e in examples], self.eval_fraction,
                                         self.split_seed)
            keep = train if split == "dev_train" else held
            examples = [e for e in examples if e.title in keep]
        return examples

    def encode(self, examples: Sequence[SquadExample], tokenizer: Any, max_length: int
               ) -> list[Feature]:
        """Sliding windows over each context; one feature per window."""
        feats, reached = self._windows(examples, tokenizer, max_length)
        _check_windows_cover(examples, reached, tokenizer)
        return feats

    def window_coverage(self, examples: Sequence[SquadExample], tokenizer: Any,
                        max_length: int) -> dict[str, int]:
        """What the windows of ``examples`` hold, without ``encode``'s refusal: questions,
        windows, contexts whose windows stop before their last token, and answered questions
        whose first answer lies whole in no window (training gives them [CLS] targets and
        evaluation cannot predict them). The counts behind huggingface/tokenizers#2091's
        effect (``attnlab data squad-windows``)."""
        feats, reached = self._windows(examples, tokenizer, max_length)
        inside = {f["example_index"] for f in feats if f["start_positions"] > 0}
        return {"questions": len(examples), "windows": len(feats),
                "cut_contexts": len(_cut_contexts(examples, reached, tokenizer)),
                "answers_in_no_window": sum(1 for i, e in enumerate(examples)
                                            if e.answers and i not in inside)}

    def _windows(self, examples: Sequence[SquadExample], tokenizer: Any, max_length: int
                 ) -> tuple[list[Feature], list[int]]:
        """(features, per example the last context character a window holds)."""
        require_fast(tokenizer, self.name)
        if not examples:
            return [], []
        stride = self.stride if self.stride is not None else max_length // 3
        questions = [e.question.lstrip() for e in examples]
        longest = max(len(q) for q in tokenizer(questions, add_special_tokens=False)["input_ids"])
        room = max_length - longest - tokenizer.num_special_tokens_to_add(pair=True)
        if stride >= room:  # the tokenizer would panic (a BaseException) instead
            raise ValueError(
                f"stride {stride} must be smaller than the context room of a window: {room} "
                f"tokens = max_length {max_length} - longest question {longest} - special "
                "tokens; lower the task's stride or raise max_length"
            )
        enc = tokenizer(
            questions, [e.context for e in examples],
            truncation="only_second", max_length=max_length, stride=stride,
            return_overflowing_tokens=True, return_offsets_mapping=True,
        )
        keys = [k for k in enc.keys() if k in MODEL_INPUT_KEYS]
        feats = []
        reached = [0] * len(examples)  # per example: the last context character a window holds
        for i, offsets in enumerate(enc["offset_mapping"]):
            ex_idx = enc["overflow_to_sample_mapping"][i]
            ex = examples[ex_idx]
            seq = enc.sequence_ids(i)
            ctx = [j for j, s in enumerate(seq) if s == 1]
            if ctx:
                reached[ex_idx] = max(reached[ex_idx], offsets[ctx[-1]][1])
            start_pos = end_pos = 0
            if ex.answers and ctx:
                a0 = ex.answer_starts[0]
                a1 = a0 + len(ex.answers[0])
                first, last = ctx[0], ctx[-1]
                if offsets[first][0] <= a0 and offsets[last][1] >= a1:
                    start_pos = first
                    while start_pos <= last and offsets[start_pos][0] <= a0:
                        start_pos += 1
                    start_pos -= 1
                    end_pos = last
                    while end_pos >= first and offsets[end_pos][1] >= a1:
                        end_pos -= 1
                    end_pos += 1
            f: Feature = {k: enc[k][i] for k in keys}
            spans = [tuple(o) if s == 1 else None for o, s in zip(offsets, seq, strict=True)]
            f.update(start_positions=start_pos, end_positions=end_pos, example_index=ex_idx,
                     offset_mapping=spans)
            feats.append(f)
        return feats, reached

    def collator(self, tokenizer: Any, seed: int = 0) -> Callable[[list[Feature]], dict]:
        return padding_collator(tokenizer)

    def batch_predictions(self, outputs: Mapping[str, Any], batch: Mapping[str, Any]) -> list:
        """``(start_logits [n_i], end_logits [n_i])`` per feature."""
        starts = unpad(outputs["start_logits"], batch)
        ends = unpad(outputs["end_logits"], batch)
        return list(zip(starts, ends, strict=True))

    def answers(self, predictions: Sequence[Any], features: Sequence[Feature],
                examples: Sequence[SquadExample]) -> dict[str, str]:
        """Final answer text per question id (v2: "" when the null score wins)."""
        return self._answers(predictions, features, examples)[0]

    def _answers(self, predictions, features, examples):
        texts, diffs = postprocess(examples, features, predictions, self.n_best,
                                   self.max_answer_length)
        if self.version == "2.0":
            final = {q: ("" if diffs[q] > self.null_threshold else t) for q, t in texts.items()}
        else:
            final = texts
        return final, texts, diffs

    def compute_metrics(self, predictions: Sequence[Any], features: Sequence[Feature],
                        examples: Sequence[SquadExample]) -> dict[str, float]:
        """Official EM / F1 in percent (v2: plus HasAns/NoAns and best-threshold scores)."""
        final, texts, diffs = self._answers(predictions, features, examples)
        gold = {ex.id: ex.answers for ex in examples}
        out = squad_scores(final, gold, self.version)
        if self.version == "2.0":
            out.update(best_null_threshold(texts, diffs, gold))
        return out


SQUAD = register_task(SquadTask())
SQUAD_V2 = register_task(SquadTask(name="squad_v2", version="2.0"))

"""What a run trains and evaluates on, and how it evaluates: the seeded training subset
(``subset``), the evaluation splits (``eval_splits_of``), the evaluator over them
(``make_evaluator``) and the warning for a model that learned one class
(``degenerate_warning``). Shared by ``attnlab run`` (``recipes.finetune``), ``attnlab tlm``
(``recipes.tlm_train``), ``attnlab eval`` and head importance (``recipes.importance``).
"""

from __future__ import annotations

import random

import torch

from ..config import ExperimentConfig


def subset(examples: list, fraction: float, limit: int | None, seed: int) -> list:
    """Seeded fraction of ``examples`` (order kept), then the first ``limit``."""
    if fraction < 1.0:
        keep = sorted(random.Random(seed).sample(range(len(examples)),
                                                 max(1, round(fraction * len(examples)))))
        examples = [examples[i] for i in keep]
    return examples[:limit] if limit is not None else examples


def make_evaluator(task, splits: dict[str, tuple[list, list]], tokenizer, seed: int,
                   batch_size: int):
    """evaluate(model) -> metrics; with several eval splits, names get a ``split/`` prefix.

    A fresh collator per evaluation, seeded the same, so masked-LM masks are identical in
    every evaluation. For single-label classification, ``evaluate.one_class`` gets, per
    call, whether every prediction of some split was the same class (see
    :func:`degenerate_warning`).
    """
    classify = (task.head == "sequence-classification"
                and getattr(task, "problem_type", None) == "single_label_classification")

    one_class_log: list[bool] = []  # evaluate.one_class: one entry per evaluation

    def evaluate(model: torch.nn.Module) -> dict[str, float]:
        device = next(model.parameters()).device
        result: dict[str, float] = {}
        one_class = False
        for split, (examples, features) in splits.items():
            collate = task.collator(tokenizer, seed=seed)
            preds: list = []
            for i in range(0, len(features), batch_size):
                batch = collate(features[i : i + batch_size])
                batch = {k: v.to(device) for k, v in batch.items()}
                preds += task.batch_predictions(model(**batch), batch)
            metrics = task.compute_metrics(preds, features, examples)
            if classify and len(preds) > 1:
                one_class |= len({int(torch.as_tensor(p).argmax()) for p in preds}) == 1
            if len(splits) == 1:
                result.update(metrics)
            else:
                result.update({f"{split}/{k}": v for k, v in metrics.items()})
        one_class_log.append(one_class)
        return result

    evaluate.one_class = one_class_log  # type: ignore[attr-defined]  # read by the runner
    return evaluate


def degenerate_warning(one_class: list[bool], evals: list[dict], best_step: int | None,
                       steps: int, lr: float, *, by_steps: bool = False,
                       section: str = "train", lr_key: str = "optim.lr") -> str | None:
    """A message when the kept model predicted one class for every dev example (MCC 0, the
    majority-class accuracy), else None. ``one_class`` holds this process's evaluations:
    the last ``len(one_class)`` of ``evals``, or, after a finalize (Diff-Prune), more than
    ``evals`` with the reported model's last. The fix names the config's own keys:
    ``{section}.max_steps`` when ``by_steps`` (the run's length is set by it, not by
    ``{section}.epochs``), and ``lr_key``."""
    if not one_class:
        return None
    if len(one_class) > len(evals):  # finalized: the last evaluation is the result
        kept = one_class[-1]
    else:
        mine = evals[len(evals) - len(one_class):]
        at_best = [o for o, e in zip(one_class, mine, strict=True) if e["step"] == best_step]
        kept = (at_best or one_class[-1:])[0]
    if not kept:
        return None
    more = (f"raise {section}.max_steps, which overrides {section}.epochs" if by_steps
            else f"raise {section}.epochs")
    return (f"the kept model predicts one class for every dev example (after {steps} steps "
            f"at lr {lr:g}): it learned only the majority class. Likely causes: too few "
            f"steps ({more}) or a learning rate too low or too high ({lr_key}).")


def eval_splits_of(cfg: ExperimentConfig, task) -> tuple[str, ...]:
    """The splits a run evaluates on: ``task.eval_split`` if given, else the task's own."""
    return (cfg.task.eval_split,) if cfg.task.eval_split else tuple(task.eval_splits)

"""Plans that choose heads by what they do: resolve ``class:`` and score selectors.

A plan rule may name its heads by a head analysis instead of indices (``hf.plan``'s
:class:`~attnlab.hf.plan.HeadSelector`): ``{layers: all, heads: class:vertical, mechanism:
band(window=8)}``, ``"all:class:vertical:band(window=8)"``, ``"0-2:entropy<1.5:softmax"``.
``hf`` knows no analysis, so this module, a layer above, turns every selector into explicit
indices before ``apply_plan`` sees the plan (which refuses a selector with a one-line error
saying to pass an analysis).

The analysis (``analysis:`` in a config, ``analysis=`` as an override, ``--analysis`` on
``attnlab demo``) is one of

* a ``head_scores.json`` written by ``attnlab analyze heads``, or a folder holding one (the
  analysis folder, or a run folder with ``analysis/``): read, never recomputed;
* ``task:NAME``: computed now by :func:`attnlab.recipes.analyze.analyze_model` on task NAME's
  dev split, on the model the plan is about to change (``task`` alone: the run's own task).

What a selector refers to: the heads of the model as loaded, before any rule of the plan is
applied (an analysis describes the pretrained heads; a saved one may come from any model of the
same shape, which is checked).

Resolution (:func:`resolve_plan`): rule by rule, in order, a selector rule becomes one explicit
rule per group of its layers with the same matched heads, in place, so "later rules win"
keeps its meaning. Class names are those of ``attnlab.analysis`` (``vertical``, ``diagonal``,
``vertical+diagonal``, ``block``, ``heterogeneous``); an unknown one is an error naming the
close matches, as is an unknown score label. A threshold never matches a NaN score (``block``
without sentence pairs). A selector may give its heads only to a mechanism of scope "head"
(one that can share a layer with other mechanisms).

Decision: a selector that matches no head of its layers is an **error**, not a warning: the
run would otherwise compare the untouched model with itself and report it as a result. The
message says what the analysis has instead (its classes and counts, or the score's range).

The resolved plan (explicit indices) is what a run records (``config.yaml``, ``plan.json``,
``summary.json``) and what ``save_pretrained`` writes to ``plan.json``, so a saved model or
run reloads without the analysis. :class:`Selection` is the short table of matched heads that
``attnlab run`` and ``attnlab demo`` print.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..analysis import DEFAULT_SCORERS, HEAD_CLASSES, read_json
from ..config import ConfigError, ExperimentConfig, computed_analysis
from ..core import mechanism_class
from ..core.spec import RegistryError, unknown_name
from ..hf.arch import inspect_model
from ..hf.plan import HeadSelector, Plan, PlanError, Rule
from ..models import model_config
from ..tasks import get_task

ANALYSIS_FILE = "head_scores.json"  # what `attnlab analyze heads` writes


# ----------------------------------------------------------------------------- the analysis


@dataclass(frozen=True)
class HeadTable:
    """The head analysis selectors are resolved against."""

    scores: dict[str, Tensor]  # score label -> [L, H] (NaN: not measured)
    classes: list[list[str]] | None  # [L][H] class names (None: the analysis has none)
    source: str  # where it comes from, for messages and the Selection table

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(next(iter(self.scores.values())).shape)  # type: ignore[return-value]


def analysis_file(path: str | Path) -> Path:
    """``head_scores.json`` itself, or the one in a folder or in a run's ``analysis/``."""
    p = Path(path).expanduser()
    for cand in (p, p / ANALYSIS_FILE, p / "analysis" / ANALYSIS_FILE):
        if cand.is_file():
            return cand
    raise FileNotFoundError(
        f"analysis {str(path)!r}: no {ANALYSIS_FILE} there (looked at the path, in it and in "
        f"its analysis/); write one with `attnlab analyze heads MODEL`, or give task:NAME to "
        "compute it on a task's dev split")


def read_head_table(path: str | Path) -> HeadTable:
    """The scores and classes of a saved ``head_scores.json`` (see :func:`analysis_file`)."""
    file = analysis_file(path)
    try:
        scores, classes = read_json(file)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{file} is not a head_scores.json of `attnlab analyze heads` "
                         f"({type(e).__name__}: {e})") from None
    if not scores:
        raise ValueError(f"{file} holds no scores; re-run `attnlab analyze heads`")
    return HeadTable(scores, classes, str(file))


def task_of(spec: str, own_task: str | None) -> str | None:
    """``"task:NAME"`` -> NAME, ``"task"`` -> ``own_task``; None for a path."""
    if not computed_analysis(spec):
        return None
    if ":" not in spec:
        if own_task is None:
            raise ValueError("analysis 'task' means the run's own task, and there is none "
                             "here; write task:NAME, e.g. task:cola")
        return own_task
    name = spec.split(":", 1)[1].strip()
    get_task(name)  # an unknown task: the registry's error with close matches
    return name


def computed_table(model: torch.nn.Module, tokenizer: Any, task: str, *,
                   data_dir: str | None, max_length: int | None, batch_size: int = 32,
                   name: str = "model") -> HeadTable:
    """Analyse ``model`` on ``task``'s dev split now (``analyze_model``: the same scores and
    classes as ``attnlab analyze heads --task TASK``)."""
    from .analyze import LoadedModel, TextSource, analyze_model  # cycle: analyze -> finetune

    source = TextSource(task=task, data_dir=data_dir, max_length=max_length)
    result = analyze_model(LoadedModel(model, tokenizer, name, name), source,
                           batch_size=batch_size, n_examples=0)
    a = result.analysis
    return HeadTable(dict(a.scores), a.classes,
                     f"{source.describe()} ({a.n_examples} examples, computed now)")


# ----------------------------------------------------------------------------- resolution


@dataclass(frozen=True)
class SelectedRule:
    """The heads one selector rule matched."""

    rule: int  # index of the rule in the plan as written
    text: str  # the rule's compact form
    heads: dict[int, tuple[int, ...]]  # layer -> matched heads (layers with none left out)

    @property
    def count(self) -> int:
        return sum(len(h) for h in self.heads.values())


@dataclass(frozen=True)
class Selection:
    """Which heads the selectors of a plan matched, and in which analysis."""

    source: str  # the analysis
    shape: tuple[int, int]  # (layers, heads) of the analysis and the model
    rules: tuple[SelectedRule, ...]

    def __str__(self) -> str:
        lines = [f"heads chosen by the head analysis of {self.source}:"]
        total = self.shape[0] * self.shape[1]
        for r in self.rules:
            lines.append(f"  plan rule {r.rule} ({r.text}): {r.count} of {total} heads")
            lines += [f"    layer {layer}: heads {', '.join(map(str, heads))}"
                      for layer, heads in r.heads.items()]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"analysis": self.source, "layers": self.shape[0], "heads": self.shape[1],
                "rules": [{"rule": r.rule, "text": r.text,
                           "heads": {str(k): list(v) for k, v in r.heads.items()}}
                          for r in self.rules]}


def _check_scope(rule: Rule, where: str) -> None:
    scope = mechanism_class(rule.mechanism.name).caps.scope
    if scope != "head":
        raise PlanError(f"{where}: {rule.mechanism.name!r} has scope {scope!r} (it takes every "
                        "head of a layer), but a selector picks some heads; give it heads: all")


def _check_names(selector: HeadSelector, where: str, scores: list[str]) -> None:
    """Unknown class or score label: an error naming the close matches."""
    if selector.kind == "class" and selector.name not in HEAD_CLASSES:
        raise PlanError(f"{where}: " + unknown_name("head class", selector.name, HEAD_CLASSES))
    if selector.kind == "score" and selector.name not in scores:
        raise PlanError(f"{where}: " + unknown_name("head score", selector.name, scores))


def _matched(selector: HeadSelector, table: HeadTable, where: str) -> Tensor:
    """bool [L, H]: the heads the selector matches in the table."""
    _check_names(selector, where, list(table.scores))
    if selector.kind == "class":
        if table.classes is None:
            raise PlanError(f"{where}: the head analysis {table.source} has no classes (its "
                            "vertical and diagonal scores are missing); re-run `attnlab analyze "
                            "heads`")
        return torch.tensor([[c == selector.name for c in row] for row in table.classes])
    score = table.scores[selector.name].double()
    return torch.tensor([[selector.matches(float(x)) for x in row] for row in score.tolist()])


def _nothing_matched(selector: HeadSelector, table: HeadTable, layers: list[int],
                     where: str) -> PlanError:
    which = "any layer" if len(layers) == table.shape[0] else f"layers {layers}"
    if selector.kind == "class":
        assert table.classes is not None  # _matched checked it
        counts: dict[str, int] = {}
        for layer in layers:
            for c in table.classes[layer]:
                counts[c] = counts.get(c, 0) + 1
        has = ", ".join(f"{c} {n}" for c, n in sorted(counts.items(), key=lambda x: -x[1]))
        return PlanError(f"{where}: no head in {which} is {selector.name!r} in {table.source} "
                         f"(its heads there: {has}); choose a class it has, or drop the rule")
    vals = table.scores[selector.name].double()[layers].flatten()
    vals = vals[~vals.isnan()]
    if not vals.numel():
        return PlanError(f"{where}: score {selector.name!r} is n/a for every head in {which} "
                         f"in {table.source} (block needs sentence pairs); choose another score")
    return PlanError(f"{where}: no head in {which} has {selector} in {table.source} "
                     f"({selector.name} runs from {float(vals.min()):.3f} to "
                     f"{float(vals.max()):.3f}); change the threshold, or drop the rule")


def resolve_plan(plan: Any, table: HeadTable, *, shape: tuple[int, int] | None = None
                 ) -> tuple[Plan, Selection]:
    """``plan`` (anything ``Plan.parse`` takes) with every selector replaced by explicit
    indices from ``table``, and the :class:`Selection` of matched heads. ``shape``: the
    model's (layers, heads), which must be the analysis's."""
    plan = Plan.parse(plan)
    L, H = table.shape
    if shape is not None and tuple(shape) != (L, H):
        raise PlanError(
            f"the head analysis {table.source} has {L} layers x {H} heads but the model has "
            f"{shape[0]} x {shape[1]}; analyse this model (`attnlab analyze heads MODEL`) or "
            "give task:NAME to compute the analysis on it")
    rules: list[Rule] = []
    picks: list[SelectedRule] = []
    for pos, rule in enumerate(plan.rules):
        selector = rule.selector
        if selector is None:
            rules.append(rule)
            continue
        where = f"plan rule {pos} ({rule.describe()})"
        _check_scope(rule, where)
        layers = list(range(L)) if rule.layers == "all" else list(rule.layers)
        bad = [layer for layer in layers if layer >= L]
        if bad:
            raise PlanError(f"{where}: layer index {bad[0]} is out of range; the model has {L} "
                            f"layers (valid layer indices 0-{L - 1}). Fix the rule's layers.")
        hit = _matched(selector, table, where)  # [L, H]
        chosen = {layer: tuple(int(h) for h in hit[layer].nonzero().flatten().tolist())
                  for layer in layers}
        chosen = {layer: heads for layer, heads in chosen.items() if heads}
        if not chosen:
            raise _nothing_matched(selector, table, layers, where)
        groups: dict[tuple[int, ...], list[int]] = {}
        for layer, heads in chosen.items():
            groups.setdefault(heads, []).append(layer)
        for heads, group in groups.items():  # first-seen order: by first layer
            rules.append(Rule(tuple(group), heads, rule.mechanism))
        picks.append(SelectedRule(pos, rule.describe(), chosen))
    return Plan(tuple(rules)), Selection(table.source, (L, H), tuple(picks))


def missing_analysis(plan: Plan, *, option: str = "analysis:", own_task: bool = True) -> str:
    """The one-line message for a plan with selectors and no analysis: ``option`` is how
    the caller takes one (a config's ``analysis:``, ``attnlab demo``'s ``--analysis``);
    ``task`` alone is offered only where there is a task of one's own (a run)."""
    pos, rule = next((i, r) for i, r in enumerate(plan.rules) if r.selector is not None)
    tasks = "task / task:NAME" if own_task else "task:NAME"
    return (f"plan rule {pos} ({rule.describe()}) chooses heads by a head analysis "
            f"({rule.selector}); set {option} to a head_scores.json of `attnlab analyze "
            f"heads` (or its folder), or {tasks} to compute it on a dev split")


def resolve_for_model(plan: Any, model: torch.nn.Module, tokenizer: Any,
                      analysis: str | None, *, own_task: str | None = None,
                      data_dir: str | None = None, max_length: int | None = None,
                      batch_size: int = 32, name: str = "model", option: str = "analysis="
                      ) -> tuple[Plan, Selection | None]:
    """The plan for an in-memory ``model`` (``attnlab demo``, scripts): resolved against the
    ``analysis`` file, or against an analysis of ``model`` itself computed on a task's dev
    split (``task:NAME``); a plan without selectors comes back as it is. ``option`` names
    the caller's way to give the analysis, for the error when there is none."""
    plan = Plan.parse(plan)
    if not plan.selective:
        return plan, None
    if analysis is None:
        raise PlanError(missing_analysis(plan, option=option, own_task=own_task is not None))
    host = inspect_model(model)
    task = task_of(analysis, own_task)
    table = (read_head_table(analysis) if task is None else
             computed_table(model, tokenizer, task, data_dir=data_dir, max_length=max_length,
                            batch_size=batch_size, name=name))
    return resolve_plan(plan, table, shape=(host.num_layers, host.num_heads))


# ----------------------------------------------------------------------------- runs


def config_shape(model_name: str) -> tuple[int, int]:
    """(layers, heads) of a model named in a config, from its config alone."""
    cfg = model_config(model_name)
    return int(cfg.num_hidden_layers), int(cfg.num_attention_heads)


def check_run_selectors(cfg: ExperimentConfig) -> Plan | None:
    """``preflight``: refuse a selector plan that cannot be resolved, and return the plan to
    check against the model's config: resolved when the analysis is a file; without its
    selector rules when the analysis will be computed (which heads they get is known only
    then; their names and scopes are checked now)."""
    plan = Plan.parse(cfg.plan) if cfg.plan else None
    task = None
    if cfg.analysis is not None:  # checked even when no rule needs it: a typo is caught
        try:
            task = task_of(cfg.analysis, cfg.task.name)
        except (ValueError, RegistryError) as e:
            raise ConfigError(f"analysis {cfg.analysis!r}: {e}") from None
        if task is None and not Path(cfg.analysis).expanduser().exists():
            raise ConfigError(f"analysis {cfg.analysis!r}: no such file or folder; give a "
                              "head_scores.json of `attnlab analyze heads` (or its folder), "
                              "or task:NAME")
    if plan is None or not plan.selective:
        return plan
    if cfg.analysis is None:
        raise ConfigError(missing_analysis(plan))
    if task is None:
        table = read_head_table(cfg.analysis)
        return resolve_plan(plan, table, shape=config_shape(cfg.model.name))[0]
    for pos, rule in enumerate(plan.rules):
        if rule.selector is not None:
            where = f"plan rule {pos} ({rule.describe()})"
            _check_scope(rule, where)
            _check_names(rule.selector, where, list(DEFAULT_SCORERS))
    return Plan(tuple(r for r in plan.rules if r.selector is None))


def resolve_run_plan(cfg: ExperimentConfig) -> tuple[ExperimentConfig, Selection | None]:
    """``cfg`` with its plan's selectors resolved (explicit indices in ``cfg.plan``, which
    ``config.yaml``, ``plan.json`` and the summary then record), and the Selection; ``cfg``
    itself when the plan has no selector. A computed analysis (``task``/``task:NAME``) runs on
    the model the run starts from: built as the run builds it, with the run's seed."""
    plan = check_run_selectors(cfg)  # refuses what cannot be resolved
    if plan is None or not Plan.parse(cfg.plan).selective:
        return cfg, None
    assert cfg.analysis is not None  # check_run_selectors refused the plan without one
    full = Plan.parse(cfg.plan)
    task = task_of(cfg.analysis, cfg.task.name)
    if task is None:
        table = read_head_table(cfg.analysis)
        shape = config_shape(cfg.model.name)
    else:
        from accelerate.utils import set_seed

        from .runmodel import build_model

        set_seed(cfg.seed)  # the init the run starts from (a scratch encoder, a new head)
        model, tok = build_model(cfg, get_task(cfg.task.name))
        table = computed_table(model.eval(), tok, task,
                               data_dir=cfg.task.data_dir if task == cfg.task.name else None,
                               max_length=cfg.model.max_length, batch_size=cfg.eval.batch_size,
                               name=cfg.model.name)
        host = inspect_model(model)
        shape = (host.num_layers, host.num_heads)
        del model
    resolved, selection = resolve_plan(full, table, shape=shape)
    analysis = cfg.analysis if task is not None else str(analysis_file(cfg.analysis).resolve())
    return dataclasses.replace(cfg, plan=resolved.to_list(), analysis=analysis), selection


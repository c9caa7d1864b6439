"""``attnlab analyze heads`` and ``attnlab report``: head analysis of a model, top to bottom.

Load the model (the embedded MiniLM ``"default"``, a run directory rebuilt with its plan,
tuner and weights, or a saved model folder); tokenize a task split or a text file; per
batch, ``capture_attention`` feeds the streaming ``HeadScoreAccumulator`` and the chosen
heads' average maps; then classify the heads and write tables (CSV, JSON, Markdown) and
figures (PNG + SVG).

``compare_analyses`` puts two models' class maps side by side (how TLM compared task-driven
and pretrained models); ``run_report`` writes a run's one-file HTML report, reusing the
run's ``analysis/`` folder when present and analysing a small dev sample otherwise.

A head's average map uses only the examples of the most common length (the longest among
ties): maps of different lengths share no positions, and resizing them would smear the
[CLS]/[SEP] columns that make a head vertical. Axis labels show a token where all agree.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from ..analysis import (
    DEFAULT_SCORERS,
    ClassRule,
    HeadAnalysis,
    HeadScoreAccumulator,
    class_counts,
    classify_heads,
    to_csv,
    to_json,
    token_infos,
)
from ..analysis.plots import (
    attention_map,
    class_count_bars,
    class_map,
    class_share_comparison,
    compare_class_maps,
    save_figure,
    score_heatmap,
)
from ..config import ExperimentConfig
from ..hf.arch import UnsupportedModelError, inspect_model
from ..hf.capture import capture_attention
from ..io import atomic_write
from ..models import load_model as load_hf_model
from ..tasks import get_task, read_texts
from .naming import run_label, safe_name  # re-exported: cli_analyze and connections use them
from .quickstart import SHARED_DATA
from .rundir import is_tlm_run
from .runmodel import load_run_model

T = TypeVar("T")
# progress(iterable, total, description) -> the same items; the CLI passes a rich bar.
Progress = Callable[[Iterable[T], int, str], Iterable[T]]
INPUT_KEYS = ("input_ids", "attention_mask", "token_type_ids")
# Scores that are shares or probability mass (colour scale fixed to [0, 1] in heatmaps).
UNIT_SCORES = {"vertical", "vertical_tlm", "vertical_pasta", "diagonal", "block",
               "special_mass", "prev_mass", "next_mass"}
SUMMARY_SCORES = ("vertical", "vertical_pasta", "vertical_tlm", "diagonal", "entropy")
ANALYSIS_DIR = "analysis"


def _no_progress(items: Iterable[T], total: int, description: str) -> Iterable[T]:
    return items


# ----------------------------------------------------------------------------- heads spec


def parse_heads(spec: str | None) -> list[tuple[int, int]]:
    """``"0:3,2:7"`` -> [(0, 3), (2, 7)] (layer:head, 0-based, duplicates dropped)."""
    if spec is None or not spec.strip():
        return []
    out: list[tuple[int, int]] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", part)
        if m is None:
            raise ValueError(
                f"bad --heads entry {part.strip()!r}: expected LAYER:HEAD pairs of 0-based "
                "integers separated by commas, e.g. --heads 0:3,2:7"
            )
        pair = (int(m.group(1)), int(m.group(2)))
        if pair not in out:
            out.append(pair)
    return out


def check_heads(heads: Sequence[tuple[int, int]], n_layers: int, n_heads: int) -> None:
    """Error naming the first head that the model does not have."""
    for layer, head in heads:
        if layer >= n_layers or head >= n_heads:
            raise ValueError(
                f"head {layer}:{head} is out of range: the model has layers 0-{n_layers - 1} "
                f"and heads 0-{n_heads - 1} per layer"
            )


# ----------------------------------------------------------------------------- the model


@dataclass
class LoadedModel:
    """A model to analyse, with where it came from."""

    model: torch.nn.Module
    tokenizer: Any
    name: str  # short label for titles and folder names
    source: str  # as given: "default", a run directory or a model folder
    run_dir: Path | None = None  # set for finished attnlab runs
    config: ExperimentConfig | None = None  # the run's config (runs only)


def is_run_dir(path: Path) -> bool:
    return (path / "config.yaml").is_file() and not (path / "config.json").is_file()


def load_model(spec: str) -> LoadedModel:
    """``"default"`` (the embedded MiniLM), a run directory, or a saved model folder."""
    if spec == "default":
        model, tok = load_hf_model("default")
        return LoadedModel(model.eval(), tok, "default", spec)
    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(
            f"{spec} does not exist; pass 'default' (the embedded MiniLM), a finished run "
            "directory (runs/<name>/ with config.yaml and tuned.safetensors) or a saved model "
            "folder (config.json + weights)"
        )
    name = run_label(path)
    if is_run_dir(path) and is_tlm_run(path):  # attnlab tlm train: the encoder
        from .tlm_train import load_tlm_run

        tlm, tok = load_tlm_run(path)
        return LoadedModel(tlm.encoder, tok, name, spec, run_dir=path)
    if is_run_dir(path):
        model, tok, cfg = load_run_model(path)
        return LoadedModel(_capturable(model), tok, name, spec, run_dir=path, config=cfg)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{spec} is neither a run directory (no config.yaml) nor a "
                                "saved model folder (no config.json)")
    model, tok = load_hf_model(str(path))  # a plan.json beside it is re-applied
    return LoadedModel(model.eval(), tok, name, spec)


def _capturable(model: torch.nn.Module) -> torch.nn.Module:
    """LoRA runs: merge the low-rank updates into the weights (same outputs, to 1e-8 in our
    check) because ``inspect_model`` does not recognise peft's wrapped q/v projections."""
    try:
        inspect_model(model)
    except UnsupportedModelError:
        if not callable(getattr(model, "merge_and_unload", None)):
            raise
        return model.merge_and_unload().eval()  # type: ignore[operator]  # HF method
    return model


# ----------------------------------------------------------------------------- the text


@dataclass(frozen=True)
class TextSource:
    """Where the sentences come from: a task split, or a text file when ``text_file`` is set."""

    task: str = "cola"  # registered task name (attnlab.tasks)
    split: str | None = None  # None: the task's first eval split (dev)
    data_dir: str | None = None  # None: ../shared/data when present, else "builtin"
    text_file: str | None = None  # one sentence per line (.jsonl: {"text": ...} per line)
    limit: int | None = None  # first N examples only
    max_length: int | None = None  # tokens per example (truncated); None: a run's, else 128

    def resolved_data_dir(self) -> str:
        if self.data_dir is not None:
            return self.data_dir
        return str(SHARED_DATA) if (SHARED_DATA / "glue").is_dir() else "builtin"

    def describe(self) -> str:
        if self.text_file is not None:
            return f"text file {self.text_file}"
        return f"{self.task} {self.split or 'dev'} from {self.resolved_data_dir()}"


def load_features(source: TextSource, tokenizer: Any) -> list[dict[str, list[int]]]:
    """Tokenized examples (model inputs only), in the source's order."""
    if source.limit is not None and source.limit < 1:
        raise ValueError(f"--limit must be at least 1, got {source.limit}")
    max_length = 128 if source.max_length is None else source.max_length
    if max_length < 3:
        raise ValueError(f"--max-length must be at least 3, got {max_length}")
    if source.text_file is not None:
        path = Path(source.text_file)
        if path.is_dir():
            raise IsADirectoryError(f"text file {path} is a folder; give a .txt file (one "
                                    'sentence per line) or a .jsonl file ({"text": ...} per '
                                    "line)")
        if not path.is_file():
            raise FileNotFoundError(f"text file {path} does not exist")
        texts = [t.text for t in read_texts(path)][: source.limit]
        if not texts:
            raise ValueError(f"text file {path} has no non-empty lines")
        enc = tokenizer(texts, truncation=True, max_length=max_length)
        feats = [{k: enc[k][i] for k in INPUT_KEYS if k in enc} for i in range(len(texts))]
    else:
        task = get_task(source.task)
        split = source.split or task.eval_splits[0]
        examples = task.load(split, source.resolved_data_dir())[: source.limit]
        feats = [{k: f[k] for k in INPUT_KEYS if k in f}
                 for f in task.encode(examples, tokenizer, max_length)]
    feats = feats[: source.limit]
    if not feats:
        raise ValueError(f"no examples in {source.describe()}")
    return feats


def batches(feats: Sequence[dict[str, list[int]]], tokenizer: Any, batch_size: int
            ) -> list[tuple[list[int], dict[str, torch.Tensor]]]:
    """(original indices, padded batch); examples sorted by length so padding stays small.

    Scores are per-example means, so the order does not change them.
    """
    if batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch_size}")
    order = sorted(range(len(feats)), key=lambda i: -len(feats[i]["input_ids"]))
    out = []
    for k in range(0, len(order), batch_size):
        idx = order[k : k + batch_size]
        out.append((idx, tokenizer.pad([feats[i] for i in idx], return_tensors="pt")))
    return out


# ----------------------------------------------------------------------------- the analysis


@dataclass
class HeadMap:
    """Average map of one head over the examples of one length."""

    layer: int
    head: int
    mean: torch.Tensor | None  # [n, n]; None when the layer gives no probabilities
    count: int
    tokens: list[str]


@dataclass
class HeadsResult:
    """Everything ``analyze_model`` measured; written to disk by :func:`write_analysis`."""

    analysis: HeadAnalysis
    examples: list[dict[str, Any]]  # explorer examples {"tokens", "maps" [L, H, n, n]}
    head_maps: list[HeadMap]
    meta: dict[str, Any] = field(default_factory=dict)


def _consensus(token_lists: Sequence[Sequence[str]], n: int) -> list[str]:
    """Per position: the token when every example has the same one, else the position."""
    return [
        next(iter(s)) if len(s := {t[p] for t in token_lists}) == 1 else str(p)
        for p in range(n)
    ]


def analyze_model(
    loaded: LoadedModel,
    source: TextSource,
    *,
    batch_size: int = 32,
    heads: Sequence[tuple[int, int]] = (),
    n_examples: int = 4,
    rule: ClassRule | None = None,
    progress: Progress | None = None,
) -> HeadsResult:
    """Stream the source's examples through the model in batches; scores, classes, average
    maps of the chosen ``heads``, and the first ``n_examples`` examples for the explorer."""
    host = inspect_model(loaded.model)
    n_layers, n_heads = host.num_layers, host.num_heads
    check_heads(heads, n_layers, n_heads)
    feats = load_features(source, loaded.tokenizer)
    lengths = Counter(sum(f.get("attention_mask", [1] * len(f["input_ids"]))) for f in feats)
    target_n = max(lengths, key=lambda n: (lengths[n], n))  # most common length, longest tie
    sums: dict[tuple[int, int], torch.Tensor] = {}
    map_tokens: list[tuple[str, ...]] = []
    examples: dict[int, dict[str, Any]] = {}
    missing_layers: set[int] = set()
    mechanisms: dict[int, list[str]] = {}
    acc = HeadScoreAccumulator(DEFAULT_SCORERS)
    work = batches(feats, loaded.tokenizer, batch_size)
    start = time.perf_counter()
    for idx, batch in (progress or _no_progress)(work, len(work), f"heads of {loaded.name}"):
        cache = capture_attention(loaded.model, batch, on_missing="none")
        n, m = next((p.shape[-2:] for p in cache.values() if p is not None), (0, 0))
        if n != m:
            raise ValueError(f"{loaded.name} attends from {n} queries to {m} keys (prefix "
                             "tuning adds virtual keys); head analysis needs n x n maps")
        infos = token_infos(batch["input_ids"], batch.get("attention_mask"),
                            batch.get("token_type_ids"), loaded.tokenizer)
        acc.update(cache, infos)
        missing_layers |= {layer for layer, p in cache.items() if p is None}
        mechanisms = cache.mechanisms
        for i, (orig, info) in enumerate(zip(idx, infos, strict=True)):
            keep_ex = orig < n_examples and not missing_layers
            if not (keep_ex or (heads and info.length == target_n)):
                continue
            crop = {layer: p[i].index_select(-2, info.keep).index_select(-1, info.keep)
                    for layer, p in cache.items() if p is not None}  # layer -> [H, n_i, n_i]
            if keep_ex:
                examples[orig] = {"tokens": list(info.tokens or map(str, range(info.length))),
                                  "maps": torch.stack([crop[k] for k in sorted(crop)])}
            if heads and info.length == target_n:
                map_tokens.append(info.tokens or tuple(map(str, range(target_n))))
                for layer, head in heads:
                    if layer in crop:
                        sums[layer, head] = sums.get((layer, head), 0) + crop[layer][head]
    seconds = time.perf_counter() - start
    scores = acc.result()
    analysis = HeadAnalysis(scores, acc.counts(), acc.n_examples, classify_heads(scores, rule))
    tokens = _consensus(map_tokens, target_n) if map_tokens else []
    head_maps = [
        HeadMap(layer, head, (sums[layer, head] / len(map_tokens)).double()
                if (layer, head) in sums else None, len(map_tokens), tokens)
        for layer, head in heads
    ]
    meta = {
        "model": loaded.source,
        "model_name": loaded.name,
        "text": source.describe(),
        "max_length": 128 if source.max_length is None else source.max_length,
        "batch_size": batch_size,
        "layers": n_layers,
        "heads": n_heads,
        "examples": acc.n_examples,
        "batches": len(work),
        "seconds": round(seconds, 2),
        "layers_without_maps": sorted(missing_layers),
        "classifier": dataclasses.asdict(rule or ClassRule()),
        "mechanisms": {str(k): v for k, v in mechanisms.items()},
    }
    return HeadsResult(analysis, [examples[k] for k in sorted(examples)], head_maps, meta)


# ----------------------------------------------------------------------------- tables


def _mean(x: torch.Tensor) -> float:
    """Mean over heads ignoring NaN (NaN when every head is NaN, e.g. block on single
    sentences)."""
    x = x.double()
    return float(x.nanmean()) if bool((~x.isnan()).any()) else math.nan


def layer_summary(analysis: HeadAnalysis) -> list[dict[str, Any]]:
    """One row per layer: ``n_<class>`` heads in each class, ``mean_<score>`` over heads."""
    counts = class_counts(analysis.classes) if analysis.classes is not None else {}
    rows = []
    for layer in range(next(iter(analysis.scores.values())).shape[0]):
        row: dict[str, Any] = {"layer": layer}
        row.update({f"n_{c}": counts[c][layer] for c in counts})
        row.update({f"mean_{s}": _mean(v[layer]) for s, v in analysis.scores.items()})
        rows.append(row)
    return rows


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "n/a" if math.isnan(v) else f"{v:.3f}"
    return str(v)


def summary_markdown(rows: Sequence[dict[str, Any]], scores: Sequence[str] = SUMMARY_SCORES
                     ) -> str:
    """The per-layer table as Markdown: heads per class, then the named scores' head means;
    the last row sums the counts and averages the means over layers."""
    counts = [k for k in rows[0] if k.startswith("n_")]
    means = [f"mean_{s}" for s in scores if f"mean_{s}" in rows[0]]
    head = ["layer", *counts, *means]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    lines += ["| " + " | ".join(_fmt(r[k]) for k in head) + " |" for r in rows]
    total = [str(sum(r[k] for r in rows)) for k in counts]
    avg = [_fmt(_mean(torch.tensor([r[k] for r in rows]))) for k in means]
    lines.append("| all | " + " | ".join(total + avg) + " |")
    return "\n".join(lines) + "\n"


def _summary_csv(rows: Sequence[dict[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows({k: ("" if math.isnan(v) else round(v, 6)) if isinstance(v, float) else v
                 for k, v in r.items()} for r in rows)
    return buf.getvalue()


def _examples_json(examples: Sequence[dict[str, Any]]) -> str:
    """Explorer examples in thousandths (as the report stores them), shape kept."""
    docs = [{"tokens": e["tokens"], "shape": list(e["maps"].shape),
             "maps": (e["maps"] * 1000).round().to(torch.int16).flatten().tolist()}
            for e in examples]
    return json.dumps({"scale": 1000, "examples": docs}, separators=(",", ":")) + "\n"


def read_examples(path: Path) -> list[dict[str, Any]]:
    """Inverse of the writer in :func:`write_analysis` (``examples.json``)."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    return [{"tokens": e["tokens"],
             "maps": torch.tensor(e["maps"], dtype=torch.float32).reshape(e["shape"])
             / doc["scale"]} for e in doc["examples"]]


def write_analysis(result: HeadsResult, out: Path) -> list[Path]:
    """Tables, figures and explorer examples of one analysis into ``out``; returns paths."""
    a, name = result.analysis, result.meta.get("model_name", "model")
    meta = {**result.meta, "counts": a.counts}
    written = [to_json(out / "head_scores.json", a.scores, a.classes, meta),
               to_csv(out / "head_scores.csv", a.scores, a.classes)]
    rows = layer_summary(a)
    written.append(atomic_write(out / "layer_summary.csv", _summary_csv(rows)))
    written.append(atomic_write(out / "layer_summary.md", summary_markdown(rows)))
    for label, table in a.scores.items():
        unit = label.split("(")[0] in UNIT_SCORES
        fig = score_heatmap(table, title=f"{label}: {name}, {a.n_examples} examples",
                      vmin=0.0 if unit else None, vmax=1.0 if unit else None, label=label)
        written += save_figure(fig, out / f"score_{safe_name(label)}")
    if a.classes is not None:
        written += save_figure(class_map(a.classes, title=f"head classes: {name}"),
                               out / "classes")
        written += save_figure(class_count_bars(a.classes, title=f"classes per layer: {name}"),
                               out / "class_counts")
    maps_doc = {}
    for hm in result.head_maps:
        if hm.mean is None:
            continue
        title = (f"layer {hm.layer} head {hm.head}: mean of {hm.count} examples "
                 f"of {len(hm.tokens)} tokens")
        written += save_figure(attention_map(hm.mean, hm.tokens, title=title),
                               out / f"head_L{hm.layer}_H{hm.head}")
        maps_doc[f"{hm.layer}:{hm.head}"] = [[round(float(x), 6) for x in r]
                                            for r in hm.mean.tolist()]
    if result.head_maps:
        hm0 = result.head_maps[0]
        doc = {"length": len(hm0.tokens), "examples": hm0.count, "tokens": hm0.tokens,
               "maps": maps_doc,
               "skipped": [f"{h.layer}:{h.head}" for h in result.head_maps if h.mean is None]}
        written.append(atomic_write(out / "head_maps.json", json.dumps(doc, indent=1) + "\n"))
    if result.examples:
        written.append(atomic_write(out / "examples.json", _examples_json(result.examples)))
    return written


# ----------------------------------------------------------------------------- comparison


def compare_analyses(a: HeadsResult, b: HeadsResult, out: Path
                     ) -> tuple[dict[str, Any], list[Path]]:
    """Side-by-side class maps with the changed heads, score differences B - A."""
    ca, cb = a.analysis.classes, b.analysis.classes
    la, lb = a.meta["model_name"], b.meta["model_name"]
    if ca is None or cb is None:
        raise ValueError("both analyses need head classes (vertical and diagonal scores)")
    shape_a, shape_b = (len(ca), len(ca[0])), (len(cb), len(cb[0]))
    labels = (la, lb if lb != la else f"{lb} (B)")
    if shape_a != shape_b:  # no head-by-head match: class shares by relative depth
        return _compare_shares(a, b, labels, out)
    fig = compare_class_maps(ca, cb, labels=labels, title=f"head classes: {la} vs {lb}")
    written = list(save_figure(fig, out / "compare_classes"))
    diff = b.analysis.scores["vertical"].double() - a.analysis.scores["vertical"].double()
    bound = max(float(diff.abs().nan_to_num().max()), 1e-6)
    fig = score_heatmap(diff, title=f"vertical share, {lb} minus {la}", cmap="RdBu_r",
                        vmin=-bound, vmax=bound, label="difference")
    written += save_figure(fig, out / "compare_vertical")
    changed = [{"layer": layer, "head": head, "a": ca[layer][head], "b": cb[layer][head]}
               for layer in range(shape_a[0]) for head in range(shape_a[1])
               if ca[layer][head] != cb[layer][head]]
    doc = {"a": a.meta, "b": b.meta, "changed": changed,
           "class_counts": {"a": class_counts(ca), "b": class_counts(cb)},
           "mean_scores": {k: {s: None if math.isnan(x := _mean(v)) else round(x, 6)
                               for s, v in r.analysis.scores.items()}  # NaN -> null
                           for k, r in (("a", a), ("b", b))}}
    written.append(atomic_write(out / "compare.json",
                                json.dumps(doc, indent=1, allow_nan=False) + "\n"))
    return doc, written


def _compare_shares(a: HeadsResult, b: HeadsResult, labels: tuple[str, str], out: Path
                    ) -> tuple[dict[str, Any], list[Path]]:
    """Models of different shapes: each class's share of every layer's heads against
    relative depth, and the class counts (no head-by-head changes)."""
    ca, cb = a.analysis.classes, b.analysis.classes
    assert ca is not None and cb is not None  # checked by compare_analyses
    fig = class_share_comparison(ca, cb, labels=labels,
                                 title=f"head classes by depth: {labels[0]} vs {labels[1]}")
    written = list(save_figure(fig, out / "compare_class_shares"))
    doc = {"a": a.meta, "b": b.meta, "shapes": {"a": [len(ca), len(ca[0])],
                                                 "b": [len(cb), len(cb[0])]},
           "class_counts": {"a": class_counts(ca), "b": class_counts(cb)},
           "class_shares": {k: {c: round(sum(n) / (len(cl) * len(cl[0])), 6)
                                for c, n in class_counts(cl).items()}
                            for k, cl in (("a", ca), ("b", cb))},
           "mean_scores": {k: {s: None if math.isnan(x := _mean(v)) else round(x, 6)
                               for s, v in r.analysis.scores.items()}
                           for k, r in (("a", a), ("b", b))}}
    written.append(atomic_write(out / "compare.json",
                                json.dumps(doc, indent=1, allow_nan=False) + "\n"))
    return doc, written


def default_out(loaded: LoadedModel) -> Path:
    """``<run_dir>/analysis`` for runs, else ``runs/analysis-<model>``."""
    if loaded.run_dir is not None:
        return loaded.run_dir / ANALYSIS_DIR
    return Path("runs") / f"analysis-{safe_name(loaded.name)}"


def compare_out(spec_a: str, spec_b: str) -> Path:
    """``runs/analysis-compare-<a>-vs-<b>``."""
    a, b = (s if s == "default" else run_label(s) for s in (spec_a, spec_b))
    return Path("runs") / f"analysis-compare-{safe_name(a)}-vs-{safe_name(b)}"


def source_for(loaded: LoadedModel, source: TextSource, task_given: bool) -> TextSource:
    """Fill a run's own task, data folder and max length where the user gave none."""
    cfg = loaded.config
    if cfg is None:
        return source
    same_task = not task_given or source.task == cfg.task.name
    return dataclasses.replace(
        source,
        task=source.task if task_given else cfg.task.name,
        data_dir=cfg.task.data_dir if source.data_dir is None and same_task
        else source.data_dir,
        max_length=cfg.model.max_length if source.max_length is None else source.max_length,
    )

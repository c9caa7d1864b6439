"""``attnlab analyze connections``: the JAT connection case study, top to bottom.

1. load the model: a finished token-classification run (rebuilt with its plan, tuner and
   trained weights; any other run is refused before it is built), the embedded MiniLM
   (``"default"``) or a saved model folder;
2. read CoNLL-2003 sentences (default: the dev split ``valid.txt``, ``--limit`` first N) from
   ``--data-dir``, else the run's data folder, else ``../shared/data``; tokenize with the
   model's tokenizer and label every token with its word's entity class (gold tags from the
   data, for every model, so two models are counted on identical labels);
3. in length-sorted batches, ``capture_attention`` records every layer's maps and
   :class:`~attnlab.analysis.connections.ConnectionCounter` counts the major connections
   (p > mean + std of the map) per layer and pair class;
4. write ``connections.csv`` (layer x class counts, total with and without SEP),
   ``connections.json`` (counts, counts without SEP, candidate pairs, metadata) and the bar
   plots ``connections_per_layer`` and ``connections_per_layer_nosep`` (PNG + SVG).

``compare_connections`` puts two models side by side (the paper's baseline vs BERT-JAT):
each model's files in ``a-<name>/`` and ``b-<name>/``, plus ``connections_compare.csv``,
``connections_compare.json`` and ``connections_compare{,_nosep}.png/svg``.
The definitions (token-level labels, ordered pairs, diagonal left out) are in
``attnlab.analysis.connections``.
"""

from __future__ import annotations

import csv
import io
import json
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..analysis.connections import (
    PAIR_CLASSES,
    ConnectionCounter,
    ConnectionCounts,
    compare_connection_bars,
    connection_bars,
    token_classes,
)
from ..analysis.plots import save_figure
from ..config import load_config
from ..hf.capture import capture_attention
from ..io import atomic_write
from ..tasks import get_task
from .analyze import (
    INPUT_KEYS,
    LoadedModel,
    Progress,
    batches,
    is_run_dir,
    load_model,
)
from .naming import run_label, safe_name
from .quickstart import SHARED_DATA

DEFAULT_TASK = "conll2003"
DEFAULT_MAX_LENGTH = 128
T = TypeVar("T")
THRESHOLD = "p_ij > mean + std (population std) of each cropped (sentence, layer, head) map"


@dataclass
class ConnectionsResult:
    """What :func:`count_model` measured; written by :func:`write_connections`."""

    counts: ConnectionCounts
    meta: dict[str, Any] = field(default_factory=dict)


def _no_progress(items: Iterable[T], total: int, description: str) -> Iterable[T]:
    return items


# ----------------------------------------------------------------------------- the model


def load_ner_model(spec: str) -> LoadedModel:
    """``load_model`` that refuses a run not trained for token classification, before the
    model is built (a sentence-level run has no per-token reading of its heads to study)."""
    path = Path(spec)
    if spec != "default" and not path.exists():
        raise FileNotFoundError(
            f"run directory {spec} does not exist; pass a finished token-classification run "
            "(runs/<name>/ trained on conll2003), 'default' (the embedded MiniLM) or a saved "
            "model folder"
        )
    if spec != "default" and is_run_dir(path):
        cfg = load_config(path / "config.yaml")
        task = get_task(cfg.task.name)
        if task.head != "token-classification":
            raise ValueError(
                f"run {spec} was trained on {cfg.task.name} ({task.head}); the connection "
                "study needs a token-classification run on conll2003 (attnlab run with "
                "task.name=conll2003), or 'default' for the embedded MiniLM"
            )
    return load_model(spec)


# ----------------------------------------------------------------------------- the text


@dataclass(frozen=True)
class ConllSource:
    """Which CoNLL sentences are read, and how they are tokenized."""

    split: str = "dev"  # dev (valid.txt), train or test
    data_dir: str | None = None  # None: the run's, else ../shared/data
    limit: int | None = None  # first N sentences only
    max_length: int | None = None  # tokens per sentence (truncated); None: the run's, else 128


def _task_and_data(loaded: LoadedModel, source: ConllSource) -> tuple[str, str, int]:
    """(task name, data folder, max length), filling the run's own where not given."""
    cfg = loaded.config
    task = cfg.task.name if cfg is not None else DEFAULT_TASK
    data_dir = source.data_dir
    if data_dir is None and cfg is not None and cfg.task.data_dir not in (None, "builtin"):
        data_dir = cfg.task.data_dir
    if data_dir is None:
        if not (SHARED_DATA / "conll2003").is_dir():
            raise FileNotFoundError(
                f"no CoNLL-2003 data found ({SHARED_DATA / 'conll2003'} is missing); pass "
                "--data-dir with train.txt/valid.txt/test.txt"
            )
        data_dir = str(SHARED_DATA)
    max_length = source.max_length
    if max_length is None:
        max_length = cfg.model.max_length if cfg is not None else DEFAULT_MAX_LENGTH
    if max_length < 3:
        raise ValueError(f"--max-length must be at least 3, got {max_length}")
    return task, data_dir, max_length


def labelled_features(loaded: LoadedModel, source: ConllSource
                      ) -> tuple[list[dict[str, list[int]]], list[list[str]], dict[str, Any]]:
    """(model inputs per sentence, token classes per sentence, description of the text)."""
    if source.limit is not None and source.limit < 1:
        raise ValueError(f"--limit must be at least 1, got {source.limit}")
    name, data_dir, max_length = _task_and_data(loaded, source)
    task = get_task(name)
    examples = task.load(source.split, data_dir)[: source.limit]
    if not examples:
        raise ValueError(f"no sentences in {name} {source.split} from {data_dir}")
    if not hasattr(examples[0], "ner_tags"):
        raise ValueError(f"task {name} has no entity tags; the connection study reads CoNLL-2003")
    feats = task.encode(examples, loaded.tokenizer, max_length)
    labels = [token_classes(f["word_ids"], examples[f["example_index"]].ner_tags)
              for f in feats]
    inputs = [{k: f[k] for k in INPUT_KEYS if k in f} for f in feats]
    truncated = sum(len({w for w in f["word_ids"] if w is not None})
                    < len(examples[f["example_index"]].tokens) for f in feats)
    tokens = Counter(c for sent in labels for c in sent)
    info = {"task": name, "split": source.split, "data_dir": data_dir,
            "text": f"{name} {source.split} from {data_dir}", "max_length": max_length,
            "sentences": len(feats), "truncated_sentences": truncated,
            "tokens": dict(sorted(tokens.items()))}
    return inputs, labels, info


# ----------------------------------------------------------------------------- counting


def count_model(
    loaded: LoadedModel,
    source: ConllSource,
    *,
    batch_size: int = 32,
    entities_only: bool = False,
    include_diagonal: bool = False,
    progress: Progress | None = None,
) -> ConnectionsResult:
    """Stream the sentences through the model; per-layer major-connection counts."""
    inputs, labels, info = labelled_features(loaded, source)
    counter = ConnectionCounter(entities_only=entities_only, include_diagonal=include_diagonal)
    work = batches(inputs, loaded.tokenizer, batch_size)
    mechanisms: dict[int, list[str]] = {}
    start = time.perf_counter()
    for idx, batch in (progress or _no_progress)(work, len(work),
                                                  f"connections of {loaded.name}"):
        cache = capture_attention(loaded.model, batch)  # error if a layer has no maps
        counter.update(cache, [labels[i] for i in idx], batch.get("attention_mask"))
        mechanisms = cache.mechanisms
    counts = counter.result()
    meta = {
        "model": loaded.source,
        "model_name": loaded.name,
        **info,
        "batch_size": batch_size,
        "layers": counts.counts.shape[0],
        "heads": counts.n_heads,
        "threshold": THRESHOLD,
        "pairs": "ordered (query i -> key j)",
        "labels": "token-level: each sub-word carries its word's gold entity class; "
                  "[CLS]/[SEP] are SEP; padding excluded",
        "entities_only": entities_only,
        "include_diagonal": include_diagonal,
        "seconds": round(time.perf_counter() - start, 2),
        "mechanisms": {str(k): v for k, v in mechanisms.items()},
    }
    return ConnectionsResult(counts, meta)


# ----------------------------------------------------------------------------- files


def _csv(rows: Sequence[dict[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def describe(result: ConnectionsResult) -> str:
    m = result.meta
    extra = (", entities only" if m["entities_only"] else "") + \
            (", diagonal counted" if m["include_diagonal"] else "")
    return f"{m['model_name']}, {m['sentences']} sentences of {m['text']}{extra}"


def write_connections(result: ConnectionsResult, out: Path) -> list[Path]:
    """connections.csv/json and the two bar plots into ``out``; returns the paths."""
    out = Path(out)
    rows = result.counts.rows()
    doc = {**result.counts.to_dict(), "rows": rows, "meta": result.meta}
    written = [atomic_write(out / "connections.csv", _csv(rows)),
               atomic_write(out / "connections.json", json.dumps(doc, indent=1) + "\n")]
    what = describe(result)
    written += save_figure(connection_bars(result.counts, title=f"major connections: {what}"),
                           out / "connections_per_layer")
    written += save_figure(connection_bars(result.counts, include_sep=False,
                                           title=f"major connections without SEP: {what}"),
                           out / "connections_per_layer_nosep")
    return written


def compare_connections(a: ConnectionsResult, b: ConnectionsResult, out: Path
                        ) -> tuple[dict[str, Any], list[Path]]:
    """Two models side by side: one CSV with both, a JSON, and bar plots with/without SEP."""
    if a.meta["sentences"] != b.meta["sentences"]:
        raise ValueError(f"the two models read different sentences ({a.meta['sentences']} vs "
                         f"{b.meta['sentences']}); give both the same data")
    la, lb = a.meta["model_name"], b.meta["model_name"]
    labels = (la, lb if lb != la else f"{lb} (B)")
    out = Path(out)
    rows = [{"model": tag, "name": name, **r}
            for tag, name, res in (("a", labels[0], a), ("b", labels[1], b))
            for r in res.counts.rows()]
    doc = {"classes": list(PAIR_CLASSES), "a": {**a.counts.to_dict(), "meta": a.meta},
           "b": {**b.counts.to_dict(), "meta": b.meta},
           "difference_b_minus_a": (b.counts.counts - a.counts.counts).tolist()}
    written = [atomic_write(out / "connections_compare.csv", _csv(rows)),
               atomic_write(out / "connections_compare.json", json.dumps(doc, indent=1) + "\n")]
    what = f"{a.meta['sentences']} sentences of {a.meta['text']}"
    for sep, suffix in ((True, ""), (False, "_nosep")):
        fig = compare_connection_bars(
            a.counts, b.counts, labels=labels, include_sep=sep,
            title=f"major connections{'' if sep else ' without SEP'}: {la} vs {lb}, {what}")
        written += save_figure(fig, out / f"connections_compare{suffix}")
    return doc, written


def default_connections_out(loaded: LoadedModel) -> Path:
    """``<run>/analysis`` for runs (next to the head analysis), else
    ``runs/connections-<model>``."""
    if loaded.run_dir is not None:
        return loaded.run_dir / "analysis"
    return Path("runs") / f"connections-{safe_name(loaded.name)}"


def compare_connections_out(spec_a: str, spec_b: str) -> Path:
    """``runs/connections-compare-<a>-vs-<b>``."""
    a, b = (s if s == "default" else run_label(s) for s in (spec_a, spec_b))
    return Path("runs") / f"connections-compare-{safe_name(a)}-vs-{safe_name(b)}"

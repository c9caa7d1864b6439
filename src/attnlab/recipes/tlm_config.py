"""The TLM config (``attnlab tlm``'s YAML: sections, loading, overrides, checks) and the
external set it retrieves (``external_file``, ``read_external``); the pipeline that runs it
is ``recipes.tlm`` (its docstring describes the method, the conditions and the run folder),
the stages ``recipes.tlm_train``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import yaml

from ..config import (
    ConfigError,
    EvalConfig,
    TaskConfig,
    apply_overrides,
    config_changes,
    from_dict,
    read_yaml_mapping,
    to_dict,
)

External = Literal["bm25", "random", "none"]
HEADS = ("sequence-classification", "token-classification")


@dataclass(frozen=True, kw_only=True)
class TlmModelSection:
    """The from-scratch encoder (``models.encoder_config``). The paper's scales: small- and
    medium-scale TLM are BERT-Base (``size: base``: 12 layers, hidden 768, 12 heads, 109M
    parameters; they differ in corpus and steps), large-scale is BERT-Large (``size: base``
    with ``config: {num_hidden_layers: 24, hidden_size: 1024, num_attention_heads: 16,
    intermediate_size: 4096}``, 335M). The shipped configs use ``tiny`` for a CPU."""

    size: str = "base"  # models.SIZES name; base = BERT-Base, the paper's small-scale model
    max_length: int = 128  # tokens per task example and per external passage (official 128)
    config: dict[str, Any] = field(default_factory=dict)  # BertConfig overrides, e.g. layers


@dataclass(frozen=True, kw_only=True)
class RetrievalSection:
    """Where the external data comes from (``attnlab.tlm.retrieve``)."""

    # general corpus D: a JSONL ({"text": ...}) or .txt file, or a folder of them
    corpus: str | None = None
    hits: str | None = None  # a ready external set (JSONL with "text"): used, not retrieved
    cache_dir: str | None = None  # BM25 index + hits (None: <output_dir>/tlm-cache/<corpus>-...)
    k: int | None = None  # K neighbours per task example (None: default_k, 50/500/5000)
    k1: float = 1.2  # BM25 k1 (Elasticsearch's default; the paper used Elasticsearch)
    b: float = 0.75  # BM25 b (Elasticsearch's default)
    passage_tokens: int = 128  # passage cap in whitespace words (tlm.retrieve.split_passages)
    random_count: int | None = None  # external=random: passages (None: as many as BM25's)


@dataclass(frozen=True, kw_only=True)
class Stage1Section:
    """Joint training from scratch. Defaults: the official small-scale ``train.sh``."""

    steps: int = 150_000  # optimizer steps (official 150K)
    # examples per step and process: the official train.sh runs 32 per GPU on 8 GPUs, a
    # global batch of 256, which this default gives on one device (as stage 2's default
    # gives finetune.sh's global 32); on 8 processes set 32
    batch_size: int = 256
    rho1: int = 999  # ρ1: external batches per task batch (paper: 1 ... 1999)
    rho2: float = 20.0  # ρ2: L_mlm weight in task batches (paper: 20, 100, 1000)
    lr: float = 1e-4  # peak learning rate (AdamW)
    weight_decay: float = 0.01  # not on biases / LayerNorm
    warmup_ratio: float = 1 / 15  # linear warmup share, then linear decay (official 10K/150K)
    max_grad_norm: float | None = None  # clipping (None: off, as the official code)
    eval_every: int | None = None  # steps between dev evaluations (None: at the end only)
    save_every: int = 500  # steps between checkpoints (and at the end)
    log_every: int = 10  # steps per metrics.jsonl line (losses averaged over them)


@dataclass(frozen=True, kw_only=True)
class Stage2Section:
    """Fine-tuning with the task head re-initialised. Defaults: the official ``finetune.sh``."""

    # examples per step and process: the official finetune.sh runs 4 per GPU on 8 GPUs, a
    # global batch of 32, which this default gives on one device
    batch_size: int = 32
    epochs: float = 3.0  # used when max_steps is None
    max_steps: int | None = 30_000  # official 30K
    lr: float = 2e-5  # peak learning rate
    weight_decay: float = 0.0  # official 0
    warmup_ratio: float = 0.1  # official 3K of 30K
    max_grad_norm: float | None = None  # clipping (None: off, as the official code)
    eval_every: int | None = 1000  # steps between dev evaluations (None: once per epoch)
    log_every: int = 10  # steps per metrics.jsonl line
    early_stopping_patience: int | None = None  # evaluations without improvement


@dataclass(frozen=True, kw_only=True)
class TlmConfig:
    """One run of TLM (Yao et al., "NLP From Scratch Without Large-Scale Pretraining",
    ICML 2022): a task, a condition (``external``), a seed; both stages."""

    name: str | None = None  # run folder under output_dir (None: tlm-<task>/<external>/seed-<s>)
    seed: int = 0  # model init, data order, masks, random passages
    output_dir: str = "runs"
    external: External = "bm25"  # external data: bm25 (TLM), random, none (task data only)
    model: TlmModelSection = field(default_factory=TlmModelSection)
    task: TaskConfig = field(default_factory=TaskConfig)
    retrieval: RetrievalSection = field(default_factory=RetrievalSection)
    stage1: Stage1Section = field(default_factory=Stage1Section)
    stage2: Stage2Section = field(default_factory=Stage2Section)
    eval: EvalConfig = field(default_factory=EvalConfig)
    keep_checkpoints: bool = False  # keep the checkpoints of a finished run

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / str(self.name)


STAGE2_KEYS = ("stage2", "eval")  # what `attnlab tlm finetune` may override
PATH_KEYS = (("task", "data_dir"), ("retrieval", "corpus"), ("retrieval", "hits"),
             ("retrieval", "cache_dir"))


def load_tlm_config(path: str | Path | None, overrides: list[str] | None = None) -> TlmConfig:
    """Read a TLM YAML config, apply ``key.sub=value`` overrides, resolve paths, validate.

    Paths written in the file (``task.data_dir``, ``retrieval.corpus``/``hits``/
    ``cache_dir``) are relative to the file; given as overrides, to the current folder;
    ``output_dir`` stays as given (runs go where the user runs)."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        data = _absolute_paths(read_yaml_mapping(p, "task:, stage1:, ..."), p.parent)
        run_keys = sorted(set(data) & {"plan", "tuning", "analysis", "optim", "train"})
        if run_keys and not set(data) & {"stage1", "stage2", "retrieval", "external"}:
            raise ConfigError(
                f"{p} is a config of `attnlab run` ({', '.join(run_keys)}: ...), not of "
                "`attnlab tlm`; give a TLM config (configs/tlm_*.yaml: task:, retrieval:, "
                "stage1:, stage2:) or the folder of a TLM run")
    data = _absolute_paths(apply_overrides(data, overrides or []), Path.cwd())
    cfg = from_dict(TlmConfig, data)
    if cfg.name is None:
        cfg = dataclasses.replace(
            cfg, name=f"tlm-{cfg.task.name}/{cfg.external}/seed-{cfg.seed}")
    validate_tlm(cfg)
    return cfg


def _absolute_paths(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    out = dict(data)
    for section, key in PATH_KEYS:
        sub = out.get(section)
        if not isinstance(sub, dict) or not isinstance(sub.get(key), str):
            continue
        value = sub[key]
        if value == "builtin" or Path(value).expanduser().is_absolute():
            continue
        out[section] = {**sub, key: str((folder / Path(value).expanduser()).resolve())}
    return out


def validate_tlm(cfg: TlmConfig) -> None:
    """Everything a run would refuse, as one-line ConfigErrors naming the fix (no data read
    beyond checking that files and folders exist)."""
    from ..models import SIZES, encoder_config
    from ..tasks import get_task
    from ..tlm.objective import TlmObjective
    from .rundir import check_writable

    m, s1, s2 = cfg.model, cfg.stage1, cfg.stage2
    if m.size not in SIZES:
        raise ConfigError(f"model.size {m.size!r}: unknown; use one of {', '.join(SIZES)}")
    if not isinstance(m.config, dict):
        raise ConfigError(f"model.config must be a mapping of BertConfig fields, got {m.config!r}")
    try:
        bert = encoder_config(m.size, **m.config)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model.config: {e}") from None
    if not 3 <= m.max_length <= bert.max_position_embeddings:
        raise ConfigError(f"model.max_length must be in [3, {bert.max_position_embeddings}] "
                          f"(the encoder's positions), got {m.max_length}")
    task = get_task(cfg.task.name)
    if task.head not in HEADS:
        raise ConfigError(f"task {task.name!r} ({task.head}): TLM's task head needs a sequence "
                          "or token classification task (GLUE, conll2003)")
    try:
        TlmObjective(rho1=s1.rho1, rho2=s1.rho2)
    except ValueError as e:
        raise ConfigError(f"stage1: {e}") from None
    for where, value in (("stage1.steps", s1.steps), ("stage1.batch_size", s1.batch_size),
                         ("stage1.save_every", s1.save_every),
                         ("stage1.log_every", s1.log_every),
                         ("stage1.eval_every", s1.eval_every or 1),
                         ("stage2.batch_size", s2.batch_size),
                         ("stage2.log_every", s2.log_every),
                         ("stage2.max_steps", s2.max_steps or 1),
                         ("stage2.eval_every", s2.eval_every or 1),
                         ("eval.batch_size", cfg.eval.batch_size)):
        if value < 1:
            raise ConfigError(f"{where} must be >= 1, got {value}")
    if s2.max_steps is None and s2.epochs <= 0:
        raise ConfigError("stage2.epochs must be > 0 (or set stage2.max_steps)")
    for where, ratio in (("stage1.warmup_ratio", s1.warmup_ratio),
                         ("stage2.warmup_ratio", s2.warmup_ratio)):
        if not 0 <= ratio < 1:
            raise ConfigError(f"{where} must be in [0, 1), got {ratio}")
    for where, lr in (("stage1.lr", s1.lr), ("stage2.lr", s2.lr)):
        if not lr > 0:
            raise ConfigError(f"{where} must be > 0, got {lr}")
    _validate_sources(cfg)
    d = cfg.task.data_dir
    if d is not None and d != "builtin" and not Path(d).is_dir():
        raise ConfigError(f"task.data_dir {d!r} is not a folder; give the data root (e.g. "
                          "../shared/data) or 'builtin' (CoLA's shipped sample)")
    check_writable(cfg.run_dir)


def _validate_sources(cfg: TlmConfig) -> None:
    r = cfg.retrieval
    if r.k is not None and r.k < 1:
        raise ConfigError(f"retrieval.k must be >= 1 (or null for default_k), got {r.k}")
    if r.passage_tokens < 8:
        raise ConfigError(f"retrieval.passage_tokens must be >= 8, got {r.passage_tokens}")
    if r.random_count is not None and r.random_count < 1:
        raise ConfigError(f"retrieval.random_count must be >= 1, got {r.random_count}")
    if not r.k1 >= 0:
        raise ConfigError(f"retrieval.k1 must be >= 0 (BM25's term saturation, e.g. 1.2), "
                          f"got {r.k1}")
    if not 0 <= r.b <= 1:
        raise ConfigError(f"retrieval.b must be in [0, 1] (BM25's length normalisation, e.g. "
                          f"0.75), got {r.b}")
    if r.cache_dir is not None:
        blocker = next((p for p in (Path(r.cache_dir), *Path(r.cache_dir).parents)
                        if p.exists()), None)
        if blocker is not None and not blocker.is_dir():
            raise ConfigError(f"retrieval.cache_dir {r.cache_dir!r}: {blocker} is a file, not "
                              "a folder; give a folder (or null for <output_dir>/tlm-cache)")
    if cfg.external == "none":
        return
    if r.hits is not None and cfg.external == "bm25":
        if not Path(r.hits).is_file():
            raise ConfigError(f"retrieval.hits {r.hits!r} is not a file; give a JSONL external "
                              "set, or null to retrieve from retrieval.corpus")
        return
    if r.corpus is None:
        raise ConfigError(f"external={cfg.external} needs retrieval.corpus (a JSONL or text "
                          "corpus, e.g. ../shared/data/corpus_en/docs.jsonl); or external=none")
    from ..tlm.retrieve import corpus_files

    try:
        corpus_files(r.corpus)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"retrieval.corpus {r.corpus!r}: {e}; give a JSONL or text corpus "
                          "file, or a folder of them, e.g. ../shared/data/corpus_en/docs.jsonl"
                          ) from None


def config_yaml(cfg: TlmConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def saved_config_changes(run_dir: Path, cfg: TlmConfig, ignore: tuple[str, ...] = ()
                         ) -> list[str] | None:
    """How ``cfg`` differs from ``run_dir/config.yaml`` (None: there is none), leaving out
    the run's location and the sections in ``ignore``."""
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return None
    try:
        old = from_dict(TlmConfig, yaml.safe_load(saved.read_text()) or {})
    except (ConfigError, yaml.YAMLError) as e:
        return [f"{saved} cannot be read by this version ({e})"]
    # config_changes compares any two config dataclasses (typed for ExperimentConfig)
    return config_changes(cast(Any, old), cast(Any, cfg),
                          ignore=("name", "output_dir", "keep_checkpoints", *ignore))


# ----------------------------------------------------------------------------- external data


def corpus_source(cfg: TlmConfig) -> dict[str, Any]:
    """What an index of ``cfg``'s corpus is built from: the corpus (resolved path; of the
    files read, ``tlm.retrieve.corpus_files``: their count, total size in bytes and latest
    modification time in ns) and the passage length. Kept in the index's metadata
    (``Bm25Index.build(source=...)``) and compared on every load."""
    from ..tlm.retrieve import corpus_files

    r = cfg.retrieval
    path = Path(str(r.corpus)).expanduser().resolve()
    stats = [f.stat() for f in corpus_files(path)]
    return {"corpus": str(path), "files": len(stats), "bytes": sum(s.st_size for s in stats),
            "mtime_ns": max(s.st_mtime_ns for s in stats), "passage_tokens": r.passage_tokens}


def cache_dir(cfg: TlmConfig, source: dict[str, Any] | None = None) -> Path:
    """Folder of the BM25 index and the hits of one corpus under one BM25 setting.

    Default: ``<output_dir>/tlm-cache/<corpus stem>-<fingerprint>-p<passage_tokens>-k1_<k1>-
    b<b>``, the fingerprint a digest of ``corpus_source`` (path, files, size, mtime), so
    two corpora of one name (``en/docs.jsonl``, ``de/docs.jsonl``), or a corpus edited in
    place, never share an index. ``source``: ``corpus_source(cfg)``, when the caller has it
    (its file stats are then not read again)."""
    r = cfg.retrieval
    if r.cache_dir is not None:
        return Path(r.cache_dir)
    stem = Path(str(r.corpus)).stem
    src = source or corpus_source(cfg)
    tag = hashlib.sha256(repr((src["corpus"], src["files"], src["bytes"], src["mtime_ns"])
                              ).encode()).hexdigest()[:8]
    return (Path(cfg.output_dir) / "tlm-cache"
            / f"{stem}-{tag}-p{r.passage_tokens}-k1_{r.k1:g}-b{r.b:g}")


def load_index(cfg: TlmConfig, progress: bool = True):
    """The corpus's BM25 index (``cache_dir/index``): loaded, or built there first (the
    build is atomic: a folder is an index only once complete). An index in the folder that
    was built from another corpus (path, files, size, mtime), passage length, k1 or b is refused
    (a ConfigError naming the difference), never silently used."""
    from ..tasks.base import DataFormatError
    from ..tlm import retrieve as tr  # bm25s: imported on use

    r = cfg.retrieval
    source = corpus_source(cfg)  # the files' stats, read once
    folder = cache_dir(cfg, source) / "index"
    if (folder / tr.META_NAME).is_file():
        index = tr.Bm25Index.load(folder, mmap=True)
        built = {**(index.meta.get("source") or {}), "k1": index.k1, "b": index.b}
        wanted = {**source, "k1": float(r.k1), "b": float(r.b)}
        diff = [f"{k} {built.get(k)!r} (asked {v!r})" for k, v in wanted.items()
                if built.get(k) != v]
        if diff:
            raise ConfigError(
                f"{folder} holds a BM25 index of other data: " + "; ".join(diff) + ". Remove "
                "that folder (with its hits/) to rebuild it, or set another retrieval.cache_dir")
        return index
    try:
        docs = tr.read_corpus(Path(str(r.corpus)))
    except DataFormatError:
        raise
    except ValueError as e:  # e.g. a corpus of blank lines only
        raise ConfigError(f"retrieval.corpus: {e}") from None
    passages = tr.split_passages(docs, max_tokens=r.passage_tokens)
    if not passages:
        raise ConfigError(f"retrieval.corpus {r.corpus}: no passages (is it empty?)")
    return tr.Bm25Index.build(passages, folder, k1=r.k1, b=r.b, show_progress=progress,
                              source=source)


def _digest(texts: list[str], *extra: object) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(b"\x00")
    h.update(repr(extra).encode())
    return h.hexdigest()[:12]


def count_passages(path: Path) -> int:
    with open(path, encoding="utf-8") as fh:
        return sum(1 for line in fh if line.strip())


def external_file(cfg: TlmConfig, examples: list, progress: bool = True) -> dict[str, Any]:
    """The external set of ``cfg``'s condition for the task's training ``examples``: made (and
    cached) if needed. Returns {"file", "passages", "condition", "k"} (file None for none).

    bm25: ``retrieval.hits`` if given, else the union of the top-K passages of every
    example's query text (``query_texts``: text fields only, never labels); an empty result
    raises ``EmptyRetrievalError`` (retrieve's own), never trains on nothing. random: as
    many passages as the BM25 set (or ``retrieval.random_count``), seeded by ``seed``."""
    if cfg.external == "none":
        return {"condition": "none", "file": None, "passages": 0, "k": None}
    r = cfg.retrieval
    if cfg.external == "bm25" and r.hits is not None:
        path = Path(r.hits)
        return {"condition": "bm25", "file": str(path), "passages": count_passages(path),
                "k": None}
    from ..tlm import retrieve as tr  # bm25s: imported on use

    index = load_index(cfg, progress)
    k = r.k if r.k is not None else tr.default_k(len(examples))
    if r.hits is not None:
        bm25 = Path(r.hits)
    else:
        queries = tr.query_texts(examples)
        bm25 = cache_dir(cfg) / "hits" / f"bm25-{cfg.task.name}-k{k}-{_digest(queries, k)}.jsonl"
        if not bm25.is_file():  # written atomically: a file here is complete
            tr.write_hits(bm25, tr.retrieve(index, queries, k, progress=progress))
    if cfg.external == "bm25":
        return {"condition": "bm25", "file": str(bm25), "passages": count_passages(bm25),
                "k": k}
    count = r.random_count if r.random_count is not None else count_passages(bm25)
    if count > len(index):
        raise ConfigError(f"retrieval.random_count {count} is more than the corpus's "
                          f"{len(index):,} passages; give at most {len(index)}, or null for as "
                          "many as BM25 retrieves")
    path = cache_dir(cfg) / "hits" / f"random-n{count}-seed{cfg.seed}.jsonl"
    if not path.is_file():
        tr.write_hits(path, tr.random_passages(index, count, cfg.seed))
    return {"condition": "random", "file": str(path), "passages": count_passages(path),
            "k": k}


def read_external(source: dict[str, Any]) -> list[str]:
    """The passages' texts; an empty set is an error, not a run on nothing."""
    from ..tasks.mlm import read_texts

    if source["file"] is None:
        return []
    texts = [t.text for t in read_texts(Path(source["file"])) if t.text.strip()]
    if not texts:
        raise ConfigError(f"the external set {source['file']} has no passages: retrieval found "
                          "nothing to train on; check retrieval.corpus and retrieval.k, or run "
                          "with external=none")
    return texts


def tuning_spec(cfg: TlmConfig) -> str:
    s = cfg.stage1
    rho1 = 0 if cfg.external == "none" else s.rho1
    return f"tlm(external={cfg.external}, rho1={rho1}, rho2={s.rho2:g}, steps={s.steps})"

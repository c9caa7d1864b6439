"""TLM data selection: BM25 top-K passages of a general corpus for every task example.

Yao, Zheng, Yang and Yang, "NLP From Scratch Without Large-Scale Pretraining: A Simple and
Efficient Framework", ICML 2022 (official code: github.com/yaoxingcheng/TLM,
``src/data_selection.py``). TLM uses each task example's text as a query, keeps the top-K
passages of a general corpus for every query, and trains on the union of them (plus the
task data) from scratch.

Pipeline::

    docs = read_corpus("corpus.jsonl")                 # TextExample(guid, text) per document
    passages = split_passages(docs, max_tokens=128)     # Passage(pid, doc_id, text)
    index = Bm25Index.build(passages, "runs/bm25")      # on disk, memory-mapped on load
    hits = retrieve(index, query_texts(task_rows), k=default_k(len(task_rows)))
    write_hits("selected.jsonl", hits)                  # readable by tasks.mlm.read_texts

Passages. The official indices (``index_128``) hold documents cut to at most 128 tokens.
``split_passages`` cuts each document into the fewest chunks of at most ``max_tokens``
whitespace-separated words (``str.split`` units), of near-equal size (sizes differ by at most
one word, so no stub of two words is left at a document's end), each chunk the original text
from its first word to its last. Words, not sub-word tokens, so no tokenizer is needed: 128
English words are about 160-170 WordPiece tokens. Chunks without a single BM25 term
(punctuation only) are dropped; ``pid`` numbers the kept passages 0..n-1 (the index row).

Scoring: Lucene's BM25, as Elasticsearch 8 / Lucene 9 compute it (bm25s ``method="lucene"``)::

    score(q, d) = sum_{t in q} idf(t) * tf(t, d) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl))
    idf(t)      = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))

with N passages, df(t) passages containing t, |d| the passage's term count, avgdl the mean
of |d|; a term repeated in the query counts once per repetition. Defaults k1 = 1.2, b = 0.75
are Elasticsearch's, which the paper used (its index mapping asks for similarity "BM25" with
no parameters); the Elasticsearch backend uses the same values.

Tokenisation (``analyze``): the closest that bm25s's regex tokenizer gets to Elasticsearch's
``standard`` analyzer (Unicode word segmentation, lowercase, no stopwords, no stemming):
lowercase, then runs of word characters (``\\w``, so digits and ``_`` too; single letters
kept), joined as UAX#29 word boundaries join them: across an apostrophe, period or colon
between letters (``don't``, ``u.s``, ``c:a``) and across a period, comma, semicolon or
apostrophe between digits (``3.14``, ``3,000``). Hyphens and other punctuation split. It
approximates UAX#29: CJK text (one token per ideograph in Elasticsearch, one per run here)
and other rare cases segment differently.

Union (as in the official ``build_dataset``): every query keeps its top-K; a passage found by
several queries appears once, with its best (lowest, 0-based) rank; ties go to the higher
score, then the earlier query. Queries are the examples' input text only (``query_texts``);
labels never reach them.

Choice of K (``K_DEFAULTS``, ``default_k``): the paper uses K = 50 for its high-resource tasks
(AGNews, Helpfulness, RCT: 115K-180K training examples), 500 for IMDB (20K) and 5,000 for the
low-resource ones (Hyperpartisan, ACL-ARC, SciERC, ChemProt: 0.5K-4.2K). It states no size
thresholds; ours are >= 100,000 examples -> 50, >= 10,000 -> 500, else 5,000 (10,000 sits
between the largest low-resource task, 4.2K, and IMDB, 20K).

Deviations: the official code silently skips queries whose search fails and writes the union
in dictionary order with fresh ids; here a failed search raises, queries that match nothing
are reported (a warning naming them), an empty union raises ``EmptyRetrievalError``, and hits
keep their passage ids, sorted by pid. The optional RAKE key-phrase queries of the official
code are not implemented (its default is the full text, as here). Ties inside the top-K are
broken by the lower pid here; Elasticsearch breaks them by its internal document order.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..io import atomic_path, write_json
from ..tasks.mlm import TextExample, read_texts

# Tokenisation shared by index and queries (see the module docstring).
TOKEN_PATTERN = (r"\w+(?:(?:(?<=[^\W\d_])['\u2019.:](?=[^\W\d_])"  # letter . letter
                 r"|(?<=\d)[.,;'\u2019](?=\d))\w+)*")  # digit , digit
ANALYZER = "attnlab-standard-v1"  # bump when TOKEN_PATTERN or lowercasing change
_TOKEN = re.compile(TOKEN_PATTERN)
_WORD = re.compile(r"\S+")

K1 = 1.2  # BM25 k1 (Elasticsearch default)
B = 0.75  # BM25 b (Elasticsearch default)
META_NAME = "attnlab_bm25.json"  # our metadata beside bm25s's files; marks a folder as an index
FORMAT = 1

# (minimum number of task examples, K): the first row whose minimum is met applies.
K_DEFAULTS: tuple[tuple[int, int], ...] = (
    (100_000, 50),  # high-resource (paper: AGNews, Helpfulness, RCT)
    (10_000, 500),  # middle (paper: IMDB, 20K); 10K is our threshold, the paper states none
    (0, 5000),  # low-resource (paper: Hyperpartisan, ACL-ARC, SciERC, ChemProt)
)
CORPUS_SUFFIXES = (".jsonl", ".txt")


@dataclass(frozen=True)
class Passage:
    """One indexed chunk of a corpus document; ``pid`` is its row in the index."""

    pid: int
    doc_id: str
    text: str


@dataclass(frozen=True)
class Hit:
    """A retrieved passage: best 0-based ``rank`` over all queries, its score there, and the
    query (index into the query list) that gave it. Random draws have rank -1, score 0."""

    pid: int
    text: str
    doc_id: str
    rank: int
    score: float
    query_index: int


class EmptyRetrievalError(ValueError):
    """No query matched any passage: there is nothing to train on."""


@runtime_checkable
class SearchBackend(Protocol):
    """What ``retrieve`` and ``random_passages`` need; ``Bm25Index`` and ``ElasticBackend``
    both satisfy it."""

    def search(self, queries: list[str], k: int) -> list[list[tuple[int, float]]]: ...

    def passage(self, pid: int) -> Passage: ...

    def passages(self, pids: Sequence[int]) -> list[Passage]: ...

    def __len__(self) -> int: ...


# ----------------------------------------------------------------------------- corpus


def analyze(texts: Sequence[str]) -> list[list[str]]:
    """BM25 terms of each text (the tokenisation of the module docstring)."""
    import bm25s  # heavy-ish (scipy); imported on use

    return bm25s.tokenize(list(texts), lower=True, token_pattern=TOKEN_PATTERN, stopwords=None,
                          return_ids=False, show_progress=False)


def corpus_files(path: str | Path) -> list[Path]:
    """The files a corpus ``path`` is read from: the file itself (``.jsonl`` or ``.txt``) or
    a folder's ``.jsonl``/``.txt`` files, searched recursively, in sorted path order, hidden
    ones skipped. ValueError for another suffix or a folder without such files,
    FileNotFoundError when nothing is there."""
    root = Path(path).expanduser()
    if root.is_file():
        if root.suffix not in CORPUS_SUFFIXES:
            raise ValueError(f"{root}: corpus files must be .jsonl or .txt, got {root.suffix!r}")
        return [root]
    if root.is_dir():
        files = sorted(f for f in root.rglob("*") if f.is_file() and f.suffix in CORPUS_SUFFIXES
                       and not any(p.startswith(".") for p in f.relative_to(root).parts))
        if not files:
            raise ValueError(f"{root}: no .jsonl or .txt files in this folder")
        return files
    raise FileNotFoundError(f"corpus {root} does not exist")


def read_corpus(path: str | Path) -> list[TextExample]:
    """Documents of a ``.jsonl`` file (``{"text": ..., "id": ...}`` per line), a ``.txt`` file
    (one document per non-blank line) or a folder of them (searched recursively, files in
    sorted path order, hidden ones skipped). Bad JSON or a missing "text" raises
    ``DataFormatError`` naming file:line (``tasks.mlm.read_texts``)."""
    root = Path(path).expanduser()
    docs = [d for f in corpus_files(root) for d in read_texts(f)]
    if not docs:
        raise ValueError(f"{root}: the corpus holds no documents (every line is blank)")
    return docs


def split_passages(docs: Iterable[TextExample | str], max_tokens: int = 128) -> list[Passage]:
    """Cut documents into passages of at most ``max_tokens`` whitespace-separated words, of
    near-equal size; passages without a BM25 term are dropped (module docstring). Words, not
    the model's sub-word tokens: a passage of 128 words is usually longer than 128 WordPiece
    tokens, so training at ``max_length`` 128 reads its beginning; pass a smaller
    ``max_tokens`` (a TLM config's ``retrieval.passage_tokens``) to keep passages whole."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    out: list[Passage] = []
    for i, doc in enumerate(docs):
        doc_id, text = (str(i), doc) if isinstance(doc, str) else (doc.guid, doc.text)
        spans = [m.span() for m in _WORD.finditer(text)]
        n = len(spans)
        parts = -(-n // max_tokens)  # ceil: the fewest chunks of <= max_tokens words
        for j in range(parts):
            lo, hi = j * n // parts, (j + 1) * n // parts  # words [lo, hi)
            chunk = text[spans[lo][0]:spans[hi - 1][1]]
            if _TOKEN.search(chunk):
                out.append(Passage(pid=len(out), doc_id=doc_id, text=chunk))
    return out


# ----------------------------------------------------------------------------- bm25s index


class Bm25Index:
    """Embedded BM25 backend of TLM retrieval (Yao et al., "NLP From Scratch Without
    Large-Scale Pretraining: A Simple and Efficient Framework", ICML 2022).

    A ``bm25s`` eager index (per-(term, passage) Lucene BM25 weights in a sparse matrix,
    module docstring) plus the passages (``corpus.jsonl`` with bm25s's line-offset index), in
    one folder, loaded memory-mapped: nothing but the vocabulary and the line offsets is read
    into memory. Exact search: per query the scores of every passage are summed from the
    query terms' postings, then the top-k of the matching passages (score > 0) is taken,
    ties broken by the lower pid.
    """

    def __init__(self, model: Any, folder: Path, meta: dict[str, Any]) -> None:
        self.model = model  # bm25s.BM25
        self.folder = folder
        self.meta = meta

    @property
    def k1(self) -> float:
        return float(self.model.k1)

    @property
    def b(self) -> float:
        return float(self.model.b)

    @classmethod
    def build(cls, passages: Sequence[Passage], folder: str | Path, *, k1: float = K1,
              b: float = B, show_progress: bool = True,
              source: Mapping[str, Any] | None = None) -> Bm25Index:
        """Index ``passages`` (pids 0..n-1 in order) into ``folder`` and load it.

        ``source``: what the passages were made from (JSON values, e.g. the corpus file's
        path, size and mtime and the passage length), kept in the metadata as ``source`` so
        a cache can tell whose index it holds (``recipes.tlm_config.load_index``).

        Written to a hidden temporary folder beside ``folder`` and renamed into place, so a
        kill leaves the old index or the new one, never a half-written one. An existing
        index in ``folder`` is replaced; any other non-empty folder is refused.
        """
        import bm25s

        passages = list(passages)
        if not passages:
            raise ValueError("no passages to index: the corpus is empty")
        for i, p in enumerate(passages):
            if p.pid != i:
                raise ValueError(f"passage {i} has pid {p.pid}: pids must be 0..n-1 in order "
                                 "(split_passages numbers them so)")
        if k1 < 0 or not 0 <= b <= 1:
            raise ValueError(f"BM25 needs k1 >= 0 and 0 <= b <= 1, got k1={k1}, b={b}")
        folder = Path(folder).expanduser()
        _check_target(folder)
        tokens = bm25s.tokenize([p.text for p in passages], lower=True,
                                token_pattern=TOKEN_PATTERN, stopwords=None, return_ids=True,
                                show_progress=show_progress)
        empty = [i for i, ids in enumerate(tokens.ids) if not ids]
        if empty:
            raise ValueError(f"passage {empty[0]} ({len(empty)} in all) has no BM25 term; "
                             "split_passages drops such passages")
        model = bm25s.BM25(k1=k1, b=b, method="lucene", idf_method="lucene")
        log = logging.getLogger("bm25s")  # bm25s sets itself to DEBUG on import
        level = log.level
        log.setLevel(max(level, logging.INFO))
        try:
            model.index(tokens, show_progress=show_progress)
        finally:
            log.setLevel(level)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = folder.parent / f".{folder.name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            model.save(tmp, corpus=({"pid": p.pid, "doc_id": p.doc_id, "text": p.text}
                                    for p in passages), show_progress=show_progress)
            write_json(tmp / META_NAME, {
                "format": FORMAT, "analyzer": ANALYZER, "token_pattern": TOKEN_PATTERN,
                "method": "lucene", "k1": k1, "b": b, "num_passages": len(passages),
                "bm25s_version": bm25s.__version__,
                "source": dict(source) if source is not None else None,
            })
            _swap_into_place(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return cls.load(folder)

    @classmethod
    def load(cls, folder: str | Path, *, mmap: bool = True) -> Bm25Index:
        """Open an index written by ``build``; ``mmap`` maps the score arrays and passages."""
        import bm25s

        folder = Path(folder).expanduser()
        meta_path = folder / META_NAME
        if not meta_path.is_file():
            raise FileNotFoundError(f"{folder} is not a BM25 index (no {META_NAME}); build one "
                                    "with Bm25Index.build(passages, folder)")
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("format") != FORMAT or meta.get("analyzer") != ANALYZER:
            raise ValueError(f"{folder} was built with index format {meta.get('format')} / "
                             f"analyzer {meta.get('analyzer')!r}; this version reads format "
                             f"{FORMAT} / {ANALYZER!r}: rebuild the index")
        model = bm25s.BM25.load(folder, mmap=mmap, load_corpus=True, show_progress=False)
        if model.scores["num_docs"] != meta["num_passages"] or model.corpus is None:
            raise ValueError(f"{folder}: the index files disagree with {META_NAME} "
                             "(a copy cut short?): rebuild the index")
        return cls(model, folder, meta)

    def __len__(self) -> int:
        return int(self.model.scores["num_docs"])

    def search(self, queries: list[str], k: int) -> list[list[tuple[int, float]]]:
        """Per query, up to ``k`` ``(pid, score)`` of matching passages, best first."""
        k = validate_k(k)
        out: list[list[tuple[int, float]]] = []
        for terms in analyze(validate_queries(queries)):
            ids = self.model.get_tokens_ids(terms)  # terms absent from the corpus dropped
            if not ids:
                out.append([])
                continue
            scores = self.model.get_scores(ids)  # [N] float32
            out.append(top_k(scores, k))
        return out

    def passage(self, pid: int) -> Passage:
        if not 0 <= pid < len(self):
            raise IndexError(f"pid {pid} out of range: the index holds {len(self)} passages")
        row = self.model.corpus[int(pid)]
        return Passage(pid=int(row["pid"]), doc_id=str(row["doc_id"]), text=row["text"])

    def passages(self, pids: Sequence[int]) -> list[Passage]:
        return [self.passage(p) for p in pids]


def top_k(scores: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The ``k`` best ``(pid, score)`` among passages with score > 0 (matching passages),
    by score descending, then pid ascending."""
    pids = np.flatnonzero(scores > 0)
    if pids.size > k:
        sub = scores[pids]
        kth = np.partition(sub, pids.size - k)[pids.size - k]  # the k-th largest score
        pids = pids[sub >= kth]  # k plus any tied with the k-th
    s = scores[pids]
    order = np.lexsort((pids, -s))[:k]
    return [(int(pids[i]), float(s[i])) for i in order]


def _check_target(folder: Path) -> None:
    if folder.is_file():
        raise ValueError(f"{folder} is a file; give a folder for the index")
    if folder.is_dir() and any(folder.iterdir()) and not (folder / META_NAME).is_file():
        raise ValueError(f"{folder} exists and is not a BM25 index; refusing to replace it: "
                         "choose another folder or empty it")


def _swap_into_place(tmp: Path, folder: Path) -> None:
    """Rename ``tmp`` to ``folder``; an existing ``folder`` is moved aside first, then removed."""
    if not folder.exists():
        os.replace(tmp, folder)
        return
    old = folder.parent / f".{folder.name}.{os.getpid()}.old"
    shutil.rmtree(old, ignore_errors=True)
    os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def validate_k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    return int(k)


def validate_queries(queries: Sequence[str]) -> list[str]:
    if isinstance(queries, str):
        raise ValueError("queries must be a list of strings, not one string")
    queries = list(queries)
    bad = next((i for i, q in enumerate(queries) if not isinstance(q, str)), None)
    if bad is not None:
        raise ValueError(f"query {bad} is a {type(queries[bad]).__name__}, not a string: "
                         "turn task rows into text with query_texts(examples)")
    return queries


# ----------------------------------------------------------------------------- retrieval


def default_k(num_examples: int) -> int:
    """The paper's K for a task with ``num_examples`` training examples (``K_DEFAULTS``)."""
    if num_examples < 0:
        raise ValueError(f"num_examples must be >= 0, got {num_examples}")
    return next(k for minimum, k in K_DEFAULTS if num_examples >= minimum)


def query_texts(examples: Iterable[Any]) -> list[str]:
    """One query string per task example, from its input text fields only, never its label.

    GLUE rows: ``text_a`` (+ " " + ``text_b`` for pairs); CoNLL rows: the tokens joined by
    spaces; SQuAD rows: question + " " + context (never the answers); text rows (masked-LM,
    ListOps): ``text``; plain strings as they are; mappings: the first of "text",
    "sentence" (+ "text_b"/"sentence2" when present).
    """
    out = []
    for i, ex in enumerate(examples):
        if isinstance(ex, str):
            out.append(ex)
        elif isinstance(ex, Mapping):
            first = next((ex[key] for key in ("text", "text_a", "sentence", "sentence1")
                          if isinstance(ex.get(key), str)), None)
            if first is None:
                raise ValueError(f"example {i}: a mapping needs a 'text' or 'sentence' string "
                                 f"field; it has {sorted(ex)}")
            second = next((ex[key] for key in ("text_b", "sentence2")
                           if isinstance(ex.get(key), str)), None)
            out.append(first if second is None else f"{first} {second}")
        elif hasattr(ex, "text_a"):  # GlueExample
            out.append(ex.text_a if ex.text_b is None else f"{ex.text_a} {ex.text_b}")
        elif hasattr(ex, "tokens"):  # NerExample
            out.append(" ".join(ex.tokens))
        elif hasattr(ex, "question") and hasattr(ex, "context"):  # SquadExample
            out.append(f"{ex.question} {ex.context}")
        elif isinstance(getattr(ex, "text", None), str):  # TextExample, ListOpsExample
            out.append(ex.text)
        else:
            raise ValueError(f"example {i}: no text field on a {type(ex).__name__}; pass GLUE, "
                             "CoNLL, SQuAD or text rows, mappings with 'text', or strings")
    return out


def retrieve(backend: SearchBackend, texts: list[str], k: int, *, progress: bool = True,
             batch_size: int = 256) -> list[Hit]:
    """Top-``k`` passages per query text, their union de-duplicated (module docstring),
    sorted by pid. Warns naming the queries that matched nothing; raises
    ``EmptyRetrievalError`` when no query matched anything."""
    k = validate_k(k)
    texts = validate_queries(texts)
    if not texts:
        raise ValueError("no query texts: the task split is empty")
    from tqdm.auto import tqdm

    best: dict[int, tuple[int, float, int]] = {}  # pid -> (rank, -score, query)
    unmatched: list[int] = []
    with tqdm(total=len(texts), desc="BM25 retrieval", unit="query", disable=not progress) as bar:
        for start in range(0, len(texts), batch_size):
            batch = texts[start:start + batch_size]
            results = backend.search(batch, k)
            if len(results) != len(batch):
                raise RuntimeError(f"the search backend answered {len(results)} of "
                                   f"{len(batch)} queries")
            for j, hits in enumerate(results):
                if not hits:
                    unmatched.append(start + j)
                for rank, (pid, score) in enumerate(hits):
                    key = (rank, -float(score), start + j)
                    if pid not in best or key < best[pid]:
                        best[pid] = key
            bar.update(len(batch))
    if not best:
        raise EmptyRetrievalError(
            f"none of the {len(texts)} queries matched a passage (k={k}): the index and the "
            "task share no word; check that the corpus and the task are in one language")
    if unmatched:
        warnings.warn(f"{len(unmatched)} of {len(texts)} queries matched no passage "
                      f"(query indices {unmatched[:10]}{' ...' if len(unmatched) > 10 else ''})",
                      stacklevel=2)
    pids = sorted(best)
    return [Hit(pid=p.pid, text=p.text, doc_id=p.doc_id, rank=best[p.pid][0],
                score=-best[p.pid][1], query_index=best[p.pid][2])
            for p in backend.passages(pids)]


def random_passages(backend_or_passages: SearchBackend | Sequence[Passage], count: int,
                    seed: int) -> list[Hit]:
    """The "random retrieval" control: ``count`` passages drawn uniformly without replacement
    (numpy ``default_rng(seed)``), sorted by pid; rank -1, score 0, query_index -1."""
    n = len(backend_or_passages)
    if not 1 <= count <= n:
        raise ValueError(f"count must be between 1 and the {n} passages, got {count}")
    pids = sorted(int(p) for p in np.random.default_rng(seed).choice(n, size=count,
                                                                       replace=False))
    if isinstance(backend_or_passages, Sequence):
        chosen = [backend_or_passages[p] for p in pids]
    else:
        chosen = backend_or_passages.passages(pids)
    return [Hit(pid=p.pid, text=p.text, doc_id=p.doc_id, rank=-1, score=0.0, query_index=-1)
            for p in chosen]


def write_hits(path: str | Path, hits: Sequence[Hit]) -> Path:
    """JSON lines ``{"text", "id" (= pid), "doc_id", "rank", "score", "query_index"}``,
    written atomically; ``tasks.mlm.read_texts`` reads them back as training text."""
    if not hits:
        raise EmptyRetrievalError("no hits to write: retrieval found nothing to train on")
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for h in hits:
            f.write(json.dumps({"text": h.text, "id": h.pid, "doc_id": h.doc_id, "rank": h.rank,
                                "score": h.score, "query_index": h.query_index},
                               ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return path

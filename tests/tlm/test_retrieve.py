"""TLM retrieval: passages, the embedded BM25 index against a brute-force Lucene BM25,
the de-duplicated union, label-free queries, bad input, hits files, the random control."""

from __future__ import annotations

import json
import math
import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from attnlab.tasks.base import DataFormatError
from attnlab.tasks.conll import NerExample
from attnlab.tasks.glue import GlueExample
from attnlab.tasks.mlm import TextExample, read_texts
from attnlab.tasks.squad import SquadExample
from attnlab.tlm import retrieve as rt
from attnlab.tlm.retrieve import (
    Bm25Index,
    EmptyRetrievalError,
    Hit,
    Passage,
    SearchBackend,
    analyze,
    default_k,
    query_texts,
    random_passages,
    read_corpus,
    retrieve,
    split_passages,
    write_hits,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tasks"))
from tasks_helpers import need_data  # noqa: E402

# Hand-built corpus: shared and rare terms, repeated terms, varied lengths, stopwords kept,
# single letters, one exact duplicate (pids 6 and 7) for ties.
TEXTS = [
    "The cat sat on the mat and the cat slept.",
    "A dog chased the cat across the garden.",
    "Dogs and cats are common pets; a dog is loyal.",
    "The stock market fell as interest rates rose.",
    "Interest in cats rose sharply after the cat video.",
    "Mat weaving is an old craft: a mat of reeds, a mat of grass, a mat of wool.",
    "Quantum computers use qubits.",
    "Quantum computers use qubits.",
    "The garden has a pond, a bench and a big old oak tree where the dog sleeps at noon.",
    "I saw a cat.",
]
QUERIES = ["cat on a mat", "dog in the garden", "interest rates", "quantum qubits",
           "the", "a cat and a dog and a cat", "unmatched zzzz"]


@pytest.fixture(scope="module")
def passages() -> list[Passage]:
    return [Passage(i, f"d{i}", t) for i, t in enumerate(TEXTS)]


@pytest.fixture(scope="module")
def index(passages, tmp_path_factory) -> Bm25Index:
    return Bm25Index.build(passages, tmp_path_factory.mktemp("bm25") / "idx",
                           show_progress=False)


def lucene_bm25(docs: list[list[str]], query: list[str], k1: float, b: float) -> list[float]:
    """Brute-force Lucene BM25 (Lucene >= 8 / Elasticsearch 8 form), float64."""
    n = len(docs)
    avgdl = sum(len(d) for d in docs) / n
    df = Counter(t for d in docs for t in set(d))
    out = []
    for d in docs:
        tf = Counter(d)
        s = 0.0
        for t in query:  # a repeated query term counts once per repetition
            if tf[t]:
                idf = math.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5))
                s += idf * tf[t] / (tf[t] + k1 * (1 - b + b * len(d) / avgdl))
        out.append(s)
    return out


def brute_top_k(scores: list[float], k: int) -> list[int]:
    order = sorted((i for i, s in enumerate(scores) if s > 0), key=lambda i: (-scores[i], i))
    # guard: neighbours in the ranking are exact ties (identical passages) or clearly
    # apart, so float32 rounding in the index cannot reorder them
    for a, c in zip(order, order[1:], strict=False):
        gap = scores[a] - scores[c]
        assert gap == 0 or gap > 1e-4 * scores[a], (a, c, gap)
    return order[:k]


def test_analyze_is_lowercase_words_without_stopword_removal():
    assert analyze(["The U.S. cat's 3,000 e-mails: don't STOP at 3.14, a I."]) == [
        ["the", "u.s", "cat's", "3,000", "e", "mails", "don't", "stop", "at", "3.14", "a", "i"]]
    assert analyze(["!!! ..."]) == [[]]


@pytest.mark.parametrize(("k1", "b"), [(1.2, 0.75), (0.9, 0.4)])
def test_exact_top_k_against_brute_force_bm25(passages, tmp_path, k1, b):
    index = Bm25Index.build(passages, tmp_path / "idx", k1=k1, b=b, show_progress=False)
    assert (index.k1, index.b) == (k1, b)
    docs = analyze(TEXTS)
    for k in (1, 3, len(TEXTS)):
        got = index.search(QUERIES, k)
        for q, hits in zip(QUERIES, got, strict=True):
            brute = lucene_bm25(docs, analyze([q])[0], k1, b)
            assert [p for p, _ in hits] == brute_top_k(brute, k), (q, k)
            for pid, score in hits:  # float32 index weights: rel 1e-5
                assert score == pytest.approx(brute[pid], rel=1e-5), (q, pid)


def test_ties_go_to_lower_pid_and_only_matches_are_returned(index):
    (hits,) = index.search(["quantum qubits"], 5)
    assert [p for p, _ in hits] == [6, 7] and hits[0][1] == hits[1][1]
    (hits,) = index.search(["quantum qubits"], 1)
    assert [p for p, _ in hits] == [6]
    assert index.search(["unmatched zzzz", ""], 3) == [[], []]


def test_index_is_memory_mapped_and_reloads_identically(index, passages):
    mapped = Bm25Index.load(index.folder, mmap=True)
    assert isinstance(mapped.model.scores["data"], np.memmap)
    loaded = Bm25Index.load(index.folder, mmap=False)
    assert not isinstance(loaded.model.scores["data"], np.memmap)
    assert mapped.search(QUERIES, 4) == loaded.search(QUERIES, 4) == index.search(QUERIES, 4)
    assert len(mapped) == len(passages)
    assert [mapped.passage(i) for i in range(len(passages))] == passages
    assert isinstance(mapped, SearchBackend)
    with pytest.raises(IndexError, match="out of range"):
        mapped.passage(len(passages))


def test_build_is_atomic_and_guards_folders(passages, tmp_path, monkeypatch):
    import bm25s

    target = tmp_path / "idx"

    def broken_save(self, save_dir, **kw):
        Path(save_dir).mkdir(parents=True)
        (Path(save_dir) / "data.csc.index.npy").write_bytes(b"half")
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(bm25s.BM25, "save", broken_save)
        with pytest.raises(OSError, match="disk full"):
            Bm25Index.build(passages, target, show_progress=False)
    assert os.listdir(tmp_path) == []  # no index, no temporary folder

    Bm25Index.build(passages[:3], target, show_progress=False)
    assert len(Bm25Index.build(passages, target, show_progress=False)) == len(passages)
    assert sorted(os.listdir(tmp_path)) == ["idx"]  # replaced in place, nothing left over

    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a BM25 index; refusing"):
        Bm25Index.build(passages, other, show_progress=False)
    with pytest.raises(FileNotFoundError, match="not a BM25 index"):
        Bm25Index.load(other)
    with pytest.raises(ValueError, match="pids must be 0..n-1"):
        Bm25Index.build(passages[1:], tmp_path / "x", show_progress=False)
    with pytest.raises(ValueError, match="corpus is empty"):
        Bm25Index.build([], tmp_path / "x", show_progress=False)


def test_split_passages_near_equal_chunks_of_at_most_max_tokens():
    words = [f"w{i}" for i in range(130)]
    doc = TextExample("doc", "  ".join(words))
    parts = split_passages([doc, TextExample("punct", "!!! ... --"),
                            TextExample("short", "Hello,\tworld!")], max_tokens=128)
    assert [len(p.text.split()) for p in parts] == [65, 65, 2]
    assert " ".join(p.text for p in parts[:2]).split() == words  # nothing lost or reordered
    assert parts[0].text.startswith("w0  w1")  # original spacing kept inside a chunk
    assert [p.pid for p in parts] == [0, 1, 2]
    assert [p.doc_id for p in parts] == ["doc", "doc", "short"]  # punctuation-only dropped
    assert parts[2].text == "Hello,\tworld!"
    sizes = [len(p.text.split()) for p in split_passages([doc], max_tokens=40)]
    assert sorted(sizes) == [32, 32, 33, 33]  # ceil(130 / 40) = 4 chunks, sizes differ by <= 1
    with pytest.raises(ValueError, match="max_tokens"):
        split_passages([doc], max_tokens=0)


class ScriptedBackend:
    """Fixed search answers; records the queries it was sent."""

    def __init__(self, answers, passages):
        self.answers, self._passages, self.sent = answers, passages, []

    def search(self, queries, k):
        self.sent.extend(queries)
        return [self.answers[q][:k] for q in queries]

    def passage(self, pid):
        return self._passages[pid]

    def passages(self, pids):
        return [self._passages[p] for p in pids]

    def __len__(self):
        return len(self._passages)


def test_union_keeps_best_rank_then_score_then_first_query(passages):
    answers = {
        "q0": [(3, 9.0), (1, 5.0), (2, 4.0)],
        "q1": [(1, 7.0), (3, 6.0)],  # pid 1: rank 1 in q0, rank 0 here -> rank 0, q1
        "q2": [(5, 2.0), (2, 3.0)],  # pid 2: rank 2 in q0, rank 1 here -> rank 1, q2
        "q3": [(5, 2.5)],  # pid 5: rank 0 in q2 (2.0) and here (2.5) -> higher score wins
        "q4": [(3, 9.0)],  # pid 3: rank 0, score 9 in q0 and here -> first query wins
    }
    backend = ScriptedBackend(answers, passages)
    hits = retrieve(backend, list(answers), 3, progress=False, batch_size=2)
    assert [(h.pid, h.rank, h.score, h.query_index) for h in hits] == [
        (1, 0, 7.0, 1), (2, 1, 3.0, 2), (3, 0, 9.0, 0), (5, 0, 2.5, 3)]
    assert hits[0] == Hit(1, passages[1].text, "d1", 0, 7.0, 1)
    # k truncates each query's list before the union
    assert [h.pid for h in retrieve(backend, ["q0"], 1, progress=False)] == [3]


def test_empty_retrieval_is_an_error_and_unmatched_queries_are_reported(index):
    with pytest.raises(EmptyRetrievalError, match="none of the 2 queries matched"):
        retrieve(index, ["zzzz", "!!!"], 5, progress=False)
    assert issubclass(EmptyRetrievalError, ValueError)
    with pytest.warns(UserWarning, match=r"1 of 2 queries matched no passage \(query indices "
                                         r"\[1\]\)"):
        hits = retrieve(index, ["quantum", "zzzz"], 5, progress=False)
    assert [h.pid for h in hits] == [6, 7]
    with pytest.raises(ValueError, match="no query texts"):
        retrieve(index, [], 5, progress=False)
    with pytest.raises(ValueError, match="query 0 is a GlueExample"):
        retrieve(index, [GlueExample("g", "cat", None, 1)], 5, progress=False)
    with pytest.raises(EmptyRetrievalError, match="no hits to write"):
        write_hits(Path("never-written.jsonl"), [])
    assert not Path("never-written.jsonl").exists()


def test_labels_never_reach_the_query(tmp_path):
    # every label word is planted in a passage of its own; only the input text may match
    labels = ["zebra", "acceptable", "b-loc", "giraffe"]
    texts = ["a quiet cat naps", "Paris is lovely in spring", "who painted the ceiling",
             "plain sentence here"] + [f"{w} {w} {w}" for w in labels]
    index = Bm25Index.build([Passage(i, str(i), t) for i, t in enumerate(texts)],
                            tmp_path / "idx", show_progress=False)
    examples = [
        {"text": "a quiet cat", "label": "zebra"},
        GlueExample("g-1", "the cat naps", None, label=1),  # CoLA label 1 = "acceptable"
        NerExample("n-1", ("Paris", "is", "lovely"), ("NNP", "VBZ", "JJ"), ("O", "O", "O"),
                   ("B-LOC", "O", "O")),
        SquadExample("s-1", "t", "Michelangelo painted the ceiling.", "who painted the "
                     "ceiling", answers=("giraffe",), answer_starts=(0,)),
        TextExample("t-1", "plain sentence"),
    ]
    queries = query_texts(examples)
    assert queries == ["a quiet cat", "the cat naps", "Paris is lovely",
                       "who painted the ceiling Michelangelo painted the ceiling.",
                       "plain sentence"]
    spy = ScriptedBackend({q: r for q, r in zip(queries, index.search(queries, 10),
                                                strict=True)}, index.passages(range(len(texts))))
    hits = retrieve(spy, queries, 10, progress=False)
    assert {h.pid for h in hits} == {0, 1, 2, 3}  # none of the planted label passages
    sent_terms = {t for terms in analyze(spy.sent) for t in terms}
    assert spy.sent == queries and not set(labels) & sent_terms


def test_query_texts_pairs_and_unknown_rows():
    assert query_texts([GlueExample("g", "first part", "second part", 0),
                        {"sentence1": "a", "sentence2": "b", "label": 1}, "raw"]) == [
        "first part second part", "a b", "raw"]
    with pytest.raises(ValueError, match="example 0: no text field on a int"):
        query_texts([3])
    with pytest.raises(ValueError, match="example 0: a mapping needs"):
        query_texts([{"label": "x"}])


def test_read_corpus_reports_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "cut\n')
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:2: broken JSON"):
        read_corpus(bad)
    missing = tmp_path / "folder" / "b.jsonl"
    missing.parent.mkdir()
    (missing.parent / "a.txt").write_text("one doc\n\nanother doc\n")
    missing.write_text('{"text": "ok", "id": "x1"}\n\n{"body": "no text"}\n')
    with pytest.raises(DataFormatError, match=r"b\.jsonl:3: expected an object with a \"text\""):
        read_corpus(missing.parent)
    missing.write_text('{"text": "ok", "id": "x1"}\n')
    (missing.parent / ".hidden.txt").write_text("skipped\n")
    docs = read_corpus(missing.parent)
    assert [(d.guid, d.text) for d in docs] == [("a.txt:1", "one doc"), ("a.txt:3", "another doc"),
                                                ("x1", "ok")]
    (tmp_path / "c.csv").write_text("x,y\n")
    with pytest.raises(ValueError, match="must be .jsonl or .txt"):
        read_corpus(tmp_path / "c.csv")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_corpus(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .jsonl or .txt files"):
        read_corpus(tmp_path / "empty")


def test_write_hits_round_trips_through_read_texts(tmp_path, index):
    hits = retrieve(index, ["cat mat", "quantum"], 2, progress=False)
    path = write_hits(tmp_path / "sel" / "selected.jsonl", hits)
    assert [(d.guid, d.text) for d in read_texts(path)] == [(str(h.pid), h.text) for h in hits]
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert set(rows[0]) == {"text", "id", "doc_id", "rank", "score", "query_index"}
    assert [r["rank"] for r in rows] == [h.rank for h in hits]
    assert os.listdir(path.parent) == ["selected.jsonl"]


def test_random_passages_seeded_uniform_without_replacement(index, passages):
    a = random_passages(index, 4, seed=3)
    assert a == random_passages(index, 4, seed=3) == random_passages(passages, 4, seed=3)
    assert len({h.pid for h in a}) == 4 and [h.pid for h in a] == sorted(h.pid for h in a)
    assert all(h.rank == -1 and h.score == 0.0 and h.text == TEXTS[h.pid] for h in a)
    assert random_passages(index, 4, seed=4) != a
    # uniform: over 3,000 seeds each of 10 pids is drawn 3,000 * 3/10 = 900 times on average;
    # binomial sd = sqrt(3000 * 0.3 * 0.7) = 25.1, bound 5 sd
    counts = Counter(h.pid for s in range(3000) for h in random_passages(passages, 3, seed=s))
    assert all(abs(counts[p] - 900) < 5 * 25.1 for p in range(10)), counts
    with pytest.raises(ValueError, match="between 1 and the 10 passages"):
        random_passages(passages, 11, seed=0)


def test_default_k_follows_the_paper():
    assert [default_k(n) for n in (500, 9_999, 10_000, 20_000, 99_999, 100_000, 180_000)] == [
        5000, 5000, 500, 500, 500, 50, 50]
    assert rt.K_DEFAULTS[0] == (100_000, 50)
    with pytest.raises(ValueError):
        default_k(-1)


def test_shared_corpus_smoke(tmp_path):
    corpus = need_data("corpus_en", "docs.jsonl")
    rows = need_data("glue", "CoLA").parent.parent
    from attnlab.tasks import get_task

    docs = read_corpus(corpus)[:50]
    passages = split_passages(docs)
    assert all(len(p.text.split()) <= 128 for p in passages)
    index = Bm25Index.build(passages, tmp_path / "idx", show_progress=False)
    dev = get_task("cola").load("dev", rows)[:20]
    hits = retrieve(index, query_texts(dev), 5, progress=False)
    assert 0 < len(hits) <= 100 and all(0 <= h.rank < 5 for h in hits)


def test_bench_retrieval_runs_on_a_tiny_corpus(tmp_path):
    from attnlab.bench.retrieval import bench_retrieval, format_markdown

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"{t} doc {i}", "id": i}) + "\n"
                              for i, t in enumerate(TEXTS * 4)))
    res = bench_retrieval(corpus, queries=QUERIES, k=3, num_queries=5, repeats=1,
                          isolate=False, workdir=tmp_path)
    assert [p["passages"] for p in res["points"]] == [10, 20, 40]
    assert res["num_queries"] == 5 and res["projection"]["target_passages"] == 10**7
    assert all(p["index_bytes"] < p["total_bytes"] for p in res["points"])
    assert "| 40 |" in format_markdown(res)
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl"]  # the indices were temporary

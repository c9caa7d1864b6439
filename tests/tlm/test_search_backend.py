"""Elasticsearch/OpenSearch backend: request building and response parsing against
hand-written Elasticsearch 8 responses (fixtures/README.md); no server is contacted."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from attnlab.tasks.base import MissingPackageError
from attnlab.tlm import search_backend as sb
from attnlab.tlm.retrieve import (
    Bm25Index,
    Hit,
    Passage,
    SearchBackend,
    random_passages,
    retrieve,
)

FIXTURES = Path(__file__).parent / "fixtures"
PASSAGES = [Passage(i, f"doc{i // 2}", t) for i, t in enumerate([
    "The cat sat on the mat.", "A dog barks at the cat.", "Dogs bark loudly at night.",
    "The mat is red.", "Stock markets fell sharply today."])]
QUERIES = ["cat on the mat", "dogs bark", "zebra"]


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


class FakeIndices:
    def __init__(self, client: FakeClient, exists: bool) -> None:
        self.client, self._exists = client, exists

    def exists(self, **kw):
        self.client.calls.append(("indices.exists", kw))
        return self._exists

    def create(self, **kw):
        self.client.calls.append(("indices.create", kw))
        return fixture("es_create_index")

    def delete(self, **kw):
        self.client.calls.append(("indices.delete", kw))
        return {"acknowledged": True}

    def refresh(self, **kw):
        self.client.calls.append(("indices.refresh", kw))
        return {"_shards": {"total": 1, "successful": 1, "failed": 0}}


class FakeClient:
    """Stands in for elasticsearch.Elasticsearch: records calls, answers with fixtures."""

    def __init__(self, answers: dict[str, list[str]], exists: bool = False) -> None:
        self.answers = {k: list(v) for k, v in answers.items()}
        self.calls: list[tuple[str, dict]] = []
        self.indices = FakeIndices(self, exists)

    def _answer(self, name: str, kw: dict):
        self.calls.append((name, kw))
        return Response(fixture(self.answers[name].pop(0)))

    def bulk(self, **kw):
        return self._answer("bulk", kw)

    def msearch(self, **kw):
        return self._answer("msearch", kw)

    def mget(self, **kw):
        return self._answer("mget", kw)

    def count(self, **kw):
        return self._answer("count", kw)


class Response:
    """Like the client's ObjectApiResponse: the JSON is under ``.body``."""

    def __init__(self, body: dict) -> None:
        self.body = body


def test_index_definition_is_standard_analyzer_bm25_with_our_k1_b():
    d = sb.index_definition(k1=1.2, b=0.75)
    sim = d["settings"]["index"]["similarity"]["tlm_bm25"]
    assert sim == {"type": "BM25", "k1": 1.2, "b": 0.75}
    text = d["mappings"]["properties"]["text"]
    assert text == {"type": "text", "analyzer": "standard", "similarity": "tlm_bm25"}
    assert d["settings"]["index"]["number_of_shards"] == 1
    assert d["mappings"]["dynamic"] == "strict"  # a stray field (a label) is refused


def test_bulk_operations_and_msearch_body():
    ops = sb.bulk_operations("tlm_test", PASSAGES[:2])
    assert ops == [
        {"index": {"_index": "tlm_test", "_id": "0"}},
        {"pid": 0, "doc_id": "doc0", "text": "The cat sat on the mat."},
        {"index": {"_index": "tlm_test", "_id": "1"}},
        {"pid": 1, "doc_id": "doc0", "text": "A dog barks at the cat."},
    ]
    body = sb.msearch_body("tlm_test", ["a b", "c"], 7)
    assert body[0] == {"index": "tlm_test"} and body[2] == {"index": "tlm_test"}
    assert body[1] == {"query": {"match": {"text": {"query": "a b"}}}, "size": 7,
                       "_source": False, "track_total_hits": False}
    assert body[3]["query"]["match"]["text"]["query"] == "c"
    dfs = sb.msearch_body("tlm_test", ["a"], 1, dfs=True)
    assert dfs[0] == {"index": "tlm_test", "search_type": "dfs_query_then_fetch"}


def test_parse_responses():
    assert sb.parse_bulk(fixture("es_bulk_ok")) == 3
    with pytest.raises(sb.SearchServerError, match=r"1 of 2 documents: _id 1 .*strict_dynamic"):
        sb.parse_bulk(fixture("es_bulk_error"))
    res = sb.parse_msearch(fixture("es_msearch"), 3)
    assert [[p for p, _ in r] for r in res] == [[0, 3, 1], [2], []]
    assert res[0][0][1] == pytest.approx(1.6644806, rel=1e-7)
    with pytest.raises(sb.SearchServerError, match=r"query 11 failed \(status 400\).*"
                       r"maxClauseCount"):
        sb.parse_msearch(fixture("es_msearch_error"), 2, offset=10)
    with pytest.raises(sb.SearchServerError, match="answered 3 of 4"):
        sb.parse_msearch(fixture("es_msearch"), 4)
    got = sb.parse_mget(fixture("es_mget"), [3, 0])
    assert got == [PASSAGES[3], PASSAGES[0]]
    with pytest.raises(KeyError, match="passage 99"):
        sb.parse_mget(fixture("es_mget_missing"), [0, 99])
    assert sb.parse_count(fixture("es_count")) == 5


def test_backend_index_batches_bulk_and_refreshes():
    client = FakeClient({"bulk": ["es_bulk_ok", "es_bulk_ok_2"]})
    backend = sb.ElasticBackend(client, "tlm_test")
    assert backend.index(PASSAGES, batch_size=3) == 5
    names = [c[0] for c in client.calls]
    assert names == ["indices.exists", "indices.create", "bulk", "bulk", "indices.refresh"]
    create = client.calls[1][1]
    assert create["index"] == "tlm_test" and create["mappings"]["properties"]["text"][
        "analyzer"] == "standard"
    assert [op["_id"] for op in (o.get("index") for o in client.calls[3][1]["operations"]) if op
            ] == ["3", "4"]


def test_backend_refuses_existing_index_unless_recreate():
    client = FakeClient({"bulk": ["es_bulk_ok"]}, exists=True)
    backend = sb.ElasticBackend(client, "tlm_test")
    with pytest.raises(ValueError, match="already exists: pass recreate=True"):
        backend.index(PASSAGES[:3])
    backend.index(PASSAGES[:3], recreate=True)
    assert ("indices.delete", {"index": "tlm_test"}) in client.calls
    with pytest.raises(ValueError, match="passage 0 has pid 1"):
        backend.index(PASSAGES[1:], recreate=True)


def test_backend_search_batches_msearch_and_agrees_with_bm25_index(tmp_path):
    client = FakeClient({"msearch": ["es_msearch"]})
    backend = sb.ElasticBackend(client, "tlm_test", msearch_batch=64)
    got = backend.search(QUERIES, 3)
    (name, kw), = client.calls
    assert name == "msearch" and kw["searches"] == sb.msearch_body("tlm_test", QUERIES, 3)
    # the embedded backend on the same corpus: same pids in the same order, same scores
    # (to float32 rounding, rel 1e-6)
    local = Bm25Index.build(PASSAGES, tmp_path / "idx", show_progress=False).search(QUERIES, 3)
    assert [[p for p, _ in r] for r in got] == [[p for p, _ in r] for r in local]
    for r_es, r_local in zip(got, local, strict=True):
        for (_, s_es), (_, s_local) in zip(r_es, r_local, strict=True):
            assert s_es == pytest.approx(s_local, rel=1e-6)


def test_retrieve_through_elastic_backend():
    client = FakeClient({"msearch": ["es_msearch"]})
    backend = sb.ElasticBackend(client, "tlm_test")
    assert isinstance(backend, SearchBackend)

    def mget(**kw):  # answer any mget from PASSAGES, in the fixture's format
        client.calls.append(("mget", kw))
        return {"docs": [{"_index": "tlm_test", "_id": i, "found": True, "_source": {
            "pid": int(i), "doc_id": PASSAGES[int(i)].doc_id, "text": PASSAGES[int(i)].text}}
            for i in kw["ids"]]}

    client.mget = mget
    with pytest.warns(UserWarning, match="1 of 3 queries matched no passage"):
        hits = retrieve(backend, QUERIES, 3, progress=False)
    assert [h.pid for h in hits] == [0, 1, 2, 3]
    assert hits[0] == Hit(pid=0, text=PASSAGES[0].text, doc_id="doc0", rank=0,
                          score=pytest.approx(1.6644806), query_index=0)
    assert client.calls[-1] == ("mget", {"index": "tlm_test", "ids": ["0", "1", "2", "3"]})


def test_len_passage_and_random_control():
    client = FakeClient({"count": ["es_count"], "mget": ["es_mget"]})
    backend = sb.ElasticBackend(client, "tlm_test")
    assert len(backend) == 5
    assert backend.passages([3, 0]) == [PASSAGES[3], PASSAGES[0]]
    client.answers["count"] = ["es_count"]
    client.answers["mget"] = ["es_mget_missing"]
    with pytest.raises(KeyError, match="not in the index"):
        random_passages(backend, 2, seed=0)


def test_search_rejects_k_beyond_result_window_and_bad_names():
    backend = sb.ElasticBackend(FakeClient({}), "tlm_test")
    with pytest.raises(ValueError, match="max_result_window"):
        backend.search(["a"], 10_001)
    with pytest.raises(ValueError, match="positive integer"):
        backend.search(["a"], 0)
    with pytest.raises(ValueError, match="lowercase"):
        sb.ElasticBackend(FakeClient({}), "TLM")


def test_opensearch_client_gets_body_keyword():
    OsClient = type("OpenSearch", (FakeClient,), {"__module__": "opensearchpy.client"})
    client = OsClient({"bulk": ["es_bulk_ok"], "msearch": ["es_msearch"]})
    backend = sb.ElasticBackend(client, "tlm_test")
    backend.index(PASSAGES[:3])
    backend.search(QUERIES, 3)
    calls = dict((n, kw) for n, kw in client.calls)
    assert set(calls["indices.create"]) == {"index", "body"}
    assert "body" in calls["bulk"] and "body" in calls["msearch"]


def test_missing_client_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "elasticsearch" else real(name, *a))
    with pytest.raises(MissingPackageError, match=r"pip install 'attnlab\[search\]'"):
        sb.ElasticBackend("http://localhost:9200", "tlm_test")

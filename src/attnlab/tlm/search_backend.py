"""Elasticsearch / OpenSearch backend for TLM retrieval, for corpora beyond one machine.

Yao et al., "NLP From Scratch Without Large-Scale Pretraining: A Simple and Efficient
Framework", ICML 2022, selected its data with Elasticsearch (official code
``src/data_selection.py``: one index, a ``text`` field with the ``standard`` analyzer and
similarity ``BM25`` at Elasticsearch's defaults k1 = 1.2, b = 0.75, one shard, full-text
queries). This backend builds the same index through the official Python client and answers
the ``SearchBackend`` interface of ``attnlab.tlm.retrieve`` (``search``, ``passage``,
``passages``, ``len``), so ``retrieve(ElasticBackend(...), texts, k)`` works as with the
embedded ``Bm25Index``.

Start a server (no server can be installed where this code was written and tested)::

    docker run --rm -p 9200:9200 -e discovery.type=single-node \\
        -e xpack.security.enabled=false -e ES_JAVA_OPTS="-Xms4g -Xmx4g" \\
        docker.elastic.co/elasticsearch/elasticsearch:8.15.3
    # or OpenSearch:
    docker run --rm -p 9200:9200 -e discovery.type=single-node \\
        -e DISABLE_SECURITY_PLUGIN=true -e DISABLE_INSTALL_DEMO_CONFIG=true \\
        opensearchproject/opensearch:2.17.1

then ``pip install 'attnlab[search]'`` (the ``elasticsearch`` client; for OpenSearch install
``opensearch-py`` and pass its ``OpenSearch`` client object) and::

    backend = ElasticBackend("http://localhost:9200", "tlm_corpus")
    backend.index(split_passages(read_corpus("corpus.jsonl")))
    hits = retrieve(backend, query_texts(rows), k=50)

Testing: the request bodies (index settings and mapping, bulk, msearch, mget) are built and
the responses parsed by plain functions, tested with a stand-in client against responses
in the Elasticsearch 8 format (``tests/tlm/fixtures``) that were written by hand from the API
reference, not recorded from a live server (none can run here); no test talks to a server.

Index layout: document ``_id`` = str(pid), fields ``pid`` (integer), ``doc_id`` (keyword,
not indexed), ``text`` (standard analyzer, BM25 similarity with our k1 and b). Searches are
``match`` queries on ``text`` (OR of the analysed terms, as the official code's single-field
``multi_match``), ``size`` = k, ``_source`` off; passage texts come from ``mget`` afterwards.

Differences from ``Bm25Index`` (same formula, same k1 and b): Lucene stores each passage's
length in one byte (lossy above small lengths), so scores differ slightly and near-ties can
swap; the analyzers differ on rare strings (see ``retrieve.TOKEN_PATTERN``); ties are broken
by Lucene's document order, not by pid (hits are re-sorted by (score desc, pid) within the
returned k). With more than one shard, queries use ``dfs_query_then_fetch`` so idf and avgdl
are global, as on one shard. A query with more terms than the cluster's
``indices.query.bool.max_clause_count`` fails; the error names the query.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..tasks.base import require_package
from .retrieve import K1, B, Passage, validate_k, validate_queries

TEXT_FIELD = "text"
MAX_RESULT_WINDOW = 10_000  # Elasticsearch's default index.max_result_window (size limit)


class SearchServerError(RuntimeError):
    """The search server refused a request; the message names the item and the reason."""


# ----------------------------------------------------------------------------- requests


def index_definition(k1: float = K1, b: float = B, shards: int = 1,
                     replicas: int = 0) -> dict[str, Any]:
    """Settings and mappings for ``indices.create``: standard analyzer, BM25(k1, b)."""
    return {
        "settings": {"index": {
            "number_of_shards": shards,
            "number_of_replicas": replicas,
            "similarity": {"tlm_bm25": {"type": "BM25", "k1": k1, "b": b}},
        }},
        "mappings": {
            "dynamic": "strict",
            "properties": {
                "pid": {"type": "integer"},
                "doc_id": {"type": "keyword", "index": False},
                TEXT_FIELD: {"type": "text", "analyzer": "standard", "similarity": "tlm_bm25"},
            },
        },
    }


def bulk_operations(index_name: str, passages: Iterable[Passage]) -> list[dict[str, Any]]:
    """Bulk-API lines: an ``index`` action (``_id`` = pid) then the document, per passage."""
    ops: list[dict[str, Any]] = []
    for p in passages:
        ops.append({"index": {"_index": index_name, "_id": str(p.pid)}})
        ops.append({"pid": p.pid, "doc_id": p.doc_id, TEXT_FIELD: p.text})
    return ops


def msearch_body(index_name: str, queries: Sequence[str], k: int, *,
                 dfs: bool = False) -> list[dict[str, Any]]:
    """Multi-search lines: a header and a ``match`` query of size ``k`` per query."""
    header: dict[str, Any] = {"index": index_name}
    if dfs:
        header["search_type"] = "dfs_query_then_fetch"
    body = []
    for q in queries:
        body.append(dict(header))
        body.append({"query": {"match": {TEXT_FIELD: {"query": q}}}, "size": k,
                     "_source": False, "track_total_hits": False})
    return body


# ----------------------------------------------------------------------------- responses


def body_of(response: Any) -> Any:
    """The JSON body of a client response (``ObjectApiResponse.body``, or a plain dict)."""
    return getattr(response, "body", response)


def _reason(error: Any) -> str:
    if isinstance(error, Mapping):
        reason = f"{error.get('type', 'error')}: {error.get('reason', '')}".strip()
        cause = error.get("caused_by")
        root = error.get("root_cause") or []
        if isinstance(cause, Mapping):
            reason += f" (caused by {cause.get('type')}: {cause.get('reason')})"
        elif root and isinstance(root[0], Mapping):
            reason += f" (root cause {root[0].get('type')}: {root[0].get('reason')})"
        return reason
    return str(error)


def parse_bulk(response: Any) -> int:
    """Number of documents written; raises ``SearchServerError`` naming failed items."""
    body = body_of(response)
    items = body.get("items", [])
    failed = []
    for item in items:
        (action, result), = item.items()
        if "error" in result or result.get("status", 200) >= 300:
            failed.append(f"_id {result.get('_id')} ({action}, status {result.get('status')}): "
                          f"{_reason(result.get('error'))}")
    if failed or body.get("errors"):
        more = f" and {len(failed) - 3} more" if len(failed) > 3 else ""
        raise SearchServerError(f"bulk indexing failed for {len(failed)} of {len(items)} "
                                f"documents: {'; '.join(failed[:3])}{more}")
    return len(items)


def parse_msearch(response: Any, num_queries: int, offset: int = 0
                  ) -> list[list[tuple[int, float]]]:
    """Per query ``[(pid, score), ...]``, best first (score desc, then pid). A failed query
    raises ``SearchServerError`` naming it (``offset`` + its position in the batch)."""
    responses = body_of(response).get("responses", [])
    if len(responses) != num_queries:
        raise SearchServerError(f"msearch answered {len(responses)} of {num_queries} queries")
    out = []
    for i, r in enumerate(responses):
        if "error" in r:
            raise SearchServerError(f"query {offset + i} failed (status {r.get('status')}): "
                                    f"{_reason(r['error'])}")
        shards = r.get("_shards", {})
        if shards.get("failed"):
            raise SearchServerError(f"query {offset + i}: {shards['failed']} of "
                                    f"{shards.get('total')} shards failed")
        hits = [(int(h["_id"]), float(h["_score"])) for h in r["hits"]["hits"]]
        out.append(sorted(hits, key=lambda t: (-t[1], t[0])))
    return out


def parse_mget(response: Any, pids: Sequence[int]) -> list[Passage]:
    """Passages of an ``mget`` answer, in the order of ``pids``; missing ones raise."""
    docs = body_of(response).get("docs", [])
    if len(docs) != len(pids):
        raise SearchServerError(f"mget answered {len(docs)} of {len(pids)} ids")
    out = []
    for pid, d in zip(pids, docs, strict=True):
        if "error" in d:
            raise SearchServerError(f"fetching passage {pid} failed: {_reason(d['error'])}")
        if not d.get("found"):
            raise KeyError(f"passage {pid} is not in the index")
        src = d["_source"]
        out.append(Passage(pid=int(src["pid"]), doc_id=str(src["doc_id"]), text=src[TEXT_FIELD]))
    return out


def parse_count(response: Any) -> int:
    return int(body_of(response)["count"])


# ----------------------------------------------------------------------------- backend


class ElasticBackend:
    """TLM retrieval over Elasticsearch/OpenSearch BM25 (Yao et al., "NLP From Scratch
    Without Large-Scale Pretraining: A Simple and Efficient Framework", ICML 2022).

    ``client_or_url``: an ``elasticsearch.Elasticsearch`` (or ``opensearchpy.OpenSearch``)
    client, or a URL for which an Elasticsearch client is made (needs the ``search`` extra).
    See the module docstring for the server command, index layout and score differences.
    """

    def __init__(self, client_or_url: Any, index_name: str, *, k1: float = K1, b: float = B,
                 shards: int = 1, msearch_batch: int = 64) -> None:
        if isinstance(client_or_url, str):
            require_package("elasticsearch", "search", "the Elasticsearch retrieval backend")
            from elasticsearch import Elasticsearch  # optional: the search extra

            client_or_url = Elasticsearch(client_or_url, request_timeout=300)
        if not index_name or index_name != index_name.lower() or index_name.startswith("_"):
            raise ValueError(f"index name {index_name!r}: Elasticsearch needs a non-empty "
                             "lowercase name not starting with '_'")
        if shards < 1 or msearch_batch < 1:
            raise ValueError("shards and msearch_batch must be positive")
        self.client = client_or_url
        self.index_name = index_name
        self.k1, self.b, self.shards = k1, b, shards
        self.msearch_batch = msearch_batch
        # opensearch-py takes request bodies as body=; the Elasticsearch 8/9 client as keywords
        self._opensearch = type(self.client).__module__.startswith("opensearchpy")

    def create(self, *, recreate: bool = False) -> None:
        """Create the index (settings and mapping of ``index_definition``)."""
        if bool(self.client.indices.exists(index=self.index_name)):
            if not recreate:
                raise ValueError(f"index {self.index_name!r} already exists: pass "
                                 "recreate=True to replace it, or use another index name")
            self.client.indices.delete(index=self.index_name)
        definition = index_definition(self.k1, self.b, self.shards)
        if self._opensearch:
            self.client.indices.create(index=self.index_name, body=definition)
        else:
            self.client.indices.create(index=self.index_name, **definition)

    def index(self, passages: Iterable[Passage], batch_size: int = 1000, *,
              recreate: bool = False) -> int:
        """Create the index and bulk-load ``passages`` (pids 0..n-1 in order, as
        ``split_passages`` numbers them: ``random_passages`` draws from that range) in
        batches; returns the count. A failure midway leaves a partial index: index again
        with ``recreate=True``."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.create(recreate=recreate)
        total = 0
        batch: list[Passage] = []
        for i, p in enumerate(passages):
            if p.pid != i:
                raise ValueError(f"passage {i} has pid {p.pid}: pids must be 0..n-1 in order "
                                 "(split_passages numbers them so)")
            batch.append(p)
            if len(batch) == batch_size:
                total += self._bulk(batch)
                batch = []
        if batch:
            total += self._bulk(batch)
        if total == 0:
            raise ValueError("no passages to index: the corpus is empty")
        self.client.indices.refresh(index=self.index_name)
        return total

    def _bulk(self, batch: list[Passage]) -> int:
        ops = bulk_operations(self.index_name, batch)
        if self._opensearch:
            return parse_bulk(self.client.bulk(body=ops))
        return parse_bulk(self.client.bulk(operations=ops))

    def search(self, queries: list[str], k: int) -> list[list[tuple[int, float]]]:
        """Per query, up to ``k`` ``(pid, score)``, best first (one msearch per batch)."""
        k = validate_k(k)
        if k > MAX_RESULT_WINDOW:
            raise ValueError(f"k={k} exceeds Elasticsearch's index.max_result_window "
                             f"({MAX_RESULT_WINDOW}); raise that index setting first")
        queries = validate_queries(queries)
        out: list[list[tuple[int, float]]] = []
        for start in range(0, len(queries), self.msearch_batch):
            batch = queries[start:start + self.msearch_batch]
            body = msearch_body(self.index_name, batch, k, dfs=self.shards > 1)
            if self._opensearch:
                resp = self.client.msearch(body=body)
            else:
                resp = self.client.msearch(searches=body)
            out.extend(parse_msearch(resp, len(batch), offset=start))
        return out

    def passages(self, pids: Sequence[int], batch_size: int = 1000) -> list[Passage]:
        out: list[Passage] = []
        for start in range(0, len(pids), batch_size):
            chunk = [int(p) for p in pids[start:start + batch_size]]
            ids = [str(p) for p in chunk]
            if self._opensearch:
                resp = self.client.mget(index=self.index_name, body={"ids": ids})
            else:
                resp = self.client.mget(index=self.index_name, ids=ids)
            out.extend(parse_mget(resp, chunk))
        return out

    def passage(self, pid: int) -> Passage:
        return self.passages([pid])[0]

    def __len__(self) -> int:
        return parse_count(self.client.count(index=self.index_name))

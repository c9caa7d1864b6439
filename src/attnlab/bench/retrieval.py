"""Cost of TLM's embedded BM25 retrieval (``attnlab.tlm.retrieve.Bm25Index``).

Method: read the corpus and cut it into passages; then, on the first 25%, 50% and 100% of
the passages (prefixes, so each is a real corpus of that size), in a fresh Python process
per size (``isolate``; glibc told to return freed memory at once, ``MALLOC_MMAP_THRESHOLD_``):

* build the index ``repeats`` times (tokenise + bm25s index + write to disk + load
  memory-mapped; wall clock) and keep the fastest: the machine is shared, and other jobs only
  ever add time;
* build memory: the resident-set high-water mark during a build minus the resident size
  before it (Linux ``VmHWM``, reset before each build; the passages themselves are already in
  memory and not counted), the largest over the builds;
* size on disk: the score arrays and vocabulary, and with the stored passages;
* search: batched top-k of the query set, ``repeats`` runs after a warm-up, the fastest.

A least-squares line through the points of each quantity against the passage count gives
its slope; the projection at ``target`` passages (10^7 by default) is intercept + slope *
target, i.e. it assumes the costs stay linear in the passage count. They should: every build
step is a per-passage loop (profiled: tokenising ~half, then document frequencies, score
triplets, writing), bm25s holds every passage's token ids in memory while it builds, and a
query scores every passage sharing a term with it (queries keep stopwords, so that is most
passages) in a dense score vector of all passages.

Run: ``python -m attnlab.bench.retrieval --corpus ../shared/data/corpus_en/docs.jsonl
--data-root ../shared/data`` (queries: CoLA dev sentences). The machine is shared: timings
vary run to run (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..tlm.retrieve import Bm25Index, query_texts, read_corpus, retrieve, split_passages
from ..train.memory import peak_rss_mb, reset_peak_rss

INDEX_FILES = ("data.csc.index.npy", "indices.csc.index.npy", "indptr.csc.index.npy",
               "vocab.index.json", "params.index.json")


def cola_dev_sentences(data_root: str | Path) -> list[str]:
    """The CoLA dev sentences under a GLUE data root (the benchmark's queries)."""
    from ..tasks import get_task

    return query_texts(get_task("cola").load("dev", data_root))


def _rss_mb() -> float:
    """MiB resident now (Linux ``VmRSS``; nan elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _folder_bytes(folder: Path, names: Sequence[str] | None = None) -> int:
    files = [folder / n for n in names] if names is not None else list(folder.iterdir())
    return sum(f.stat().st_size for f in files if f.is_file())


def _fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line."""
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(slope), float(intercept)


def measure_point(corpus_path: str | Path, n: int, queries: Sequence[str], folder: str | Path,
                  *, max_tokens: int = 128, k: int = 50, repeats: int = 3) -> dict[str, Any]:
    """Build, size and search measurements on the first ``n`` passages of the corpus."""
    import bm25s  # noqa: F401  (imported before measuring: its import is not build memory)

    passages = split_passages(read_corpus(corpus_path), max_tokens=max_tokens)[:n]
    queries = list(queries)
    folder = Path(folder)
    builds, peaks = [], []
    for _ in range(repeats):  # each build replaces the previous one in ``folder``
        before, exact = _rss_mb(), reset_peak_rss()
        t0 = time.perf_counter()
        index = Bm25Index.build(passages, folder, show_progress=False)
        builds.append(time.perf_counter() - t0)
        peaks.append(peak_rss_mb() - before if exact else float("nan"))
        del index
    index = Bm25Index.load(folder, mmap=True)
    index.search(queries[:10], k)  # warm-up: page in the mapped arrays
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        index.search(queries, k)
        times.append(time.perf_counter() - t0)
    with warnings.catch_warnings():  # queries without a match: counted below
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        hits = retrieve(index, queries, k, progress=False)
        retrieve_s = time.perf_counter() - t0
    return {
        "passages": len(passages), "build_s": min(builds), "build_runs_s": builds,
        "build_extra_rss_mb": max(peaks), "index_bytes": _folder_bytes(folder, INDEX_FILES),
        "total_bytes": _folder_bytes(folder), "search_s": min(times), "search_runs_s": times,
        "queries_per_s": len(queries) / min(times), "retrieve_s": retrieve_s,
        "union_passages": len(hits),
        "unmatched_queries": sum(1 for r in index.search(queries, 1) if not r),
    }


def _measure_isolated(args: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """``measure_point(**args)`` in a fresh interpreter (its own memory high-water mark)."""
    spec = tmp / f"point_{args['n']}.json"
    spec.write_text(json.dumps(args))
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run([sys.executable, "-m", "attnlab.bench.retrieval", "--point", str(spec)],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"measurement at {args['n']} passages failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_retrieval(corpus_path: str | Path, *, queries: Sequence[str] | None = None,
                    data_root: str | Path | None = None, max_tokens: int = 128, k: int = 50,
                    num_queries: int = 1000, repeats: int = 3,
                    fractions: Sequence[float] = (0.25, 0.5, 1.0), target: int = 10**7,
                    isolate: bool = True, workdir: str | Path | None = None) -> dict[str, Any]:
    """Build time and memory, index size and queries/second at several corpus sizes, with
    linear projections to ``target`` passages. ``queries`` default to the CoLA dev sentences
    of ``data_root`` (default: two folders above the corpus file, i.e. the shared data root).
    ``isolate``: measure each size in a fresh process (module docstring)."""
    if queries is None:
        root = Path(data_root) if data_root is not None else Path(corpus_path).resolve().parents[1]
        queries = cola_dev_sentences(root)
    queries = list(queries)[:num_queries]
    if not queries:
        raise ValueError("no queries to time")
    t0 = time.perf_counter()
    docs = read_corpus(corpus_path)
    t_read = time.perf_counter() - t0
    t0 = time.perf_counter()
    passages = split_passages(docs, max_tokens=max_tokens)
    t_split = time.perf_counter() - t0
    words = sum(len(p.text.split()) for p in passages)
    num_docs = len(docs)
    del docs
    points: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=workdir, prefix="bench_bm25_") as tmp:
        for f in fractions:
            n = max(1, round(f * len(passages)))
            args: dict[str, Any] = {
                "corpus_path": str(corpus_path), "n": n, "queries": queries,
                "folder": str(Path(tmp) / f"idx_{n}"), "max_tokens": max_tokens, "k": k,
                "repeats": repeats}
            points.append(_measure_isolated(args, Path(tmp)) if isolate
                          else measure_point(**args))
    ns = [p["passages"] for p in points]
    projection: dict[str, Any] = {"target_passages": target}
    for key, unit in (("build_s", 1.0), ("build_extra_rss_mb", 1.0), ("index_bytes", 1.0),
                      ("total_bytes", 1.0),
                      ("search_s", 1.0 / len(queries))):  # search: seconds per query
        slope, intercept = _fit(ns, [p[key] * unit for p in points])
        name = "query_s" if key == "search_s" else key
        projection[name] = {"slope_per_passage": slope, "intercept": intercept,
                            "at_target": intercept + slope * target}
    import bm25s

    return {
        "corpus": str(corpus_path), "documents": num_docs,
        "passages": len(passages), "words": words, "max_tokens": max_tokens, "k": k,
        "num_queries": len(queries), "repeats": repeats, "isolated": isolate,
        "read_s": t_read, "split_s": t_split, "points": points, "projection": projection,
        "env": {"bm25s": bm25s.__version__, "numpy": np.__version__,
                "python": platform.python_version(), "cpus": os.cpu_count(),
                "machine": platform.machine()},
    }


def _mb(b: float) -> str:
    return f"{b / 2**20:.1f} MB"


def format_markdown(result: dict[str, Any]) -> str:
    """A Markdown section: per-size table, then the fitted slopes and projections."""
    r = result
    lines = [
        f"Corpus `{r['corpus']}`: {r['documents']:,} documents -> {r['passages']:,} passages "
        f"of at most {r['max_tokens']} words ({r['words']:,} words; read {r['read_s']:.2f} s, "
        f"split {r['split_s']:.2f} s). Queries: {r['num_queries']:,}, top-{r['k']}; build and "
        f"search times: the fastest of {r['repeats']} runs. bm25s {r['env']['bm25s']} (numpy "
        f"backend), numpy {r['env']['numpy']}, {r['env']['cpus']} CPUs.",
        "",
        "| passages | build (s) | build memory | index arrays | with passages | search (s) "
        "| queries/s | union of top-k | queries without a match |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in r["points"]:
        lines.append(f"| {p['passages']:,} | {p['build_s']:.2f} | "
                     f"{p['build_extra_rss_mb']:.0f} MB | {_mb(p['index_bytes'])} | "
                     f"{_mb(p['total_bytes'])} | {p['search_s']:.3f} | "
                     f"{p['queries_per_s']:,.0f} | {p['union_passages']:,} | "
                     f"{p['unmatched_queries']} |")
    pr = r["projection"]
    t = pr["target_passages"]
    b, ib, tb, q = pr["build_s"], pr["index_bytes"], pr["total_bytes"], pr["query_s"]
    m = pr["build_extra_rss_mb"]
    lines += [
        "",
        f"Linear fit over the {len(r['points'])} sizes, projected to {t:.0e} passages:",
        "",
        f"- build: {b['slope_per_passage'] * 1e6:.1f} s per million passages -> "
        f"{b['at_target'] / 60:.1f} min",
        f"- build memory: {m['slope_per_passage'] * 1e6 / 1024:.1f} GB per million passages -> "
        f"{m['at_target'] / 1024:.0f} GB",
        f"- index arrays: {ib['slope_per_passage']:.0f} bytes per passage -> "
        f"{ib['at_target'] / 2**30:.2f} GB; with stored passages "
        f"{tb['slope_per_passage']:.0f} bytes per passage -> {tb['at_target'] / 2**30:.2f} GB",
        f"- search: {q['slope_per_passage'] * 1e6 * 1e3:.2f} ms per query per million "
        f"passages -> {q['at_target'] * 1e3:.0f} ms per query "
        f"({1 / q['at_target']:.1f} queries/s) at top-{r['k']}",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", help=".jsonl/.txt corpus file or folder")
    ap.add_argument("--data-root", default=None, help="GLUE data root for CoLA dev queries")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=50)
    ap.add_argument("--num-queries", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the raw result here")
    ap.add_argument("--point", default=None, help=argparse.SUPPRESS)  # internal: one size
    args = ap.parse_args(argv)
    if args.point:
        print(json.dumps(measure_point(**json.loads(Path(args.point).read_text()))))
        return {}
    if not args.corpus:
        ap.error("--corpus is required")
    result = bench_retrieval(args.corpus, data_root=args.data_root, max_tokens=args.max_tokens,
                             k=args.k, num_queries=args.num_queries, repeats=args.repeats)
    if args.json:
        from ..io import write_json

        write_json(args.json, result)
    print(format_markdown(result))
    return result


if __name__ == "__main__":
    main()

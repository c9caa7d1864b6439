"""``attnlab bench speed``: every registered mechanism against dense SDPA, one table of record.

Each (mechanism, n) pair is measured by ``bench.speed`` (fresh subprocesses: peak memory
from the resident-set high-water mark, then the median time of the repeats, forward and
forward+backward), with SDPA at every n in the same run as the ratio base. Rows are
appended to ``rows.jsonl`` in the output folder as they finish, so an interrupted run
resumes where it stopped (rows measured with other settings are not reused; each row names
the commit it was measured on, and the table says so when its cells come from more than
one). At the end:
``results.json`` (environment, rows, fitted exponents), ``table.md`` and ``scaling.png``.

Mechanisms of scope "module" (they replace the host's projections, e.g. ``mqa``) are
not attention-alone measurements and are left out of the default list; a mechanism that
needs the host's maximum length (Linformer's E, F) is built with max_len = n.
Quadratic mechanisms (the complexity they declare has n*m, n^2 or "dense") run only up to
``dense_max_n``: beyond it their [b, h, n, n] scores would not fit in memory. Exponents are
least-squares slopes of log time against log n over the lengths >= ``fit_from``.

Peers (``bench.peers``: transformers' modules, compiled FlexAttention) may join the list;
then every method is fed one input the way peers are, and the table gains a "Peers" part:
each peer's time and memory over ours with the same key sets at the same n. A
forward-only peer (FlexAttention on CPU) is timed and measured forward only and left out
of the chart.

The global-token target (a few percent) is below the drift between two subprocess
measurements, so on the CPU each longformer-with-global-tokens row and its window without
them are also timed alternately in one fresh process (``bench.paired``, ``PAIRED_ROUNDS``
rounds, resumable in ``paired.jsonl``); the target is checked on that median ratio, printed
with its range over rounds (on the two cells if that process fails). The table's cells stay
the separate measurements.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.progress import Progress

from ..core import list_mechanisms, mechanism_class
from ..io import append_jsonl, atomic_write, read_jsonl, write_json
from .peers import is_peer, ours_for
from .speed import (
    SDPA,
    add_ratios,
    check_method,
    code_commit,
    commits_note,
    environment,
    measure_isolated,
    run_child,
)

DEFAULT_NS = (512, 1024, 2048, 4096, 8192, 16384)
PAIRED_ROUNDS = 9  # alternated rounds of the global-token target's paired timing

# Settings at long lengths where a mechanism's defaults are not the usual long-input ones.
# A mechanism missing here runs with its defaults (its bare name).
BENCH_SPECS = {
    "axial": "axial(cols=64)",
    "band": "band(window=128)",
    "bp_tree": "bp_tree(window=8, k=2)",
    "dilated": "dilated(window=64, dilation=2)",
    "block_local": "block_local(block=128)",
    "longformer": "longformer(window=128, global_tokens=(0,))",
    "lsh": "lsh(buckets=32, chunk=64, num_hashes=2)",
    "routing": "routing(num_clusters=16)",
    "performer": "performer(num_features=64)",
    "mega": "mega(chunk=128)",
    "camtl_prior": "camtl_prior(task=0)",  # task-conditioned: a bench's batches are one task
}


def bench_spec(name: str) -> str:
    return BENCH_SPECS.get(name, name)


def is_quadratic(name: str) -> bool:
    """Whether a mechanism's declared complexity grows as n*m (dense scores)."""
    if name == SDPA or is_peer(name):
        return False
    spec_name = name.split("(")[0]
    c = mechanism_class(spec_name).caps.complexity
    return "n*m" in c or "n^2" in c or "dense" in c


def _key(row: dict[str, Any]) -> tuple:
    return (row["method"], row["n"], row["repeats"], row["threads"], row["heads"],
            row["head_dim"], row["batch"], row.get("one_input", False),
            row.get("device", "cpu"), row.get("dtype", "float32"))


def fit_exponent(points: Sequence[tuple[int, float]]) -> float | None:
    """Least-squares slope of log t against log n (None with fewer than two points)."""
    pts = [(math.log(n), math.log(t)) for n, t in points if t and t > 0]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else None


def run_suite(
    out: str | Path,
    mechanisms: Sequence[str] | None = None,
    ns: Sequence[int] = DEFAULT_NS,
    *,
    repeats: int = 3,
    threads: int = 1,
    heads: int = 12,
    head_dim: int = 64,
    batch: int = 1,
    device: str = "cpu",
    dtype: str = "float32",
    dense_max_n: int = 4096,
    fit_from: int = 2048,
    progress: bool = True,
    measure: Callable[..., dict[str, float]] | None = None,
    pair: Callable[..., list[float]] | None = None,
    paired_rounds: int = PAIRED_ROUNDS,
) -> dict[str, Any]:
    """Measure ``mechanisms`` (names or specs; default: every registered one, with
    ``bench_spec`` settings) and SDPA at each n; write the output folder; return the results
    (``environment``, ``rows``, ``exponents``). ``device="cuda"`` measures on the GPU in
    this process (the sparse patterns on FlexAttention), in ``dtype``. ``pair``: the
    paired ratio of the global-token target (module docstring; ``paired_ratio`` by default,
    tests pass a stand-in); ``paired_rounds`` 0 checks it on the separate cells."""
    measure = measure or measure_isolated
    pair = pair or paired_ratio
    names = list(mechanisms) if mechanisms else [
        m for m in list_mechanisms() if mechanism_class(m).caps.scope != "module"]
    specs = [m if "(" in m or is_peer(m) else bench_spec(m) for m in names]
    for spec in specs:  # a bad spec is refused before anything runs, not an error cell
        check_method(spec)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # with peers in the run every method is fed like them: one leaf x, q = k = v copies
    # (``bench.peers``), so the two sides compute and keep the same tensors
    common = dict(repeats=repeats, threads=threads, heads=heads, head_dim=head_dim,
                  batch=batch, one_input=any(is_peer(s) for s in specs), device=device,
                  dtype=dtype)
    jobs = [(method, n) for n in ns for method in dict.fromkeys([SDPA, *specs])
            if not (is_quadratic(method) and n > dense_max_n)]
    log = out / "rows.jsonl"
    done = {_key(r): r for r in read_jsonl(log)}
    todo = [(m, n) for m, n in jobs if _key({"method": m, "n": n, **common}) not in done]
    commit = code_commit() if todo else None  # in each row: a resumed run may mix commits

    def run_all(step: Callable[[str], None]) -> None:
        for method, n in todo:
            try:
                res = measure(method=method, n=n, **common)
                row = {"method": method, "n": n, **common, **res}
            except RuntimeError as e:  # one failing mechanism does not stop the table
                row = {"method": method, "n": n, **common, "error": str(e).splitlines()[-1]}
            row["commit"] = commit
            append_jsonl(log, row)
            done[_key(row)] = row
            step(f"{method} n={n}")

    if progress and todo:
        with Progress(transient=True) as bar:
            task = bar.add_task("bench speed", total=len(todo))
            run_all(lambda desc: bar.update(task, advance=1, description=desc))
    else:
        run_all(lambda desc: None)
    rows = [done[_key({"method": m, "n": n, **common})] for m, n in jobs]
    results = summarise(rows, fit_from)
    paired = {}
    if device == "cpu" and batch == 1 and paired_rounds > 0:
        paired = paired_targets(out / "paired.jsonl", results["rows"], pair,
                                rounds=paired_rounds, threads=threads, heads=heads,
                                head_dim=head_dim)
    results["targets"] = check_targets(results["rows"], paired)
    results["environment"] = environment(threads)
    results["command_settings"] = {**common, "dense_max_n": dense_max_n, "fit_from": fit_from,
                                   "ns": list(ns)}
    write_json(out / "results.json", results)
    atomic_write(out / "table.md", format_table(results))
    ok = [r for r in results["rows"] if "error" not in r and not r.get("forward_only")]
    if ok:
        from .plots import env_title, scaling_plot

        labels = {m: f"{m} (n^{e:.2f})" for m, e in results["exponents"].items()
                  if e is not None}
        scaling_plot([{**r, "method": labels.get(r["method"], r["method"])} for r in ok],
                     out / "scaling.png", title=env_title(results["environment"]),
                     subject="one attention layer vs dense SDPA; legend n^e: fitted "
                             f"over n >= {fit_from}")
    return results


def summarise(rows: list[dict[str, Any]], fit_from: int) -> dict[str, Any]:
    """Ratios against SDPA at the same n and each method's fitted exponent."""
    out_rows = add_ratios([dict(r) for r in rows])
    exponents = {}
    for method in dict.fromkeys(r["method"] for r in out_rows):
        pts = [(r["n"], r["fwd_ms"] if r.get("forward_only") else r["fwdbwd_ms"])
               for r in out_rows
               if r["method"] == method and "error" not in r and r["n"] >= fit_from]
        exponents[method] = fit_exponent(pts)
    return {"rows": out_rows, "exponents": exponents}


def _config(method: str):
    """The resolved config of one of our mechanism specs; None for SDPA, a peer or a spec
    that does not resolve."""
    from ..core import resolve_config

    if method == SDPA or is_peer(method):
        return None
    try:
        return resolve_config(method)
    except (ValueError, KeyError):
        return None


# Targets of record (docs/benchmarks.md): band(window=128)'s forward+backward peak memory
# against SDPA at these n, and the time a global token may add to a sliding window.
BAND_MEMORY_TARGETS = {4096: 0.5, 16384: 0.25}
GLOBAL_TOKEN_COST = 0.02  # longformer with g global tokens <= (1 + 0.02 g) x the window alone
GLOBAL_TOKEN_N = 4096


def global_token_pairs(rows: list[dict[str, Any]]) -> list[tuple[dict, dict]]:
    """(row, base row) for each ``longformer`` with global tokens at ``GLOBAL_TOKEN_N`` and
    the same window without them in the run (``band`` or ``longformer`` with no global
    tokens); rows with an error are left out."""
    ok = [(r, _config(r["method"])) for r in rows if "error" not in r]
    pairs = []
    for r, cfg in ok:
        if cfg is None or cfg.name != "longformer" or not cfg.global_tokens \
                or r["n"] != GLOBAL_TOKEN_N:
            continue
        base = next((b for b, bc in ok if b["n"] == r["n"] and bc is not None
                     and bc.window == cfg.window and (bc.name == "band" or (
                         bc.name == "longformer" and not bc.global_tokens))), None)
        if base is not None:
            pairs.append((r, base))
    return pairs


def paired_ratio(base: str, method: str, n: int, *, rounds: int, threads: int, heads: int,
                 head_dim: int) -> list[float]:
    """[median, min, max] over ``rounds`` of method's forward+backward time over base's,
    the two alternated in one fresh process (``bench.paired``)."""
    res = run_child("attnlab.bench.paired", {"specs": [base, method], "n": n,
                                             "rounds": rounds, "threads": threads,
                                             "heads": heads, "head_dim": head_dim})
    return list(res["rows"][1]["fwdbwd_ratio"])


PAIRED_KEY = ("method", "base", "n", "threads", "heads", "head_dim", "rounds")


def paired_targets(log: Path, rows: list[dict[str, Any]], pair: Callable[..., list[float]],
                   **settings: int) -> dict[tuple[str, str], dict[str, Any]]:
    """(method, base) -> its ``log`` row (``PAIRED_KEY`` and ``ratio``) for every
    ``global_token_pairs`` pair: read from ``log`` when measured with these ``settings``
    (rounds, threads, heads, head_dim), else measured by ``pair`` and appended. A pair whose
    measurement fails is left out (its target falls back to the separate cells)."""
    done = {tuple(r[k] for k in PAIRED_KEY): r for r in read_jsonl(log)}
    out = {}
    for r, base in global_token_pairs(rows):
        row: dict[str, Any] = {"method": r["method"], "base": base["method"], "n": r["n"],
                               **{k: settings[k] for k in PAIRED_KEY[3:]}}
        key = tuple(row[k] for k in PAIRED_KEY)
        if key not in done:
            try:
                row["ratio"] = pair(base["method"], r["method"], r["n"], **settings)
            except RuntimeError:
                continue
            append_jsonl(log, row)
            done[key] = row
        out[(r["method"], base["method"])] = done[key]
    return out


def check_targets(rows: list[dict[str, Any]],
                  paired: dict[tuple[str, str], dict[str, Any]] | None = None
                  ) -> list[dict[str, Any]]:
    """The targets the measured rows can speak to: band(window=128) memory vs SDPA at
    ``BAND_MEMORY_TARGETS``' lengths, and each ``longformer`` with global tokens against the
    same window without them (``global_token_pairs``) at ``GLOBAL_TOKEN_N``,
    forward+backward: on the paired ratio where ``paired`` has it ((method, base) -> its
    ``paired.jsonl`` row), else on the two rows. Each entry: what, n, value, target, met."""
    ok = [(r, _config(r["method"])) for r in rows if "error" not in r]
    out: list[dict[str, Any]] = []
    for r, cfg in ok:
        if cfg is not None and cfg.name == "band" and cfg.window == 128 \
                and r["n"] in BAND_MEMORY_TARGETS and "mem_ratio" in r:
            out.append({"what": f"{r['method']} peak memory / SDPA", "n": r["n"],
                        "value": r["mem_ratio"], "target": BAND_MEMORY_TARGETS[r["n"]]})
    for r, base in global_token_pairs(rows):
        cfg = _config(r["method"])
        g = len(cfg.global_tokens)
        p = (paired or {}).get((r["method"], base["method"]))
        if p is None:
            out.append({"what": f"{r['method']} time / {base['method']} (fwd+bwd)",
                        "n": r["n"], "value": r["fwdbwd_ms"] / base["fwdbwd_ms"],
                        "target": 1 + GLOBAL_TOKEN_COST * g})
            continue
        med, lo, hi = p["ratio"]
        out.append({"what": f"{r['method']} time / {base['method']} (fwd+bwd, median of "
                            f"{p['rounds']} alternated rounds in one process, range "
                            f"{lo:.3f}-{hi:.3f})",
                    "n": r["n"], "value": med, "target": 1 + GLOBAL_TOKEN_COST * g,
                    "paired": p["ratio"]})
    fed = " (fed one input, as peers)" if any(r.get("one_input") for r, _ in ok) else ""
    for t in out:
        t["met"] = t["value"] <= t["target"]
        if "paired" not in t:  # the paired timing feeds q, k, v as three leaves
            t["what"] += fed  # a run with peers counts the q, k, v copies (bench.peers)
    return out


def _ms(x: float) -> str:
    """Milliseconds to three significant figures at most (GPU calls take well under 1 ms)."""
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}" if x >= 1 else (
        f"{x:.3f}")


def format_table(results: dict[str, Any]) -> str:
    """Markdown: forward+backward ms per n with the ratio to SDPA, peak MB at the largest
    n each method ran, and the fitted exponent; then the peak at every n
    (``memory_table``), the peers and the targets."""
    rows = results["rows"]
    ns = sorted({r["n"] for r in rows})
    head = ("| method | " + " | ".join(f"{n}" for n in ns)
            + " | exponent | peak MB (n) | memory vs SDPA |\n"
            + "|---|" + "---:|" * (len(ns) + 3) + "\n")
    lines = []
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = {r["n"]: r for r in rows if r["method"] == method}
        cells = []
        for n in ns:
            r = mine.get(n)
            if r is None:
                cells.append("-")
            elif "error" in r:
                cells.append("error")
            elif r.get("forward_only"):
                ratio = f" ({r['fwd_speedup']:.2f}x)" if "fwd_speedup" in r else ""
                cells.append(f"fwd {_ms(r['fwd_ms'])}{ratio}")
            else:
                ratio = f" ({r['fwdbwd_speedup']:.2f}x)" if "fwdbwd_speedup" in r else ""
                cells.append(f"{_ms(r['fwdbwd_ms'])}{ratio}")
        ran = [r for r in mine.values() if "error" not in r]
        last = max(ran, key=lambda r: r["n"]) if ran else None
        e = results["exponents"].get(method)
        peak = "-" if last is None else (
            f"fwd {last['peak_fwd_mb']:.0f} ({last['n']})" if last.get("forward_only")
            else f"{last['peak_mem_mb']:.0f} ({last['n']})")
        mem = f"{last['mem_ratio']:.2f}x" if last and "mem_ratio" in last else "-"
        lines.append(f"| `{method}` | " + " | ".join(cells)
                     + f" | {'-' if e is None else f'{e:.2f}'} | {peak} | {mem} |\n")
    errors = [f"- `{r['method']}` at n = {r['n']}: {r['error']}\n" for r in rows if "error" in r]
    fit_from = results.get("command_settings", {}).get("fit_from")
    over = ("" if fit_from is None else
            f" over the lengths n >= {fit_from} ('-' with fewer than two of them)")
    note = ("\nForward+backward ms (speed-up vs SDPA at the same n); exponent: least-squares "
            f"slope of log time on log n{over}; '-' at a length: not run (quadratic beyond "
            "dense_max_n).\n" + commits_note(rows))
    if any(r.get("forward_only") for r in rows):
        note += ("'fwd': forward only (no backward on this device), its speed-up, memory and "
                 "exponent against SDPA's forward; left out of the plot.\n")
    targets = [f"- {t['what']} at n = {t['n']}: {t['value']:.{3 if 'paired' in t else 2}f} "
               f"(target <= "
               f"{t['target']:.2f}: {'met' if t['met'] else 'NOT met'})\n"
               for t in results.get("targets", [])]
    return (head + "".join(lines) + note + ("".join(errors) if errors else "")
            + memory_table(rows, ns) + peers_table(rows)
            + ("\nTargets:\n" + "".join(targets) if targets else ""))


def memory_table(rows: list[dict[str, Any]], ns: Sequence[int]) -> str:
    """Markdown: each method's peak MB at every n with its ratio to SDPA's (forward+backward;
    'fwd' marks a forward-only peak). Empty with a single n (the main table has it)."""
    if len(ns) < 2:
        return ""
    lines = []
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = {r["n"]: r for r in rows if r["method"] == method and "error" not in r}
        cells = []
        for n in ns:
            r = mine.get(n)
            if r is None:
                cells.append("-")
                continue
            fwd_only = bool(r.get("forward_only"))
            peak = r["peak_fwd_mb"] if fwd_only else r["peak_mem_mb"]
            ratio = f" ({r['mem_ratio']:.2f}x)" if "mem_ratio" in r else ""
            cells.append(f"{'fwd ' if fwd_only else ''}{peak:.0f}{ratio}")
        lines.append(f"| `{method}` | " + " | ".join(cells) + " |\n")
    return ("\nPeak memory, MB (ratio to SDPA at the same n), at every n:\n\n"
            "| method | " + " | ".join(f"{n}" for n in ns) + " |\n"
            "|---|" + "---:|" * len(ns) + "\n" + "".join(lines))


def peers_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: each peer against our mechanism with the same key sets (``ours_for``) at
    the same n, when both ran: peer time / ours (forward, forward+backward) and peer peak /
    ours (forward+backward; forward for forward-only peers). Empty without such pairs."""
    ok = [r for r in rows if "error" not in r]
    ours = [(r, _config(r["method"])) for r in ok]
    lines = []
    for p in ok:
        spec = ours_for(p["method"])
        want = _config(spec) if spec else None
        mine = next((r for r, c in ours if c == want and r["n"] == p["n"]), None)
        if want is None or mine is None:
            continue
        both = not p.get("forward_only") and "fwdbwd_ms" in mine
        bwd = f"{p['fwdbwd_ms'] / mine['fwdbwd_ms']:.2f}x" if both else "n/a"
        mem = (p["peak_mem_mb"] / mine["peak_mem_mb"] if both
               else p["peak_fwd_mb"] / max(mine["peak_fwd_mb"], 1e-9))
        lines.append(f"| `{p['method']}` | `{mine['method']}` | {p['n']} "
                     f"| {p['fwd_ms'] / mine['fwd_ms']:.2f}x | {bwd} "
                     f"| {mem:.2f}x{'' if both else ' (fwd)'} |\n")
    if not lines:
        return ""
    return ("\nPeers (peer / ours: above 1x the peer is slower or uses more memory):\n\n"
            "| peer | ours | n | fwd time | fwd+bwd time | peak memory |\n"
            "|---|---|---:|---:|---:|---:|\n" + "".join(lines))

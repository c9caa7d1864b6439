"""Speed and peak memory of sparse mechanisms against dense ``F.scaled_dot_product_attention``.

Method (why it is done this way):

* On CPU every (method, n) measurement runs in fresh Python subprocesses. PyTorch has no CPU
  allocator statistics, so peak memory is the process's resident-set high-water mark
  after the call minus the resident size just before it (after creating the inputs and a
  warm-up on a tiny input that loads the kernels and thread pools; ``DevicePeak``: Linux
  ``VmHWM``, reset at that point, elsewhere the lifetime ``ru_maxrss``). A fresh process
  makes the high-water mark belong to this call alone; ``MALLOC_MMAP_THRESHOLD_=65536``
  makes glibc return freed buffers to the system at once, so the mark follows live memory
  rather than allocator caching. It counts everything the call touches (tensors, saved
  activations, gradients of q, k, v).
* Memory: the first forward (under ``torch.no_grad``), then the first forward+backward
  (loss = sum of outputs; gradients of q, k, v). Time, in a second subprocess with the
  default allocator: one warm-up call, then the median of ``repeats`` calls (of an even
  count, the mean of the middle two), for the forward (no grad) and for forward+backward.
* On CUDA (``--device cuda``) every measurement runs in this one process: the peak is
  ``torch.cuda.max_memory_allocated`` above what was allocated before the call, the clocks
  wait for the GPU, the warm-up is at n itself, and compiled FlexAttention graphs (one per
  length and grad mode) and cached block masks serve every method of the run.
* Methods at one n run back to back and ratios compare them within one benchmark run:
  this machine is shared, absolute times drift between runs.

Run: ``python -m attnlab.bench.speed`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from rich.progress import Progress

from ..core import AttnContext, AttnOutput, HeadDims, build_mechanism, mechanism_class
from ..io import write_json
from ..train.memory import lifetime_peak_rss_mb, peak_rss_mb, reset_peak_rss
from .peers import build_peer, forward_only, is_flex, is_peer, ours_on_one_input
from .plots import env_title, scaling_plot

SDPA = "sdpa"


def _spec(mechanism: str, window: int) -> str:
    """``band`` -> ``band(window=128)`` when the config has a window; full specs unchanged."""
    if "(" in mechanism or is_peer(mechanism):
        return mechanism
    fields = {f.name for f in dataclasses.fields(mechanism_class(mechanism).config_cls)}
    return f"{mechanism}(window={window})" if "window" in fields else mechanism


def check_method(method: str) -> None:
    """RegistryError naming what is wrong with a method of the run: an unknown mechanism or
    peer, an unknown parameter or an invalid value."""
    from ..core import RegistryError, resolve_config
    from .peers import peer_params

    if is_peer(method):
        try:
            peer_params(method)
        except ValueError as e:
            raise RegistryError(str(e)) from None
    elif method != SDPA:
        resolve_config(method)


def measure(
    method: str, n: int, heads: int = 12, head_dim: int = 64, batch: int = 1, repeats: int = 3,
    threads: int | None = None, part: str = "time", device: str = "cpu",
    dtype: str = "float32", one_input: bool = False,
) -> dict[str, float]:
    """One measurement in *this* process (call it in a fresh one for a valid peak memory).

    ``method`` is "sdpa" (dense ``F.scaled_dot_product_attention``), a mechanism spec, or a
    peer (``hf_...``, see ``bench.peers``; peers imply ``one_input``).
    ``one_input``: every method gets one leaf x [b, n, h*d] and three copies of it as q, k,
    v (the layout peers need; use it for every method of a run that has peers).
    ``part="memory"`` returns peak_fwd_mb and peak_mem_mb (forward+backward) from the first
    calls; ``part="time"`` returns the medians fwd_ms and fwdbwd_ms after a warm-up call;
    ``part="both"`` (CUDA only: the allocator's peak statistics need no fresh process)
    returns all four.
    """
    if threads:
        torch.set_num_threads(threads)
    peak = DevicePeak(device)
    one_input = one_input or is_peer(method)

    def make(length: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        shapes = ([(batch, length, heads * head_dim)] if one_input
                  else [(batch, heads, length, head_dim)] * 3)
        return [torch.randn(shape, generator=g).to(device, getattr(torch, dtype))
                .requires_grad_() for shape in shapes]

    def runner(length: int) -> Callable[..., torch.Tensor]:
        if is_peer(method):
            return build_peer(method, heads, head_dim, length, device, getattr(torch, dtype))
        if method == SDPA:
            def sdpa(q, k, v, ctx=None):
                return AttnOutput(F.scaled_dot_product_attention(q, k, v))
            mech: Any = sdpa
        else:
            mech = build_mechanism(method, HeadDims(heads, head_dim, max_len=length)
                                   ).eval().to(device)  # max_len: Linformer's E, F
        ctx = AttnContext()
        if one_input:
            return ours_on_one_input(mech, ctx, heads, head_dim)
        return lambda q, k, v: mech(q, k, v, ctx).out

    def fwd(run, inputs):
        with torch.no_grad():
            run(*inputs)

    def fwdbwd(run, inputs):
        for t in inputs:
            t.grad = None
        run(*inputs).sum().backward()

    no_backward = forward_only(method, device)
    # warm-up: kernels, thread pools, allocator; BigBird needs several blocks; compiled
    # FlexAttention compiles per shape and caches its block mask per shape, so its warm-up
    # (and every CUDA warm-up: the sparse patterns run on it there) is at n itself (the
    # peak mark is reset after it, see DevicePeak)
    warm = (n if is_flex(method) or peak.cuda else min(n, 1024) if is_peer(method)
            else 64)
    small, small_run = make(warm), runner(warm)
    fwd(small_run, small)
    if not no_backward:
        fwdbwd(small_run, small)
    for t in small:  # a warm-up at n would otherwise leave its gradients live in the base
        t.grad = None
    inputs, run = (small, small_run) if warm == n else (make(n), runner(n))
    out: dict[str, float] = {}
    if part in ("memory", "both"):
        peak.start()
        fwd(run, inputs)
        out["peak_fwd_mb"] = peak.mb()
        if not no_backward:
            peak.start()
            fwdbwd(run, inputs)
            out["peak_mem_mb"] = peak.mb()
        if part == "memory":
            return out

    def median_ms(fn) -> float:
        fn(run, inputs)  # warm-up at this size
        times = []
        for _ in range(repeats):
            peak.sync()
            start = time.perf_counter()
            fn(run, inputs)
            peak.sync()
            times.append((time.perf_counter() - start) * 1000)
        return statistics.median(times)  # of an even count: the mean of the middle two

    if no_backward:
        return {"fwd_ms": median_ms(fwd), "forward_only": True, **out}
    return {"fwd_ms": median_ms(fwd), "fwdbwd_ms": median_ms(fwdbwd), **out}


class DevicePeak:
    """Peak memory of the calls after ``start()``, in MiB, above what was live at start.

    CPU: the resident-set high-water mark. On Linux the first ``start`` resets the kernel's
    mark to the current resident size (``VmHWM``, ``train.memory.reset_peak_rss``), so a
    warm-up's peak is not charged and does not hide the call's; elsewhere it is the
    lifetime mark (``ru_maxrss``), which is why the call runs in a fresh process. The mark
    is cumulative (the base is taken at the first ``start``; later calls keep it, so a
    forward+backward peak includes the forward). CUDA:
    ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (tensor memory,
    no fresh process needed). ``sync()`` waits for queued GPU work before reading a clock.
    """

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.base: float | None = None
        self.reset = False  # whether the kernel's mark was reset at the first start

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _now(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated() / 2**20
        return peak_rss_mb() if self.reset else lifetime_peak_rss_mb()

    def start(self) -> None:
        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated() / 2**20
        elif self.base is None:
            self.reset = reset_peak_rss()
            self.base = self._now()

    def mb(self) -> float:
        self.sync()
        return self._now() - (self.base or 0.0)


def _child() -> None:
    """Subprocess entry: ``python -c '...; _child()' JSON`` prints one JSON line."""
    print(json.dumps(measure(**json.loads(sys.argv[1]))))


def _measure_in_subprocess(**kwargs: Any) -> dict[str, float]:
    env = dict(os.environ)
    if kwargs.get("part") == "memory":
        # glibc: serve every allocation >= 64 KiB by mmap and unmap it on free, so the
        # resident high-water mark follows live tensor memory instead of allocator caching
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    return run_child("attnlab.bench.speed", kwargs, env)


def measure_isolated(**kwargs: Any) -> dict[str, float]:
    """``measure`` in fresh subprocesses on CPU: one for the peak memory, then one for the
    times. On CUDA in this process (the allocator's peak statistics need no fresh process,
    and compiled FlexAttention kernels are then compiled once per shape for the whole run
    instead of once per measurement)."""
    if str(kwargs.get("device", "cpu")).startswith("cuda"):
        return measure(part="both", **kwargs)
    mem = _measure_in_subprocess(part="memory", **kwargs)
    return {**_measure_in_subprocess(part="time", **kwargs), **mem}


def run_child(module: str, kwargs: dict[str, Any], env: dict[str, str] | None = None
              ) -> dict[str, Any]:
    """Run ``module._child()`` in a fresh Python with ``kwargs`` as JSON; its JSON reply."""
    code = f"from {module} import _child; _child()"
    res = subprocess.run(
        [sys.executable, "-c", code, json.dumps(kwargs)], capture_output=True, text=True,
        check=False, env=env,
    )
    if res.returncode != 0:
        tail = res.stderr[-2000:].rstrip()  # ends with the error line when the child printed one
        why = exit_reason(res.returncode, res.stderr)
        raise RuntimeError(f"benchmark subprocess failed for {kwargs}:\n{tail}"
                           + ("" if tail.endswith(why) else f"\n{why}"))
    return json.loads(res.stdout.strip().splitlines()[-1])


def exit_reason(returncode: int, stderr: str) -> str:
    """One line on why a child failed (tables keep a failure's last line): its last error
    line, or the signal that killed it (SIGKILL with no error: most likely the kernel's
    out-of-memory killer), or its exit status."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        oom = " (no error printed: most likely out of memory)" if (
            -returncode == signal.SIGKILL and not stderr.strip()) else ""
        return f"killed by {name}{oom}"
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit status {returncode}, no error printed"


def bench_sparse(
    ns: tuple[int, ...] = (1024, 2048, 4096, 8192),
    window: int = 128,
    heads: int = 12,
    head_dim: int = 64,
    batch: int = 1,
    repeats: int = 3,
    mechanism: str | Sequence[str] = "band",
    *,
    threads: int | None = None,
    progress: bool = True,
    device: str = "cpu",
    dtype: str = "float32",
) -> list[dict[str, Any]]:
    """Time and peak memory of ``mechanism`` vs dense SDPA (fp32 on CPU by default; on
    ``device="cuda"`` the sparse patterns run through FlexAttention).

    ``mechanism`` is a registry name (``band`` gets ``window``), a full spec string, or a
    list of them (each is compared with the same SDPA measurement).
    Returns one row per (n, method): n, method, fwd_ms, fwdbwd_ms, peak_fwd_mb,
    peak_mem_mb, and the ratios fwd_speedup, fwdbwd_speedup (SDPA time / method time) and
    mem_ratio (method peak / SDPA peak), all against SDPA at the same n in this run.
    """
    names = [mechanism] if isinstance(mechanism, str) else list(mechanism)
    specs = [_spec(name, window) for name in names]  # an unknown name: RegistryError
    for spec in specs:  # a bad spec is refused before anything runs (RegistryError)
        check_method(spec)
    jobs = [(n, method) for n in ns for method in (SDPA, *specs)]
    rows: list[dict[str, Any]] = []
    common = dict(heads=heads, head_dim=head_dim, batch=batch, repeats=repeats, threads=threads,
                  device=device, dtype=dtype, one_input=any(is_peer(s) for s in specs))

    def run_all(step) -> None:
        for n, method in jobs:
            rows.append({"n": n, "method": method, **measure_isolated(method=method, n=n,
                                                                      **common)})
            step(f"{method} n={n}")

    if progress:
        with Progress(transient=True) as bar:
            task = bar.add_task("benchmark", total=len(jobs))
            run_all(lambda desc: bar.update(task, advance=1, description=desc))
    else:
        run_all(lambda desc: None)
    return add_ratios(rows)


def add_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with its ratios to SDPA at the same n (in place; rows with an "error" and
    rows without an SDPA row at their n get none): fwd_speedup and fwdbwd_speedup (SDPA time
    / method time) and mem_ratio (method peak / SDPA peak, forward+backward). A
    forward-only row (FlexAttention on CPU) has no fwdbwd_speedup and its mem_ratio
    compares forward peaks."""
    base = {r["n"]: r for r in rows if r["method"] == SDPA and "error" not in r}
    for r in rows:
        ref = base.get(r["n"])
        if ref is None or "error" in r:
            continue
        r["fwd_speedup"] = ref["fwd_ms"] / r["fwd_ms"]
        if r.get("forward_only"):
            r["mem_ratio"] = r["peak_fwd_mb"] / max(ref["peak_fwd_mb"], 1e-9)
            continue
        r["fwdbwd_speedup"] = ref["fwdbwd_ms"] / r["fwdbwd_ms"]
        r["mem_ratio"] = r["peak_mem_mb"] / max(ref["peak_mem_mb"], 1e-9)
    return rows


def format_markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table (ratios are against SDPA at the same n)."""
    head = (
        "| n | method | fwd ms | fwd+bwd ms | peak MB fwd | peak MB fwd+bwd "
        "| fwd speed-up | fwd+bwd speed-up | memory vs SDPA |\n"
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    def cell(r: dict[str, Any], key: str, fmt: str) -> str:
        return format(r[key], fmt) if key in r else "n/a"

    body = "".join(
        f"| {r['n']} | `{r['method']}` | {r['fwd_ms']:.1f} | {cell(r, 'fwdbwd_ms', '.1f')} "
        f"| {r['peak_fwd_mb']:.1f} | {cell(r, 'peak_mem_mb', '.1f')} | {r['fwd_speedup']:.2f}x "
        f"| {cell(r, 'fwdbwd_speedup', '.2f')}x | {r['mem_ratio']:.2f}x |\n"
        for r in rows
    )
    return head + body


def print_results(table: str, rows: list[dict[str, Any]], env_before: dict[str, Any],
                  json_path: str | None, plot_path: str | None = None) -> None:
    """Print a benchmark's Markdown table and environment; save rows + environment as JSON
    and the scaling curves as PNG when asked."""
    print(table)
    print(f"environment: {env_before}; load after: {environment()['loadavg']}")
    if json_path:
        write_json(json_path, {"environment": env_before, "rows": rows})
    if plot_path:
        scaling_plot(rows, plot_path, title=env_title(env_before))


def environment(threads: int | None = None) -> dict[str, Any]:
    """What the numbers depend on: versions, threads used, cores, load."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "torch": torch.__version__,
        "gpu": gpu,
        "threads": threads or torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def code_commit() -> str | None:
    """The commit of the code that measures (``recipes.rundir.git_commit``: ``-dirty`` when
    src/ has changes; None outside a checkout). Resumable benches store it in each row."""
    from ..recipes.rundir import git_commit

    return git_commit()


def short_commit(commit: str | None) -> str:
    """``abc1234``, ``abc1234 with uncommitted changes`` or ``unknown``."""
    if not commit:
        return "unknown"
    dirty = commit.endswith("-dirty")
    return commit.removesuffix("-dirty")[:7] + (" with uncommitted changes" if dirty else "")


def commits_note(rows: Sequence[dict[str, Any]]) -> str:
    """A line naming the commits ``rows`` were measured on and how many cells each, when
    there is more than one (a run resumed on other code); "" otherwise. Rows without a
    ``commit`` count as ``unknown``."""
    counts: dict[str, int] = {}
    for r in rows:
        c = short_commit(r.get("commit"))
        counts[c] = counts.get(c, 0) + 1
    if len(counts) < 2:
        return ""
    return ("Cells of this table were measured on more than one commit (a resumed run): "
            + ", ".join(f"{c} ({k} cell{'s' if k > 1 else ''})" for c, k in counts.items())
            + ".\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ns", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mechanism", nargs="+", default=["band"],
                    help="names or specs, e.g. band 'dilated(window=64, dilation=2)'")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--plot", default=None, help="also draw the scaling curves to this PNG")
    args = ap.parse_args(argv)
    env_before = environment(args.threads)
    rows = bench_sparse(
        tuple(args.ns), args.window, args.heads, args.head_dim, args.batch, args.repeats,
        args.mechanism, threads=args.threads, device=args.device, dtype=args.dtype,
    )
    print_results(format_markdown(rows), rows, env_before, args.json, args.plot)


if __name__ == "__main__":
    main()

"""The demo: put a plan into the embedded MiniLM and compare it with the untouched model.

For a few built-in sentences, reports the cosine between each sentence embedding (mean
pooling over real tokens, as sentence-transformers does for all-MiniLM-L6-v2) of the
modified model and of the untouched one, the time per batch and the peak extra memory.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..bench.memory import peak_memory_mb
from ..hf.surgery import SurgeryReport, apply_plan
from ..models import load_default_model
from .head_select import resolve_for_model

DEFAULT_PLAN = ["0-2:all:band(window=8)"]

SENTENCES = [
    "Attention lets every token look at every other token in the sentence.",
    "The cat sat on the mat.",
    "Sparse attention patterns restrict each query to a window of nearby keys, which "
    "makes long documents affordable on modest hardware while keeping most of the "
    "accuracy of the dense model on standard benchmarks.",
    "A researcher swaps the attention of three layers and checks what changed.",
    "Linear attention replaces the softmax kernel with a feature map so that the cost "
    "grows linearly with the length of the input sequence rather than quadratically.",
    "Short one.",
    "Heads that always look at the separator token are called vertical heads, and "
    "special-token adaptation tunes only the vectors added at those positions.",
    "Jump self-attention propagates scores along high-order connections between tokens.",
]


@dataclass
class DemoRow:
    model: str
    cos_mean: float
    cos_min: float
    ms_per_batch: float
    peak_mb: float


def sentence_embeddings(model, batch) -> torch.Tensor:
    """Mean-pooled, L2-normalised sentence embeddings [b, hidden]."""
    hidden = model(**batch).last_hidden_state  # [b,n,hidden]
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [b,n,1]
    emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
    return torch.nn.functional.normalize(emb, dim=-1)


def _measure(model, batch, repeats: int) -> tuple[torch.Tensor, float, float]:
    with torch.no_grad():
        emb = sentence_embeddings(model, batch)  # warm-up, and the result
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            sentence_embeddings(model, batch)
            times.append((time.perf_counter() - t0) * 1e3)
        _, peak = peak_memory_mb(lambda: sentence_embeddings(model, batch))
    return emb, statistics.median(times), peak


def run_demo(
    plan: list[str] | None = None, repeats: int = 5, sentences: list[str] | None = None,
    analysis: str | None = None, echo: Callable[[str], None] | None = None,
) -> tuple[list[DemoRow], SurgeryReport]:
    """Baseline vs the plan on the embedded model; returns the table rows and the report.

    analysis: for rules that choose heads by class or score (``all:class:vertical:...``), a
    ``head_scores.json`` (or its folder) or ``task:NAME`` to analyse the embedded model on
    that task's dev split (``recipes.head_select``); ``echo`` gets the table of matched heads.
    """
    torch.manual_seed(0)
    base, tokenizer = load_default_model("base")
    base.eval()
    batch = tokenizer(sentences or SENTENCES, padding=True, return_tensors="pt")
    resolved, selection = resolve_for_model(plan or DEFAULT_PLAN, base, tokenizer, analysis,
                                            name="default", option="--analysis")
    if selection is not None and echo is not None:
        echo(str(selection))
    modified = copy.deepcopy(base)
    report = apply_plan(modified, resolved)
    modified.eval()
    ref, ms, peak = _measure(base, batch, repeats)
    rows = [DemoRow("untouched (sdpa)", 1.0, 1.0, ms, peak)]
    emb, ms, peak = _measure(modified, batch, repeats)
    cos = (emb * ref).sum(-1)  # [b]
    rows.append(DemoRow("with plan", cos.mean().item(), cos.min().item(), ms, peak))
    return rows, report

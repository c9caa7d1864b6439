"""One cell of ``attnlab bench lra``: the encoder, its training and evaluation, and the
isolated measurement of one training step.

The encoder (``ENCODER``): a from-scratch BERT (``models.encoder_config``) of 2 layers,
hidden size 64, 2 heads of 64 / 2 = 32 dims, feed-forward 128, GELU, hidden dropout 0.1,
``max_position_embeddings`` = the bench's length and ``vocab_size`` = the task's compact
vocabulary. Attention-probability dropout is 0: dropout on the [n, m] probabilities would
force every exact mechanism, softmax included, onto a path that materialises them, so the
softmax baseline could not use a fused kernel. The mechanism goes into every head of every
layer (``apply_plan`` with one rule ``all:all:SPEC``); ``softmax`` is attnlab's softmax
mechanism through surgery, i.e. ``F.scaled_dot_product_attention`` (the kernel it ran is
recorded from the profiler, ``kernels``).

Training (``train_and_evaluate``): AdamW from ``train.optim.build_optimizer`` (lr ``--lr``,
weight decay 0.01, linear warmup over 10% of the steps then linear decay), gradient
clipping at 1.0, a seeded data order (``train.loop.epoch_batches``), the mechanisms'
auxiliary losses added as ``attnlab run`` adds them; then the task's metric on the
evaluation split. It is an explicit loop rather than ``train.loop.fit``: a cell is the unit
of resume, so it needs no checkpoints, evaluations between steps or run folder. Batches are
padded to their longest example (the task's real lengths); the in-loop steps/s
(``train_steps_per_s``, steps after the first) is reported but is not the speed of record.

The speed of record (``measure_isolated_step``) times one training step (forward, backward,
clipping, AdamW) on a batch of exactly ``batch_size x length`` random ids, no padding, as
LRA's efficiency table does, in fresh subprocesses (``bench.speed.run_child``): on CPU one
for peak memory (glibc's ``MALLOC_MMAP_THRESHOLD_=65536``, so the resident set follows live
memory; the high-water mark is reset right before the step, ``train.memory``) and one for
time (a warm-up step, then the median of ``repeats`` steps); on CUDA one for both
(``torch.cuda.max_memory_allocated`` above what was allocated before the step).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from ..hf.backend import aux_loss as mechanism_aux_loss
from ..hf.surgery import apply_plan
from ..models import encoder_config
from ..train.loop import epoch_batches
from ..train.memory import peak_rss_mb, reset_peak_rss
from ..train.optim import OptimSettings, build_optimizer
from .lra_data import BenchData
from .speed import DevicePeak, run_child

# The encoder of every cell (BertConfig fields; see the module docstring).
ENCODER: dict[str, Any] = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2,
                           "intermediate_size": 128, "attention_probs_dropout_prob": 0.0}
WEIGHT_DECAY, WARMUP_RATIO, MAX_GRAD_NORM = 0.01, 0.1, 1.0
MEASURE_VOCAB, MEASURE_LABELS = 261, 10  # the measured model: bytes + specials, 10 classes
# profiler op names of fused attention kernels (SDPA's CPU flash, CUDA flash / efficient /
# cuDNN, FlexAttention)
_KERNEL = re.compile(r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention"
                     r"|flex_attention", re.IGNORECASE)


def plan_for(spec: str) -> list[dict[str, str]]:
    """The surgery plan of a cell: ``spec`` in every head of every layer."""
    return [{"layers": "all", "heads": "all", "mechanism": spec}]


def build_model(spec: str, head: str, num_labels: int, vocab_size: int, length: int,
                seed: int, device: str = "cpu") -> torch.nn.Module:
    """The bench encoder with ``head`` and ``spec`` in every head, seeded, on ``device``."""
    # heavy: transformers (model classes), imported on use
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    cfg = encoder_config("tiny", **ENCODER, vocab_size=vocab_size,
                         max_position_embeddings=length, num_labels=num_labels)
    if head == "sequence-classification":
        cfg.problem_type = "single_label_classification"
        auto: Any = AutoModelForSequenceClassification
    elif head == "token-classification":
        auto = AutoModelForTokenClassification
    else:
        raise ValueError(f"bench lra trains classification heads, not {head!r}")
    torch.manual_seed(seed)
    model = auto.from_config(cfg, attn_implementation="sdpa")
    apply_plan(model, plan_for(spec))
    if head == "token-classification":
        model = LabelledPositions(model)
    return model.to(device)


class LabelledPositions(torch.nn.Module):
    """A token-classification model whose training loss runs the classifier only at the
    labelled positions (label != -100): the recall task labels its query positions alone
    (8 of 512 at the bench's defaults), and with its 8,192 classes the classifier at every
    position was most of a training step. The loss is the one of the wrapped model (mean
    cross-entropy over the labelled positions); in eval mode, or without labels, the
    wrapped model runs as is (logits [b, n, C] for the task's predictions). Hidden dropout
    before the classifier draws a mask for the kept rows only, so with dropout the random
    stream differs from the wrapped model's.

    ``model``: a transformers ``*ForTokenClassification`` (``base_model``, ``dropout``,
    ``classifier``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if labels is None or not self.training:
            return self.model(input_ids=input_ids, attention_mask=attention_mask,
                              labels=labels, **kwargs)
        from transformers.modeling_outputs import TokenClassifierOutput

        m: Any = self.model
        hidden = m.base_model(input_ids, attention_mask=attention_mask, **kwargs)[0]  # [b,n,H]
        keep = labels != -100  # [b,n]
        logits = m.classifier(m.dropout(hidden[keep]))  # [k,C]: the labelled positions
        loss = torch.nn.functional.cross_entropy(logits, labels[keep])
        return TokenClassifierOutput(loss=loss, logits=logits)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _step(model: torch.nn.Module, optimizer, scheduler, batch: dict[str, torch.Tensor]
          ) -> float:
    """One optimizer step on ``batch``; returns the loss (task loss + auxiliary losses)."""
    loss = model(**batch).loss
    extra = mechanism_aux_loss(model)
    if extra is not None:
        loss = loss + extra
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                   MAX_GRAD_NORM)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def _optimizer(model: torch.nn.Module, lr: float, steps: int):
    return build_optimizer(model, OptimSettings(lr=lr, weight_decay=WEIGHT_DECAY,
                                                warmup_ratio=WARMUP_RATIO, schedule="linear"),
                           steps)


def train_and_evaluate(model: torch.nn.Module, data: BenchData, *, steps: int,
                       batch_size: int, lr: float, seed: int, device: str = "cpu",
                       on_step: Callable[[], None] | None = None) -> dict[str, float]:
    """Train ``steps`` optimizer steps, then evaluate: ``accuracy`` (the task's metric),
    ``final_loss`` (mean of the last 10 steps), ``train_steps_per_s``, ``train_seconds``,
    and on CPU ``train_peak_mb``: the resident set's high-water mark over the training
    steps above its size when they started (the optimizer state, one step's activations,
    and whatever outlives a step: memory that grows from step to step shows here, before
    the kernel's out-of-memory killer ends the run with no row). Not the speed cell's
    peak, which measures one step of a fixed batch in a fresh process."""
    tracked = device == "cpu" and reset_peak_rss()
    base_mb = peak_rss_mb() if tracked else 0.0
    optimizer, scheduler = _optimizer(model, lr, steps)
    collate = data.task.collator(data.tokenizer, seed=seed)
    torch.manual_seed(seed)  # dropout masks
    model.train()
    order: list[list[int]] = []
    epoch, losses, times = 0, [], []
    for _ in range(steps):
        if not order:
            order = epoch_batches(len(data.train), batch_size, seed, epoch, 0, 1)
            epoch += 1
        idx = order.pop(0)
        batch = {k: v.to(device) for k, v in collate([data.train[i] for i in idx]).items()}
        _sync(device)
        start = time.perf_counter()
        losses.append(_step(model, optimizer, scheduler, batch))
        _sync(device)
        times.append(time.perf_counter() - start)
        if on_step is not None:
            on_step()
    peak = {"train_peak_mb": peak_rss_mb() - base_mb} if tracked else {}
    metrics = evaluate(model, data, batch_size, device)
    timed = times[1:] or times  # the first step pays for lazy initialisation
    return {"accuracy": metrics[data.task.main_metric],
            "final_loss": sum(losses[-10:]) / len(losses[-10:]),
            "train_steps_per_s": len(timed) / sum(timed), "train_seconds": sum(times),
            **peak}


def evaluate(model: torch.nn.Module, data: BenchData, batch_size: int, device: str
             ) -> dict[str, float]:
    """The task's metrics on ``data.eval`` (eval mode, no gradients)."""
    collate = data.task.collator(data.tokenizer)
    model.eval()
    preds: list = []
    with torch.no_grad():
        for i in range(0, len(data.eval), batch_size):
            batch = {k: v.to(device) for k, v in collate(data.eval[i:i + batch_size]).items()}
            preds += data.task.batch_predictions(model(**batch), batch)
    return data.task.compute_metrics(preds, data.eval, data.eval_examples)


# ----------------------------------------------------------------------------- measurement


def measure_step(spec: str, length: int, batch_size: int, *, part: str = "time",
                 repeats: int = 3, device: str = "cpu", threads: int | None = None
                 ) -> dict[str, Any]:
    """One measurement in *this* process (call it in a fresh one: ``measure_isolated_step``).

    ``part="memory"``: ``peak_mem_mb`` of the first full-size training step above the
    memory in use before it (after a warm-up step on a 64-token batch that creates the
    optimizer state and loads the kernels). ``part="time"``: ``step_ms`` (median of
    ``repeats`` steps after a full-size warm-up), ``steps_per_s`` and ``kernels`` (fused
    attention kernels seen by the profiler in one more step). ``part="both"``: all (CUDA).
    """
    if threads:
        torch.set_num_threads(threads)
    model = build_model(spec, "sequence-classification", MEASURE_LABELS, MEASURE_VOCAB,
                        length, seed=0, device=device)
    optimizer, scheduler = _optimizer(model, 1e-4, 10 ** 6)
    model.train()
    g = torch.Generator().manual_seed(0)

    def batch(n: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(5, MEASURE_VOCAB, (batch_size, n), generator=g)
        return {"input_ids": ids.to(device),
                "attention_mask": torch.ones_like(ids).to(device),
                "labels": torch.randint(MEASURE_LABELS, (batch_size,), generator=g).to(device)}

    full = batch(length)
    _step(model, optimizer, scheduler, batch(min(length, 64)))  # optimizer state, kernels
    out: dict[str, Any] = {}
    if part in ("memory", "both"):
        out["peak_mem_mb"] = _peak_of(lambda: _step(model, optimizer, scheduler, full), device)
        if part == "memory":
            return out
    _step(model, optimizer, scheduler, full)  # warm-up at full size
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        _step(model, optimizer, scheduler, full)
        _sync(device)
        times.append((time.perf_counter() - start) * 1000)
    step_ms = statistics.median(times)  # of an even count: the mean of the middle two
    return {**out, "step_ms": step_ms, "steps_per_s": 1000 / step_ms,
            "kernels": _kernels(lambda: _step(model, optimizer, scheduler, full))}


def _peak_of(fn: Callable[[], Any], device: str) -> float:
    """MiB the call needed above what was in use when it started."""
    if device.startswith("cuda"):
        peak = DevicePeak(device)
        peak.start()
        fn()
        return peak.mb()
    if not reset_peak_rss():  # no resettable high-water mark: the lifetime one (bench.speed)
        peak = DevicePeak(device)
        peak.start()
        fn()
        return peak.mb()
    base = peak_rss_mb()  # just reset: the resident size now
    fn()
    return peak_rss_mb() - base


def _kernels(fn: Callable[[], Any]) -> list[str]:
    """Names of the fused attention ops that ``fn`` ran (profiler)."""
    from torch.profiler import profile

    from .memory import quiet_native_stderr

    with quiet_native_stderr(), profile() as prof:
        fn()
    return sorted({e.key for e in prof.key_averages() if _KERNEL.search(e.key)})


def _child() -> None:
    """Subprocess entry (``bench.speed.run_child``): one JSON line out."""
    print(json.dumps(measure_step(**json.loads(sys.argv[1]))))


def measure_isolated_step(spec: str, length: int, batch_size: int, *, repeats: int = 3,
                          device: str = "cpu", threads: int | None = None) -> dict[str, Any]:
    """``measure_step`` in fresh subprocesses (module docstring); RuntimeError with the
    child's stderr if one fails."""
    kw = {"spec": spec, "length": length, "batch_size": batch_size, "repeats": repeats,
          "device": device, "threads": threads}
    module = "attnlab.bench.lra_cell"
    if device.startswith("cuda"):
        return run_child(module, {**kw, "part": "both"})
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    mem = run_child(module, {**kw, "part": "memory"}, env)
    return {**run_child(module, {**kw, "part": "time"}), **mem}

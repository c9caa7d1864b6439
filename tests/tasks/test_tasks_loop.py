"""One generic train/eval loop drives every head type (tiny random BERT, a few steps)."""

from __future__ import annotations

import math

import pytest
import torch
from tasks_helpers import write
from test_conll import IOB1
from test_squad import example

from attnlab.tasks import get_task, read_conll

AUTO = {"sequence-classification": "AutoModelForSequenceClassification",
        "token-classification": "AutoModelForTokenClassification",
        "question-answering": "AutoModelForQuestionAnswering",
        "masked-lm": "AutoModelForMaskedLM"}


def tiny_model(task, tokenizer):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, num_labels=max(task.num_labels, 1),
        problem_type=task.problem_type,
    )
    return getattr(transformers, AUTO[task.head]).from_config(cfg)


def run(task, examples, tokenizer):
    """What a runner does, written once for all heads."""
    from torch.utils.data import DataLoader

    feats = task.encode(examples, tokenizer, max_length=48)
    model = tiny_model(task, tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train = DataLoader(feats, batch_size=8, shuffle=True, collate_fn=task.collator(tokenizer, 0),
                       generator=torch.Generator().manual_seed(0))
    model.train()
    for batch in train:
        loss = model(**batch).loss
        assert torch.isfinite(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    preds = []
    with torch.no_grad():
        for batch in DataLoader(feats, batch_size=8, collate_fn=task.collator(tokenizer, 0)):
            preds += task.batch_predictions(model(**batch), batch)
    assert len(preds) == len(feats)
    return task.compute_metrics(preds, feats, examples)


def squad_examples():
    answers = ["omicron pi rho", "xi omicron", "beta gamma", "ten", "kappa", "phi chi"]
    return [example(a, f"q{i}") for i, a in enumerate(answers)]


@pytest.mark.parametrize("name", ["cola", "stsb", "conll2003", "squad", "mlm"])
def test_one_loop_for_every_head(name, tokenizer, tmp_path):
    task = get_task(name)
    if name in ("cola", "mlm"):
        examples = task.load("train", "builtin")[:40]
    elif name == "stsb":
        rows = "".join(f"{i}\tA man number {i}.\tA person {i % 3}.\t{i % 6}\n" for i in range(20))
        write(tmp_path / "STS-B" / "train.tsv", "index\tsentence1\tsentence2\tscore\n" + rows)
        examples = task.load("train", tmp_path)
    elif name == "conll2003":
        examples = read_conll(write(tmp_path / "train.txt", IOB1)) * 6
    else:
        examples = squad_examples()
    out = run(task, examples, tokenizer)
    assert task.main_metric in out and all(isinstance(v, float) for v in out.values())
    assert math.isfinite(out[task.main_metric])

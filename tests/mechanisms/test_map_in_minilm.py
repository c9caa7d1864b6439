"""The mechanisms of the survey map's §3.1-3.2 inside the embedded all-MiniLM-L6-v2: one
plan puts each on two heads of its own layer; the model runs, trains one step with finite
gradients, and the demo prints its comparison with the untouched model."""

from __future__ import annotations

import torch
from typer.testing import CliRunner

import attnlab
from attnlab.cli import app

RULES = [
    "0:0,1:performer(num_features=16)",
    "1:0,1:linear_relu",
    "2:0,1:axial(cols=4)",
    "3:0,1:bp_tree(window=2, k=1)",
    "4:0,1:lsh(buckets=4, chunk=4, num_hashes=2)",
    "5:0,1:axial(cols=4, mode='two_pass')",
    "5:2,3:routing(num_clusters=2)",
    "4:2,3:sac(k=4)",
]


def test_new_mechanisms_train_one_step_in_minilm():
    model, tok = attnlab.load_default_model("sequence-classification", num_labels=2)
    report = attnlab.apply_plan(model, attnlab.Plan.parse(RULES))
    assert {spec.split("(")[0] for row in report.table for spec in row} >= {
        "performer", "linear_relu", "axial", "bp_tree", "lsh", "routing", "sac"}
    batch = tok(["a short sentence", "another, somewhat longer sentence for the batch"],
                padding=True, return_tensors="pt")
    model.train()
    loss = model(**batch, labels=torch.tensor([0, 1])).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_demo_prints_the_comparison_for_the_new_mechanisms():
    args = ["demo", "--repeats", "1"]
    for rule in RULES:
        args += ["-p", rule]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "cos mean" in res.output and "peak MB" in res.output

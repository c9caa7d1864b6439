"""The mechanisms of the survey map's §3.1-3.4 inside the embedded all-MiniLM-L6-v2: one
plan per part puts each on two heads of a layer (layer-scope ones on a whole layer); the
model runs, trains one step with finite gradients, and the demo prints its comparison with
the untouched model."""

from __future__ import annotations

import pytest
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
# §3.3-3.4: prototype queries, compressed memory, low rank
RULES_33_34 = [
    "0:0,1:clustered(clusters=4, bits=16, iterations=3)",
    "0:2,3:improved_clustered(clusters=4, bits=16, iterations=3, topk=4)",
    "1:0,1:probsparse(factor=1)",
    "1:2,3:mca(compression=2)",
    "2:0,1:isab(num_inducing=4)",
    "2:2,3:poolingformer(window=2, window2=8, pool_size=2)",
    "3:all:luna(num_memory=4)",
    "4:0,1:linformer(k=8)",
    "4:2,3:lowrank_band(rank=4, window=2)",
    "5:0,1:nystrom(num_landmarks=4, conv_kernel=3)",
    "5:2,3:csalr(num_landmarks=4)",
]
PARTS = {"3.1-3.2": RULES, "3.3-3.4": RULES_33_34}


@pytest.mark.parametrize("part", sorted(PARTS))
def test_new_mechanisms_train_one_step_in_minilm(part):
    rules = PARTS[part]
    model, tok = attnlab.load_default_model("sequence-classification", num_labels=2)
    report = attnlab.apply_plan(model, attnlab.Plan.parse(rules))
    assert {spec.split("(")[0] for row in report.table for spec in row} >= {
        rule.split(":")[2].split("(")[0] for rule in rules}
    batch = tok(["a short sentence", "another, somewhat longer sentence for the batch"],
                padding=True, return_tensors="pt")
    model.train()
    loss = model(**batch, labels=torch.tensor([0, 1])).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("part", sorted(PARTS))
def test_demo_prints_the_comparison_for_the_new_mechanisms(part):
    args = ["demo", "--repeats", "1"]
    for rule in PARTS[part]:
        args += ["-p", rule]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "cos mean" in res.output and "peak MB" in res.output

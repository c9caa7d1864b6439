"""Replace some attention heads of a pretrained encoder, then fine-tune it: attnlab as a library.

Loads the embedded all-MiniLM-L6-v2 (6 layers x 12 heads) with a new classification head,
puts band attention (window 8) on the even heads of every layer and Jump Self-attention on
the odd heads of layers 0-1, prints the layer x head table, fine-tunes the whole model with
a plain PyTorch loop on CoLA (the CoLA-format sample shipped in the package: no download)
and prints the dev Matthews correlation. The same run from a config is ``attnlab run``.
Without ``--tiny`` (4 epochs, batch 16, on the 400 sentences) it reached dev MCC 0.21 in
4 minutes on 2 busy CPU cores.

    python examples/replace_heads_and_finetune.py
    python examples/replace_heads_and_finetune.py --tiny     # 6 steps on 48 sentences (CI)
"""

import argparse
import random

import torch

import attnlab

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--tiny", action="store_true", help="CI size: 48 sentences, 6 steps")
args = parser.parse_args()
torch.manual_seed(0)

task = attnlab.get_task("cola")
train = task.load("train", data_dir="builtin")  # "builtin": the shipped sample
dev = task.load("dev", data_dir="builtin")
if args.tiny:
    train, dev = train[:48], dev[:32]

model, tok = attnlab.load_default_model("sequence-classification", num_labels=task.num_labels)
plan = attnlab.Plan.parse([  # later rules win; heads no rule names stay softmax
    {"layers": "all", "heads": [0, 2, 4, 6, 8, 10], "mechanism": "band(window=8)"},
    {"layers": [0, 1], "heads": [1, 3, 5, 7, 9, 11], "mechanism": "jat(rho=5, coef=0.5)"},
])
print(attnlab.apply_plan(model, plan))  # validated against the model before any change

collate = task.collator(tok)
train_feats, dev_feats = task.encode(train, tok, 64), task.encode(dev, tok, 64)
random.Random(0).shuffle(train_feats)
batch_size, epochs = (8, 1) if args.tiny else (16, 4)  # quickstart's sample recipe
steps = epochs * ((len(train_feats) + batch_size - 1) // batch_size)
optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
sched = torch.optim.lr_scheduler.LinearLR(optim, 1.0, 0.0, total_iters=steps)
model.train()
for step in range(steps):
    i = step * batch_size % len(train_feats)
    loss = model(**collate(train_feats[i : i + batch_size])).loss  # labels are in the batch
    loss = loss + (attnlab.aux_loss(model) or 0.0)  # regularisers of the mechanisms, if any
    loss.backward()
    optim.step()
    sched.step()
    optim.zero_grad()
    print(f"step {step + 1}/{steps}  loss {loss.item():.4f}")

model.eval()
preds = []
with torch.no_grad():
    for i in range(0, len(dev_feats), 64):
        batch = collate(dev_feats[i : i + 64])
        preds += task.batch_predictions(model(**batch), batch)
metrics = task.compute_metrics(preds, dev_feats, dev)
print(f"dev {task.main_metric}: {metrics[task.main_metric]:.3f}  ({len(dev)} sentences)")
